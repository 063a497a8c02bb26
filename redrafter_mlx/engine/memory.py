"""The memory a decode step needs, estimated from its shape before anything is compiled.

A beam shape too large for the machine would otherwise end in an empty ``MemoryError`` (or
swap the machine to a halt) somewhere inside the compiled step. :func:`check_step_memory`
refuses it first, with the estimate, the memory available and the largest shape of that
kind that fits. It also refuses a tree with more tokens than the model's context holds (a
prompt needs one slot at least): such a step can never be whole, and building it for a
small model (``--lookup 1000``: 7,004 slots against 512) took minutes before failing.

The estimate counts what stays resident (the weights, the K/V cache and the token history
over ``slots`` cache slots, the drafter's own K/V cache when it keeps one (an early-exit
adapter's, as the drafter or in the draft slot), a draft model's weights and K/V cache:
``with_draft_model``) for every row the batch can hold (a request with parallel branches can
grow to ``max_branches`` rows: the caller passes those), and the step's largest transient
working set, phase by phase (``engine/decode.py``), for B rows, N candidates (W beams, K
chains, the draft slot's chains: ``draft_model.step_candidates``) of at most Lt tokens
packed into P = ``shape.slots`` slots, attention over A window slots, e bytes per
activation:

* draft: the drafter's logits (B, W, Vd) float32 at each step, with the top-50 partition
  (or, past 50 beams, the full log-softmax and a sort of all W·Vd candidates); an
  early-exit chain in the draft slot by the same rule for its one chain (``head_bytes``);
* pack (``engine/tree.py``): the prefix matches (B, N, N, Lt), the slot hits (B, P, N·Lt),
  the ancestor test (B, P, Lt, P) and the tree mask (B, P, P);
* verify: the cache mask (B, P, A), one layer's attention scores (B, heads, P, A) in
  float32 (the composed path; the fused kernel needs less), the layer activations, and
  the verifier's logits (B, P, V) float32 with what drawing from them takes;
* commit: a tree (more than one candidate) moves its chosen path into place
  (``decode.commit_path``); reading the path from the cache made MLX copy the whole K/V
  cache, so the path is now read from the verify's own K/V and written in place. The copy
  stays in the estimate as a margin (the step may still hold a second cache briefly).

Measured on tiny models, the transient part lies between 1x and 3x the step's measured peak
(``tests/test_guards.py``); it is an upper bound by design, never a promise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .cache import bucket
from .shape import BeamShape, ShapeError
from .sources import step_candidates, step_capacity

F32 = 4
INT32 = 4
BOOL = 1
DRAFT_TOP_K = 50  # engine/drafter.py: a beam step ranks each beam's 50 best tokens


@dataclass(frozen=True)
class Dims:
    """The sizes the estimate reads from a loaded model and drafter.

    ``draft_vocab``: rows of the drafter's head (0: no drafter); ``act_bytes``: bytes per
    activation (the float dtype the weights compute in); ``weight_bytes``: both modules'
    parameters as loaded (quantized ones included); ``draft_kv``: bytes per row and cache
    slot of the drafter's own K/V cache (an early-exit adapter's, ``early_exit.py``; 0: a
    recurrent drafter, which keeps none). An early-exit adapter in the draft slot
    (``chain``) counts as one as the drafter does: its weights in ``weight_bytes``, its
    cache in ``draft_kv``, and ``chain_vocab``, the head its chain ranks each draft step
    (``draft_bytes``; 0: no such chain).
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_vocab: int
    act_bytes: int
    weight_bytes: int
    draft_kv: int = 0
    chain_vocab: int = 0

    @classmethod
    def of(cls, model, drafter=None, chain=None) -> Dims:
        """The dimensions of a loaded ``Model``, an optional drafter (a ``Drafter`` or an
        early-exit adapter) and an optional early-exit adapter in the draft slot
        (``chain``)."""
        args = model.args
        parts = (model, drafter, chain)
        weights = sum(module_bytes(m) for m in parts if isinstance(m, nn.Module))
        head = getattr(getattr(drafter, "args", None), "head_size", args.vocab_size)
        group = getattr(model, "group", None)
        shards = 1 if group is None else group.size()  # a split model: this rank's share
        return cls(
            hidden=args.hidden_size,
            layers=args.num_hidden_layers,
            heads=args.num_attention_heads // shards,
            kv_heads=max(1, args.num_key_value_heads // shards),
            head_dim=args.head_dim,
            intermediate=args.intermediate_size // shards,
            vocab=args.vocab_size,
            draft_vocab=head if drafter is not None else 0,
            act_bytes=model.dtype.size,
            weight_bytes=weights,
            draft_kv=own_cache_bytes(drafter) + own_cache_bytes(chain),
            chain_vocab=chain.args.head_size if chain is not None else 0,
        )


def own_cache_bytes(drafter) -> int:
    """Bytes per row and slot of the K/V cache a drafter keeps (``make_cache``: an early-exit
    adapter's, per adapter layer (B, n_kv, S, D) keys and values); 0 for one that keeps
    none."""
    if not hasattr(drafter, "make_cache"):
        return 0
    keys, values = drafter.make_cache(1, 1)
    return sum(a.nbytes for a in (*keys, *values))


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


def draft_bytes(d: Dims, shape: BeamShape, batch: int) -> int:
    """The draft phase's working set: one beam step's drafter logits and their ranking, or
    one draft step of an early-exit chain in the draft slot (the same rule for its one
    chain: ``Dims.chain_vocab``), whichever is larger (they run one after the other)."""
    beams = head_bytes(batch, shape.width, d.draft_vocab) if shape.drafts else 0
    chain = head_bytes(batch, 1, d.chain_vocab) if shape.model_length else 0
    return max(beams, chain)


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


def with_draft_model(
    est: StepMemory, dd: Dims, shape: BeamShape, batch: int, window: int, shared: bool
) -> StepMemory:
    """``est`` plus a draft model's weights (none when it is the target itself: ``shared``),
    its own K/V cache over the window, and its working set (the phases run one by one)."""
    if not shape.model_length:
        return est
    weights = 0 if shared else dd.weight_bytes
    step = max(est.step, draft_model_bytes(dd, shape, batch, window))
    return StepMemory(est.weights + weights, est.cache + kv_bytes(dd, batch, window), step)


def step_memory(
    d: Dims,
    shape: BeamShape,
    batch: int,
    window: int,
    slots: int | None = None,
    sampling: bool = False,
    candidates: int | None = None,
) -> StepMemory:
    """The memory of one step of ``shape`` over ``batch`` rows attending to ``window`` slots
    of a cache of ``slots`` slots (default: the window); ``candidates``: as ``pack_bytes``."""
    if shape.is_autoregressive:
        shape = BeamShape(1, 1, 1)
    slots = max(slots or 0, window)
    phases = max(
        draft_bytes(d, shape, batch),
        pack_bytes(shape, batch, candidates),
        verify_bytes(d, shape, batch, window, sampling),
    )
    step = phases + commit_bytes(d, shape, batch, slots, candidates)
    cache = kv_bytes(d, batch, slots) + batch * slots * INT32  # + the token history
    cache += d.draft_kv * batch * slots  # the drafter's own (held whatever the step's shape)
    return StepMemory(d.weight_bytes, cache, step)


def available_memory() -> tuple[int, str]:
    """(bytes this process may use, what that figure is).

    Metal: the device's recommended working set. Otherwise the RAM available now
    (``MemAvailable``) plus what MLX already holds (the loaded weights, which the estimate
    counts too), else the machine's physical RAM.
    """
    if mx.metal.is_available():
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        size = info.get("max_recommended_working_set_size")
        if size:
            return int(size), "Metal's recommended working set"
    free = _mem_available()
    if free is not None:
        return free + mx.get_active_memory(), "free RAM plus what MLX holds"
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical RAM"


def _mem_available() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class ShapeTooLarge(ShapeError):
    """A beam shape whose step does not fit in memory, or whose tree does not fit the model's
    context; the message says what does."""


def largest_fitting(fits, shape: BeamShape, part: str | None = None) -> BeamShape | None:
    """The largest shape of ``shape``'s kind for which ``fits(shape)`` holds, shrinking
    ``part`` (a field of :attr:`BeamShape.largest_part`) when given and enough; else the
    widest at its length (lookup alone: the most chains), else the longest single beam; None
    if none. Capacity is dropped (the worst case), so the suggestion always validates."""
    upper = {
        "width": shape.width,
        "length": shape.length,
        "lookup": shape.lookup,
        "lookup_length": shape.chain_length,
    }
    if part in upper:
        low = 1 if part in ("width", "lookup") else 2
        n = _bisect(lambda n: fits(replace(shape, capacity=None, **{part: n})), low, upper[part])
        if n is not None:
            return replace(shape, capacity=None, **{part: n})
    if not shape.drafts:
        k = _bisect(lambda n: fits(replace(shape, lookup=n, capacity=None)), 1, shape.lookup)
        return None if k is None else replace(shape, lookup=k, capacity=None)
    w = _bisect(lambda n: fits(replace(shape, width=n, capacity=None)), 1, shape.width)
    if w is not None:
        return replace(shape, width=w, capacity=None)
    single = replace(shape, width=1, capacity=None)
    n = _bisect(lambda n: fits(replace(single, length=n)), 2, shape.length)
    return None if n is None else replace(single, length=n)


def _bisect(ok, low: int, high: int) -> int | None:
    """The largest n in [low, high] with ok(n), given ok is monotone decreasing; else None."""
    if low > high or not ok(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if ok(mid):
            low = mid
        else:
            high = mid - 1
    return low


def gib(n: int) -> str:
    """Bytes as GiB with sensible precision (``1.5 GiB``, ``2,048 GiB``)."""
    value = n / 2**30
    return f"{value:,.0f} GiB" if value >= 100 else f"{value:.2g} GiB"


def decode_window(tokens: int, context: int | None, shape: BeamShape) -> int:
    """Cache slots a decode reaches when its longest row grows to ``tokens`` (prompt and
    answer; at most the model's ``context``): ``engine/cache.py``'s window, with two steps
    in flight and the step's own slots."""
    if context is not None:
        tokens = min(tokens, context)
    return bucket(tokens + 2 * shape.longest + shape.slots)


def check_step_memory(
    model,
    drafter,
    shape: BeamShape,
    batch: int = 1,
    tokens: int = 512,
    sampling: bool = False,
    available: tuple[int, str] | None = None,
    draft_model=None,
) -> StepMemory:
    """Return the estimate for ``batch`` rows of up to ``tokens`` tokens (prompt and answer),
    or raise :class:`ShapeTooLarge` when it exceeds the memory available (``available``:
    (bytes, what), default :func:`available_memory`) or its tree cannot fit the model's
    context beside a prompt, naming the field that makes it large (``largest_part``, the flag
    the user most likely raised) and the largest shape that fits. The draft sources the run
    holds (``drafter`` and the draft slot ``draft_model``: ``held.held_sources``) each add their
    own part (``Source.memory``: weights, their state, their draft working set)."""
    from .held import held_sources  # the sources price themselves with this module

    held = held_sources(drafter, draft_model)
    d = Dims.of(model)
    context = model.max_context

    def need(s: BeamShape) -> StepMemory:
        if step_capacity(s, held) != s.slots:  # further draft-slot chains: their slots too
            s = replace(s, capacity=step_capacity(s, held))
        window = decode_window(tokens, context, s)
        candidates = step_candidates(s, held)
        est = step_memory(d, s, batch, window, sampling=sampling, candidates=candidates)
        for part in (source.memory(model, s, batch, window) for source in held):
            est = StepMemory(
                est.weights + part.weights, est.cache + part.cache, max(est.step, part.step)
            )
        return est

    def in_context(s: BeamShape) -> bool:  # the tree after a prompt of one token at least
        return context is None or s.is_autoregressive or s.tree_tokens < context

    estimate = need(shape)
    limit, what = available or available_memory()
    if estimate.total <= limit and in_context(shape):
        return estimate
    part = "max_tokens" if shape.is_autoregressive else shape.largest_part
    best = largest_fitting(lambda s: in_context(s) and need(s).total <= limit, shape, part)
    instead = f"the largest that fits is {best.label}" if best else "no speculative shape fits"
    if shape.is_autoregressive:
        instead = "the model and its cache alone do not fit: ask for fewer tokens or rows"
    if estimate.total <= limit:  # fits in memory, but not in the model's context
        raise ShapeTooLarge(
            part,
            f"beam shape {shape.label} puts {shape.tree_tokens:,} tree tokens in the cache each "
            f"step but the model's context holds {context:,} tokens; {instead}",
        )
    rows = f" for {batch} rows" if batch > 1 else ""
    raise ShapeTooLarge(
        part,
        f"beam shape {shape.label} needs about {gib(estimate.total)}{rows} (step "
        f"{gib(estimate.step)}, cache {gib(estimate.cache)}, weights {gib(estimate.weights)}) "
        f"but only {gib(limit)} is available ({what}); {instead}",
    )
