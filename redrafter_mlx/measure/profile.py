"""Per-phase profile of a decode step: time and graph-op count of each phase, AR beside it.

A ReDrafter step is draft -> pack -> verify -> accept -> commit (``decode.py``). Here each
phase runs as its own compiled function on real inputs (a prefilled prompt), so its time and
op count can be read apart; the whole step (the product's own compiled batch step,
``step.batch_step``, as every loop runs it) and the AR step are timed in the same rounds,
interleaved, so machine noise hits all alike.
A shape with context-lookup chains is timed as its whole step only (no phases apart).
``loop`` is the wall time per step of the real generation loop
(``generation.generate_steps``, which runs that same step), and ``host`` = loop - step:
what the Python loop adds on top of it.

Op counts are the primitives MLX will dispatch: a compiled function's outputs, before
evaluation, hang on the graph of the simplified and fused tape, which ``mx.export_to_dot``
writes out; we count its primitive nodes (``Compiled...`` = one fused elementwise kernel).
On the CPU backend each costs ~13-20 us, so on a small model the op count sets the step time.

``launch_bound`` adds what each step would cost where launches dominate (an Apple GPU running
a small model): its kernels times a per-launch cost, plus the weights it reads over the
memory bandwidth (:class:`MacCost`), and that estimate over AR's.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from redrafter_mlx.engine.core.sampling import RowSampler, SamplerConfig, draw
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.core.tree import PackedTree, pack
from redrafter_mlx.engine.decoding.decode import (
    DecodeState,
    accept_phase,
    commit_phase,
    shape_candidates,
    verify_phase,
)
from redrafter_mlx.engine.decoding.step import uniform_step
from redrafter_mlx.engine.drafting.sources import sized_sources
from redrafter_mlx.engine.verifier.protocol import Verifier

PHASES = ("draft", "pack", "verify", "accept", "commit")
# Primitives that only make a view (no kernel runs; ~1-2 us each on the CPU backend, against
# ~8-20 us for an op that computes).
VIEW_OPS = frozenset(
    ("Reshape", "Squeeze", "ExpandDims", "Transpose", "Unflatten", "Flatten", "Broadcast", "Slice")
)
_NODE = re.compile(r'\[label ="([^"]+)", shape=rectangle\]')


def graph_ops(*outputs) -> Counter:
    """Primitives in the unevaluated graph behind ``outputs`` (stops at evaluated arrays).

    Returns a Counter of primitive names. Call on a compiled function's outputs before
    evaluating them to count what one call dispatches.
    """
    arrays = [a for a in _flatten(outputs) if isinstance(a, mx.array)]
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, *arrays)
        with open(path, encoding="utf-8") as f:
            return Counter(_NODE.findall(f.read()))
    finally:
        os.unlink(path)


def _flatten(x):
    if isinstance(x, (list, tuple)):
        for item in x:
            yield from _flatten(item)
    else:
        yield x


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


class _Timed:
    """A thunk timed once per round; ``ops`` counted at the first (post-warm-up) call."""

    def __init__(self, name: str, call: Callable[[], tuple]):
        self.name, self.call, self.times, self.ops = name, call, [], None
        self.with_verify = False  # a commit timed with its verify (a recurrent model's)

    def run(self, count: bool = False) -> None:
        tic = time.perf_counter()
        out = self.call(count and self)
        mx.eval(out)
        self.times.append(time.perf_counter() - tic)

    @property
    def ms(self) -> float:
        return 1e3 * _median(self.times)


def _weights(*modules):
    return [m.state for m in modules if isinstance(m, nn.Module)]


def _as_shape(shape, sources: tuple) -> BeamShape:
    """A :class:`BeamShape` with its capacity filled in, from a shape or a (W, L, C) tuple
    (the slots its step packs with the run's ``sources``: ``sources.step_capacity``)."""
    from redrafter_mlx.engine.drafting.sources import step_capacity

    if not isinstance(shape, BeamShape):
        shape = BeamShape(*shape)
    return replace(shape, capacity=step_capacity(shape, sources))


def profile_steps(
    model: Verifier,
    sources: tuple,
    shapes: Sequence[BeamShape | tuple[int, int, int]],
    prompt: Sequence[int],
    repeats: int = 40,
    loop_tokens: int = 96,
    loop_rounds: int = 3,
) -> dict:
    """Profile the AR step and a speculative step per shape on ``prompt`` (greedy).

    ``shapes``: :class:`BeamShape` values or (W, L, C) tuples. A shape with context-lookup
    chains (or lookup alone) is timed as its whole compiled step and loop only: its phases
    are not compiled apart, so its row has no per-phase keys.

    Returns ``{"rows": [...], "device": str}``; one row per configuration (AR first) with
    per-phase ms and op counts, ``step_ms``/``step_ops`` (one compiled step), ``loop_ms``
    (generation loop wall time per step), ``host_ms`` (loop - step) and
    ``overhead_ms`` (step - verify). Timings are medians over ``repeats`` interleaved rounds.
    ``sources``: the run's draft sources, resolved once (``held.held_sources``); the draft
    slot's run in the shapes with its chains (``D1×L``: whole step only).
    """
    from redrafter_mlx.engine.decoding.cache import Session, bucket, prefill_session, text_history
    from redrafter_mlx.engine.drafting.held import check_sources
    from redrafter_mlx.engine.drafting.sources import stateful

    check_sources(sources)
    held = sources
    shapes = [_as_shape(s, held) for s in shapes]
    sampler = SamplerConfig()
    session = Session(model, 1)
    hidden = prefill_session(session, [list(prompt)])
    first = draw(model.logits(hidden), RowSampler.from_config(sampler, model.vocab_size, None))
    lengths = session.lengths
    C_max = max([s.slots for s in shapes] + [1])
    window = bucket(len(prompt) + C_max + 1)
    session.ensure_slots(window)
    session.cached = [list(prompt)]
    # The committed text, as the loop keeps it for context lookup (every step writes it, as
    # in the loop; the lookup chains read it).
    history = text_history([list(prompt)], window)
    # The stateful sources' states (``Source.prefill``), carried like the cache (the steps
    # without a source pass its state on).
    src = tuple(source.prefill(model, session, slice(None)) for source in stateful(held))
    mx.eval(first, hidden, lengths, session.cache, history, src)
    # The cache is carried from call to call so that scatters update it in place, as in
    # the loop; every call sees the same lengths (and so the same context).
    kv = {"kv": session.cache}
    session.cache = None
    sources = {"src": src}

    def base_state():
        return DecodeState(first, hidden, lengths, kv.pop("kv"), history, sources["src"])

    def keep(state_or_kv):
        kv["kv"] = state_or_kv

    configs: list[tuple[str, dict[str, _Timed]]] = []

    # --- AR: one compiled step (the loop's own).
    ar_step = uniform_step(model, (), None, sampler, 1)

    def ar_call(counter, step=ar_step):
        nxt, out = step(base_state(), window)
        if counter:
            counter.ops = graph_ops(nxt, out)
        keep(nxt.cache)
        return nxt, out

    configs.append(("AR", {"step": _Timed("step", ar_call)}))

    shape_of = {}
    for shape in shapes:
        if shape.label in shape_of:
            continue
        shape_of[shape.label] = shape
        stateful_runs = any(source.stateful for source in sized_sources(held, shape))
        if shape.lookup or shape.model_length or stateful_runs:  # the whole step only
            timed = _lookup_thunks(model, held, shape, sampler, window, base_state, keep, sources)
        else:
            W, L, C = shape.width, shape.length, shape.slots
            timed = _shape_thunks(model, held, W, L, C, sampler, window, base_state, keep, kv)
        configs.append((shape.label, timed))

    # Warm-up (compiles) and op counts, then interleaved timed rounds.
    for _, timed in configs:
        for t in timed.values():
            t.run()
            t.run(count=True)
            t.times.clear()
    for _ in range(repeats):
        for _, timed in configs:
            for t in timed.values():
                t.run()

    # The real loop, interleaved across configurations.
    loop: dict[str, list[float]] = {name: [] for name, _ in configs}
    for r in range(loop_rounds + 1):
        for name, _ in configs:
            shape = shape_of.get(name, AR)
            if shape.capacity is not None and shape.capacity > shape.max_packed:
                shape = replace(shape, capacity=None)  # further chains': the loop's own rule
            ms = _loop_ms_per_step(model, held, prompt, shape, loop_tokens)
            if r:  # round 0 warms up
                loop[name].append(ms)

    rows = []
    for name, timed in configs:
        row = dict(config=name, step_ms=timed["step"].ms, step_ops=_total(timed["step"].ops))
        row["step_kernels"] = kernels(timed["step"].ops)
        row["step_op_kinds"] = dict(timed["step"].ops.most_common())
        for phase in PHASES:
            if phase in timed:
                row[f"{phase}_ms"] = timed[phase].ms
                row[f"{phase}_ops"] = _total(timed[phase].ops)
                row[f"{phase}_kernels"] = kernels(timed[phase].ops)
        if "commit" in timed and timed["commit"].with_verify:  # a recurrent commit: its share
            for unit in ("ms", "ops", "kernels"):
                row[f"commit_{unit}"] -= row[f"verify_{unit}"]
        if name != "AR":
            shape = shape_of[name]
            W, L, C = shape.width, shape.length, shape.slots
            row.update(width=W, length=L, capacity=C, draft_steps=L - 1 if shape.drafts else 0)
            if shape.lookup:
                row.update(lookup=shape.lookup, lookup_length=shape.chain_length)
            if shape.model_length:
                row.update(model_length=shape.model_length)
            for source in sized_sources(held, shape):  # each source's own forwards
                row.update(source.profile_counts())
            if all(f"{p}_ms" in row for p in PHASES):
                row["phases_ms"] = sum(row[f"{p}_ms"] for p in PHASES)
                row["overhead_ms"] = row["step_ms"] - row["verify_ms"]
        row["loop_ms"] = _median(loop[name])
        row["host_ms"] = row["loop_ms"] - row["step_ms"]
        rows.append(row)
    return {"rows": rows, "device": str(mx.default_device()), "window": window}


def _total(ops: Counter | None) -> int:
    return sum(ops.values()) if ops else 0


def kernels(ops: Counter | dict) -> int:
    """Ops that compute (views excluded)."""
    return sum(n for name, n in ops.items() if name not in VIEW_OPS)


def _shape_thunks(model, held, W, L, C, sampler, window, base_state, keep, kv):
    """Timed thunks for each phase of one shape, plus the whole compiled step (``held``: the
    run's sources)."""
    from redrafter_mlx.engine.drafting.held import held_modules

    weights = _weights(model, *held_modules(held))

    def draft(init_token, hidden):
        """Candidates (B, N, L) and which of their tokens are present (B, N, L)."""
        state = DecodeState(init_token, hidden, None, None)
        cand = shape_candidates(model, state, BeamShape(W, L), held)
        if cand.present is None:
            return cand.beams, mx.ones(cand.beams.shape, dtype=mx.bool_)
        return cand.beams, cand.present

    def verify(tokens, depth, mask, unpacker, lengths, cache, key):
        tree = PackedTree(tokens, depth, None, unpacker, mask)  # the paths: recurrent layers
        fresh = []  # the layers' new K/V, which the commit reads
        rows = RowSampler.from_config(sampler, model.vocab_size, key, tokens.shape[0])
        out = verify_phase(model, tree, lengths, cache, rows, window, None, fresh)
        return (*out, fresh)

    def commit(cache, lengths, path_slots, hidden, n, fresh):
        return commit_phase(cache, lengths, path_slots, hidden, n, fresh, C, W == 1)

    def verify_commit(tokens, depth, mask, unpacker, lengths, cache, key, path_slots, n):
        """The verify and its commit in one graph: a recurrent layer's commit re-runs the
        layer on the verify's own inputs (``lm_cache.StateCommit``), so it cannot be
        compiled apart; its cost is this one's over the verify's alone."""
        h, _, cache, fresh = verify(tokens, depth, mask, unpacker, lengths, cache, key)
        return commit_phase(cache, lengths, path_slots, h, n, fresh, C, W == 1)

    draft_fn = mx.compile(draft, inputs=weights)
    pack_fn = mx.compile(lambda beams, present: tuple(pack(beams, C, present if W > 1 else None)))
    verify_fn = mx.compile(verify, inputs=weights)
    accept_fn = mx.compile(lambda b, t, u: accept_phase(b, t, u, C)[:4])
    recurrent = getattr(model, "recurrent", False)
    commit_fn = mx.compile(verify_commit, inputs=weights) if recurrent else mx.compile(commit)
    step_fn = uniform_step(model, held, BeamShape(W, L, C), sampler, 1)

    # Fixed inputs for each phase, from one real pass through the phases.
    s = base_state()
    beams, present = draft_fn(s.init_token, s.hidden)
    tree = PackedTree(*pack_fn(beams, present))
    h, target, cache, fresh = verify_fn(
        tree.tokens, tree.depth, tree.mask, tree.unpacker, s.lengths, s.cache, None
    )
    tokens, n, _, path_slots = accept_fn(beams, target, tree.unpacker)
    mx.eval(beams, tree, h, target, cache, fresh, tokens, n, path_slots)
    keep(cache)
    lengths, init_token, hidden, rng = s.lengths, s.init_token, s.hidden, None  # greedy

    def counted(counter, out):
        if counter:
            counter.ops = graph_ops(out)
        return out

    def t_draft(c):
        return counted(c, draft_fn(init_token, hidden))

    def t_pack(c):
        return counted(c, pack_fn(beams, present))

    def t_verify(c):
        cache = kv.pop("kv")
        out = verify_fn(tree.tokens, tree.depth, tree.mask, tree.unpacker, lengths, cache, rng)
        out = counted(c, out)
        keep(out[2])
        return out

    def t_accept(c):
        return counted(c, accept_fn(beams, target, tree.unpacker))

    def t_commit(c):
        if recurrent:  # timed with the verify (``verify_commit``): the row subtracts it
            args = (tree.tokens, tree.depth, tree.mask, tree.unpacker, lengths)
            out = counted(c, commit_fn(*args, kv.pop("kv"), rng, path_slots, n))
        else:
            out = counted(c, commit_fn(kv.pop("kv"), lengths, path_slots, h, n, fresh))
        keep(out[0])
        return out

    def t_step(c):
        nxt, out = step_fn(base_state(), window)
        counted(c, (nxt, out))
        keep(nxt.cache)
        return nxt, out

    thunks = dict(
        draft=t_draft, pack=t_pack, verify=t_verify, accept=t_accept, commit=t_commit, step=t_step
    )
    timed = {name: _Timed(name, fn) for name, fn in thunks.items()}
    timed["commit"].with_verify = recurrent
    return timed


def _lookup_thunks(model, held, shape: BeamShape, sampler, window, base_state, keep, sources=None):
    """The whole compiled step of a shape with lookup chains or a draft model's chain (its
    phases are not split; ``held``: the run's sources); ``sources``: where the stateful
    sources' states are carried."""
    step_fn = uniform_step(model, held, shape, sampler, 1)

    def t_step(counter):
        nxt, out = step_fn(base_state(), window)
        if counter:
            counter.ops = graph_ops(nxt, out)
        keep(nxt.cache)
        if sources is not None:
            sources["src"] = nxt.sources
        return nxt, out

    return {"step": _Timed("step", t_step)}


def _loop_ms_per_step(model, held, prompt, shape: BeamShape, max_tokens) -> float:
    """Wall ms per step of the generation loop (first token excluded), greedy, no EOS, over
    the run's sources ``held`` (those ``shape`` has no part for dropped: ``Run.of_sources``)."""
    from redrafter_mlx.engine.loop.generation import run_steps
    from redrafter_mlx.engine.loop.run import Run

    steps, start = 0, None
    run = Run.of_sources(model, held, shape)
    events = run_steps(run, [list(prompt)], max_tokens=max_tokens, seed=0)
    for ev in events:
        if start is None:
            start = time.perf_counter()
            continue
        steps = ev.stats.steps
    return 1e3 * (time.perf_counter() - start) / max(steps, 1)


# --------------------------------------------------------------------------- launch-bound estimate

# Per-launch cost of one kernel on an Apple GPU, in microseconds. Measured figures: a chain of
# 3,200 tiny dependent MLX kernels takes 8.8 ms on an M3 Ultra at MLX's default command-buffer
# size, 2.75 us each (ml-explore/mlx issue 4521); 832 extra small dispatches (an rms_norm each)
# added 5.2 us of GPU time each in a Metal decode loop (antonellof/ferrox issue 149). 4 us sits
# between them; a real op does some work too.
LAUNCH_US = 4.0
# Memory bandwidth in GB/s: the base M2, M3 (100) and M4 (120) chips; M1 68, Pro 150-273, Max
# 300-546, Ultra 800 (Apple's specifications). Peak figures: a decode loop reaches ~70-85%.
BANDWIDTH_GBS = 100.0
# The weights' dtype on the Mac: what chat loads there by default (float16 on Metal).
MAC_DTYPE = "float16"


@dataclass(frozen=True)
class MacCost:
    """The launch-bound machine a step is priced on: ``launch_us`` per kernel, weights read
    at ``bandwidth_gbs``, float weights held as ``dtype`` (None: as loaded here; packed
    quantized weights keep their own size)."""

    launch_us: float = LAUNCH_US
    bandwidth_gbs: float = BANDWIDTH_GBS
    dtype: str | None = MAC_DTYPE

    def __post_init__(self):
        if not self.launch_us >= 0:
            raise ValueError(f"--launch-us must be >= 0, got {self.launch_us}")
        if not self.bandwidth_gbs > 0:
            raise ValueError(f"--bandwidth-gbs must be > 0, got {self.bandwidth_gbs}")

    def ms(self, kernels: int, weight_bytes: int) -> tuple[float, float]:
        """(launch ms, memory ms) of a step that runs ``kernels`` and reads ``weight_bytes``."""
        return kernels * self.launch_us / 1e3, weight_bytes / (self.bandwidth_gbs * 1e6)


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of weights a step reads: ``model`` per LLM forward (the input embedding table of
    an untied model excluded: a forward gathers only its rows), and the drafter's
    ``drafter_once`` per step (feature projection) plus ``drafter_step`` per draft step.

    An early-exit adapter as the drafter (``engine/drafting/early_exit.py``) drafts with the
    target's first layers: its chain of L tokens runs L forwards of those layers and the adapter and
    L - 1 of the target's head, so ``drafter_once`` is one forward of the layers and the
    adapter and ``drafter_step`` one of the layers, the adapter and the head; a refresh of
    the committed tokens (``early_exit_chain.refresh_committed``, with another source in the tree)
    reads the layers and the adapter once more (``drafter_refresh``). An early-exit adapter
    in the draft slot (``--draft-model <early-exit folder>``) is priced by the same rule
    (``adapter_bytes``): ``chain_once`` (its first forward, and its refresh) and
    ``chain_step`` (each draft step); beside a draft model both are priced."""

    model: int
    drafter_once: int = 0
    drafter_step: int = 0
    draft_model: int = 0  # a draft model's forward (``--draft-model``)
    drafter_refresh: int = 0  # an early-exit refresh's forward
    chain_once: int = 0  # an early-exit adapter in the draft slot: layers + adapter
    chain_step: int = 0  # ... and with the head

    def per_step(
        self,
        draft_steps: int,
        model_forwards: int = 0,
        refreshes: int = 0,
        chain_steps: int = 0,
        chain_refreshes: int = 0,
    ) -> int:
        """Bytes one step reads: one forward of the LLM, plus ``draft_steps`` of the drafter
        (and ``refreshes`` of an early-exit one's refresh), ``model_forwards`` of a draft
        model, and ``chain_steps`` of a draft-slot early-exit chain (with its first forward
        and ``chain_refreshes`` refreshes)."""
        extra = model_forwards * self.draft_model
        if chain_steps:
            extra += (1 + chain_refreshes) * self.chain_once + chain_steps * self.chain_step
        if not draft_steps:
            return self.model + extra
        once = self.drafter_once + refreshes * self.drafter_refresh
        return self.model + once + draft_steps * self.drafter_step + extra


def _nbytes(array: mx.array, dtype: str | None) -> int:
    """Bytes of ``array`` held as ``dtype`` (float arrays only; None or not float: as is)."""
    if dtype is None or not mx.issubdtype(array.dtype, mx.floating):
        return array.nbytes
    return array.size * getattr(mx, dtype).size


def weight_bytes(model: nn.Module, sources: tuple, dtype: str | None) -> WeightBytes:
    """The bytes of weights a forward of ``model`` and a draft step of each of the run's
    ``sources`` (``held.held_sources``) read, float weights counted as ``dtype`` (None: as
    loaded). Each source says what it reads (``Source.price``, by ``WeightPricer``)."""
    from redrafter_mlx.engine.drafting.held import check_sources

    check_sources(sources)
    pricer = WeightPricer(model, dtype)
    priced = WeightBytes(pricer.total)
    for source in sources:
        fields = source.price(pricer)
        if fields:
            priced = replace(priced, **fields)
    return priced


class WeightPricer:
    """What each kind of draft source reads per step (``Source.price`` calls the method for
    its kind), against the target ``model``'s parameters as ``dtype``."""

    def __init__(self, model: nn.Module, dtype: str | None):
        self.params = tree_flatten(model.parameters())
        self.untied = any(name.startswith("lm_head.") for name, _ in self.params)
        self.dtype = dtype
        gathered = "model.embed_tokens."  # read whole only as a tied output head
        self.total = sum(
            _nbytes(a, dtype)
            for name, a in self.params
            if not (self.untied and name.startswith(gathered))
        )

    def drafter(self, drafter) -> dict:
        """A recurrent drafter: its feature projection once a step, the rest per draft step."""
        once = step = 0
        for name, a in tree_flatten(drafter.parameters()):
            if name.startswith("feature_proj."):
                once += _nbytes(a, self.dtype)
            else:
                step += _nbytes(a, self.dtype)
        return dict(drafter_once=once, drafter_step=step)

    def early_exit(self, adapter, part: str) -> dict:
        """An early-exit chain (``adapter_bytes``): as the drafter (``part`` "beams"), its
        refresh a forward of the layers and the adapter; in the draft slot, ``chain_*``."""
        once, step = adapter_bytes(self.params, self.untied, adapter, self.dtype)
        if part == "beams":
            return dict(drafter_once=once, drafter_step=step, drafter_refresh=once)
        return dict(chain_once=once, chain_step=step)

    def draft_model(self, draft) -> dict:
        """A draft model: one forward of it."""
        return dict(draft_model=WeightPricer(draft, self.dtype).total)


def adapter_bytes(params: list, untied: bool, adapter, dtype: str | None) -> tuple[int, int]:
    """An early-exit chain's reads (the one rule, wherever the adapter sits): a forward of
    the target's first ``exit_layer`` layers and the adapter (``params``: the target's
    flattened parameters), and that plus the target's head (a draft step)."""
    shallow = tuple(f"model.layers.{i}." for i in range(adapter.args.exit_layer))
    head = "lm_head." if untied else "model.embed_tokens."
    layers = sum(_nbytes(a, dtype) for name, a in params if name.startswith(shallow))
    heads = sum(_nbytes(a, dtype) for name, a in params if name.startswith(head))
    once = layers + sum(_nbytes(a, dtype) for _, a in tree_flatten(adapter.parameters()))
    return once, once + heads


def launch_bound(rows: list[dict], weights: WeightBytes, cost: MacCost) -> list[dict]:
    """``rows`` (``profile_steps``'s, AR first) with the launch-bound estimate of each step.

    Adds ``mac_bytes`` (weights read per step: the LLM once, the drafter once per draft
    step), ``mac_launch_ms`` (``step_kernels`` x ``cost.launch_us``), ``mac_memory_ms``
    (bytes over ``cost.bandwidth_gbs``), ``mac_ms`` (their sum: dependent kernels run one
    after the other, each paying its launch and its reads), ``mac_x_ar`` (over AR's
    estimate: the tokens per step a shape must average to beat plain decoding there) and
    ``step_x_ar`` (the measured step over AR's, for comparison).
    """

    def estimate(row: dict) -> dict:
        nbytes = weights.per_step(
            row.get("draft_steps", 0),
            row.get("draft_model_forwards", 0),
            row.get("drafter_refreshes", 0),
            row.get("chain_steps", 0),
            row.get("chain_refreshes", 0),
        )
        launch_ms, memory_ms = cost.ms(row["step_kernels"], nbytes)
        return dict(
            mac_bytes=nbytes,
            mac_launch_ms=launch_ms,
            mac_memory_ms=memory_ms,
            mac_ms=launch_ms + memory_ms,
        )

    ar = next(r for r in rows if r["config"] == "AR")
    ar_ms = estimate(ar)["mac_ms"]
    out = []
    for row in rows:
        row = {**row, **estimate(row)}
        row["mac_x_ar"] = row["mac_ms"] / ar_ms if ar_ms > 0 else None
        row["step_x_ar"] = row["step_ms"] / ar["step_ms"] if ar["step_ms"] > 0 else None
        out.append(row)
    return out
