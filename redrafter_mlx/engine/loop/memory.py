"""The memory a decode step needs, estimated from its shape before anything is compiled.

A beam shape too large for the machine would otherwise end in an empty ``MemoryError`` (or
swap the machine to a halt) somewhere inside the compiled step. :func:`check_step_memory`
refuses it first, with the estimate, the memory available and the largest shape of that
kind that fits. It also refuses a tree with more tokens than the model's context holds (a
prompt needs one slot at least): such a step can never be whole, and building it for a
small model (``--lookup 1000``: 7,004 slots against 512) took minutes before failing.

The estimate (``run_memory``; the formulas: ``core/footprint.py``) counts what stays
resident (the weights, the K/V cache and the token history over ``slots`` cache slots, and
each draft source's own weights and state, ``Source.memory``: an early-exit adapter's K/V
cache, a draft model's weights and K/V cache) for every row the batch can hold (a request
with parallel branches can grow to ``max_branches`` rows: the caller passes those), and the
step's largest transient working set, phase by phase (``engine/decoding/decode.py``), for B
rows, N candidates (W beams, K chains, the draft slot's chains:
``sources.step_candidates``) of at most Lt tokens packed into P = ``shape.slots`` slots,
attention over A window slots, e bytes per activation:

* draft: the largest of the step's sources' draft working sets (``Source.memory``): the
  drafter's logits (B, W, Vd) float32 at each step, with the top-50 partition (or, past 50
  beams, the full log-softmax and a sort of all W·Vd candidates); an early-exit chain's by
  the same rule for its one chain (``head_bytes``); a draft model's catch-up forward;
* pack (``engine/core/tree.py``): the prefix matches (B, N, N, Lt), the slot hits (B, P, N·Lt),
  the ancestor test (B, P, Lt, P) and the tree mask (B, P, P);
* verify: the cache mask (B, P, A), one layer's attention scores (B, heads, P, A) in
  float32 (the composed path; the fused kernel needs less), the layer activations, and
  the verifier's logits (B, P, V) float32 with what drawing from them takes;
* commit: a tree (more than one candidate) moves its chosen path into place
  (``decode.commit_path``); reading the path from the cache made MLX copy the whole K/V
  cache, so the path is now read from the verify's own K/V and written in place. The copy
  stays in the estimate as a margin (the step may still hold a second cache briefly).

Measured on tiny models, the transient part lies between 1x and 3x the step's measured peak
(``tests/engine/loop/test_guards.py``); it is an upper bound by design, never a promise.
"""

from __future__ import annotations

import os
from dataclasses import replace

import mlx.core as mx

from ..core.footprint import Dims, StepMemory, step_memory
from ..core.shape import BeamShape, ShapeError
from ..decoding.cache import bucket
from ..drafting.held import check_sources
from ..drafting.sources import step_candidates, step_capacity


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
    answer; at most the model's ``context``): ``engine/decoding/cache.py``'s window, with two steps
    in flight and the step's own slots."""
    if context is not None:
        tokens = min(tokens, context)
    return bucket(tokens + 2 * shape.longest + shape.slots)


def run_memory(
    model, held, shape: BeamShape, batch: int, window: int, sampling=False, dims=None
) -> StepMemory:
    """The memory of a step of ``shape`` with the draft sources ``held``
    (``held.held_sources``) over ``batch`` rows attending to ``window`` slots: the target's
    (``footprint.step_memory``, ``dims``: ``Dims.of(model)``) and each source's own part
    (``Source.memory``: its weights and state, held whatever the shape; its draft working
    set, the largest of them the draft phase's)."""
    parts = [source.memory(model, shape, batch, window) for source in held]
    draft = max([0, *(part.step for part in parts)])
    candidates = step_candidates(shape, held)
    d = dims or Dims.of(model)
    est = step_memory(
        d, shape, batch, window, sampling=sampling, candidates=candidates, draft=draft
    )
    weights = est.weights + sum(part.weights for part in parts)
    return StepMemory(weights, est.cache + sum(part.cache for part in parts), est.step)


def check_step_memory(
    model,
    sources: tuple,
    shape: BeamShape,
    batch: int = 1,
    tokens: int = 512,
    sampling: bool = False,
    available: tuple[int, str] | None = None,
) -> StepMemory:
    """Return the estimate for ``batch`` rows of up to ``tokens`` tokens (prompt and answer),
    or raise :class:`ShapeTooLarge` when it exceeds the memory available (``available``:
    (bytes, what), default :func:`available_memory`) or its tree cannot fit the model's
    context beside a prompt, naming the field that makes it large (``largest_part``, the flag
    the user most likely raised) and the largest shape that fits. The draft sources the run
    holds (``sources``, resolved once: ``held.held_sources``) each add their own part
    (``Source.memory``: weights, their state, their draft working set)."""
    check_sources(sources)
    held = sources
    d = Dims.of(model)
    context = model.max_context

    def need(s: BeamShape) -> StepMemory:
        if step_capacity(s, held) != s.slots:  # further draft-slot chains: their slots too
            s = replace(s, capacity=step_capacity(s, held))
        window = decode_window(tokens, context, s)
        return run_memory(model, held, s, batch, window, sampling, d)

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
