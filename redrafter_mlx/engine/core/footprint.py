"""The memory formulas of a decode step: the sizes a loaded model gives (``Dims``), what a
step holds (``StepMemory``: resident weights and cache, the transient step) and each
phase's working set. ``memory.check_step_memory`` sums them for a run (the target and its
tree, each draft source's own part: ``Source.memory``) and refuses what does not fit; the
method is in ``memory.py``'s docstring."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from .shape import BeamShape

F32 = 4
INT32 = 4
BOOL = 1
DRAFT_TOP_K = 50  # engine/drafting/drafter.py: a beam step ranks each beam's 50 best tokens


@dataclass(frozen=True)
class Dims:
    """The sizes the estimate reads from a loaded model (the target, or a draft model).

    ``act_bytes``: bytes per activation (the float dtype the weights compute in);
    ``weight_bytes``: its parameters as loaded (quantized ones included). A draft source's
    own weights, state and draft working set are its own part (``Source.memory``)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    act_bytes: int
    weight_bytes: int

    @classmethod
    def of(cls, model) -> Dims:
        """The dimensions of a loaded model (a split one: this rank's share)."""
        args = model.args
        group = getattr(model, "group", None)
        shards = 1 if group is None else group.size()
        return cls(
            hidden=args.hidden_size,
            layers=args.num_hidden_layers,
            heads=args.num_attention_heads // shards,
            kv_heads=max(1, args.num_key_value_heads // shards),
            head_dim=args.head_dim,
            intermediate=args.intermediate_size // shards,
            vocab=args.vocab_size,
            act_bytes=model.dtype.size,
            weight_bytes=module_bytes(model),
        )


def own_cache_bytes(drafter) -> int:
    """Bytes per row and slot of the K/V cache a drafter keeps (``make_cache``: an early-exit
    adapter's: its entries' arrays, per adapter layer (B, n_kv, S, D)); 0 for one that keeps
    none."""
    if not hasattr(drafter, "make_cache"):
        return 0
    return sum(a.nbytes for entry in drafter.make_cache(1, 1) for a in entry)


def module_bytes(module) -> int:
    """Bytes of a module's parameters (and an early-exit adapter's bound shortlist rows)."""
    head = getattr(module, "_head", None)
    extra = head.nbytes if isinstance(head, mx.array) else 0
    return extra + sum(v.nbytes for _, v in tree_flatten(module.parameters()))


@dataclass(frozen=True)
class StepMemory:
    """Bytes a decode step holds: resident ``weights`` and ``cache``, transient ``step``."""

    weights: int
    cache: int
    step: int

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.step


def head_bytes(batch: int, width: int, vocab: int) -> int:
    """One draft step's logits (B, W, V) float32 and their ranking (0: no head)."""
    if not vocab:
        return 0
    logits = batch * width * vocab * F32
    if width <= DRAFT_TOP_K < vocab:
        return 3 * logits  # logits, their full log-softmax's inputs, the partition's indices
    return 7 * logits  # full log-softmax, top-k floor, and a sort of every candidate


def pack_bytes(shape: BeamShape, batch: int, candidates: int | None = None) -> int:
    """Tree packing's working set (nothing for a single chain, which is packed as is);
    ``candidates``: how many the step packs (default ``shape.beams``; a draft pair's second
    chain: ``draft_model.step_candidates``)."""
    n, lt, p = candidates or shape.beams, shape.longest, shape.slots
    if n <= 1:
        return 0
    dedup = batch * n * n * lt * (2 * BOOL + 2 * INT32)
    hits = batch * p * n * lt * (2 * BOOL + INT32)
    ancestors = batch * p * lt * p * 2 * BOOL
    mask = batch * p * p * 3 * BOOL
    return max(dedup, hits, ancestors) + mask


def verify_bytes(d: Dims, shape: BeamShape, batch: int, window: int, sampling: bool) -> int:
    """The verify pass's working set: the cache mask, then the larger of one layer's
    attention and activations, or the logits and the draw."""
    p, e = shape.slots, d.act_bytes
    mask = batch * p * window * (INT32 + 3 * BOOL)
    scores = batch * d.heads * p * window * (e + 2 * F32)
    acts = batch * p * e * (8 * d.hidden + 4 * d.intermediate + 10 * d.heads * d.head_dim)
    logits = batch * p * d.vocab * (e + (7 if sampling else 2) * F32)
    return mask + max(scores + acts, logits)


def kv_bytes(d: Dims, batch: int, slots: int) -> int:
    """The K/V caches of every layer over ``slots`` slots."""
    return 2 * d.layers * batch * d.kv_heads * slots * d.head_dim * d.act_bytes


def commit_bytes(
    d: Dims, shape: BeamShape, batch: int, slots: int, candidates: int | None = None
) -> int:
    """Committing a tree's chosen path (``decode.commit_path``): at most one copy of the K/V
    caches (kept as a margin: the path is written in place from the verify's own K/V). A
    single chain commits in place: nothing. ``candidates``: as ``pack_bytes``."""
    single = (candidates or shape.beams) <= 1 or (
        shape.drafts
        and shape.width == 1
        and shape.lookup == 1
        and shape.slots <= min(shape.length, shape.chain_length)
    )
    return 0 if single else kv_bytes(d, batch, slots)


def draft_model_bytes(dd: Dims, shape: BeamShape, batch: int, window: int) -> int:
    """A draft model's working set for its chain (``draft_model.DraftModelSource``): the
    catch-up forward over ``shape.longest`` tokens, its attention and its logits."""
    if not shape.model_length:
        return 0
    t, e = shape.longest, dd.act_bytes
    scores = batch * dd.heads * t * window * (e + 2 * F32)
    acts = batch * t * e * (8 * dd.hidden + 4 * dd.intermediate + 10 * dd.heads * dd.head_dim)
    logits = batch * dd.vocab * (e + 2 * F32)
    return max(scores + acts, logits)


def step_memory(
    d: Dims,
    shape: BeamShape,
    batch: int,
    window: int,
    slots: int | None = None,
    sampling: bool = False,
    candidates: int | None = None,
    draft: int = 0,
) -> StepMemory:
    """The target's memory in one step of ``shape`` over ``batch`` rows attending to
    ``window`` slots of a cache of ``slots`` slots (default: the window); ``candidates``:
    as ``pack_bytes``; ``draft``: the draft phase's working set (the largest of the step's
    sources', ``Source.memory``), one of the phases that run one after the other."""
    if shape.is_autoregressive:
        shape = BeamShape(1, 1, 1)
    slots = max(slots or 0, window)
    phases = max(
        draft,
        pack_bytes(shape, batch, candidates),
        verify_bytes(d, shape, batch, window, sampling),
    )
    step = phases + commit_bytes(d, shape, batch, slots, candidates)
    cache = kv_bytes(d, batch, slots) + batch * slots * INT32  # + the token history
    return StepMemory(d.weight_bytes, cache, step)
