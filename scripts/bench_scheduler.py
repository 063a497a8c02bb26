"""The server's scheduler in process, its modes interleaved: tok/s of adaptive shapes, one
pinned shape and plain decoding on the same requests, round after round.

    python -m scripts.bench_scheduler --prompts edit --concurrency 1 --rounds 2
    python -m scripts.bench_scheduler --model <folder without a drafter> --prompts mt-bench

No HTTP (``scripts.bench_serve`` measures the server end to end, one mode after another):
each mode keeps one ``Scheduler`` for the whole run (as a running server keeps what it
learnt), and every round runs the modes one after another on the same requests, so machine
noise falls on all of them alike. Each round: N closed-loop clients until every prompt's
greedy answer (``--max-tokens``) is done; tok/s counts generated tokens over the wall time,
prefill included. Round 0 includes the compiles of a cold server; ``steady`` leaves it out.
Numbers, not assertions.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from rich.console import Console
from rich.table import Table

import redrafter_mlx
from redrafter_mlx.engine.bundled import bundled_drafter_for, smollm2_path
from redrafter_mlx.engine.prompts import load_records
from redrafter_mlx.engine.shape import BeamShape
from redrafter_mlx.serve.scheduler import Request, Scheduler


class Sink:
    def __init__(self):
        self.tokens, self.done, self.steps = 0, False, 0

    def __call__(self, event):
        self.tokens += len(event.tokens)
        self.steps = event.stats.steps
        self.done = self.done or event.done


def run(sched: Scheduler, prompts: list[list[int]], n: int, max_tokens: int):
    """N closed-loop clients over ``prompts``: (tokens, seconds, steps)."""
    todo, sinks = list(prompts), []
    tic = time.perf_counter()
    while todo or sched._busy() or sched.queue.qsize():
        while todo and sum(not s.done for s in sinks) < n:
            sinks.append(Sink())
            sched.submit(Request(todo.pop(0), max_tokens, sinks[-1]))
        sched.run_once(0.0)
    return sum(s.tokens for s in sinks), time.perf_counter() - tic, sum(s.steps for s in sinks)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: SmolLM2 with its bundled drafter)")
    p.add_argument("--shape", help="the asked shape (default W1xL4+K1xL8, K1xL8 undrafted)")
    p.add_argument("--prompts", default="mt-bench")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)
    path = args.model or smollm2_path()
    model, drafter, tok = redrafter_mlx.load(path, bundled_drafter_for(path))
    default = "W1xL4+K1xL8" if drafter is not None else "K1xL8"
    shape = BeamShape.parse(args.shape or default)
    pinned = shape  # serve --no-adapt: one beam and one chain get room for one of them
    if shape.drafts and shape.width == 1 and shape.lookup == 1 and shape.capacity is None:
        pinned = replace(shape, capacity=min(shape.length, shape.chain_length))
    records = load_records(args.prompts, args.num_prompts, spread_categories=True)
    prompts = [tok.chat_prompt([{"role": "user", "content": r.prompt}]) for r in records]
    eos = tok.eos_token_ids
    modes = {
        "adaptive": Scheduler(model, drafter, shape, eos, 8, adapt=True),
        f"pinned {pinned.label}": Scheduler(model, drafter, pinned, eos, 8),
        "AR": Scheduler(model, None, None, eos, 8),
    }
    hello = tok.chat_prompt([{"role": "user", "content": "Hello"}])
    for sched in modes.values():
        sched.warmup(hello)
    results = {k: [] for k in modes}
    for r in range(args.rounds):
        for name, sched in modes.items():
            results[name].append(run(sched, prompts, args.concurrency, args.max_tokens))
            tokens, seconds, _ = results[name][-1]
            print(f"round {r} {name}: {tokens / seconds:.1f} tok/s", flush=True)

    def rate(rows):
        return sum(t for t, _, _ in rows) / sum(s for _, s, _ in rows)

    table = Table(
        title=f"scheduler in process · {path} · {args.prompts} ({len(prompts)}) · "
        f"N={args.concurrency} · {args.max_tokens} tokens · {args.rounds} rounds interleaved"
    )
    for col in ("mode", "tok/s", "vs AR", "steady tok/s", "steady vs AR", "tok/step"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    ar, ar_steady = rate(results["AR"]), rate(results["AR"][1:] or results["AR"])
    for name, rows in results.items():
        steady = rate(rows[1:] or rows)
        per_step = sum(t for t, _, _ in rows) / max(sum(s for _, _, s in rows), 1)
        table.add_row(
            name,
            f"{rate(rows):.1f}",
            f"{rate(rows) / ar:.2f}×",
            f"{steady:.1f}",
            f"{steady / ar_steady:.2f}×",
            f"{per_step:.2f}",
        )
    console = Console(width=max(Console().width, 120))
    console.print(table)
    choice = modes["adaptive"].choice
    if choice is not None:
        console.print(f"[dim]adaptive steps per shape: {choice.steps_run()}[/]")
        console.print(f"[dim]adaptive ms per step (per batch size): {choice.step_ms()}[/]")


if __name__ == "__main__":
    main()
