"""One rank of the tensor-parallel tests: run under ``mlx.launch -n N`` by
tests/engine/base/test_distributed.py.

``python -m tests.support.dist_worker CASES.json OUT_DIR`` (as a module, so that this folder's
``tuning.py`` does not hide the tuning package): loads each case's model split across the
launched ranks (and its drafter whole), decodes the case, and writes
``OUT_DIR/rank{r}.json`` with, per case, the tokens of every row, the bytes this rank's model
holds, MLX's peak memory while loading, and a hash of one verify forward's logits (to check
that the logits are bitwise the same on every rank).

A case with ``"serve"`` runs the server's scheduler instead: rank 0 submits the requests
(``serve_schedule``) and every other rank follows its events (``Scheduler.follow``); each
rank reports the tokens its rows produced, by request (with ``"adapt"`` too: adaptive
shapes with step costs that differ by rank, and the steps run per shape). A case with
``"adapt"`` alone decodes adaptively with step costs that differ by rank, and reports the
shapes it ran. A case with ``"tune"`` runs the tuner's search with ``cli.tune``'s shared
measure and clock, each rank measuring (a real decode) but reporting made-up speeds that
differ by rank.
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from redrafter_mlx.engine.base.distributed import world
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.loop.adaptive import Adaptive
from redrafter_mlx.engine.loop.generation import generate_steps
from redrafter_mlx.engine.loop.loading import load_drafter, load_model
from redrafter_mlx.engine.verifier import slots as model_module
from redrafter_mlx.serve import scheduler as scheduler_module
from redrafter_mlx.serve.scheduler import Request, Scheduler


def param_bytes(model) -> int:
    """Bytes of every parameter the model holds on this rank."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def fresh_memory() -> int:
    """Free what earlier cases left, reset MLX's peak; the bytes still held (the baseline)."""
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    return mx.get_active_memory()


def logits_hash(model, prompt: list[int]) -> str:
    """sha256 of the float32 logits of one prefill forward over ``prompt``."""
    T = len(prompt)
    cache = model.make_cache(1, T)
    pos = mx.arange(T, dtype=mx.int32)[None]
    mask = (mx.arange(T)[None, :] <= mx.arange(T)[:, None])[None, None]
    hidden, _ = model(mx.array([prompt], mx.int32), pos, mask, cache, pos)
    logits = np.array(model.logits(hidden).astype(mx.float32))
    return hashlib.sha256(logits.tobytes()).hexdigest()


def serve_schedule(sched: Scheduler, requests: list[dict]) -> dict[str, list]:
    """Rank 0 (or alone): submit ``requests`` (those marked ``late`` once 3 steps have run,
    so they join mid-flight) and run the loop until all are answered; each request's tokens
    (and error, if any) by id."""
    out: dict[str, list] = {}

    def submit(late: bool) -> None:
        for i, spec in enumerate(requests):
            if spec.get("late", False) == late:
                settings = {k: v for k, v in spec.items() if k not in ("prompt", "n", "late")}
                settings["logit_bias"] = tuple(map(tuple, settings.get("logit_bias", ())))
                sink = collect(out.setdefault(f"r{i}", []))
                sampler = SamplerConfig(**settings)
                sched.submit(Request(spec["prompt"], spec["n"], sink, sampler, id=f"r{i}"))

    submit(late=False)
    while sched.stats.steps < 3:
        sched.run_once(0.0)
    submit(late=True)
    while sum(bool(t) and t[-1] == "done" for t in out.values()) < len(requests):
        sched.run_once(0.0)
    while sched.batch.pending is not None:
        sched.run_once(0.0)
    return out


def collect(tokens: list):
    """A sink that appends a request's tokens, then "done" (or its error)."""

    def sink(event) -> None:
        tokens.extend(event.tokens)
        if event.error:
            tokens.append(f"error: {event.error}")
        if event.done:
            tokens.append("done")

    return sink


def run_serve(case: dict, group) -> dict:
    """The scheduler over the split model: rank 0 drives it, the others follow."""
    model, _ = load_model(case["model"], mx.float32, group)
    drafter = load_drafter(case["drafter"], mx.float32) if case.get("drafter") else None
    shape = BeamShape.parse(case["shape"])
    adapt = Adaptive(step_cost=rank_costs(group.rank())) if case.get("adapt") else False
    sched = Scheduler(model, drafter, shape, (), case["max_batch"], group=group, adapt=adapt)
    if group.rank() == 0:
        out = serve_schedule(sched, case["serve"])
        sched.release()
        return {"tokens": out, "shapes": shapes_run(sched)}
    seen: dict[str, list] = {}
    original = scheduler_module.request_from

    def recording(event):  # a follower's own copy of each request keeps its row's tokens
        request = original(event)
        request.sink = collect(seen.setdefault(request.id, []))
        return request

    scheduler_module.request_from = recording
    try:
        sched.follow()
    finally:
        scheduler_module.request_from = original
    return {"tokens": seen, "shapes": shapes_run(sched)}


def shapes_run(sched: Scheduler) -> dict[str, int]:
    """Steps the scheduler ran per shape (adaptive; else empty)."""
    return {} if sched.choice is None else {k.label: n for k, n in sched.choice.ran.items()}


def rank_costs(rank: int):
    """Injected step costs that disagree by rank: rank 0 finds long beams cheap, the others
    find them dear (left to their own timings, the ranks would choose differently)."""

    def cost(shape) -> float:
        tokens = 1 if shape == AR else shape.slots
        return 1.0 + (0.05 if rank == 0 else 2.0) * tokens

    return cost


def run_adapt(case: dict, group) -> dict:
    """Adaptive decoding over the split model; the tokens and the shape of every step."""
    model, _ = load_model(case["model"], mx.float32, group)
    drafter = load_drafter(case["drafter"], mx.float32)
    adapt = Adaptive(step_cost=rank_costs(group.rank()), every=2, probe=4)
    tokens = decoded(model, drafter, case, adapt=adapt)
    return {"tokens": tokens, "shapes": [s.label for s in adapt.history]}


def decoded(model, drafter, case: dict, **options) -> list[list[int]]:
    """Each of the case's prompts' tokens, decoded at its shape and length with ``options``."""
    tokens = [[] for _ in case["prompts"]]
    shape = BeamShape.parse(case["shape"])
    for ev in generate_steps(
        model, drafter, case["prompts"], max_tokens=case["max_tokens"], shape=shape, **options
    ):
        for row, new in zip(tokens, ev.tokens):
            row.extend(new)
    return tokens


def run_tune(case: dict, group) -> dict:
    """The tuner's search over the split model: the shapes each rank measured, in order, and
    the recommendation. Rank 0 says longer beams are faster, the others the opposite."""
    from redrafter_mlx.cli.tune import shared_clock, shared_measure
    from tuning.search import Measurement, SearchPlan, successive_halving

    model, _ = load_model(case["model"], mx.float32, group)
    drafter = load_drafter(case["drafter"], mx.float32)
    measured = []

    def measure(shape, n_tokens):
        measured.append(shape.label)
        small = drafter if shape.drafts else None
        for _ in generate_steps(model, small, case["prompts"], max_tokens=n_tokens, shape=shape):
            pass
        speed = shape.longest if group.rank() == 0 else 10 - shape.longest
        return Measurement((float(speed),) * len(case["prompts"]), (1.0,), None)

    shapes = [BeamShape.parse(label) for label in case["shapes"]]
    plan = SearchPlan(warmup_tokens=2, min_tokens=4, short_tokens=6, long_tokens=8)
    found = successive_halving(
        shared_measure(measure, group), shapes, 20.0, shared_clock(group), plan
    )
    return {"measured": measured, "recommended": found.recommended.label}


def run_case(case: dict, group) -> dict:
    if "tune" in case:
        return run_tune(case, group)
    if "serve" in case:
        return run_serve(case, group)
    if "adapt" in case:
        return run_adapt(case, group)
    model_module.FUSED_KERNELS = case.get("fused")  # None: by device (composed on the CPU)
    base = fresh_memory()
    model, _ = load_model(case["model"], mx.float32, group)
    load_peak = mx.get_peak_memory() - base
    drafter = load_drafter(case["drafter"], mx.float32) if case.get("drafter") else None
    tokens = decoded(
        model,
        drafter,
        case,
        sampler=SamplerConfig(temperature=case.get("temperature", 0.0)),
        seed=case.get("seed"),
        adapt=True,  # greedy: rank 0's shapes on every rank; seeded: pinned
    )
    return {
        "tokens": tokens,
        "param_bytes": param_bytes(model),
        "load_peak": load_peak,
        "logits_sha": logits_hash(model, case["prompts"][0]),
        "kv_heads": model.make_cache(1, 1)[0].keys.shape[1],
    }


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    group = world()
    if group is None:
        raise SystemExit("run me under mlx.launch -n N (N > 1)")
    out = {"size": group.size(), "cases": {name: run_case(c, group) for name, c in cases.items()}}
    Path(sys.argv[2], f"rank{group.rank()}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
