"""Checkpoints of a distillation run and the output folder's rules.

``out/checkpoints/step-NNNNNNNN/`` holds the drafter files + ``training_state.*`` (optimizer
state, step, run config), written into a temp dir and renamed (atomic); the published
weights are also copied to ``out/`` (each file replaced atomically). ``plan_output`` decides
whether a run writes ``out`` in place or into a staging folder that replaces it at the end.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..engine.base.output_dir import holds, install, refusal
from ..engine.drafting.drafter import Drafter, DrafterArgs
from ..engine.loop.loading import non_finite

KEEP_CHECKPOINTS = 2


def checkpoint_root(out: Path) -> Path:
    return Path(out) / "checkpoints"


def list_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temp dirs of interrupted writes are never listed)."""
    root = checkpoint_root(out)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


# A run's kind (``"kind"`` in its run record; a recurrent drafter's run records none): what
# it is called, and how ``distill --resume`` continues it.
RUN_KINDS = {
    "recurrent": ("a recurrent drafter's run", "without --kind early-exit"),
    "early-exit": ("an early-exit adapter's run", "with --kind early-exit"),
}


def resumed_state(out: Path, kind: str) -> dict | None:
    """``training_state.json`` of ``out``'s newest checkpoint (None: no checkpoint), for a
    ``kind`` run (``RUN_KINDS``) to resume; ValueError naming the kind ``out`` holds and how
    to resume it when it is another kind's run."""
    existing = list_checkpoints(out)
    if not existing:
        return None
    info = json.loads((existing[-1] / "training_state.json").read_text())
    held = info.get("run", {}).get("kind", "recurrent")
    if held != kind and held in RUN_KINDS:
        name, flag = RUN_KINDS[held]
        raise ValueError(f"{out} holds {name}: resume it {flag}, or choose another --out")
    return info


def drafter_config(args: DrafterArgs, predict_tokens: int, targets: str) -> dict:
    cfg = args.to_config()
    cfg.update(predict_tokens=predict_tokens, distill_targets=targets)
    return cfg


def write_drafter_files(path: Path, drafter: Drafter, config: dict) -> None:
    """The drafter directory format: config.json + model.safetensors (reference names).
    Refuses (ValueError) weights that hold a NaN or an infinity: nothing is written."""
    weights = dict(tree_flatten(drafter.parameters()))
    bad = non_finite(weights)
    if bad:
        raise ValueError(
            f"refusing to save a drafter with non-finite weights (NaN or infinity in "
            f"{', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}): training diverged"
        )
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.save_safetensors(str(path / "model.safetensors"), weights)


def save_checkpoint(
    out: Path, trainer, step: int, config: dict, run: dict, publish: bool = True, extra=None
) -> Path:
    """Write ``checkpoints/step-NNNNNNNN`` atomically (temp dir + rename), then (``publish``)
    refresh ``out/`` with its weights. ``extra`` (a dict) is stored in training_state.json
    beside the step and run (e.g. the held-out selection so far).

    Keeps the newest KEEP_CHECKPOINTS checkpoints.
    """
    root = checkpoint_root(out)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_drafter_files(tmp, trainer.drafter, config)
        state = dict(tree_flatten(trainer.optimizer.state))
        mx.save_safetensors(str(tmp / "training_state.safetensors"), state)
        (tmp / "training_state.json").write_text(
            json.dumps(dict(step=step, run=run, **(extra or {})), indent=2) + "\n"
        )
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if publish:
        publish_files(final, Path(out))
    for old in list_checkpoints(out)[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def publish_files(src: Path, out: Path) -> None:
    """Copy a drafter's files from ``src`` to ``out``, each replaced atomically."""
    for name in ("model.safetensors", "config.json"):
        part = out / f".{name}.tmp-{os.getpid()}"
        shutil.copyfile(src / name, part)
        os.replace(part, out / name)


def publish_drafter(out: Path, drafter: Drafter, config: dict) -> None:
    """Write a drafter's files into ``out`` (temp folder, then each file replaced)."""
    tmp = Path(out) / f".publish.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_drafter_files(tmp, drafter, config)
        publish_files(tmp, Path(out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_checkpoint(path: Path, trainer) -> dict:
    """Restore drafter weights and optimizer state; returns training_state.json."""
    info = json.loads((path / "training_state.json").read_text())
    trainer.drafter.load_weights(str(path / "model.safetensors"), strict=True)
    state = mx.load(str(path / "training_state.safetensors"))
    trainer.set_optimizer_state(tree_unflatten(list(state.items())))
    mx.eval(trainer.drafter.parameters(), trainer.optimizer.state)
    return info


def clean_stale_temps(out: Path) -> None:
    """Remove temp dirs/files left by a crashed write."""
    for root in (checkpoint_root(out), Path(out)):
        if root.is_dir():
            for p in root.glob(".*tmp*"):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------
# the output folder

RUN_ENTRIES = {"checkpoints", "cache", "config.json", "model.safetensors", "eval.json"}
STAGING_SUFFIX = "distilling"


def is_temp_name(name: str) -> bool:
    """A temp file or folder of a crashed write (what ``clean_stale_temps`` removes)."""
    return name.startswith(".") and "tmp" in name


def is_own_run(out: Path) -> bool:
    """``out`` holds a distill run: its ``checkpoints/`` or ``cache/`` folder, and nothing but
    what a run writes (the drafter files, eval.json, temp files of a crashed write)."""
    if not out.is_dir():
        return False
    names = {p.name for p in out.iterdir() if not is_temp_name(p.name)}
    return bool(names & {"checkpoints", "cache"}) and names <= RUN_ENTRIES


@dataclass
class OutputPlan:
    """Where a run writes. ``work``: ``out`` itself, or a staging folder beside it that
    replaces ``out`` at the end (``install_output``). ``cache_root``: where target caches go
    during the run; ``final_cache_root``: where they are once the run is installed."""

    out: Path
    work: Path
    cache_root: Path
    final_cache_root: Path

    @property
    def staged(self) -> bool:
        return self.work != self.out


def plan_output(out: Path, opts, sources: list[Path]) -> OutputPlan:
    """Check ``out`` against what this run may do to it and choose where the run writes.

    In place: a new or empty folder, or this command's own run (resumed with ``resume``, or
    continued when it has no checkpoint yet). Staged (``overwrite``): a folder holding a model,
    a drafter or other files, or a finished run started over. Anything else, and any ``out``
    holding one of ``sources`` (the model, the data), raises FileExistsError naming the flag.
    """
    own = is_own_run(out)
    problem = refusal(out, opts.overwrite or own, sources, "--overwrite")
    if problem:
        raise FileExistsError(problem)
    existing = list_checkpoints(out) if own else []
    if existing and not opts.resume and not opts.overwrite:
        raise FileExistsError(
            f"{out} already holds a distillation run ({existing[-1].name}); pass --resume to "
            f"continue it, --overwrite to start over, or choose another --out"
        )
    in_place = holds(out) is None or (own and (opts.resume or not existing))
    where = out.resolve()
    work = out if in_place else where.parent / f".{where.name}.{STAGING_SUFFIX}"
    if opts.cache_dir:
        cache = Path(opts.cache_dir).expanduser()
        return OutputPlan(out, work, cache, cache)
    reuse = own and (out / "cache").is_dir()  # an earlier run's targets move to the new folder
    return OutputPlan(out, work, (out if reuse else work) / "cache", out / "cache")


def install_output(plan: OutputPlan) -> None:
    """Replace ``plan.out`` by the finished staging folder, the reused target cache with it."""
    carry = plan.cache_root == plan.out / "cache" and not (plan.work / "cache").exists()
    if carry:
        os.replace(plan.cache_root, plan.work / "cache")
    try:
        install(plan.work, plan.out)
    except BaseException:
        if carry:
            os.replace(plan.work / "cache", plan.cache_root)
        raise
