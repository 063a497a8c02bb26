"""The drafter, its loss, the data order and the optimizer step (docs/design/distillation.md).

Loss = sum over the T draft steps of CE(step k), each averaged over its valid positions,
teacher-forced through the RNN state: s_1 = next_state(0, E[x0]), s_k = next_state(s_{k-1},
E[target_{k-1}]). AdamW with linear warm-up and cosine decay, gradient clipping at 1.0,
gradient accumulation, data-parallel gradient averaging with ``mx.distributed.all_sum``.

Shapes: B positions per micro-batch, H hidden, T drafter steps, V head ids.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from ..engine.base.errors import RedrafterError
from ..engine.drafting.drafter import Drafter, DrafterArgs
from ..engine.verifier.protocol import Verifier
from .data import Sequence
from .softmax import logsumexp, softmax
from .targets import TargetCache

CLIP_GRAD_NORM = 1.0
# No subnormal numbers in the optimizer step (see ``flush``): gradients below GRAD_FLUSH and
# AdamW moments below MOMENT_FLUSH are exactly 0.
GRAD_FLUSH = 2.0**-40  # ~9e-13: g^2 x (1 - beta2) stays normal
MOMENT_FLUSH = 2.0**-100  # ~8e-31


def drafter_args(model: Verifier, opts, draft_vocab: list[int] | None = None) -> DrafterArgs:
    """Drafter shape from the model and the options (``layers``, ``exit_dim``, ``rnn``). It
    reads the feature layers the model captures, which are what its training data holds
    (``distill`` sets them from ``--feature-layers`` before making any data; none: the
    final normed hidden state)."""
    H = model.hidden_size
    layers = tuple(getattr(model, "feature_layers", ()))
    exit_dim = 2 * H if opts.exit_dim == "auto" else int(opts.exit_dim)
    return DrafterArgs(
        vocab_size=model.vocab_size,
        hidden_size=H,
        exit_dim=exit_dim,
        num_draft_layers=opts.layers,
        rnn=opts.rnn,
        draft_vocab=draft_vocab,
        feature_layers=list(layers) or None,
    )


def resolve_feature_layers(spec, model: Verifier) -> tuple[int, ...]:
    """``--feature-layers`` -> layer indices: ``last`` (or empty/None) -> () (the final normed
    hidden state, as every drafter before); ``auto`` -> EAGLE-3's low, middle and high layer
    scaled to the depth n: the inputs of layers 2, n // 2 and n - 3 (30 layers: 2, 15, 27);
    ``i,j,k`` -> those layers (0 <= i < n: the residual stream entering layer i)."""
    n = model.args.num_hidden_layers
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "last")):
        return ()
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        return tuple(sorted({min(2, n - 1), n // 2, max(n - 3, 0)}))
    if isinstance(spec, str):
        try:
            layers = [int(p) for p in spec.replace(" ", "").split(",") if p]
        except ValueError:
            raise ValueError(
                f"feature layers must be auto, last or layer indices like 2,15,27; got {spec!r}"
            ) from None
    else:
        layers = [int(i) for i in spec]
    bad = [i for i in layers if not 0 <= i < n]
    if bad or len(set(layers)) != len(layers) or not layers:
        raise ValueError(
            f"feature layers must be distinct indices in [0, {n}) (this model's layers), "
            f"got {spec!r}"
        )
    return tuple(layers)


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

    hidden: (B, H) or wider (the cache's rows: see ``Drafter.features``);
    emb: (B, T, H) = E[x0], E[target_1..target_{T-1}]; targets: (B, T) int;
    valid: (B, T) bool. Optional soft targets: teacher (B, T, V) the LLM's probabilities for
    each step's token (over the drafter's head ids) and soft (B, T) bool, the rows that have
    them; there the loss is the cross-entropy to the teacher's distribution instead of to its
    greedy token (more signal per position: which other tokens were likely).
    Returns (loss = Σ_k mean loss of step k over its valid rows, per-step losses (T,),
    per-step top-1 accuracy (T,)).

    Both cross-entropies are logsumexp(z) minus a score: z[target], or Σ_v p_v z_v (the
    teacher sums to 1), so each step takes one logsumexp over the head and no log-softmax
    (the V-wide passes, not the matmuls, set the step time on the CPU: ``softmax``).
    """
    B, T, H = emb.shape
    state = mx.zeros((B, H), dtype=hidden.dtype)
    part = drafter.hidden_part(hidden)  # once (the feature projection), not per step
    losses, accs = [], []
    for k in range(T):
        state = drafter.next_state(state, emb[:, k])
        logits = drafter.head(part, state)
        v = valid[:, k].astype(mx.float32)
        n = mx.maximum(v.sum(), 1.0)
        score = mx.take_along_axis(logits, targets[:, k, None], axis=-1)[:, 0]
        if teacher is not None:
            score = mx.where(soft[:, k], (teacher[:, k] * logits).sum(axis=-1), score)
        ce = logsumexp(logits) - score
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


def read_batch(cache: TargetCache, model: Verifier, idx: np.ndarray, head_index=None):
    """Model inputs for cached positions idx.

    Returns hidden (B, H, or the cache's wider rows: ``Drafter.features``) f32,
    emb (B, T, H) f32, targets (B, T), valid (B, T). With a
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


def teacher_targets(cache: TargetCache, model: Verifier, idx: np.ndarray, head_ids=None):
    """Soft targets for cached positions idx, for caches whose rows run along each sequence.

    Step k's token at position t is the LLM's draw at position t+k, so its distribution is
    the LLM's head applied to the hidden state of cache row idx+k, when that row is position
    t+k of the same sequence (checked: rows idx+1..idx+k hold steps 1..k's targets as their
    x0; a chance match past a sequence's end remains possible but rare). Returns teacher (B, T, V)
    probabilities over ``head_ids`` (a shortlist, renormalised; None = the vocabulary) and
    soft (B, T) bool.
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
        logits = model.head_logits(h, head_ids)  # a wider cache (features): its first H
    teacher = softmax(logits).reshape(len(idx), T, -1)
    return teacher, mx.array(soft)


def flush(x: mx.array, below: float) -> mx.array:
    """``x`` with every value of magnitude below ``below`` set to exactly 0 (same shape).

    Once the drafter is confident its gradients for the ids it never proposes are ~1e-20, and
    AdamW's second moment g^2 falls below float32's smallest normal number (1.2e-38): on the
    rigged always-the-same-token model 9.5M of the head's 16.4M moments were subnormal after
    three steps, and subnormal operands cost many x86 CPUs a microcode assist each. A gradient
    below 2^-40 moves a weight by < 1e-4 x lr (AdamW's eps is 1e-8), a moment below 2^-100
    by nothing float32 keeps.
    """
    return mx.where(mx.abs(x) < below, 0.0, x).astype(x.dtype)


def flush_moments(state: dict | list) -> None:
    """``flush`` every AdamW moment (``m``, ``v``) of an optimizer state tree, in place (the
    compiled update captures the state's dicts, so they are updated, not replaced)."""
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for key, value in items:
        if isinstance(value, (dict, list)):
            flush_moments(value)
        elif key in ("m", "v") and isinstance(value, mx.array):
            state[key] = flush(value, MOMENT_FLUSH)


def all_finite(params) -> mx.array:
    """() bool: every value of the parameter tree ``params`` is finite (no NaN, no infinity)."""
    leaves = [v for _, v in tree_flatten(params)]
    return mx.all(mx.stack([mx.all(mx.isfinite(v)) for v in leaves]))


class TrainingDiverged(RedrafterError, ValueError):
    """The loss or the weights went NaN or infinite: the run stops and nothing from that step
    on is saved. ``step``: the optimizer step (set by the training loop)."""

    def __init__(self, what: str, step: int | None = None):
        super().__init__(what)
        self.what, self.step = what, step


class Trainer:
    """One drafter, its optimizer and the gradient step (with accumulation and all_sum).

    Two compiled functions do the work (``mx.compile`` fuses their elementwise passes: at the
    shipped shape the loss and gradient take 419 ms instead of 483, clipping and AdamW 41 ms
    instead of 90): the loss and gradients of one micro-batch, and clipping + the optimizer
    update. Accumulation and the data-parallel ``all_sum`` run between them, uncompiled.
    """

    def __init__(self, drafter: Drafter, opts, total_steps: int, group=None):
        self.drafter = drafter
        self.group = group
        self.accum = opts.grad_accum
        self.optimizer = optim.AdamW(
            learning_rate=lr_schedule(opts.lr, total_steps, opts.warmup),
            weight_decay=opts.weight_decay,
        )
        self.optimizer.init(drafter.trainable_parameters())
        self._compile()

    def _compile(self) -> None:
        """The compiled gradient and update; they capture the optimizer's state object, so a
        new one (``set_optimizer_state``) compiles them again."""
        drafter, optimizer = self.drafter, self.optimizer
        value_and_grad = nn.value_and_grad(drafter, drafter_loss)
        self._value_and_grad = mx.compile(
            lambda *batch: value_and_grad(drafter, *batch),
            inputs=drafter.state,
            outputs=drafter.state,
        )
        state = [drafter.state, optimizer.state]

        def update(grads):
            grads = tree_map(lambda g: flush(g, GRAD_FLUSH), grads)
            grads, _ = optim.clip_grad_norm(grads, CLIP_GRAD_NORM)
            optimizer.update(drafter, grads)
            flush_moments(optimizer.state)
            return all_finite(drafter.trainable_parameters())

        self._update = mx.compile(update, inputs=state, outputs=state)

    def set_optimizer_state(self, state: dict) -> None:
        """Replace the optimizer's state (a restored checkpoint's)."""
        self.optimizer.state = state
        self._compile()

    def step(self, batches) -> tuple[mx.array, mx.array, mx.array]:
        """One optimizer update from ``grad_accum`` micro-batches (hidden, emb, targets, valid
        [, teacher, soft]).

        Returns the mean (loss, per-step losses (T,), per-step accuracy (T,)) over them.
        Raises TrainingDiverged when the loss or the updated weights are not finite (the
        weights are then unusable: the caller must not save them).
        """
        total, loss_sum, steps_sum, acc_sum = None, 0.0, 0.0, 0.0
        for batch in batches:
            (loss, step_losses, accs), grads = self._value_and_grad(*batch)
            total = grads if total is None else tree_map(mx.add, total, grads)
            loss_sum, steps_sum, acc_sum = loss_sum + loss, steps_sum + step_losses, acc_sum + accs
        n = len(batches)
        grads = total if n == 1 else tree_map(lambda g: g / n, total)
        metrics = (loss_sum / n, steps_sum / n, acc_sum / n)
        if self.group is not None and self.group.size() > 1:
            grads = tree_map(self._average, grads)
            metrics = tuple(self._average(m) for m in metrics)
        finite = self._update(grads)
        mx.eval(self.drafter.parameters(), self.optimizer.state, *metrics, finite)
        if not (math.isfinite(metrics[0].item()) and finite.item()):
            loss = metrics[0].item()
            raise TrainingDiverged(
                f"the loss is {loss}" if not math.isfinite(loss) else "the weights went non-finite"
            )
        return metrics

    def _average(self, x: mx.array) -> mx.array:
        """Mean over the processes of a data-parallel run."""
        return mx.distributed.all_sum(x, group=self.group) / self.group.size()

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.learning_rate)
