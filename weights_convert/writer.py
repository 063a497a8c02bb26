"""Turn source tensors into mlx-lm safetensors shards, one tensor in memory at a time.

Each source tensor becomes a :class:`Job`: cast to the output dtype, or quantized with
``mx.quantize`` into ``{prefix}.weight`` (uint32), ``{prefix}.scales`` and ``{prefix}.biases``.
All output shapes are known before any data is read, so shards (≤ 5 GB, like mlx-lm) and the
index are planned first and each shard is then streamed to disk tensor by tensor.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from weights_convert.safetensors_io import SafetensorsWriter, TensorSpec
from weights_convert.tensors import FLOAT_CODES, TensorRef, mx_dtype, mx_to_numpy, to_mx

MAX_SHARD_BYTES = 5 << 30  # mlx_lm.utils.MAX_FILE_SIZE_GB
SAFETENSORS_METADATA = {"format": "mlx"}


@dataclass(frozen=True)
class Quantization:
    """Affine quantization settings, written to config.json as ``{group_size, bits, mode}``."""

    group_size: int
    bits: int
    mode: str = "affine"

    def as_config(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}


@dataclass(frozen=True)
class Job:
    """One source tensor and the output tensors it becomes.

    Attributes:
        source: the tensor in the checkpoint.
        specs: output tensors: ``(name, dtype, shape)`` once, or weight/scales/biases.
        quant: the quantization applied, or None.
        produce: makes the output arrays itself (already-quantized sources), or None.
    """

    source: TensorRef
    specs: tuple[TensorSpec, ...]
    quant: Quantization | None
    produce: Callable[[], list[np.ndarray]] | None = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def is_quantizable(name: str, ref: TensorRef, group_size: int) -> bool:
    """mlx-lm's rule: weights of Linear/Embedding layers (2-D ``*.weight``) whose input
    dimension is a multiple of the group size (``mlx_lm.utils.quantize_model``)."""
    return (
        name.endswith(".weight")
        and len(ref.shape) == 2
        and ref.dtype in FLOAT_CODES
        and ref.shape[-1] % group_size == 0
    )


@functools.cache
def _packed_widths(in_dim: int, group_size: int, bits: int) -> tuple[int, int]:
    """Widths of (packed weight, scales) for rows of ``in_dim`` values, asked of ``mx.quantize``."""
    import mlx.core as mx

    wq, scales, _ = mx.quantize(
        mx.zeros((1, in_dim), dtype=mx.float32), group_size=group_size, bits=bits
    )
    return wq.shape[-1], scales.shape[-1]


def make_job(name: str, ref: TensorRef, dtype: str, quant: Quantization | None) -> Job:
    """Plan one tensor: float tensors are cast to ``dtype`` (a safetensors code); 2-D weights
    are quantized when ``quant`` is given and :func:`is_quantizable`; others pass unchanged."""
    out_dtype = dtype if ref.dtype in FLOAT_CODES else ref.dtype
    if quant is not None and is_quantizable(name, ref, quant.group_size):
        rows = ref.shape[0]
        wq_width, s_width = _packed_widths(ref.shape[1], quant.group_size, quant.bits)
        prefix = name[: -len(".weight")]
        specs = (
            TensorSpec(name, "U32", (rows, wq_width)),
            TensorSpec(f"{prefix}.scales", out_dtype, (rows, s_width)),
            TensorSpec(f"{prefix}.biases", out_dtype, (rows, s_width)),
        )
        return Job(ref, specs, quant)
    return Job(ref, (TensorSpec(name, out_dtype, ref.shape),), None)


def materialize(job: Job) -> list[np.ndarray]:
    """Read the source and produce the output arrays of ``job.specs`` (numpy, bf16 as uint16).

    A tensor already in the output dtype is passed through byte for byte; otherwise it is cast
    with MLX (round to nearest even) and, if planned, quantized with ``mx.quantize``.
    """
    if job.produce is not None:
        return job.produce()
    raw = job.source.load()
    spec = job.specs[0]
    if job.quant is None and spec.dtype == job.source.dtype:
        return [raw]
    import mlx.core as mx

    weight = to_mx(raw, job.source.dtype).astype(mx_dtype(job.specs[-1].dtype))
    del raw
    if job.quant is None:
        arrays = [weight]
    else:
        arrays = list(
            mx.quantize(
                weight, group_size=job.quant.group_size, bits=job.quant.bits, mode=job.quant.mode
            )
        )
    return [mx_to_numpy(a)[0] for a in arrays]


def plan_shards(jobs: list[Job], max_bytes: int = MAX_SHARD_BYTES) -> list[list[Job]]:
    """Group jobs into shards of at most ``max_bytes`` (a larger single job gets its own shard)."""
    shards: list[list[Job]] = []
    size = 0
    for job in jobs:
        if not shards or size + job.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(job)
        size += job.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """mlx-lm's file names: ``model.safetensors`` or ``model-0000i-of-0000N.safetensors``."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_weights(
    jobs: list[Job],
    out_dir: Path,
    on_tensor: Callable[[Job], None] = lambda job: None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> list[Path]:
    """Write all jobs as safetensors shards plus ``model.safetensors.index.json`` (as mlx-lm does).

    Args:
        jobs: planned tensors, in output order.
        out_dir: an existing, empty folder.
        on_tensor: called after each job is written (progress).

    Returns:
        the shard files written.
    """
    shards = plan_shards(jobs, max_shard_bytes)
    names = shard_names(len(shards))
    weight_map: dict[str, str] = {}
    files = []
    for shard, file_name in zip(shards, names):
        specs = [spec for job in shard for spec in job.specs]
        with SafetensorsWriter(out_dir / file_name, specs, SAFETENSORS_METADATA) as writer:
            for job in shard:
                for spec, array in zip(job.specs, materialize(job)):
                    writer.write(spec.name, array)
                    weight_map[spec.name] = file_name
                on_tensor(job)
        files.append(out_dir / file_name)
    index = {
        "metadata": {
            "total_size": sum(job.nbytes for job in jobs),
            "total_parameters": sum(math.prod(job.source.shape) for job in jobs),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(out_dir / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=4)
    return files
