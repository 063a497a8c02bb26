"""``redrafter-mlx bench``: measure ReDrafter against plain decoding on a prompt set.

Runs AR, then by default what ``chat`` runs (adaptive decoding from the tuned/preset shape
with its context-lookup chains), or pinned shapes when asked (``--no-adapt``: the chat shape;
``--grid``, ``--configs``; ``--adapt``: pinned and adaptive) and, with ``--mlx-lm``, mlx-lm's
own generator on the same base model, interleaved per prompt after one warm-up each.
``--spread`` picks the prompts across the set's categories; ``--turns 2`` also runs each
prompt's second turn after the model's own (greedy, plain) first answer, as a chat does,
reported apart. Prints a rich table (``--json`` / ``--csv`` for machines); a greedy
speculative run that does not reproduce AR's tokens is a red error and exit code 1.
``--verify-cost`` instead times one verify pass per capacity against one AR step.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from redrafter_mlx.cli.common import (
    BeamFlags,
    Engine,
    branch_flags,
    plan_from_flags,
    prepare_engine,
    same_plan_everywhere,
)
from redrafter_mlx.cli.consoles import err_console, out_console
from redrafter_mlx.cli.errors import FlagError, cli_errors, fail
from redrafter_mlx.cli.options import (
    MAX_TOKENS_BRANCHES,
    BeamLengthOpt,
    BeamWidthOpt,
    BranchDepthOpt,
    BranchesOpt,
    BranchFlags,
    CapacityOpt,
    DrafterOpt,
    DraftModelOpt,
    DtypeOpt,
    LookupLengthOpt,
    LookupOpt,
    MaxBranchesOpt,
    ModelOpt,
    NoDraftOpt,
    NoLookupOpt,
    SamplingFlags,
    SystemPromptOpt,
    VerboseOpt,
    sampling_options,
)
from redrafter_mlx.cli.paths import ModelPaths

if TYPE_CHECKING:
    from redrafter_mlx.engine.core.sampling import SamplerConfig


def with_lookup(shape, chains: int, chain_length: int):
    """``shape`` with ``chains`` lookup chains of ``chain_length`` tokens (a capacity grows
    by the chains' own slots, as ``resolve_plan`` does)."""
    if not chains:
        return shape
    out = replace(shape, lookup=chains, lookup_length=chain_length)
    if shape.capacity is not None:
        out = replace(out, capacity=shape.capacity + chains * (chain_length - 1))
    return out.validate()


def choose_configs(
    paths: ModelPaths,
    dtype: str | None,
    beam: BeamFlags,
    *,
    grid: str | None = None,
    shapes: str | None = None,
    with_mlx_lm: bool = False,
    adapt: bool | None = None,
) -> tuple[list, str]:
    """(configurations to run, a sentence saying where the speculative shapes came from).

    AR first; then the pinned shapes: those of ``--configs`` (``shapes``) or ``--grid``
    (each with the lookup chains of ``beam``), else the plan ``plan_from_flags`` makes of
    ``beam``; then adaptive decoding from the plan (what ``chat`` runs); mlx-lm last.

    ``adapt``: True (``--adapt``) runs the pinned shapes and adaptive decoding, False
    (``--no-adapt``) the pinned shapes only; None (neither flag) measures what ``chat``
    runs: adaptive decoding from the plan alone, unless ``--configs``/``--grid`` asked for
    pinned shapes (or the plan is plain decoding: then the engine default, pinned, shows
    why).
    """
    from redrafter_mlx.cli.bench_report import (
        AR_CONFIG,
        MLX_LM_CONFIG,
        Config,
        parse_configs,
        parse_grid,
    )
    from redrafter_mlx.cli.common import check_shape
    from redrafter_mlx.engine.core.shape import BeamShape
    from redrafter_mlx.engine.loop.generation import DEFAULT_SHAPE
    from redrafter_mlx.engine.loop.run import missing_sources

    if grid is not None and shapes is not None:
        raise FlagError("--grid and --configs both choose the shapes to compare; give one of them")
    chains, chain_length = beam.lookup_chains()
    has_drafter = paths.drafter is not None and not beam.no_draft
    # Neither --adapt/--no-adapt nor shapes to compare: what chat runs, adaptive decoding.
    bare = adapt is None and shapes is None and grid is None
    configs = [AR_CONFIG]
    plan = None
    if shapes is not None:
        chosen = parse_configs(shapes)
        lacks = {
            s.label: missing_sources(s, has_drafter, paths.draft_model is not None) for s in chosen
        }
        needs = [label for label, what in lacks.items() if "drafter" in what]
        if needs:
            why = "--no-draft was given" if beam.no_draft else "there is no drafter (--drafter)"
            raise FlagError(
                f"--configs {', '.join(needs)} need the drafter, but {why}; lookup-only "
                f"shapes (K1xL8) run without it"
            )
        drafting = [label for label, what in lacks.items() if "draft model" in what]
        if drafting:
            raise FlagError(
                f"--configs {', '.join(drafting)} need a draft model; add --draft-model "
                "(e.g. the model itself)"
            )
        for shape in dict.fromkeys(s for s in chosen if not s.is_autoregressive):
            configs.append(Config(shape))
        source = "beam shapes from --configs"
    elif grid is not None and has_drafter:
        grid_shapes = [
            check_shape(BeamShape(w, n, beam.capacity), "--grid") for w, n in parse_grid(grid)
        ]
        configs += [Config(with_lookup(s, chains, chain_length)) for s in grid_shapes]
        source = "beam shapes from --grid" + (", with context lookup" if chains else "")
    else:
        plan = same_plan_everywhere(plan_from_flags(paths, dtype, beam))
        source = plan.source
        if grid is not None:
            source += " (--grid needs a drafter)"
        if plan.speculative and not bare:
            configs.append(Config(plan.shape))
        elif not plan.speculative and has_drafter:  # tuning found AR faster: show why
            fallback = with_lookup(DEFAULT_SHAPE, chains, chain_length)
            configs.append(Config(fallback))
            source += f"; benchmarking the engine default {fallback.label}"
    if adapt or (bare and plan.speculative):  # adaptive decoding, from chat's shape
        if plan is None:  # the shape flags were the grid's: the plan without them
            unflagged = replace(beam, width=None, length=None, capacity=None)
            plan = same_plan_everywhere(plan_from_flags(paths, dtype, unflagged))
        speculative = [c for c in configs if c.kind == "redrafter"]
        start = plan.shape if plan.speculative else (speculative[0].shape if speculative else None)
        if start is not None:
            configs.append(Config(start, adapt=True))
            if bare:
                source += "; adaptive decoding from it, as chat runs (--no-adapt: pinned)"
    if paths.draft_model is not None:  # every speculative shape gains the draft model's chain
        configs = [
            c if c.kind != "redrafter" else replace(c, shape=c.shape.runnable(has_drafter, True))
            for c in configs
        ]
        source += "; with --draft-model"
    if with_mlx_lm:
        configs.append(MLX_LM_CONFIG)
    return configs, source


def make_runner(
    engine: Engine,
    max_tokens: int,
    sampling: SamplerConfig,
    with_mlx_lm: bool,
    configs=(),
    branches=None,
):
    """A function (config, prompt ids) -> Run that dispatches on the configuration's kind
    (``branches``: the ``--branches`` rules, ``branch_flags``, for our engine's runs).
    With ``--draft-model``, mlx-lm runs its speculative decoding with the same draft model,
    drafting as many tokens a step as the first shape's draft-model chain (an early-exit
    adapter in the draft slot: mlx-lm has none, so its plain generator runs; beside a draft
    model, mlx-lm drafts with the draft model alone)."""
    from redrafter_mlx.cli import bench_report as logic
    from redrafter_mlx.engine.drafting.early_exit import is_early_exit

    lm = None
    if with_mlx_lm:
        drafts = [c.shape.model_length - 1 for c in configs if c.field("model_length")]
        draft_path = engine.paths.draft_model if drafts else None
        if isinstance(draft_path, tuple):  # (draft model, early-exit adapter)
            err_console().print(
                "mlx-lm has no early-exit drafter: its row drafts with the draft model alone",
                markup=False,
            )
            draft_path = draft_path[0]
        elif draft_path is not None and is_early_exit(draft_path):
            err_console().print(
                "mlx-lm has no early-exit drafter: its row runs its plain generator",
                markup=False,
            )
            draft_path = None
        lm = logic.load_mlx_lm(engine.paths.model, engine.dtype, draft_path, *drafts[:1])

    def runner(config, ids):
        if config.kind == "mlx-lm":
            return logic.run_mlx_lm(lm, ids, max_tokens, sampling)
        return logic.run_engine(engine, config, ids, max_tokens, sampling, branches)

    return runner


def show_verify_cost(hidden: int, layers: int, as_json: bool) -> None:
    """``--verify-cost``: the engine's verify-vs-AR timing per capacity."""
    from redrafter_mlx.cli.bench_report import render_verify_cost, verify_cost_rows

    rows = verify_cost_rows(hidden, layers)
    if as_json:
        print(json.dumps({"hidden": hidden, "layers": layers, "rows": rows}))
    else:
        out_console().print(render_verify_cost(rows, hidden, layers))


MAC_DTYPES = ("float16", "bfloat16", "float32")


def mac_cost(
    launch_us: float | None, bandwidth_gbs: float | None, mac_dtype: str | None, profile: bool
):
    """The launch-bound machine ``--profile`` prices each step on (``MacCost``), from
    ``--launch-us``, ``--bandwidth-gbs`` and ``--mac-dtype`` (None: the defaults)."""
    from redrafter_mlx.measure.profile import MacCost

    given = {"--launch-us": launch_us, "--bandwidth-gbs": bandwidth_gbs, "--mac-dtype": mac_dtype}
    named = [flag for flag, value in given.items() if value is not None]
    if named and not profile:
        raise FlagError(f"{named[0]} prices the --profile steps; add --profile or leave it out")
    if mac_dtype is not None and mac_dtype not in MAC_DTYPES:
        raise FlagError(f"--mac-dtype must be one of {', '.join(MAC_DTYPES)}, got {mac_dtype!r}")
    defaults = MacCost()
    try:
        return MacCost(
            defaults.launch_us if launch_us is None else launch_us,
            defaults.bandwidth_gbs if bandwidth_gbs is None else bandwidth_gbs,
            defaults.dtype if mac_dtype is None else mac_dtype,
        )
    except ValueError as e:
        raise FlagError(str(e)) from None


def show_profile(engine: Engine, configs: list, ids: list[int], as_json: bool, cost=None) -> None:
    """``--profile``: per-phase ms and graph ops of one step per shape, greedy, first prompt
    (shapes with lookup chains: the whole step only), and each step priced where launches
    dominate (``cost``, a ``MacCost``)."""
    from redrafter_mlx.cli.bench_report import profile_rows, render_profile

    shapes = list(dict.fromkeys(c.shape for c in configs if c.kind == "redrafter"))
    with err_console().status("profiling"):
        data = profile_rows(engine, shapes, ids, repeats=40, cost=cost)
    if as_json:
        print(json.dumps(data))
        return
    from rich.console import Console

    title = f"{Path(engine.paths.model).name} · {data['device']} · window {data['window']}"
    console = out_console()
    wide = Console(width=max(console.width, 112), highlight=False)  # 11 columns of numbers
    for table in render_profile(data, title):
        wide.print(table)


def judge_mismatches(engine: Engine, result, data: dict, sampling: SamplerConfig) -> None:
    """Check each greedy mismatch for a near-tie that float rounding decided
    (``measure.near_tie``, on the logits as ``sampling``'s bias and penalties leave them):
    its ``lead``, ``noise`` and ``near_tie`` join it in ``data`` (None where no check
    applies: a branching run, whose text is rebuilt from branches, or runs that part by
    stopping). A row whose mismatches are all near-ties gets ``near_tie`` True; ``ok`` holds
    when every mismatch is a near-tie."""
    from redrafter_mlx.cli.bench_report import AR_NAME
    from redrafter_mlx.measure import near_tie

    mismatches = data["mismatches"]
    index = {(item.prompt, item.turn): k for k, item in enumerate(result.items)}
    for m in mismatches:
        k = index[(m["prompt"], m["turn"])]
        ref, run, p = result.runs[AR_NAME][k].tokens, result.runs[m["config"]][k], m["position"]
        if run.branches or p >= min(len(run.tokens), len(ref)):
            m.update(lead=None, noise=None, near_tie=None)
            continue
        prefix = list(result.items[k].ids) + list(ref[:p])
        verdict = near_tie.check(engine.model, prefix, ref[p], run.tokens[p], sampling)
        m.update(verdict.to_dict())
    for row in data["configs"]:
        if row["matches_ar"] is False:
            mine = [
                m for m in mismatches if (m["config"], m["turn"]) == (row["config"], row["turn"])
            ]
            row["near_tie"] = all(m["near_tie"] for m in mine)
    data["ok"] = all(m["near_tie"] for m in mismatches)


def print_mismatches(mismatches: list[dict], dtype: str) -> None:
    """One line per greedy ReDrafter run that differs from AR: yellow for a near-tie that
    float rounding decided, red for an engine bug (``judge_mismatches``)."""
    from rich.text import Text

    console = err_console()
    for m in mismatches:
        where = f"prompt {m['prompt'] + 1}" + (f", turn {m['turn']}" if m["turn"] > 1 else "")
        head = f"{m['config']} differs from AR on {where} at token {m['position']}"
        if m.get("near_tie"):
            console.print(
                Text(
                    f"near-tie: {head}, where AR's token leads the other by {m['lead']:.2g} "
                    f"logits and the same logits computed in two forward shapes differ by up to "
                    f"{m['noise']:.2g} in {dtype}: float rounding decides such ties (greedy "
                    "output equals plain decoding's up to them; float32 makes them rarer)",
                    style="yellow",
                )
            )
            continue
        lead = ""
        if m.get("lead") is not None:
            lead = (
                f"; AR's token leads by {m['lead']:.3g} logits, beyond the {m['noise']:.2g} of "
                f"float rounding in {dtype}"
            )
        console.print(
            Text(
                f"MISMATCH: {head} ({m['tokens']} vs {m['ar_tokens']} tokens){lead}: greedy "
                "speculative decoding must reproduce AR exactly; this is an engine bug",
                style="bold red",
            )
        )


def first_turn_answer(engine: Engine, ids: list[int], max_tokens: int) -> str:
    """The model's own answer to a first turn: greedy plain decoding, as ``--turns 2`` puts
    it in the second turn's conversation."""
    from redrafter_mlx.engine.core.shape import AR
    from redrafter_mlx.engine.loop.generation import generate

    return generate(
        engine.model, None, engine.tokenizer, ids, max_tokens=max_tokens, shape=AR, adapt=False
    )


def build_prompts(
    engine: Engine, records: list, turns: int, system: str | None, max_tokens: int
) -> list:
    """The prompts to benchmark, each prompt's turns in order: turn 1 (the first user turn
    through the chat template) and, with ``turns == 2`` and a second turn in the record,
    turn 2: [user turn 1, assistant: the model's own greedy answer, user turn 2]."""
    from redrafter_mlx.cli.bench_report import BenchPrompt

    items = []
    for index, record in enumerate(records):
        conversation = [{"role": "user", "content": record.turns[0]}]
        first = engine.tokenizer.chat_prompt(conversation, system=system)
        items.append(BenchPrompt(first, index, 1))
        if turns < 2 or len(record.turns) < 2:
            continue
        conversation += [
            {"role": "assistant", "content": first_turn_answer(engine, first, max_tokens)},
            {"role": "user", "content": record.turns[1]},
        ]
        items.append(BenchPrompt(engine.tokenizer.chat_prompt(conversation, system), index, 2))
    return items


def check_csv_path(path: Path) -> None:
    """FlagError naming ``--csv`` unless ``path`` can be written, checked before the run (a
    file is opened for appending, so nothing is changed, and removed again if it was new)."""
    if path.is_dir():
        raise FlagError(f"--csv {path} is a folder; give a file path, e.g. {path / 'bench.csv'}")
    existed = path.exists()
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise FlagError(
            f"--csv {path} cannot be written ({e.strerror or e}); choose a writable path"
        ) from None
    if not existed:
        path.unlink(missing_ok=True)


@sampling_options
def bench(
    model: ModelOpt = None,
    drafter: DrafterOpt = None,
    draft_model: DraftModelOpt = None,
    prompts: Annotated[
        str | None,
        typer.Option(
            "--prompts",
            help='mt-bench, vicuna-bench, edit, demo, or a JSONL file of {"turns": [...], '
            '"category": ...} (default: demo with the demo model, else mt-bench).',
            show_default=False,
        ),
    ] = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", help="How many prompts to run.")] = 8,
    spread: Annotated[
        bool,
        typer.Option(
            "--spread",
            help="Pick the --num-prompts prompts across the set's categories (round-robin: "
            "the first of each category, then the second...) instead of the first N.",
        ),
    ] = False,
    turns: Annotated[
        int,
        typer.Option(
            "--turns",
            help="1, or 2: also run each prompt's second turn, after the model's own greedy "
            "answer to the first (as in a chat); each turn is reported apart.",
        ),
    ] = 1,
    max_tokens: Annotated[
        int,
        typer.Option(
            "--max-tokens", "-m", "-n", help=f"Most tokens per answer. {MAX_TOKENS_BRANCHES}"
        ),
    ] = 128,
    grid: Annotated[
        str | None,
        typer.Option(
            "--grid",
            help="ReDrafter shapes to compare, widths x lengths: 1,2x4,5, each with the "
            "lookup chains (--lookup, --no-lookup) (default: the tuned profile or chip preset).",
            show_default=False,
        ),
    ] = None,
    configs: Annotated[
        str | None,
        typer.Option(
            "--configs",
            help='Shapes to compare, comma-separated labels: "W1xL3,W1xL4+K1xL8 C12,K1xL8" '
            "(W beams of L tokens, + K lookup chains of L tokens, C packed slots; K alone: "
            "lookup without the drafter). AR always runs. Instead of --grid.",
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
            "and count its graph ops, per beam shape, with the AR step beside it (shapes with "
            "lookup chains: the whole step only); then estimate each step where launches "
            "dominate, as on an Apple GPU (kernels x --launch-us + weights read / "
            "--bandwidth-gbs), over AR's.",
        ),
    ] = False,
    launch_us: Annotated[
        float | None,
        typer.Option(
            "--launch-us",
            help="--profile: the cost of one kernel launch on the machine the estimate prices "
            "(default 4 µs, an Apple GPU: ~2.8 µs measured per tiny dependent MLX kernel on an "
            "M3 Ultra, ~5 µs per small Metal dispatch in another engine).",
            show_default=False,
        ),
    ] = None,
    bandwidth_gbs: Annotated[
        float | None,
        typer.Option(
            "--bandwidth-gbs",
            help="--profile: its memory bandwidth in GB/s, which the weights read per step "
            "cost (default 100: a base M2/M3; M1 68, M4 120, Pro 150-273, Max 300-546).",
            show_default=False,
        ),
    ] = None,
    mac_dtype: Annotated[
        str | None,
        typer.Option(
            "--mac-dtype",
            help="--profile: float16, bfloat16 or float32, the dtype of its float weights "
            "(default float16, as chat loads them on Metal; quantized weights keep their size).",
            show_default=False,
        ),
    ] = None,
    hidden: Annotated[int, typer.Option("--hidden", help="--verify-cost: hidden size.")] = 2048,
    layers: Annotated[int, typer.Option("--layers", help="--verify-cost: layers.")] = 8,
    sampling_flags: SamplingFlags = SamplingFlags(),
    system_prompt: SystemPromptOpt = None,
    beam_width: BeamWidthOpt = None,
    beam_length: BeamLengthOpt = None,
    capacity: CapacityOpt = None,
    no_draft: NoDraftOpt = False,
    lookup: LookupOpt = None,
    lookup_length: LookupLengthOpt = None,
    no_lookup: NoLookupOpt = False,
    branches: BranchesOpt = "auto",
    branch_depth: BranchDepthOpt = None,
    max_branches: MaxBranchesOpt = None,
    adapt: Annotated[
        bool | None,
        typer.Option(
            "--adapt/--no-adapt",
            help="Neither: measure what chat runs, adaptive decoding (the loop switches between "
            "the chosen shape, the single beams of each length up to it, the lookup chains "
            "alone and plain decoding by measured tokens/s) from the shape chat would use, or "
            "with --configs/--grid those shapes pinned. --adapt: the pinned shapes and the "
            "adaptive row; --no-adapt: only pinned shapes.",
            show_default=False,
        ),
    ] = None,
    dtype: DtypeOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Benchmark ReDrafter against autoregressive decoding (and mlx-lm) on a prompt set."""
    from redrafter_mlx.cli import bench_report as logic

    with cli_errors(verbose):
        if verify_cost:
            show_verify_cost(hidden, layers, as_json)
            return
        beam = BeamFlags(
            beam_width, beam_length, capacity, no_draft, lookup, lookup_length, no_lookup
        )

        def check() -> None:
            if num_prompts < 1:
                raise FlagError(f"--num-prompts must be >= 1, got {num_prompts}")
            if turns not in (1, 2):
                raise FlagError(f"--turns must be 1 or 2, got {turns}")
            if csv_path is not None:
                check_csv_path(csv_path)
            return mac_cost(launch_us, bandwidth_gbs, mac_dtype, profile)

        def choose(paths: ModelPaths) -> tuple[tuple, bool]:
            """(prompt set, its records, the configurations, their source), and whether one
            of the configurations needs the drafter."""
            from redrafter_mlx.engine.base.prompts import PromptSetError, load_records

            prompt_set = prompts or ("demo" if paths.demo else "mt-bench")
            try:
                records = load_records(prompt_set, num_prompts, spread_categories=spread)
            except PromptSetError as e:  # a bad --prompts value
                raise FlagError(f"--prompts: {e}") from None
            try:
                chosen, source = choose_configs(
                    paths,
                    dtype,
                    beam,
                    grid=grid,
                    shapes=configs,
                    with_mlx_lm=with_mlx_lm,
                    adapt=False if profile else adapt,
                )
            except logic.BenchError as e:  # a bad --grid / --configs value
                raise FlagError(str(e)) from None
            return (prompt_set, records, chosen, source), any(c.drafts for c in chosen)

        ready = prepare_engine(
            model,
            drafter,
            dtype,
            sampling=sampling_flags,
            max_tokens=max_tokens,
            check=check,
            choose=choose,
            model_defaults=False,  # greedy unless asked: rows are checked against plain decoding
            split_ok=True,
            draft_model=draft_model,
        )
        engine, sampling, paths = ready.engine, ready.sampling, ready.engine.paths
        prompt_set, records, chosen, source = ready.plan
        if profile:
            ids = engine.tokenizer.chat_prompt(
                [{"role": "user", "content": records[0].prompt}], system=system_prompt
            )
            show_profile(engine, chosen, ids, as_json, cost=ready.checked)
            return
        with err_console().status("answering the first turns" if turns > 1 else "preparing"):
            items = build_prompts(engine, records, turns, system_prompt, max_tokens)
        if turns > 1 and all(item.turn == 1 for item in items):
            err_console().print(
                f"--turns 2: no prompt of {prompt_set} has a second turn; turn 1 only",
                style="yellow",
            )
        rules = branch_flags(engine, BranchFlags(branches, branch_depth, max_branches))
        runner = make_runner(engine, max_tokens, sampling, with_mlx_lm, chosen, rules)
        with err_console().status("benchmarking") as status:
            result = logic.run_bench(
                chosen,
                items,
                runner,
                sampling.greedy,
                progress=lambda m: status.update(f"benchmarking: {m}"),
            )
        meta = dict(
            model=paths.model,
            drafter=paths.drafter,
            draft_model=paths.draft_model,
            demo=paths.demo,
            dtype=engine.dtype,
            prompt_set=prompt_set,
            spread=spread,
            max_tokens=max_tokens,
            sampling=sampling.to_dict(),
            beam_source=source,
        )
        data = logic.report(result, meta)
        if data["mismatches"]:
            judge_mismatches(engine, result, data, sampling)
        data["split"] = split_cost(engine, chosen)
        if csv_path is not None:
            logic.write_csv(data["configs"], str(csv_path))
        if as_json:
            print(json.dumps(data))
        else:
            print_report(data)
        if data["mismatches"]:
            print_mismatches(data["mismatches"], engine.dtype)
        bugs = [m for m in data["mismatches"] if not m["near_tie"]]
        if bugs:
            raise fail(f"{len(bugs)} greedy run(s) did not reproduce AR's tokens")


def split_cost(engine: Engine, configs: list) -> dict | None:
    """Under ``mlx.launch`` (the model split across ranks), what its messages cost, for each
    step size T the configurations verify: one ``all_sum`` of a (1, T, H) hidden state alone
    (fastest: the latency floor) and the median time of a step's 2 x layers of them chained in
    one graph, as a forward sends them. None when the model is whole.
    """
    import mlx.core as mx

    from redrafter_mlx.measure.allsum import alone, chained

    group = getattr(engine.model, "group", None)
    if group is None:
        return None
    H, count = engine.model.hidden_size, 2 * engine.model.args.num_hidden_layers
    dtype = engine.model.dtype
    rows = []
    for T in sorted({1} | {c.shape.slots for c in configs if c.shape is not None}):
        x = mx.zeros((1, T, H), dtype)
        alone(x, group, 3)  # warm up
        floor, _ = alone(x, group, 20)
        _, per_message = chained(x, group, count, 5)
        rows.append(dict(tokens=T, bytes=x.nbytes, floor_us=floor * 1e6,
                         per_step_ms=per_message * count * 1e3))  # fmt: skip
    return dict(ranks=group.size(), all_sums_per_step=count, sizes=rows)


def print_split(split: dict) -> None:
    """One dim line per step size: what the split model's messages cost a step."""
    console = out_console()
    console.print(
        f"[dim]split across {split['ranks']} ranks, {split['all_sums_per_step']} all_sums per "
        "step: one alone at best, and a step's worth chained (median):[/]"
    )
    for row in split["sizes"]:
        console.print(
            f"[dim]  T={row['tokens']} ({row['bytes']:,} bytes): {row['floor_us']:.0f} µs, "
            f"{row['per_step_ms']:.1f} ms per step[/]"
        )


def print_report(data: dict) -> None:
    """The rich table (one per turn) plus notes on the shape source and mlx-lm agreement."""
    from redrafter_mlx.cli.bench_report import render_table

    console = out_console()
    several = len(data["turns"]) > 1
    for turn in data["turns"]:
        rows = [row for row in data["configs"] if row["turn"] == turn]
        count = rows[0]["prompts"] if rows else 0
        title = (
            f"{Path(data['model']).name} · {data['prompt_set']} × {count}"
            + (f" · turn {turn}" if several else "")
            + f" · max {data['max_tokens']} tokens · {data['dtype']}"
            + (" · greedy" if data["greedy"] else f" · temp {data['sampling']['temperature']}")
        )
        console.print(render_table(rows, title))
    console.print(f"[dim]ReDrafter shapes: {data['beam_source']}.[/]")
    agreement = data["mlx_lm_matching_prompts"]
    if agreement is not None:
        what = "prompt turns" if several else "prompts"
        console.print(
            f"[dim]mlx-lm greedy tokens equal AR's on {agreement}/"
            f"{data['num_runs']} {what} (float rounding may differ).[/]"
        )
    if data.get("split"):
        print_split(data["split"])
