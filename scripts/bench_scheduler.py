"""The server's scheduler in process, its modes interleaved: throughput and latency of adaptive
shapes, one pinned shape and plain decoding on the same requests, with APAR branches on and
off, at each concurrency, round after round.

    python -m scripts.bench_scheduler --prompts edit --concurrency 1 --rounds 2
    python -m scripts.bench_scheduler --model <folder without a drafter> --prompts mt-bench
    python -m scripts.bench_scheduler --model smollm2-apar --branches both --concurrency 1,4

No HTTP (``scripts.bench_serve`` measures the server end to end, one mode after another):
each mode keeps one ``Scheduler`` for the whole run (as a running server keeps what it
learnt), and every round runs every mode, branch setting and concurrency one after another on
the same requests, so machine noise falls on all of them alike. Each run: N closed-loop
clients until every prompt's greedy answer (``--max-tokens``, with branches the rebuilt
text's length) is done; tok/s counts the answers' tokens over the wall time, prefill
included; latency is a request's time from submission to its last token, TTFT to its first
(with branches: the first text that is final). Round 0 includes the compiles of a cold
server; ``steady`` leaves it out. Numbers, not assertions.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field, replace

from rich.console import Console
from rich.table import Table

from redrafter_mlx.cli.common import load_engine, parse_logit_bias
from redrafter_mlx.cli.paths import resolve_paths
from redrafter_mlx.engine.base.prompts import load_records
from redrafter_mlx.engine.core.branches import branch_rules
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.serve.scheduler import Request, Scheduler

BRANCH_SETTINGS = {"on": ("on",), "off": ("off",), "both": ("off", "on")}


@dataclass
class Sink:
    """One request's events: answer tokens, when its first and last came, its branches."""

    submitted: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    first: float | None = None
    end: float | None = None
    branches: int = 0
    error: str | None = None

    def __call__(self, event):
        now = time.perf_counter()
        self.tokens += len(event.tokens)
        if event.tokens and self.first is None:
            self.first = now
        self.branches = event.stats.branches
        self.error = event.error
        if event.done:
            self.end = now

    @property
    def done(self) -> bool:
        return self.end is not None


@dataclass
class Result:
    """One run of every prompt at one concurrency: the wall time and each request's sink."""

    seconds: float
    sinks: list[Sink]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.sinks)


def run(sched: Scheduler, prompts, n: int, max_tokens: int, sampler: SamplerConfig) -> Result:
    """N closed-loop clients over ``prompts``."""
    todo, sinks = list(prompts), []
    tic = time.perf_counter()
    while todo or sched._busy() or sched.queue.qsize():
        while todo and sum(not s.done for s in sinks) < n:
            sinks.append(Sink())
            sched.submit(Request(todo.pop(0), max_tokens, sinks[-1], sampler))
        sched.run_once(0.0)
    failed = [s.error for s in sinks if s.error is not None or not s.done]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed: {failed[0]}")
    return Result(time.perf_counter() - tic, sinks)


def schedulers(engine, shape: BeamShape, settings, max_batch: int, wanted) -> dict:
    """One scheduler per (mode, branch setting) of the ``wanted`` modes (``adaptive``,
    ``pinned``, ``AR``)."""
    model, drafter, tok = engine.model, engine.drafter, engine.tokenizer
    pinned = shape  # serve --no-adapt: one beam and one chain get room for one of them
    if shape.drafts and shape.width == 1 and shape.lookup == 1 and shape.capacity is None:
        pinned = replace(shape, capacity=min(shape.length, shape.chain_length))
    eos = tok.eos_token_ids
    out = {}
    for setting in settings:
        rules = branch_rules(engine.folder or engine.paths.model, setting)
        kw = dict(max_batch=max_batch, branches=rules)
        if "adaptive" in wanted:
            out[("adaptive", setting)] = Scheduler(model, drafter, shape, eos, adapt=True, **kw)
        if "pinned" in wanted:
            out[(f"pinned {pinned.label}", setting)] = Scheduler(model, drafter, pinned, eos, **kw)
        if "AR" in wanted:
            out[("AR", setting)] = Scheduler(model, None, None, eos, **kw)
    return out


def table(results: dict, title: str) -> Table:
    """One row per (mode, branches, N): tok/s against plain decoding and against the same
    mode with branches off, latency, TTFT, forks and tokens per answer."""
    out = Table(
        title=title,
        caption="vs AR: tok/s over plain decoding's with branches off at the same N; vs off: "
        "over the same mode's with branches off; latency and p90: submission to last token; "
        "TTFT: to the first final text; forks and tokens: per answer (the rebuilt text's)",
    )
    columns = ["mode", "branches", "N", "tok/s", "vs AR", "vs off", "steady tok/s"]
    columns += ["latency s", "p90 s", "TTFT ms", "forks/ans", "tok/ans"]
    for col in columns:
        out.add_column(col, justify="left" if col in ("mode", "branches") else "right")

    def rate(rows: list[Result]) -> float:
        return sum(r.tokens for r in rows) / max(sum(r.seconds for r in rows), 1e-9)

    for (mode, setting, n), rows in results.items():
        sinks = [s for r in rows for s in r.sinks]
        latency = [s.end - s.submitted for s in sinks]
        ttft = [s.first - s.submitted for s in sinks if s.first is not None]
        ar = results.get(("AR", "off", n)) or results.get(("AR", setting, n))
        off = results.get((mode, "off", n))
        out.add_row(
            mode,
            setting,
            str(n),
            f"{rate(rows):.1f}",
            f"{rate(rows) / rate(ar):.2f}×" if ar else "–",
            f"{rate(rows) / rate(off):.2f}×" if off else "–",
            f"{rate(rows[1:] or rows):.1f}",
            f"{statistics.mean(latency):.2f}",
            f"{sorted(latency)[int(0.9 * (len(latency) - 1))]:.2f}",
            f"{1e3 * statistics.mean(ttft):.0f}" if ttft else "–",
            f"{statistics.mean(max(s.branches - 1, 0) for s in sinks):.1f}",
            f"{statistics.mean(s.tokens for s in sinks):.1f}",
        )
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder or bundled name (default: as chat picks)")
    p.add_argument("--drafter", help="drafter folder (default: the model's own, if any)")
    p.add_argument("--shape", help="the asked shape (default W1xL4+K1xL8, K1xL8 undrafted)")
    p.add_argument("--prompts", default="mt-bench")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--concurrency", default="1", help="clients at once, e.g. 1,4")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128, help="each answer's most tokens")
    p.add_argument("--max-batch", type=int, default=16, help="the scheduler's rows")
    p.add_argument("--branches", choices=sorted(BRANCH_SETTINGS), default="off")
    p.add_argument("--modes", default="adaptive,pinned,AR", help="which modes run")
    p.add_argument("--logit-bias", help='"ID:BIAS,..." on every request (tests force forks)')
    args = p.parse_args(argv)
    levels = [int(n) for n in args.concurrency.split(",")]
    paths = resolve_paths(args.model, args.drafter)
    engine = load_engine(paths, None)
    default = "W1xL4+K1xL8" if engine.drafter is not None else "K1xL8"
    shape = BeamShape.parse(args.shape or default)
    settings = BRANCH_SETTINGS[args.branches]
    modes = schedulers(engine, shape, settings, args.max_batch, args.modes.split(","))
    tok = engine.tokenizer
    records = load_records(args.prompts, args.num_prompts, spread_categories=True)
    prompts = [tok.chat_prompt([{"role": "user", "content": r.prompt}]) for r in records]
    sampler = SamplerConfig(logit_bias=parse_logit_bias(args.logit_bias))
    hello = tok.chat_prompt([{"role": "user", "content": "Hello"}])
    for sched in modes.values():
        sched.warmup(hello)
    results = {(mode, setting, n): [] for (mode, setting) in modes for n in levels}
    for r in range(args.rounds):
        for (mode, setting), sched in modes.items():
            for n in levels:
                got = run(sched, prompts, n, args.max_tokens, sampler)
                results[(mode, setting, n)].append(got)
                print(
                    f"round {r} {mode} branches {setting} N={n}: "
                    f"{got.tokens / got.seconds:.1f} tok/s",
                    flush=True,
                )
    console = Console(width=max(Console().width, 120))
    console.print(
        table(
            results,
            f"scheduler in process · {paths.model} · {args.prompts} ({len(prompts)}) · "
            f"{args.max_tokens} tokens · {args.rounds} rounds interleaved",
        )
    )
    for (mode, setting), sched in modes.items():
        if sched.choice is not None:
            console.print(
                f"[dim]{mode} (branches {setting}) steps per shape: {sched.choice.steps_run()}; "
                f"ms per step (per batch size): {sched.choice.step_ms()}[/]"
            )


if __name__ == "__main__":
    main()
