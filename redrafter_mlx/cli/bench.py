"""``redrafter-mlx bench``: measure ReDrafter against plain decoding on a prompt set.

Runs AR, each ReDrafter configuration (the tuned/preset shape, or ``--grid``) and, with
``--mlx-lm``, mlx-lm's own generator on the same base model, interleaved per prompt after
one warm-up each. Prints a rich table (``--json`` / ``--csv`` for machines); a greedy
ReDrafter run that does not reproduce AR's tokens is a red error and exit code 1.
``--verify-cost`` instead times one verify pass per capacity against one AR step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from redrafter_mlx.cli.common import (
    BeamFlags,
    BeamLengthOpt,
    BeamWidthOpt,
    CapacityOpt,
    DrafterOpt,
    DtypeOpt,
    Engine,
    FlagError,
    MinPOpt,
    ModelOpt,
    ModelPaths,
    NoDraftOpt,
    Sampling,
    SeedOpt,
    SystemPromptOpt,
    TempOpt,
    TopKOpt,
    TopPOpt,
    VerboseOpt,
    cli_errors,
    err_console,
    fail,
    out_console,
    prepare_engine,
    resolve_plan,
)


def choose_configs(
    paths: ModelPaths,
    dtype: str | None,
    grid: str | None,
    width: int | None,
    length: int | None,
    capacity: int | None,
    no_draft: bool,
    with_mlx_lm: bool,
    no_adapt: bool = True,
) -> tuple[list, str]:
    """(configurations to run, a sentence saying where the ReDrafter shapes came from)."""
    from redrafter_mlx.cli.bench_report import AR_CONFIG, MLX_LM_CONFIG, Config, parse_grid
    from redrafter_mlx.cli.common import check_shape
    from redrafter_mlx.engine.generation import DEFAULT_SHAPE
    from redrafter_mlx.engine.shape import BeamShape

    configs = [AR_CONFIG]
    if grid is not None and paths.drafter is not None and not no_draft:
        shapes = [check_shape(BeamShape(w, n, capacity)) for w, n in parse_grid(grid)]
        configs += [Config(shape) for shape in shapes]
        source = "beam shapes from --grid"
    else:
        plan = resolve_plan(paths, dtype, BeamFlags(width, length, capacity, no_draft))
        source = plan.source
        if plan.speculative:
            configs.append(Config(plan.shape))
        elif paths.drafter is not None and not no_draft:  # tuning found AR faster: show why
            configs.append(Config(DEFAULT_SHAPE))
            source += f"; benchmarking the engine default {DEFAULT_SHAPE.label}"
    speculative = [c for c in configs if c.kind == "redrafter"]
    if speculative and not no_adapt:  # adaptive decoding, from the shape chat would use
        plan = None if grid is None else resolve_plan(paths, dtype, BeamFlags(no_draft=no_draft))
        start = plan.shape if plan is not None and plan.speculative else speculative[0].shape
        configs.append(Config(start, adapt=True))
    if with_mlx_lm:
        configs.append(MLX_LM_CONFIG)
    return configs, source


def make_runner(engine: Engine, max_tokens: int, sampling: Sampling, with_mlx_lm: bool):
    """A function (config, prompt ids) -> Run that dispatches on the configuration's kind."""
    from redrafter_mlx.cli import bench_report as logic

    lm = logic.load_mlx_lm(engine.paths.model, engine.dtype) if with_mlx_lm else None

    def runner(config, ids):
        if config.kind == "mlx-lm":
            return logic.run_mlx_lm(lm, ids, max_tokens, sampling)
        return logic.run_engine(engine, config, ids, max_tokens, sampling)

    return runner


def show_verify_cost(hidden: int, layers: int, as_json: bool) -> None:
    """``--verify-cost``: the engine's verify-vs-AR timing per capacity."""
    from redrafter_mlx.cli.bench_report import render_verify_cost, verify_cost_rows

    rows = verify_cost_rows(hidden, layers)
    if as_json:
        print(json.dumps({"hidden": hidden, "layers": layers, "rows": rows}))
    else:
        out_console().print(render_verify_cost(rows, hidden, layers))


def show_profile(engine: Engine, configs: list, ids: list[int], as_json: bool) -> None:
    """``--profile``: per-phase ms and graph ops of one step per shape, greedy, first prompt."""
    from redrafter_mlx.cli.bench_report import profile_rows, render_profile

    shapes = [c.shape for c in configs if c.kind == "redrafter"]
    with err_console().status("profiling"):
        data = profile_rows(engine, shapes, ids, repeats=40)
    if as_json:
        print(json.dumps(data))
        return
    from rich.console import Console

    title = f"{Path(engine.paths.model).name} · {data['device']} · window {data['window']}"
    console = out_console()
    wide = Console(width=max(console.width, 112), highlight=False)  # 11 columns of numbers
    for table in render_profile(data, title):
        wide.print(table)


def print_mismatches(mismatches: list[dict]) -> None:
    """One red line per greedy ReDrafter run that differs from AR."""
    from rich.text import Text

    console = err_console()
    for m in mismatches:
        console.print(
            Text(
                f"MISMATCH: {m['config']} differs from AR on prompt {m['prompt'] + 1} at token "
                f"{m['position']} ({m['tokens']} vs {m['ar_tokens']} tokens): greedy speculative "
                f"decoding must reproduce AR exactly; this is an engine bug",
                style="bold red",
            )
        )


def bench(
    model: ModelOpt = None,
    drafter: DrafterOpt = None,
    prompts: Annotated[
        str | None,
        typer.Option(
            "--prompts",
            help='mt-bench, vicuna-bench, demo, or a JSONL file of {"turns": [...]} '
            "(default: demo with the demo model, else mt-bench).",
            show_default=False,
        ),
    ] = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", help="How many prompts to run.")] = 8,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", "-m", "-n", help="Most tokens per answer.")
    ] = 128,
    grid: Annotated[
        str | None,
        typer.Option(
            "--grid",
            help="ReDrafter shapes to compare, widths x lengths: 1,2x4,5 "
            "(default: the tuned profile or chip preset).",
            show_default=False,
        ),
    ] = None,
    with_mlx_lm: Annotated[
        bool, typer.Option("--mlx-lm", help="Also run mlx-lm's generator on the same base model.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object to stdout.")
    ] = False,
    csv_path: Annotated[
        Path | None,
        typer.Option(
            "--csv", help="Also write the summary rows to this CSV file.", show_default=False
        ),
    ] = None,
    verify_cost: Annotated[
        bool,
        typer.Option(
            "--verify-cost", help="Time one verify pass per capacity against one AR step instead."
        ),
    ] = False,
    profile: Annotated[
        bool,
        typer.Option(
            "--profile",
            help="Time each phase of one step (draft, pack, verify, accept, commit, host loop) "
            "and count its graph ops, per beam shape, with the AR step beside it.",
        ),
    ] = False,
    hidden: Annotated[int, typer.Option("--hidden", help="--verify-cost: hidden size.")] = 2048,
    layers: Annotated[int, typer.Option("--layers", help="--verify-cost: layers.")] = 8,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    system_prompt: SystemPromptOpt = None,
    beam_width: BeamWidthOpt = None,
    beam_length: BeamLengthOpt = None,
    capacity: CapacityOpt = None,
    no_draft: NoDraftOpt = False,
    adapt: Annotated[
        bool,
        typer.Option(
            "--adapt/--no-adapt",
            help="Also run adaptive decoding (the loop switches between the chosen shape, the "
            "single beams of each length up to it and plain decoding by measured tokens/s) as "
            "one more row; --no-adapt: only pinned shapes.",
        ),
    ] = False,
    dtype: DtypeOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Benchmark ReDrafter against autoregressive decoding (and mlx-lm) on a prompt set."""
    from redrafter_mlx.cli import bench_report as logic

    with cli_errors(verbose):
        if verify_cost:
            show_verify_cost(hidden, layers, as_json)
            return

        def check_count() -> None:
            if num_prompts < 1:
                raise FlagError(f"--num-prompts must be >= 1, got {num_prompts}")

        def choose(paths: ModelPaths) -> tuple[tuple, bool]:
            """(prompt set, its prompts, the configurations, their source), and whether one
            of the configurations speculates."""
            from redrafter_mlx.engine.prompts import PromptSetError, load_prompts

            prompt_set = prompts or ("demo" if paths.demo else "mt-bench")
            try:
                texts = load_prompts(prompt_set, num_prompts)
            except PromptSetError as e:  # a bad --prompts value
                raise FlagError(f"--prompts: {e}") from None
            try:
                configs, source = choose_configs(
                    paths,
                    dtype,
                    grid,
                    beam_width,
                    beam_length,
                    capacity,
                    no_draft,
                    with_mlx_lm,
                    not adapt or profile,
                )
            except logic.BenchError as e:  # a bad --grid value
                raise FlagError(str(e)) from None
            speculative = any(c.kind == "redrafter" for c in configs)
            return (prompt_set, texts, configs, source), speculative

        ready = prepare_engine(
            model,
            drafter,
            dtype,
            sampling=(temp, top_p, top_k, min_p, seed),
            max_tokens=max_tokens,
            check=check_count,
            choose=choose,
        )
        engine, sampling, paths = ready.engine, ready.sampling, ready.engine.paths
        prompt_set, texts, configs, source = ready.plan
        ids = [
            engine.tokenizer.chat_prompt([{"role": "user", "content": t}], system=system_prompt)
            for t in texts
        ]
        if profile:
            show_profile(engine, configs, ids[0], as_json)
            return
        runner = make_runner(engine, max_tokens, sampling, with_mlx_lm)
        with err_console().status("benchmarking") as status:
            result = logic.run_bench(
                configs,
                ids,
                runner,
                texts,
                sampling.greedy,
                progress=lambda m: status.update(f"benchmarking: {m}"),
            )
        meta = dict(
            model=paths.model,
            drafter=paths.drafter,
            demo=paths.demo,
            dtype=engine.dtype,
            prompt_set=prompt_set,
            max_tokens=max_tokens,
            sampling=sampling.kwargs(),
            beam_source=source,
        )
        data = logic.report(result, meta)
        if csv_path is not None:
            logic.write_csv(data["configs"], str(csv_path))
        if as_json:
            print(json.dumps(data))
        else:
            print_report(data)
        if data["mismatches"]:
            print_mismatches(data["mismatches"])
            raise fail(f"{len(data['mismatches'])} greedy run(s) did not reproduce AR's tokens")


def print_report(data: dict) -> None:
    """The rich table plus notes on the shape source and mlx-lm agreement."""
    from redrafter_mlx.cli.bench_report import render_table

    title = (
        f"{Path(data['model']).name} · {data['prompt_set']} × {data['num_prompts']} · "
        f"max {data['max_tokens']} tokens · {data['dtype']}"
        + (" · greedy" if data["greedy"] else f" · temp {data['sampling']['temperature']}")
    )
    console = out_console()
    console.print(render_table(data["configs"], title))
    console.print(f"[dim]ReDrafter shapes: {data['beam_source']}.[/]")
    agreement = data["mlx_lm_matching_prompts"]
    if agreement is not None:
        console.print(
            f"[dim]mlx-lm greedy tokens equal AR's on {agreement}/"
            f"{data['num_prompts']} prompts (float rounding may differ).[/]"
        )
