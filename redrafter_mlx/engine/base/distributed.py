"""Tensor parallelism over ``mx.distributed``: one model split across N processes (or Macs).

Each rank holds 1/N of every layer's attention heads (q/k/v split by output rows, o by input
columns; K/V heads split too, so GQA groups stay whole) and of its MLP (gate/up by output,
down by input); one ``all_sum`` after each attention and each MLP makes the hidden state
whole again on every rank. Embeddings, norms and the LM head are replicated, so the hidden
states, logits and everything the decode step computes from them (drafting, context lookup,
tree packing, acceptance) are the same on every rank without another message.

Loading reads only the rank's slice of each split tensor from the safetensors files
(``read_sharded``: a memory map, sliced before anything is copied), so a rank needs about 1/N
of the split weights' memory. Quantized (mlx-lm) layers split the same way, along their packed
columns, when a rank's slice holds whole quantization groups.

A layer's bias that is added after the ``all_sum`` (o_proj, down_proj) is kept by rank 0 only
and zeroed elsewhere, so it is added once.

Shapes: H hidden size, I MLP size, D head dim; N ranks, r this rank.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import mlx.core as mx
import numpy as np

from .errors import RedrafterError
from .safetensors_check import read_header

# Linear layers split by their output rows (axis 0) and by their input columns (last axis).
BY_OUTPUT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
BY_INPUT = ("o_proj", "down_proj")
_LAYER = re.compile(r"\.(" + "|".join(BY_OUTPUT + BY_INPUT) + r")\.(weight|scales|biases|bias)$")

# safetensors dtype -> (numpy dtype to read, mlx dtype to view it as)
_DTYPES = {
    "F32": (np.float32, None),
    "F16": (np.float16, None),
    "BF16": (np.uint16, mx.bfloat16),
    "U32": (np.uint32, None),
    "I32": (np.int32, None),
    "U8": (np.uint8, None),
    "I8": (np.int8, None),
    "I64": (np.int64, None),
    "BOOL": (np.bool_, None),
}


class ShardError(RedrafterError, ValueError):
    """A model that cannot be split across this many ranks; the message names what would work."""


def world() -> mx.distributed.Group | None:
    """The group of all launched processes, or None when running alone (no ``mlx.launch``)."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def check_shardable(args, n: int, quant: dict | None = None) -> None:
    """ShardError unless ``n`` ranks can each take whole heads, MLP rows and quant groups.

    args: a ``ModelArgs``. The message lists the rank counts that would work.
    """
    counts = [args.num_attention_heads, args.num_key_value_heads, args.intermediate_size]
    if quant:
        group = quant["group_size"]
        counts += [args.num_attention_heads * args.head_dim // group]  # o_proj's groups
        counts += [args.intermediate_size // group]  # down_proj's groups
    common = math.gcd(*counts)
    if common % n == 0:
        return
    works = [d for d in range(2, min(common, 64) + 1) if common % d == 0]
    what = (
        f"{args.num_attention_heads} attention heads, {args.num_key_value_heads} K/V heads "
        f"and an MLP of {args.intermediate_size}"
        + (f" in quantization groups of {quant['group_size']}" if quant else "")
    )
    fix = f"launch {_or(works)} processes instead" if works else "run it in one process"
    raise ShardError(f"cannot split a model with {what} across {n} processes: {fix}")


def _or(values: list[int]) -> str:
    text = ", ".join(str(v) for v in values[:-1])
    return f"{text} or {values[-1]}" if len(values) > 1 else str(values[0])


def split_axis(name: str, ndim: int) -> int | None:
    """The axis ``name`` is split along (0: output rows, -1: input columns), None: replicated.

    A by-input layer's ``bias`` (added once, after the sum) is replicated, see ``local``.
    """
    m = _LAYER.search(name)
    if m is None:
        return None
    layer, kind = m.groups()
    if layer in BY_OUTPUT:
        return 0
    return None if kind == "bias" else ndim - 1


def local(name: str, array: np.ndarray, rank: int, n: int) -> np.ndarray:
    """This rank's part of one tensor: its slice along ``split_axis``, a by-input bias on rank 0
    only (zeros elsewhere), anything else whole."""
    axis = split_axis(name, array.ndim)
    if axis is None:
        if _LAYER.search(name) and name.endswith(".bias") and rank != 0:
            return np.zeros(array.shape, array.dtype)
        return array
    size = array.shape[axis]
    if size % n:
        raise ShardError(f"{name} of shape {array.shape} does not split {n} ways")
    part = size // n
    index = [slice(None)] * array.ndim
    index[axis] = slice(rank * part, (rank + 1) * part)
    return array[tuple(index)]


def read_sharded(files: list[Path], rank: int, n: int) -> dict[str, mx.array]:
    """Every tensor of ``files`` as rank ``rank`` of ``n`` holds it (``local``); files checked
    by the caller.

    Each tensor is memory-mapped on its own and only the rank's slice is copied out before the
    map is dropped, so the process never holds more than its slices plus one tensor's mapped
    pages. (A slice by input columns still reads every page of its tensor from disk, through
    the OS's file cache.)
    """
    out: dict[str, mx.array] = {}
    for file in files:
        header, start = read_header(Path(file))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            whole = _view(file, start, entry, name)
            out[name] = _to_mx(local(name, whole, rank, n), entry)
            del whole  # unmaps it
    return out


def _view(file, start: int, entry: dict, name: str) -> np.ndarray:
    """A tensor in the file, memory-mapped (nothing read yet), as a numpy array of its shape."""
    if entry["dtype"] not in _DTYPES:
        raise ShardError(f"{file}: tensor {name} has dtype {entry['dtype']}, not supported")
    np_dtype, _ = _DTYPES[entry["dtype"]]
    begin, end = entry["data_offsets"]
    if end == begin:
        return np.zeros(entry["shape"], np_dtype)
    shape = tuple(entry["shape"])
    return np.memmap(file, dtype=np_dtype, mode="r", offset=start + begin, shape=shape)


def _to_mx(array: np.ndarray, entry: dict) -> mx.array:
    """Copy the (sliced) numpy view into an mx array; bfloat16 travels as its bits."""
    _, view_as = _DTYPES[entry["dtype"]]
    out = mx.array(np.ascontiguousarray(array))
    return out.view(view_as) if view_as is not None else out


# --- Keeping ranks in step: rank 0 decides, the others receive (an all_sum of rank 0's data
# and zeros from everyone else).


HEAD = 128  # int32s in a broadcast's first message: the length, then up to HEAD - 1 bytes


def broadcast_bytes(data: bytes | None, group: mx.distributed.Group | None) -> bytes | None:
    """Rank 0's ``data`` on every rank (None stays None); the other ranks' argument is unused.

    One ``all_sum`` when ``data`` has fewer than ``HEAD`` bytes (the length travels with
    them: a message is latency-bound at this size), a second for the rest of a longer one."""
    if group is None:
        return data
    head = np.zeros(HEAD, np.int32)
    if group.rank() == 0:
        head[0] = -1 if data is None else len(data)
        first = np.frombuffer((data or b"")[: HEAD - 1], np.uint8)
        head[1 : 1 + len(first)] = first
    head = np.array(_from_rank0(mx.array(head), group))
    n = int(head[0])
    if n < 0:
        return None
    got = head[1 : 1 + n].astype(np.uint8).tobytes()
    if n < HEAD:
        return got
    mine = np.frombuffer(data, np.uint8)[HEAD - 1 :] if group.rank() == 0 else None
    rest = mine if mine is not None else np.zeros(n - (HEAD - 1), np.uint8)
    rest = _from_rank0(mx.array(rest.astype(np.int32)), group)
    return got + np.array(rest).astype(np.uint8).tobytes()


def broadcast_text(text: str | None, group: mx.distributed.Group | None) -> str | None:
    """Rank 0's ``text`` (or None) on every rank."""
    raw = broadcast_bytes(None if text is None else text.encode("utf-8"), group)
    return None if raw is None else raw.decode("utf-8")


def _from_rank0(x: mx.array, group: mx.distributed.Group) -> mx.array:
    """Rank 0's ``x``: every other rank contributes zeros to the sum."""
    x = x if group.rank() == 0 else mx.zeros_like(x)
    with mx.stream(mx.cpu):
        out = mx.distributed.all_sum(x, group=group)
        mx.eval(out)
    return out


def shared_seed(seed: int | None, group: mx.distributed.Group | None) -> int | None:
    """One seed for every rank: the given one, else (when ranks run) one rank 0 draws, so
    that unseeded sampling still draws the same tokens everywhere."""
    if group is None:
        return seed
    if seed is None and group.rank() == 0:
        seed = int(np.random.SeedSequence().generate_state(1, np.uint64)[0] >> 1)
    text = broadcast_text(None if seed is None else str(seed), group)
    return None if text is None else int(text)
