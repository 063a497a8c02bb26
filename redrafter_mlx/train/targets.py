"""Training targets of a drafter and their on-disk cache (docs/design/distillation.md).

For each training position t: the LLM's hidden state h_t (after the final norm, from the
weights as they will serve) and T+1 tokens [x0, target_1..target_T] with valid (T,) flags.
Modes: ``distill`` (greedy rollouts of every prefix, ``rollout_targets``), ``self`` (the data
is the model's own greedy output: targets read off one forward, ``self_targets``) and
``ground-truth`` (the data's labels). The cache lives in ``cache_dir/<key>`` (memory-mapped
.npy files written into a temp folder and renamed) with key = model fingerprint + data hash +
seq_len + T + mode.

Shapes: N sequence tokens, M training positions, H hidden, T drafter steps, P cached rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..engine.verifier.protocol import Verifier
from .data import Sequence

CACHE_VERSION = 1


def rollout_targets(model: Verifier, tokens: mx.array, positions: mx.array, depth: int):
    """The LLM's greedy continuations of every prefix, all branches batched per depth.

    tokens: (N,) the ground-truth sequence; positions: (M,) training positions t (< N);
    depth: T. Returns hidden (M, H) — the LLM's normed hidden state at each t — and greedy
    (M, T+1): greedy[j] = ŷ_{t+1..t+T+1} continuing y_{0..t} (t = positions[j]).

    Cache layout: ground truth at slots [0, N); branch j's depth-d token at N + d·M + j. A branch
    token attends to ground-truth slots <= t and to its own branch's earlier slots, so one forward
    per depth serves all M branches (T+1 forwards instead of M·T).
    """
    N, M = tokens.shape[0], positions.shape[0]
    cache = model.make_cache(1, N + depth * M)
    idx = mx.arange(N)[None]
    causal = mx.tril(mx.ones((N, N), dtype=mx.bool_))[None, None]
    h, cache = model(tokens[None], idx, causal, cache, idx)
    hidden = h[0][positions]  # (M, H)
    current = mx.argmax(model.logits(hidden), axis=-1).astype(mx.int32)  # ŷ_{t+1}
    greedy = [current]
    sees_prefix = mx.arange(N)[None, :] <= positions[:, None]  # (M, N)
    branch = mx.arange(M)
    for d in range(depth):
        own = (mx.arange((d + 1) * M) % M)[None, :] == branch[:, None]  # (M, (d+1)·M)
        mask = mx.concatenate([sees_prefix, own], axis=1)[None, None]  # (1, 1, M, N+(d+1)M)
        write = (N + d * M + branch)[None]
        hb, cache = model(current[None], (positions + 1 + d)[None], mask, cache, write)
        current = mx.argmax(model.logits(hb[0]), axis=-1).astype(mx.int32)
        greedy.append(current)
    return hidden, mx.stack(greedy, axis=1)


def self_targets(model: Verifier, tokens: mx.array, positions: mx.array, depth: int):
    """Greedy continuations read off one forward, for sequences the model generated greedily.

    tokens: (N,); positions: (M,) training positions t; depth: T. Returns hidden (M, H), greedy
    (M, T+1) and valid (M, T) (valid[:, k-1] covers greedy[:, k]).

    With g_i = argmax of the LLM at position i (one causal forward), the greedy continuation
    of y_{0..t} is ŷ_{t+1+k} = g_{t+k} as long as the data agrees with it before
    (y_{t+1+j} = g_{t+j} for j < k): then the prefix it continues is the data's own. So for a
    response that is the model's greedy output (same weights and chat template) every target
    inside the sequence is exact without rollouts; where the data departs from the model's
    greedy choice, the targets stop after the departing step (still exact: that step's target
    is g), and targets past the end of the sequence are not valid.
    """
    N = tokens.shape[0]
    idx = mx.arange(N)[None]
    causal = mx.tril(mx.ones((N, N), dtype=mx.bool_))[None, None]
    h, _ = model(tokens[None], idx, causal, model.make_cache(1, N), idx)
    first = int(mx.min(positions).item())
    g = mx.argmax(model.logits(h[0, first:]), axis=-1).astype(mx.int32)  # g_i for i >= first
    hidden = h[0][positions]
    mx.eval(hidden, g)
    g = np.concatenate([np.zeros(first, np.int32), np.array(g)])
    y = np.array(tokens)
    agree = np.zeros(N, dtype=bool)
    agree[:-1] = g[:-1] == y[1:]  # agree[i]: the data's next token is the greedy one
    pos = np.array(positions)
    greedy = np.zeros((len(pos), depth + 1), dtype=np.int32)
    valid = np.zeros((len(pos), depth), dtype=bool)
    for j, t in enumerate(pos):
        greedy[j, 0] = g[t]
        for k in range(1, depth + 1):
            i = t + k
            if i >= N or not agree[i - 1]:
                break
            greedy[j, k], valid[j, k - 1] = g[i], True
    return hidden, greedy, valid


def ground_truth_targets(seq: Sequence, positions: list[int], depth: int):
    """Labels from the data: tokens (M, T+1) = y_{t+1..t+T+1} and valid (M, T).

    A drafter step k is valid when its target y_{t+1+k} exists and is a training token.
    """
    N = len(seq.tokens)
    toks = np.zeros((len(positions), depth + 1), dtype=np.int32)
    valid = np.zeros((len(positions), depth), dtype=bool)
    for j, t in enumerate(positions):
        for k in range(depth + 1):
            i = t + 1 + k
            if i < N:
                toks[j, k] = seq.tokens[i]
                if k:
                    valid[j, k - 1] = seq.train[i]
    return toks, valid


def sequence_hidden(model: Verifier, tokens: mx.array, positions: mx.array) -> mx.array:
    """Hidden states at ``positions`` of one causal forward.

    tokens (N,), positions (M,) -> (M, H).
    """
    N = tokens.shape[0]
    idx = mx.arange(N)[None]
    causal = mx.tril(mx.ones((N, N), dtype=mx.bool_))[None, None]
    h, _ = model(tokens[None], idx, causal, model.make_cache(1, N), idx)
    return h[0][positions]


def _numpy_float(x: mx.array) -> np.ndarray:
    """fp16 stays fp16 (half the disk); anything else becomes float32."""
    if x.dtype == mx.float16:
        return np.array(x)
    return np.array(x.astype(mx.float32))


# ------------------------------------------------------------------------------------------
# target cache


def model_fingerprint(model_dir: Path, dtype) -> str:
    """Identifies the serving weights: config, tokenizer files, weight sizes and ends, dtype."""
    h = hashlib.sha256(str(dtype).encode())
    model_dir = Path(model_dir)
    for f in sorted(model_dir.iterdir()):
        if not f.is_file():
            continue
        h.update(f.name.encode())
        if f.suffix == ".safetensors":
            size = f.stat().st_size
            h.update(size.to_bytes(8, "little"))
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
                fh.seek(max(0, size - (1 << 20)))
                h.update(fh.read())
        elif f.suffix in (".json", ".model") or f.name.startswith("tokenizer"):
            h.update(f.read_bytes())
    return h.hexdigest()


def cache_key(
    fingerprint: str, data_digest: str, seq_len: int, depth: int, mode: str, features=()
) -> str:
    """The target cache's folder name. ``features``: the feature layers its hidden states
    hold besides the final normed state (none: the key every cache had before them)."""
    fields = dict(
        v=CACHE_VERSION,
        model=fingerprint,
        data=data_digest,
        seq_len=seq_len,
        T=depth,
        mode=mode,
    )
    if features:
        fields["features"] = [int(i) for i in features]
    blob = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


@dataclass
class TargetCache:
    """Training positions on disk (memory-mapped).

    hidden (P, H) float16/32 (P, (1 + k) * H with k feature layers: the final normed state,
    then the residual entering each, as the model's forward returns them);
    tokens (P, T+1) int32 = [x0, target_1..target_T]; valid (P, T) bool.
    """

    path: Path
    hidden: np.ndarray
    tokens: np.ndarray
    valid: np.ndarray

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def open(cls, path: Path) -> TargetCache:
        load = lambda name: np.load(path / name, mmap_mode="r")
        return cls(path, load("hidden.npy"), load("tokens.npy"), load("valid.npy"))


def build_target_cache(
    model: Verifier,
    sequences: list[Sequence],
    depth: int,
    mode: str,
    path: Path,
    on_sequence: Callable[[int], None] | None = None,
) -> TargetCache:
    """Compute hidden states and targets of every training position into ``path`` (atomically)."""
    counts = [len(s.positions()) for s in sequences]
    total = sum(counts)
    if total == 0:
        raise ValueError("the training data has no training positions")
    with staged(path) as tmp:
        dtype = np.float16 if model.dtype == mx.float16 else np.float32
        mm = np.lib.format.open_memmap
        hidden = mm(tmp / "hidden.npy", "w+", dtype, (total, model.state_width))
        tokens = mm(tmp / "tokens.npy", "w+", np.int32, (total, depth + 1))
        valid = mm(tmp / "valid.npy", "w+", np.bool_, (total, depth))
        at, tic = 0, time.perf_counter()
        for seq, m in zip(sequences, counts):
            pos = seq.positions()
            h, toks, ok = sequence_targets(model, seq, pos, depth, mode)
            hidden[at : at + m], tokens[at : at + m], valid[at : at + m] = h, toks, ok
            at += m
            if on_sequence:
                on_sequence(len(seq.tokens))
        for a in (hidden, tokens, valid):
            a.flush()
        valid_share = [round(float(v), 4) for v in np.asarray(valid).mean(axis=0)]
        del hidden, tokens, valid
        (tmp / "meta.json").write_text(
            json.dumps(
                dict(
                    version=CACHE_VERSION,
                    positions=total,
                    sequences=len(sequences),
                    T=depth,
                    mode=mode,
                    tokens=sum(len(s.tokens) for s in sequences),
                    seconds=round(time.perf_counter() - tic, 2),
                    valid_per_step=valid_share,
                )
            )
        )
    return TargetCache.open(path)


@contextmanager
def staged(path: Path) -> Iterator[Path]:
    """A temp folder beside ``path``, renamed to ``path`` once the block has written it
    (when another process finished ``path`` first, theirs is kept); removed in any case."""
    tmp = path.parent / f".tmp-{path.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "meta.json").exists():  # another process finished it: use theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sequence_targets(model: Verifier, seq: Sequence, positions: list[int], depth: int, mode: str):
    """(hidden (M, H), tokens (M, T+1), valid (M, T)) as numpy for one sequence."""
    toks = mx.array(seq.tokens, dtype=mx.int32)
    pos = mx.array(positions, dtype=mx.int32)
    if mode == "distill" and getattr(model, "recurrent", False):
        raise ValueError(
            f"--targets distill rolls out every position's continuation as branches of one "
            f"tree, which {model.model_type}'s recurrent layers cannot follow; use --targets "
            "self (the model's own answers: distill without --data) or --targets ground-truth"
        )
    if mode == "distill":
        h, greedy = rollout_targets(model, toks, pos, depth)
        mx.eval(h, greedy)
        return _numpy_float(h), np.array(greedy), np.ones((len(positions), depth), dtype=bool)
    if mode == "self":
        h, greedy, valid = self_targets(model, toks, pos, depth)
        return _numpy_float(h), greedy, valid
    h = sequence_hidden(model, toks, pos)
    mx.eval(h)
    gt, valid = ground_truth_targets(seq, positions, depth)
    return _numpy_float(h), gt, valid
