"""Train a ReDrafter drafter for a frozen LLM by knowledge distillation.

See docs/design.md, "Distillation".

    from redrafter_mlx.train.distill import distill
    summary = distill("~/models/vicuna-7b", ["sharegpt.json"], "~/models/vicuna-7b-drafter",
                      predict_tokens=5, steps=20000, batch_size=256)

or ``redrafter-mlx distill --model DIR --data FILE --out DIR``. The output directory is a drafter
directory (``config.json`` with ``predict_tokens`` + ``model.safetensors``) that
``redrafter_mlx.load(model_dir, out_dir)`` serves.

Pipeline
--------
1. **Data** (``distill_data``): chats rendered in the model's chat format, cut into windows of
   ``seq_len`` tokens; training positions t are those whose next token is an assistant token
   (every token for plain text).
2. **Targets** (cached on disk): for each training position t, the LLM's hidden state h_t (after
   the final norm, from the weights *as they will serve*: same dtype and quantization) and
   T+1 tokens. ``targets="distill"`` (default): the LLM's own greedy continuation
   ŷ_{t+1..t+T+1} of the ground-truth prefix y_{1..t}; x0 = ŷ_{t+1} is the init token the
   engine gets from the LLM, the drafter learns ŷ_{t+2..t+T+1}. All positions of a sequence
   roll out together, one forward per depth, through a tree mask (``rollout_targets``).
   ``targets="ground-truth"``: x0 = y_{t+1}, drafter targets y_{t+2..t+T+1} (the reference
   trainer's labels). The cache lives in ``cache_dir/<key>`` with key = model fingerprint +
   data hash + seq_len + T + mode, so epochs, resumed runs and new runs reuse it.
3. **Training**: only the drafter trains. Loss = Σ_k CE(step k) over the T steps, each step
   averaged over its valid positions, teacher-forced through the RNN state:
   s_1 = next_state(0, E[x0]), s_k = next_state(s_{k-1}, E[target_{k-1}]). AdamW with linear
   warm-up and cosine decay, gradient clipping at 1.0, gradient accumulation.
   The data order is a pure function of (seed, epoch), so a resumed run replays it exactly.
4. **Checkpoints**: ``out/checkpoints/step-NNNNNNNN/`` (drafter files + ``training_state.*``:
   optimizer state, step, run config) written into a temp dir and renamed (atomic); the newest
   weights are also copied to ``out/`` (each file replaced atomically). ``resume=True``
   continues from the newest checkpoint and gives the same weights as an uninterrupted run.
   ``out`` is written in place when it is new, empty or this command's own run; a folder
   holding anything else (a model, a drafter, other files), or a finished run started over, is
   replaced only with ``overwrite``, and then the run writes into a staging folder beside
   ``out`` that is renamed into place at the end (``plan_output``): a failed run leaves the
   old drafter and checkpoints as they were (a reused target cache may gain entries).
5. **Evaluation**: greedy ReDrafter on held-out prompts (``eval_data``, else prompts from the
   training data, marked in-sample) at a few beam shapes (W, L ≤ T+1); mean accepted tokens
   per step is printed, returned and stored in ``out/eval.json``.

Scaling out
-----------
Data parallelism with ``mx.distributed``: launch the same command on several processes or Macs,
e.g. ``mlx.launch --hosts mac1,mac2 -- redrafter-mlx distill ...`` (or ``mlx.launch -n 2`` on
one machine). Every process builds (or reuses) the same target cache, trains on its own slice of
every global batch (global batch = batch_size × processes) and the gradients are averaged with
``mx.distributed.all_sum`` before each update, so all replicas stay identical; only rank 0
writes checkpoints and evaluates. Put ``--cache-dir`` on local disk of each host (the cache is
deterministic, so hosts compute the same one). A single process needs nothing of this.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..engine.drafter import Drafter, DrafterArgs
from ..engine.errors import ParamError
from ..engine.model import Model
from ..engine.output_dir import holds, install, refusal
from .data import Sequence, files_digest, load_prompts, load_training_data

CACHE_VERSION = 1
DEFAULT_EVAL_SHAPES = ((1, 3), (2, 4), (4, 5))
KEEP_CHECKPOINTS = 2
CLIP_GRAD_NORM = 1.0
TARGET_MODES = ("distill", "self", "ground-truth")


@dataclass
class DistillOptions:
    """All options of a run; names match the CLI flags (underscored)."""

    predict_tokens: int = 5
    layers: int = 2
    exit_dim: int | str = "auto"
    rnn: bool = True
    steps: int | None = None
    epochs: float | None = None
    batch_size: int = 128
    seq_len: int = 512
    lr: float = 1e-3
    warmup: float = 0.1
    weight_decay: float = 0.01
    eval_data: list | None = None
    eval_prompts: int = 8
    eval_max_tokens: int = 64
    eval_shapes: tuple = DEFAULT_EVAL_SHAPES
    resume: bool = False
    overwrite: bool = False
    targets: str = "distill"
    save_every: int = 500
    seed: int = 0
    grad_accum: int = 1
    cache_dir: str | None = None
    dtype: str | None = None
    draft_vocab: int | None = None
    soft_targets: bool = False
    quiet: bool = False

    def validate(self) -> DistillOptions:
        """Return self, or raise ParamError naming the option and its allowed values."""
        if self.predict_tokens < 1:
            raise ParamError(
                "predict_tokens", f"predicted tokens must be >= 1, got {self.predict_tokens}"
            )
        if self.layers < 0:
            raise ParamError("layers", f"layers must be >= 0, got {self.layers}")
        if self.targets not in TARGET_MODES:
            raise ParamError(
                "targets", f"targets must be one of {TARGET_MODES}, got {self.targets!r}"
            )
        if self.steps is not None and self.epochs is not None:
            raise ParamError("epochs", "give either steps or epochs, not both")
        if self.steps is not None and self.steps < 1:
            raise ParamError("steps", f"steps must be >= 1, got {self.steps}")
        if self.epochs is not None and self.epochs <= 0:
            raise ParamError("epochs", f"epochs must be > 0, got {self.epochs}")
        for name in ("batch_size", "grad_accum", "seq_len"):
            if getattr(self, name) < 1:
                raise ParamError(
                    name, f"{name.replace('_', ' ')} must be >= 1, got {getattr(self, name)}"
                )
        if not self.warmup >= 0:
            raise ParamError(
                "warmup",
                f"warmup must be >= 0 (a fraction < 1 or a step count), got {self.warmup}",
            )
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ParamError(
                "draft_vocab", f"draft vocab must be >= 1 token ids, got {self.draft_vocab}"
            )
        if self.soft_targets and self.targets != "self":
            raise ParamError(
                "soft_targets",
                "soft targets need --targets self (the model's distribution at a target is "
                "read from the cached hidden state where the data drew it: exact only when the "
                "data is the model's own greedy output)",
            )
        if self.exit_dim != "auto":
            try:
                self.exit_dim = int(self.exit_dim)
            except ValueError:
                raise ParamError(
                    "exit_dim", f"exit dim must be 'auto' or an integer, got {self.exit_dim!r}"
                ) from None
        return self


# ------------------------------------------------------------------------------------------
# targets


def rollout_targets(model: Model, tokens: mx.array, positions: mx.array, depth: int):
    """The LLM's greedy continuations of every prefix, all branches batched per depth.

    tokens: (N,) the ground-truth sequence; positions: (M,) training positions t (< N);
    depth: T. Returns hidden (M, H) — the LLM's normed hidden state at each t — and greedy
    (M, T+1): greedy[j] = ŷ_{t+1..t+T+1} continuing y_{0..t} (t = positions[j]).

    Cache layout: ground truth at slots [0, N); branch j's depth-d token at N + d·M + j. A branch
    token attends to ground-truth slots <= t and to its own branch's earlier slots, so one forward
    per depth serves all M branches (T+1 forwards instead of M·T).
    """
    N, M = tokens.shape[0], positions.shape[0]
    keys, values = model.make_cache(1, N + depth * M)
    idx = mx.arange(N)[None]
    causal = mx.tril(mx.ones((N, N), dtype=mx.bool_))[None, None]
    h, keys, values = model(tokens[None], idx, causal, keys, values, idx)
    hidden = h[0][positions]  # (M, H)
    current = mx.argmax(model.logits(hidden), axis=-1).astype(mx.int32)  # ŷ_{t+1}
    greedy = [current]
    sees_prefix = mx.arange(N)[None, :] <= positions[:, None]  # (M, N)
    branch = mx.arange(M)
    for d in range(depth):
        own = (mx.arange((d + 1) * M) % M)[None, :] == branch[:, None]  # (M, (d+1)·M)
        mask = mx.concatenate([sees_prefix, own], axis=1)[None, None]  # (1, 1, M, N+(d+1)M)
        write = (N + d * M + branch)[None]
        hb, keys, values = model(
            current[None], (positions + 1 + d)[None], mask, keys, values, write
        )
        current = mx.argmax(model.logits(hb[0]), axis=-1).astype(mx.int32)
        greedy.append(current)
    return hidden, mx.stack(greedy, axis=1)


def self_targets(model: Model, tokens: mx.array, positions: mx.array, depth: int):
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
    keys, values = model.make_cache(1, N)
    idx = mx.arange(N)[None]
    causal = mx.tril(mx.ones((N, N), dtype=mx.bool_))[None, None]
    h, _, _ = model(tokens[None], idx, causal, keys, values, idx)
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


def sequence_hidden(model: Model, tokens: mx.array, positions: mx.array) -> mx.array:
    """Hidden states at ``positions`` of one causal forward.

    tokens (N,), positions (M,) -> (M, H).
    """
    N = tokens.shape[0]
    keys, values = model.make_cache(1, N)
    idx = mx.arange(N)[None]
    causal = mx.tril(mx.ones((N, N), dtype=mx.bool_))[None, None]
    h, _, _ = model(tokens[None], idx, causal, keys, values, idx)
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


def cache_key(fingerprint: str, data_digest: str, seq_len: int, depth: int, mode: str) -> str:
    blob = json.dumps(
        dict(
            v=CACHE_VERSION,
            model=fingerprint,
            data=data_digest,
            seq_len=seq_len,
            T=depth,
            mode=mode,
        ),
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


@dataclass
class TargetCache:
    """Training positions on disk (memory-mapped).

    hidden (P, H) float16/32; tokens (P, T+1) int32 = [x0, target_1..target_T]; valid (P, T) bool.
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
    model: Model,
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
    tmp = path.parent / f".tmp-{path.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        dtype = np.float16 if model.model.norm.weight.dtype == mx.float16 else np.float32
        mm = np.lib.format.open_memmap
        hidden = mm(tmp / "hidden.npy", "w+", dtype, (total, model.hidden_size))
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
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "meta.json").exists():  # another process finished it: use theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return TargetCache.open(path)


def sequence_targets(model: Model, seq: Sequence, positions: list[int], depth: int, mode: str):
    """(hidden (M, H), tokens (M, T+1), valid (M, T)) as numpy for one sequence."""
    toks = mx.array(seq.tokens, dtype=mx.int32)
    pos = mx.array(positions, dtype=mx.int32)
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


# ------------------------------------------------------------------------------------------
# training


def drafter_args(
    model: Model, opts: DistillOptions, draft_vocab: list[int] | None = None
) -> DrafterArgs:
    H = model.hidden_size
    exit_dim = 2 * H if opts.exit_dim == "auto" else int(opts.exit_dim)
    return DrafterArgs(
        vocab_size=model.vocab_size,
        hidden_size=H,
        exit_dim=exit_dim,
        num_draft_layers=opts.layers,
        rnn=opts.rnn,
        draft_vocab=draft_vocab,
    )


def shortlist_vocab(sequences: list[Sequence], size: int, vocab_size: int, always=()) -> list[int]:
    """The ``size`` most frequent training tokens (FR-Spec), ascending ids.

    Frequencies count the training tokens (responses) of ``sequences``; ties go to the lower
    id; ``always`` (e.g. the end-of-turn ids) are included first. Ids never seen are not
    listed, so the list may be shorter than ``size``.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    for seq in sequences:
        toks = np.asarray(seq.tokens)[np.asarray(seq.train, dtype=bool)]
        np.add.at(counts, toks, 1)
    keep = [int(i) for i in always if 0 <= int(i) < vocab_size][:size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id asc
    for i in order:
        if len(keep) >= size or counts[i] == 0:
            break
        if int(i) not in keep:
            keep.append(int(i))
    return sorted(keep)


def shortlist_index(draft_vocab: list[int] | None, vocab_size: int) -> np.ndarray | None:
    """(V,) int32: the head index of each full id, -1 for ids outside the shortlist."""
    if not draft_vocab:
        return None
    index = np.full(vocab_size, -1, dtype=np.int32)
    index[np.asarray(draft_vocab)] = np.arange(len(draft_vocab), dtype=np.int32)
    return index


def new_drafter(args: DrafterArgs, seed: int) -> Drafter:
    """A freshly initialised float32 drafter (deterministic for a seed)."""
    mx.random.seed(seed)
    drafter = Drafter(args)
    drafter.set_dtype(mx.float32)
    mx.eval(drafter.parameters())
    return drafter


def drafter_loss(drafter: Drafter, hidden, emb, targets, valid, teacher=None, soft=None):
    """Teacher-forced loss over T draft steps.

    hidden: (B, H); emb: (B, T, H) = E[x0], E[target_1..target_{T-1}]; targets: (B, T) int;
    valid: (B, T) bool. Optional soft targets: teacher (B, T, V) the LLM's log-probabilities
    for each step's token (over the drafter's head ids) and soft (B, T) bool, the rows that
    have them; there the loss is the cross-entropy to the teacher's distribution instead of
    to its greedy token (more signal per position: which other tokens were likely).
    Returns (loss = Σ_k mean loss of step k over its valid rows, per-step losses (T,),
    per-step top-1 accuracy (T,)).
    """
    B, T, H = emb.shape
    state = mx.zeros((B, H), dtype=hidden.dtype)
    losses, accs = [], []
    for k in range(T):
        state = drafter.next_state(state, emb[:, k])
        logits = drafter(hidden, state)
        v = valid[:, k].astype(mx.float32)
        n = mx.maximum(v.sum(), 1.0)
        ce = nn.losses.cross_entropy(logits, targets[:, k])
        if teacher is not None:
            p = mx.exp(teacher[:, k])
            soft_ce = -(p * nn.log_softmax(logits, axis=-1)).sum(axis=-1)
            ce = mx.where(soft[:, k], soft_ce, ce)
        losses.append((ce * v).sum() / n)
        accs.append(((mx.argmax(logits, axis=-1) == targets[:, k]) * v).sum() / n)
    losses, accs = mx.stack(losses), mx.stack(accs)
    return losses.sum(), losses, accs


def lr_schedule(lr: float, total_steps: int, warmup: float):
    """Linear warm-up from 0 to lr, then cosine decay to 0; warmup < 1 is a fraction of steps."""
    w = int(round(warmup * total_steps)) if warmup < 1 else int(warmup)
    w = min(w, total_steps - 1) if total_steps > 1 else 0
    decay = optim.cosine_decay(lr, max(total_steps - w, 1), 0.0)
    if w == 0:
        return decay
    return optim.join_schedules([optim.linear_schedule(0.0, lr, w), decay], [w])


class DataOrder:
    """Which cached positions each micro-batch reads: a pure function of (seed, micro-batch index).

    Epoch e is a permutation drawn from numpy's generator seeded by (seed, e); it is cut into
    ``positions // global_batch`` batches (the remainder is dropped); each process reads its own
    slice of a global batch.
    """

    def __init__(self, positions: int, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        self.batch_size, self.seed, self.rank, self.world = batch_size, seed, rank, world
        self.global_batch = batch_size * world
        self.positions = positions
        self.per_epoch = positions // self.global_batch
        if self.per_epoch == 0:
            raise ValueError(
                f"{positions} training positions cannot fill one batch of {self.global_batch}; "
                f"use a smaller batch size or more data"
            )
        self._epoch, self._perm = -1, None

    def batch(self, micro: int) -> np.ndarray:
        """Sorted position indices (batch_size,) of global micro-batch ``micro`` for this rank."""
        epoch, i = divmod(micro, self.per_epoch)
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.positions)
            self._epoch = epoch
        start = i * self.global_batch + self.rank * self.batch_size
        return np.sort(self._perm[start : start + self.batch_size])


def read_batch(cache: TargetCache, model: Model, idx: np.ndarray, head_index=None):
    """Model inputs for cached positions idx.

    Returns hidden (B, H) f32, emb (B, T, H) f32, targets (B, T), valid (B, T). With a
    shortlist (``head_index``, see ``shortlist_index``) targets are head indices and a target
    outside the shortlist is not valid (the drafter cannot propose it); the RNN input stays
    the true token's embedding.
    """
    raw = cache.tokens[idx]
    valid = np.array(cache.valid[idx])
    targets = raw[:, 1:]
    if head_index is not None:
        targets = head_index[targets]
        valid &= targets >= 0
        targets = np.maximum(targets, 0)
    toks = mx.array(raw)
    hidden = mx.array(cache.hidden[idx]).astype(mx.float32)
    emb = model.embed(toks[:, :-1]).astype(mx.float32)
    return hidden, emb, mx.array(targets), mx.array(valid)


def teacher_targets(cache: TargetCache, model: Model, idx: np.ndarray, head_ids=None):
    """Soft targets for cached positions idx, for caches whose rows run along each sequence.

    Step k's token at position t is the LLM's draw at position t+k, so its distribution is
    the LLM's head applied to the hidden state of cache row idx+k, when that row is position
    t+k of the same sequence (checked: rows idx+1..idx+k hold steps 1..k's targets as their
    x0; a chance match past a sequence's end remains possible but rare). Returns teacher (B, T, V)
    log-probabilities over ``head_ids`` (a shortlist, renormalised; None = the vocabulary)
    and soft (B, T) bool.
    """
    T = cache.tokens.shape[1] - 1
    P = cache.size
    rows = idx[:, None] + np.arange(1, T + 1)[None, :]  # (B, T)
    inside = rows < P
    rows = np.minimum(rows, P - 1)
    match = inside & np.asarray(cache.valid[idx]) & (cache.tokens[rows, 0] == cache.tokens[idx, 1:])
    soft = np.cumprod(match, axis=1).astype(bool)  # rows t+1..t+k all continue the sequence
    h = mx.array(cache.hidden[rows.reshape(-1)]).astype(mx.float32)
    if head_ids is None:
        logits = model.logits(h)
    else:
        w = model.model.embed_tokens.weight if model.args.tie_word_embeddings else None
        w = w if w is not None else model.lm_head.weight
        logits = (h @ w[mx.array(head_ids)].T).astype(mx.float32)
    teacher = nn.log_softmax(logits, axis=-1).reshape(len(idx), T, -1)
    return teacher, mx.array(soft)


class Trainer:
    """One drafter, its optimizer and the gradient step (with accumulation and all_sum)."""

    def __init__(self, drafter: Drafter, opts: DistillOptions, total_steps: int, group=None):
        self.drafter = drafter
        self.group = group
        self.accum = opts.grad_accum
        self.optimizer = optim.AdamW(
            learning_rate=lr_schedule(opts.lr, total_steps, opts.warmup),
            weight_decay=opts.weight_decay,
        )
        self.optimizer.init(drafter.trainable_parameters())
        self._value_and_grad = nn.value_and_grad(drafter, drafter_loss)

    def step(self, batches) -> tuple[mx.array, mx.array, mx.array]:
        """One optimizer update from ``grad_accum`` micro-batches (hidden, emb, targets, valid).

        Returns the mean (loss, per-step losses (T,), per-step accuracy (T,)) over them.
        """
        total, loss_sum, steps_sum, acc_sum = None, 0.0, 0.0, 0.0
        for batch in batches:
            (loss, step_losses, accs), grads = self._value_and_grad(self.drafter, *batch)
            total = grads if total is None else tree_map(mx.add, total, grads)
            loss_sum, steps_sum, acc_sum = loss_sum + loss, steps_sum + step_losses, acc_sum + accs
        n = len(batches)
        grads = tree_map(lambda g: g / n, total)
        metrics = (loss_sum / n, steps_sum / n, acc_sum / n)
        if self.group is not None and self.group.size() > 1:
            grads = tree_map(self._average, grads)
            metrics = tuple(self._average(m) for m in metrics)
        grads, _ = optim.clip_grad_norm(grads, CLIP_GRAD_NORM)
        self.optimizer.update(self.drafter, grads)
        mx.eval(self.drafter.parameters(), self.optimizer.state, *metrics)
        return metrics

    def _average(self, x: mx.array) -> mx.array:
        """Mean over the processes of a data-parallel run."""
        return mx.distributed.all_sum(x, group=self.group) / self.group.size()

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.learning_rate)


# ------------------------------------------------------------------------------------------
# checkpoints


def checkpoint_root(out: Path) -> Path:
    return Path(out) / "checkpoints"


def list_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temp dirs of interrupted writes are never listed)."""
    root = checkpoint_root(out)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def drafter_config(args: DrafterArgs, predict_tokens: int, targets: str) -> dict:
    cfg = args.to_config()
    cfg.update(predict_tokens=predict_tokens, distill_targets=targets)
    return cfg


def write_drafter_files(path: Path, drafter: Drafter, config: dict) -> None:
    """The drafter directory format: config.json + model.safetensors (reference names)."""
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(drafter.parameters())))


def save_checkpoint(out: Path, trainer: Trainer, step: int, config: dict, run: dict) -> Path:
    """Write ``checkpoints/step-NNNNNNNN`` atomically (temp dir + rename), then refresh ``out/``.

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
            json.dumps(dict(step=step, run=run), indent=2) + "\n"
        )
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for name in ("model.safetensors", "config.json"):
        part = Path(out) / f".{name}.tmp-{os.getpid()}"
        shutil.copyfile(final / name, part)
        os.replace(part, Path(out) / name)
    for old in list_checkpoints(out)[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, trainer: Trainer) -> dict:
    """Restore drafter weights and optimizer state; returns training_state.json."""
    info = json.loads((path / "training_state.json").read_text())
    trainer.drafter.load_weights(str(path / "model.safetensors"), strict=True)
    state = mx.load(str(path / "training_state.safetensors"))
    trainer.optimizer.state = tree_unflatten(list(state.items()))
    mx.eval(trainer.drafter.parameters(), trainer.optimizer.state)
    return info


def clean_stale_temps(out: Path) -> None:
    """Remove temp dirs/files left by a crashed write."""
    for root in (checkpoint_root(out), Path(out)):
        if root.is_dir():
            for p in root.glob(".*tmp*"):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------
# evaluation


def eval_shapes(shapes, predict_tokens: int) -> list[tuple[int, int]]:
    """Beam shapes (W, L) with L capped at T+1 (the drafter predicts T tokens), deduplicated."""
    out = []
    for w, length in shapes:
        shape = (int(w), min(int(length), predict_tokens + 1))
        if shape[1] >= 2 and shape not in out:
            out.append(shape)
    return out


def evaluate(
    model: Model,
    drafter: Drafter,
    prompts: list[list[int]],
    shapes,
    max_tokens: int,
    eos_token_ids=(),
) -> list[dict]:
    """Greedy ReDrafter on all prompts (one batch) per beam shape: mean accepted tokens per step.

    The compiled step reads the drafter's weights at every call, so a drafter trained in place
    since an earlier evaluation is evaluated with its current weights.
    """
    from ..engine.generation import decode
    from ..engine.shape import BeamShape

    results = []
    for w, length in shapes:
        stats = None
        for ev in decode(
            model,
            drafter,
            prompts,
            max_tokens=max_tokens,
            shape=BeamShape(w, length),
            eos_token_ids=eos_token_ids,
            seed=0,
        ):
            stats = ev.stats
        results.append(
            dict(
                beam_width=w,
                beam_length=length,
                tokens_per_step=round(stats.tokens_per_step, 4),
                steps=stats.steps,
                generated=stats.generation_tokens,
            )
        )
    return results


# ------------------------------------------------------------------------------------------
# progress


class Progress:
    """A rich progress bar (or nothing when quiet) for the cache build and training."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self._bar = None
        if not quiet:
            from rich.console import Console

            self.console = Console(stderr=True)

    def print(self, *args, **kw):
        if not self.quiet:
            self.console.print(*args, **kw)

    def start(self, description: str, total: int):
        if self.quiet:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        self._bar = Bar(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
            transient=False,
        )
        self._bar.start()
        self._task = self._bar.add_task(description, total=total, info="")

    def update(self, advance: int = 1, info: str = ""):
        if self._bar is not None:
            self._bar.update(self._task, advance=advance, info=info)

    def stop(self):
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def format_metrics(loss: float, accs: list[float], tok_s: float, lr: float) -> str:
    """Progress line: loss, top-1 accuracy per draft step, training positions (tokens) / s."""
    acc = " ".join(f"{a:.2f}" for a in accs)
    return f"loss {loss:.3f}  acc[{acc}]  {tok_s:,.0f} tok/s  lr {lr:.2e}"


def eval_table(results: list[dict], title: str):
    from rich.table import Table

    table = Table(title=title)
    for col in ("W", "L", "tokens/step"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r["beam_width"]), str(r["beam_length"]), f"{r['tokens_per_step']:.3f}")
    return table


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


def plan_output(out: Path, opts: DistillOptions, sources: list[Path]) -> OutputPlan:
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


# ------------------------------------------------------------------------------------------
# the run


@dataclass
class RunContext:
    model: Model
    tokenizer: object
    model_dir: Path
    out: Path
    cache: TargetCache
    order: DataOrder
    total_steps: int
    sequences: list[Sequence]
    run: dict = field(default_factory=dict)
    draft_vocab: list[int] | None = None


def distill(model_dir, data_files, out_dir, **options) -> dict:
    """Train a drafter for ``model_dir`` on ``data_files`` into ``out_dir``; returns a summary.

    Options are the CLI flags, underscored (see ``DistillOptions``). The summary holds the
    steps run, first and final loss, per-step accuracy, the eval results (tokens/step per beam
    shape), the cache path and the output paths. What ``out_dir`` already holds is kept unless
    ``overwrite``, and then replaced only when the new drafter is complete (``plan_output``).
    """
    opts = DistillOptions(**options).validate()
    if isinstance(data_files, (str, os.PathLike)):
        data_files = [data_files]
    if isinstance(opts.eval_data, (str, os.PathLike)):
        opts.eval_data = [opts.eval_data]
    data_files = [Path(f).expanduser() for f in data_files]
    out = Path(out_dir).expanduser()
    inputs = [Path(model_dir).expanduser(), *data_files, *map(Path, opts.eval_data or [])]
    plan = plan_output(out, opts, [p for p in inputs if p.exists()])
    group = mx.distributed.init() if mx.distributed.is_available() else None
    rank = group.rank() if group is not None else 0
    if not plan.staged:
        return run_distill(model_dir, data_files, plan, opts, group)
    if rank == 0:
        shutil.rmtree(plan.work, ignore_errors=True)  # left by a killed run
    try:
        summary = run_distill(model_dir, data_files, plan, opts, group)
        if rank == 0:
            install_output(plan)
    except BaseException:
        if rank == 0:
            shutil.rmtree(plan.work, ignore_errors=True)
        raise
    return summary


def run_distill(model_dir, data_files, plan: OutputPlan, opts: DistillOptions, group) -> dict:
    """Prepare, train, save and evaluate into ``plan.work``; returns the summary of ``distill``."""
    rank, world = (group.rank(), group.size()) if group is not None else (0, 1)
    progress = Progress(opts.quiet or rank != 0)
    tic = time.perf_counter()

    ctx = prepare(model_dir, data_files, plan, opts, progress, rank, world)
    trainer = Trainer(
        new_drafter(drafter_args(ctx.model, opts, ctx.draft_vocab), opts.seed),
        opts,
        ctx.total_steps,
        group,
    )
    start = restore(ctx, trainer, opts, progress, rank)
    train_tic = time.perf_counter()
    history = train_loop(ctx, trainer, opts, progress, start, rank)
    train_seconds = time.perf_counter() - train_tic
    config = drafter_config(trainer.drafter.args, opts.predict_tokens, opts.targets)
    if rank == 0 and (not list_checkpoints(ctx.out) or history):
        save_checkpoint(ctx.out, trainer, ctx.total_steps, config, ctx.run)
    summary = dict(
        out_dir=str(plan.out),
        steps=ctx.total_steps,
        resumed_from=start,
        positions=ctx.cache.size,
        cache_dir=str(plan.final_cache_root / ctx.cache.path.name),
        train_seconds=round(train_seconds, 2),
        trained_positions=len(history) * ctx.order.batch_size * opts.grad_accum * world,
        draft_vocab=len(ctx.draft_vocab) if ctx.draft_vocab else None,
        targets=opts.targets,
        predict_tokens=opts.predict_tokens,
        first_loss=history[0]["loss"] if history else None,
        final_loss=_tail_mean([h["loss"] for h in history]),
        final_step_accuracy=history[-1]["step_accuracy"] if history else None,
        history=history,
        world_size=world,
        rank=rank,
    )
    if rank == 0:
        summary["eval"] = final_eval(ctx, opts, progress)
    summary["seconds"] = round(time.perf_counter() - tic, 2)
    return summary


def _tail_mean(values: list[float]) -> float | None:
    """Mean of the last tenth (at least one) of a list, for a less noisy final loss."""
    if not values:
        return None
    tail = values[-max(1, len(values) // 10) :]
    return sum(tail) / len(tail)


def prepare(
    model_dir,
    data_files,
    plan: OutputPlan,
    opts: DistillOptions,
    progress: Progress,
    rank: int,
    world: int,
) -> RunContext:
    """Load the serving model, render the data, build or reuse the target cache, plan the steps."""
    from ..engine.loading import load_model
    from ..engine.platform import default_dtype
    from ..engine.tokenizer import load_tokenizer

    dtype = getattr(mx, opts.dtype) if opts.dtype else default_dtype()
    model, path = load_model(model_dir, dtype)
    model.freeze()
    tokenizer = load_tokenizer(path)
    sequences = load_training_data(data_files, tokenizer, opts.seq_len)
    for f in opts.eval_data or []:  # fail early on a bad eval file
        load_prompts([f], tokenizer, limit=1)
    bad = [t for s in sequences for t in s.tokens if not 0 <= t < model.vocab_size]
    if bad:
        raise ValueError(
            f"token ids {bad[:5]} are outside the model's vocabulary "
            f"[0, {model.vocab_size}): the tokenizer does not match {path}"
        )
    key = cache_key(
        model_fingerprint(path, dtype),
        files_digest(data_files),
        opts.seq_len,
        opts.predict_tokens,
        opts.targets,
    )
    cache_root = plan.cache_root
    cache_path = cache_root / key
    if (cache_path / "meta.json").exists():
        progress.print(f"targets: reusing {cache_path}")
        cache = TargetCache.open(cache_path)
    else:
        cache_root.mkdir(parents=True, exist_ok=True)
        progress.start(f"targets ({opts.targets})", total=len(sequences))
        t0, seen = time.perf_counter(), [0]

        def tick(n_tokens):
            seen[0] += n_tokens
            progress.update(1, f"{seen[0] / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s")

        try:
            cache = build_target_cache(
                model, sequences, opts.predict_tokens, opts.targets, cache_path, tick
            )
        finally:
            progress.stop()
    order = DataOrder(
        cache.size, min(opts.batch_size, cache.size // world or 1), opts.seed, rank, world
    )
    if opts.steps is not None:
        total = opts.steps
    else:
        total = max(1, math.ceil((opts.epochs or 1.0) * order.per_epoch / opts.grad_accum))
    run = dict(
        cache_key=key,
        predict_tokens=opts.predict_tokens,
        layers=opts.layers,
        exit_dim=opts.exit_dim,
        rnn=opts.rnn,
        targets=opts.targets,
        batch_size=order.batch_size,
        grad_accum=opts.grad_accum,
        lr=opts.lr,
        warmup=opts.warmup,
        weight_decay=opts.weight_decay,
        seed=opts.seed,
        total_steps=total,
        seq_len=opts.seq_len,
        world_size=world,
    )
    if opts.soft_targets:  # only when on: runs checkpointed before the option still resume
        run["soft_targets"] = True
    draft_vocab = None
    if opts.draft_vocab:
        draft_vocab = shortlist_vocab(
            sequences, opts.draft_vocab, model.vocab_size, sorted(tokenizer.eos_token_ids)
        )
        run["draft_vocab"] = opts.draft_vocab
        covered = shortlist_index(draft_vocab, model.vocab_size)[cache.tokens[:, 1:]] >= 0
        share = float((covered & cache.valid).sum() / max(int(cache.valid.sum()), 1))
        progress.print(
            f"shortlist: {len(draft_vocab)} ids cover {share:.1%} of the training targets"
        )
    return RunContext(
        model, tokenizer, path, plan.work, cache, order, total, sequences, run, draft_vocab
    )


def restore(
    ctx: RunContext, trainer: Trainer, opts: DistillOptions, progress: Progress, rank: int = 0
) -> int:
    """Prepare ``ctx.out`` for this run; with resume, load the newest checkpoint. Returns its step.

    ``plan_output`` has chosen the folder: new, empty, or a run to resume. Only rank 0 deletes
    anything (temp dirs of a crashed write).
    """
    out = ctx.out
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        clean_stale_temps(out)
    existing = list_checkpoints(out)
    if not existing:
        if opts.resume:
            progress.print(f"resume: no checkpoint in {out}, starting from step 0")
        return 0
    info = load_checkpoint(existing[-1], trainer)
    differ = {k: (info["run"].get(k), v) for k, v in ctx.run.items() if info["run"].get(k) != v}
    if differ:
        detail = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in differ.items())
        raise ValueError(
            f"cannot resume {existing[-1]}: the run settings changed ({detail}); "
            f"use the original settings or --overwrite"
        )
    progress.print(f"resume: {existing[-1].name} (step {info['step']} of {ctx.total_steps})")
    return int(info["step"])


def train_loop(
    ctx: RunContext,
    trainer: Trainer,
    opts: DistillOptions,
    progress: Progress,
    start: int,
    rank: int,
) -> list[dict]:
    """Optimizer steps start+1..total with periodic checkpoints; returns per-step metrics."""
    config = drafter_config(trainer.drafter.args, opts.predict_tokens, opts.targets)
    head_index = shortlist_index(ctx.draft_vocab, ctx.model.vocab_size)
    history = []
    progress.start("distill", total=ctx.total_steps)
    progress.update(start)
    t0, seen = time.perf_counter(), 0
    try:
        for step in range(start + 1, ctx.total_steps + 1):
            micro = [(step - 1) * opts.grad_accum + k for k in range(opts.grad_accum)]
            batches = [training_batch(ctx, opts, m, head_index) for m in micro]
            lr = trainer.learning_rate
            loss, _, accs = trainer.step(batches)
            seen += ctx.order.batch_size * opts.grad_accum
            record = dict(
                step=step,
                loss=loss.item(),
                lr=lr,
                step_accuracy=[round(a, 4) for a in accs.tolist()],
            )
            history.append(record)
            tok_s = seen / max(time.perf_counter() - t0, 1e-9)
            progress.update(1, format_metrics(record["loss"], record["step_accuracy"], tok_s, lr))
            if (
                rank == 0
                and opts.save_every
                and step % opts.save_every == 0
                and step < ctx.total_steps
            ):
                save_checkpoint(ctx.out, trainer, step, config, ctx.run)
    finally:
        progress.stop()
    return history


def training_batch(ctx: RunContext, opts: DistillOptions, micro: int, head_index) -> tuple:
    """The drafter_loss inputs of one micro-batch (with soft targets when asked for)."""
    idx = ctx.order.batch(micro)
    batch = read_batch(ctx.cache, ctx.model, idx, head_index)
    if opts.soft_targets:
        batch += teacher_targets(ctx.cache, ctx.model, idx, ctx.draft_vocab)
    return batch


def final_eval(ctx: RunContext, opts: DistillOptions, progress: Progress) -> dict | None:
    """Serve the saved drafter (as ``load`` would) on held-out prompts; writes ``out/eval.json``.

    None when ``eval_shapes`` is empty (no evaluation)."""
    from ..engine.loading import load_drafter

    shapes = eval_shapes(opts.eval_shapes, opts.predict_tokens)
    if not shapes:
        return None
    if opts.eval_data:
        prompts = load_prompts(opts.eval_data, ctx.tokenizer, limit=opts.eval_prompts)
        source = [str(f) for f in opts.eval_data]
    else:
        prompts = training_prompts(ctx, opts.eval_prompts)
        source = "training data (in-sample: pass --eval-data for held-out prompts)"
    drafter = load_drafter(ctx.out, ctx.model.model.norm.weight.dtype)
    results = evaluate(
        ctx.model, drafter, prompts, shapes, opts.eval_max_tokens, ctx.tokenizer.eos_token_ids
    )
    report = dict(
        source=source,
        prompts=len(prompts),
        max_tokens=opts.eval_max_tokens,
        greedy=True,
        results=results,
    )
    (ctx.out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    if not opts.quiet:
        progress.console.print(eval_table(results, f"tokens/step, {len(prompts)} prompts"))
    return report


def training_prompts(ctx: RunContext, limit: int) -> list[list[int]]:
    """Prompts cut from the training sequences: the tokens before their first training token
    (for plain text, its first 16 tokens)."""
    prompts = []
    for seq in ctx.sequences[:limit]:
        first = seq.train.index(True)
        prompts.append(seq.tokens[:first] if first > 1 else seq.tokens[:16])
    return prompts
