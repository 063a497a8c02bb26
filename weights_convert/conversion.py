"""Convert a Hugging Face / PyTorch base checkpoint (and optionally a ReDrafter drafter) to MLX.

Output layout (mlx-lm's, so ``mlx_lm.load(out)`` works)::

    <out>/config.json                    (+ "quantization": {group_size, bits, mode} when quantized)
    <out>/model.safetensors              or model-0000i-of-0000N.safetensors (≤ 5 GB each)
    <out>/model.safetensors.index.json
    <out>/tokenizer.* , generation_config.json   (copied when present)
    <out>/drafter/config.json, model.safetensors, model.safetensors.index.json   (with --drafter)

Safety: everything is written into a temporary folder beside ``out`` and renamed into place at
the end; on any error or Ctrl-C the temporary folder is removed and ``out`` is untouched.
Memory: tensors are read (memory-mapped), converted and written one at a time.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from redrafter_mlx.engine.base import output_dir
from redrafter_mlx.engine.base.output_dir import staging_dir
from weights_convert import apar, kangaroo, llama
from weights_convert import drafter as drafter_fmt
from weights_convert import gguf as gguf_input
from weights_convert.errors import ConversionError
from weights_convert.sources import (
    TOKENIZER_FILES,
    copy_side_files,
    open_checkpoint,
    read_tensor_refs,
    resolve_source,
)
from weights_convert.tensors import DTYPE_CODES
from weights_convert.writer import Job, Quantization, make_job, write_weights

QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUP_SIZES = (32, 64, 128)
DRAFTER_SUBDIR = "drafter"


@dataclass
class ConversionSummary:
    """What a conversion produced (returned by :func:`convert`, printed by the CLI)."""

    out_dir: Path
    parameters: int
    dtype: str
    quantization: dict | None
    tensors: int
    quantized_tensors: int
    bytes_on_disk: int
    seconds: float
    drafter_parameters: int = 0
    drafter_quantization: dict | None = None
    dropped: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """Human-readable summary, one fact per line."""

        def quant_text(q: dict | None) -> str:
            if not q:
                return "none"
            text = f"{q['bits']}-bit affine, group size {q['group_size']}"
            others = sorted({v["bits"] for v in q.values() if isinstance(v, dict)} - {q["bits"]})
            layers = sum(isinstance(v, dict) for v in q.values())
            if layers:  # per-layer entries (a GGUF's mixed types kept as they are)
                bits = "/".join(map(str, others)) or str(q["bits"])
                text += f"; {layers} layer{'s' * (layers > 1)} at {bits}-bit"
            return text

        out = [
            f"output         {self.out_dir}",
            f"parameters     {self.parameters / 1e6:,.2f} M (base model)",
            f"dtype          {self.dtype}",
            f"quantization   {quant_text(self.quantization)} ({self.quantized_tensors} of "
            f"{self.tensors} tensors quantized)",
        ]
        if self.drafter_parameters:
            out.append(
                f"drafter        {self.drafter_parameters / 1e6:,.2f} M parameters, quantization "
                f"{quant_text(self.drafter_quantization)}"
            )
        out += [
            f"size on disk   {self.bytes_on_disk / 2**20:,.1f} MiB",
            f"time           {self.seconds:.1f} s",
        ]
        if self.dropped:
            shown = ", ".join(self.dropped[:3]) + (
                f" (+{len(self.dropped) - 3} more)" if len(self.dropped) > 3 else ""
            )
            out.append(f"dropped        {shown}")
        out += [f"note           {n}" for n in self.notes]
        out += [f"warning        {w}" for w in self.warnings]
        return out


def _check_options(
    dtype: str | None, quantize: bool, quantize_drafter: bool, q_bits: int, q_group_size: int
) -> None:
    if dtype is not None and dtype not in DTYPE_CODES:
        raise ConversionError(
            f"--dtype {dtype!r} is not supported; choose one of {', '.join(DTYPE_CODES)}"
        )
    if quantize or quantize_drafter:
        if q_bits not in QUANT_BITS:
            raise ConversionError(
                f"--q-bits {q_bits} is not supported; choose one of "
                f"{', '.join(map(str, QUANT_BITS))}"
            )
        if q_group_size not in QUANT_GROUP_SIZES:
            raise ConversionError(
                f"--q-group-size {q_group_size} is not supported; choose one of "
                f"{', '.join(map(str, QUANT_GROUP_SIZES))}"
            )


def _check_out(out: Path, force: bool, sources: list[Path]) -> None:
    """Refuse an existing non-empty ``out`` (unless ``force``) and any ``out`` holding a source."""
    problem = output_dir.refusal(out, force, sources, "--force")
    if problem:
        raise ConversionError(problem)


NOT_WRITABLE = {
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "read-only file system",
}


def not_writable(folder: Path, why: str) -> ConversionError:
    """The error for an ``--out`` whose folder cannot be written, naming the folder and fixes."""
    return ConversionError(
        f"--out: cannot write to {folder} ({why}); choose a writable --out, or make that folder "
        f"writable (chmod u+w {folder}, or remount it read-write)"
    )


def check_writable(out: Path) -> None:
    """Refuse, before any download or conversion, an ``out`` whose nearest existing folder (it
    or an ancestor) cannot be written."""
    existing = next(p for p in [out, *out.parents] if p.exists())
    if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        raise not_writable(existing, "not writable")


@contextlib.contextmanager
def _writes_to(folder: Path) -> Iterator[None]:
    """Turn a permission or read-only error of creating in ``folder`` into a ConversionError."""
    try:
        yield
    except OSError as e:
        if e.errno not in NOT_WRITABLE:
            raise
        where = Path(e.filename).parent if e.filename else folder
        raise not_writable(where, NOT_WRITABLE[e.errno]) from None


@contextlib.contextmanager
def _progress_bar(total_bytes: int, enabled: bool) -> Iterator[Callable[[Job], None]]:
    """A rich progress bar over source bytes; yields the per-tensor callback."""
    if not enabled:
        yield lambda job: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description:<28.28}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("converting", total=total_bytes)

        def advance(job: Job) -> None:
            bar.update(task, advance=job.source.nbytes, description=job.source.name)

        yield advance
        bar.update(task, description="done")


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=4)
        f.write("\n")


def _folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def convert(
    model: str,
    out: str | os.PathLike,
    drafter: str | None = None,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    dtype: str | None = None,
    quantize_drafter: bool = False,
    force: bool = False,
    progress: bool = True,
    exit_layer: int | None = None,
) -> ConversionSummary:
    """Convert a base model checkpoint (and optionally a ReDrafter drafter) to an MLX folder.

    Args:
        model: local folder or Hugging Face repo id of the base model (safetensors or ``.bin``),
            or a ``.gguf`` file (or a folder holding exactly one; see :mod:`weights_convert.gguf`).
        out: output folder; must not exist or be empty unless ``force``.
        drafter: local folder or repo id of a ReDrafter drafter, or of a Kangaroo early-exit
            adapter (:mod:`weights_convert.kangaroo`), written to ``<out>/drafter``.
        quantize: quantize the base model's Linear/Embedding weights (mlx-lm's rule).
        q_bits, q_group_size: affine quantization settings (also used for the drafter).
        dtype: storage dtype of all floating tensors that are not quantized (and of scales).
            None: float16, except for GGUF input (see :func:`gguf_input.resolve_dtype`).
        quantize_drafter: quantize the drafter's Linear weights too.
        force: replace a non-empty ``out`` (only after the new one is complete).
        progress: show a progress bar on stderr.
        exit_layer: a Kangaroo adapter's exit layer (its checkpoint does not record it).

    Returns:
        a :class:`ConversionSummary`.

    Raises:
        ConversionError: any problem with the inputs or options, with a message naming the fix.
    """
    start = time.perf_counter()
    _check_options(dtype, quantize, quantize_drafter, q_bits, q_group_size)
    out = Path(out).expanduser().absolute()
    if out.is_dir() and any(out.iterdir()) and not force:  # fail before any download
        local = [Path(s).expanduser() for s in (model, drafter) if s]
        local = [p for p in local if p.exists()]
        _check_out(out, force, local)  # a local source in ``out`` is refused, --force or not
    check_writable(out)
    model_dir = resolve_source(model, "model")
    drafter_dir = resolve_source(drafter, "drafter") if drafter else None
    if drafter_dir is not None and drafter_dir.is_file():
        raise ConversionError(
            f"--drafter {drafter} is a GGUF file; drafters come as a folder with config.json"
        )
    _check_out(out, force, [p for p in (model_dir, drafter_dir) if p is not None])
    settings = Quantization(q_group_size, q_bits)
    base_quant = settings if quantize else None
    if model_dir.is_file():  # a .gguf
        base, dtype = gguf_input.open_gguf(model_dir, dtype, base_quant)
        jobs, dropped, out_quant, tied = base.jobs, [], base.quantization, base.tied
    else:
        dtype = dtype or "float16"
        base = open_checkpoint(model_dir, "model")
        llama.check_config(base.config, model_dir)
        base_plan = llama.plan_tensors(read_tensor_refs(base), base.config, model_dir)
        jobs = [
            make_job(name, ref, DTYPE_CODES[dtype], base_quant) for name, ref in base_plan.tensors
        ]
        dropped = list(base_plan.dropped)
        out_quant = base_quant.as_config() if base_quant else None
        tied = base_plan.tied
    branches, notes = None, []
    if model_dir.is_dir():  # APAR checkpoints: the split tokens mark a branching model
        branches = apar.branches_block(model_dir, base.config)
        notes = apar.medusa_notes(model_dir, branching=branches is not None)
        if branches is not None:
            notes.insert(
                0, f"branching model (APAR): fork {branches['fork']}, child {branches['child']}"
            )
    code = DTYPE_CODES[dtype]

    draft_jobs: list[Job] = []
    draft_quant = settings if quantize_drafter else None
    draft_config = None
    if drafter_dir is not None:
        draft = open_checkpoint(drafter_dir, "drafter")
        refs = read_tensor_refs(draft)
        if kangaroo.is_kangaroo(refs):
            if quantize_drafter:
                raise ConversionError(
                    "--quantize-drafter: an early-exit (Kangaroo) adapter is kept unquantized; "
                    "drop the flag"
                )
            args = kangaroo.adapter_args(draft.config, base.config, drafter_dir, exit_layer)
            draft_plan = kangaroo.plan_tensors(refs, args, drafter_dir)
            draft_config = kangaroo.output_config(args, dtype)
        else:
            missing = kangaroo.missing_norm(refs)
            if exit_layer is not None and missing:
                raise ConversionError(
                    f"{drafter_dir} holds a Kangaroo adapter's attention tensors but lacks "
                    f"{missing}: the checkpoint is incomplete; re-download or re-save it whole"
                )
            if exit_layer is not None:
                raise ConversionError(
                    f"--exit-layer is for an early-exit (Kangaroo) adapter; {drafter_dir} is "
                    "not one (no layers.0.self_attn / norm tensors): drop the flag"
                )
            drafter_fmt.check_config(draft.config, base.config, drafter_dir)
            draft_plan = drafter_fmt.plan_tensors(refs, draft.config, drafter_dir)
            draft_config = drafter_fmt.output_config(
                draft.config, dtype, draft_quant.as_config() if draft_quant else None
            )
        draft_jobs = [make_job(name, ref, code, draft_quant) for name, ref in draft_plan.tensors]
        dropped += [f"drafter {name}" for name in draft_plan.dropped]
    elif exit_layer is not None:
        raise ConversionError("--exit-layer needs --drafter (a Kangaroo adapter)")

    warnings = []
    if model_dir.is_dir() and not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        warnings.append(
            f"no tokenizer files in {model_dir}; copy them into {out} before loading with "
            "mlx_lm.load"
        )

    total = sum(job.source.nbytes for job in jobs + draft_jobs)
    with _writes_to(out.parent), staging_dir(out) as tmp, _progress_bar(total, progress) as advance:
        write_weights(jobs, tmp, advance)
        config = llama.output_config(base.config, tied, dtype, out_quant)
        if branches is not None:
            config = dict(sorted({**config, "branches": branches}.items()))
        _write_json(tmp / "config.json", config)
        if model_dir.is_file():
            gguf_input.write_side_files(base, tmp)
        else:
            copy_side_files(model_dir, tmp)
        if drafter_dir is not None:
            (tmp / DRAFTER_SUBDIR).mkdir()
            write_weights(draft_jobs, tmp / DRAFTER_SUBDIR, advance)
            _write_json(tmp / DRAFTER_SUBDIR / "config.json", draft_config)

    return ConversionSummary(
        out_dir=out,
        parameters=sum(job.source.numel for job in jobs),
        dtype=dtype,
        quantization=out_quant,
        tensors=len(jobs),
        quantized_tensors=sum(job.quant is not None for job in jobs),
        bytes_on_disk=_folder_size(out),
        seconds=time.perf_counter() - start,
        drafter_parameters=sum(job.source.numel for job in draft_jobs),
        drafter_quantization=draft_quant.as_config() if draft_quant else None,
        dropped=dropped,
        warnings=warnings,
        notes=notes,
    )
