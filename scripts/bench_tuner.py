"""How good and how cheap is the tuner? (a benchmark: report, don't assert)

In one process, with one measure function: an exhaustive grid (every shape at the longest
token count, repeated) and the successive-halving search under a budget. Reports the
tuner's pick against the exhaustive best (tokens/s measured by the exhaustive pass, so both
are judged by the same numbers) and the time each took.

    python -m scripts.bench_tuner [--model DIR --drafter DIR] [--budget-seconds 60]

Without --budget-seconds the search sizes its own budget, as ``redrafter-mlx tune`` does.
"""

from __future__ import annotations

import argparse
import statistics
import time


def exhaustive(measure, shapes, n_tokens: int, repeats: int) -> dict:
    """{shape: median tokens/s} over ``repeats`` runs of every prompt, after one warm-up."""
    out = {}
    for shape in shapes:
        measure(shape, 8)  # warm-up (compile)
        samples = []
        for _ in range(repeats):
            samples.extend(measure(shape, n_tokens).tokens_per_s)
        out[shape] = statistics.median(samples)
    return out


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from redrafter_mlx.cli.paths import resolve_paths
    from redrafter_mlx.engine.base.prompts import load_prompts
    from redrafter_mlx.engine.core.shape import BeamShape
    from redrafter_mlx.engine.loop.loading import load
    from tuning.grid import build_grid
    from tuning.measure import EngineMeasure
    from tuning.search import SearchPlan, successive_halving

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory, smollm2 or demo (default: demo)")
    parser.add_argument("--drafter")
    parser.add_argument("--widths", default="1,2,4")
    parser.add_argument("--lengths", default="2,3,4,5,6")
    parser.add_argument("--prompts", default="demo")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-seconds", type=float, default=None)
    args = parser.parse_args()

    paths = resolve_paths(args.model or "demo", args.drafter)
    model_path, drafter_path = paths.model, paths.drafter
    model, drafter, tokenizer = load(model_path, drafter_path)
    measure = EngineMeasure(model, drafter, tokenizer, load_prompts(args.prompts, args.num_prompts))
    shapes = build_grid(
        [int(w) for w in args.widths.split(",")], [int(n) for n in args.lengths.split(",")], [None]
    )
    console = Console()

    tic = time.perf_counter()
    grid = exhaustive(measure, [BeamShape.autoregressive(), *shapes], args.max_tokens, args.repeats)
    grid_s = time.perf_counter() - tic
    tic = time.perf_counter()
    plan = SearchPlan(long_tokens=args.max_tokens)
    result = successive_halving(measure, shapes, args.budget_seconds, plan=plan)
    tune_s = time.perf_counter() - tic

    ar = grid[BeamShape.autoregressive()]
    best = max(shapes, key=grid.get)
    pick = result.recommended
    pick_tps = grid.get(pick, ar)
    table = Table(title="exhaustive grid (tokens/s, speedup vs AR)")
    table.add_column("shape")
    table.add_column("tok/s", justify="right")
    table.add_column("speedup", justify="right")
    for shape, tps in grid.items():
        mark = " <- best" if shape == best else (" <- tuner" if shape == pick else "")
        table.add_row(shape.label + mark, f"{tps:.1f}", f"{tps / ar:.2f}x")
    console.print(table)
    console.print(
        f"tuner picked {pick.label} ({result.reason}); exhaustive best {best.label}.\n"
        f"pick = {pick_tps / grid[best]:.1%} of the best shape's tokens/s "
        f"(plain decoding = {ar / grid[best]:.1%}); "
        f"tuner time {tune_s:.0f} s = {tune_s / grid_s:.0%} of the exhaustive grid's {grid_s:.0f} s"
    )


if __name__ == "__main__":
    main()
