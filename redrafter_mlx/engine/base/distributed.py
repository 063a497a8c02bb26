"""Processes launched together (``mlx.launch``): the group, and keeping ranks in step.

The verifier's split across the ranks (tensor parallelism) is ``engine/verifier/shard.py``;
here are the group of all launched processes and rank 0's decisions sent to the others
(text, bytes, seeds), so every rank runs the same steps.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def world() -> mx.distributed.Group | None:
    """The group of all launched processes, or None when running alone (no ``mlx.launch``)."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


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
