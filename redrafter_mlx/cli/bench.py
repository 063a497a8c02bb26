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

This module runs the benchmark: the command, the configurations it compares, the prompts'
turns, the runs and the report's data. Its options are ``bench_flags.py``'s, what it prints
``bench_render.py``'s, the benchmark's logic (runs, summary rows, the table) ``bench_report.py``'s
and the ``--profile`` / ``--verify-cost`` measurements ``bench_profile.py``'s.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from redrafter_mlx.cli.bench_flags import BenchFlags
from redrafter_mlx.cli.bench_profile import mac_cost, profile_rows, verify_cost_rows
from redrafter_mlx.cli.bench_render import show, show_profile, show_verify_cost
from redrafter_mlx.cli.common import (
    BeamFlags,
    Engine,
    Prepared,
    branch_flags,
    plan_from_flags,
    prepare_engine,
    same_plan_everywhere,
)
from redrafter_mlx.cli.consoles import err_console
from redrafter_mlx.cli.errors import FlagError, cli_errors, fail
from redrafter_mlx.cli.options import flag_groups
from redrafter_mlx.cli.paths import ModelPaths

if TYPE_CHECKING:
    from redrafter_mlx.engine.core.sampling import SamplerConfig


@flag_groups
def bench(flags: BenchFlags) -> None:
    """Benchmark ReDrafter against autoregressive decoding (and mlx-lm) on a prompt set."""
    with cli_errors(flags.verbose):
        if flags.verify_cost:
            rows = verify_cost_rows(flags.hidden, flags.layers)
            show_verify_cost(rows, flags.hidden, flags.layers, flags.as_json)
            return
        ready = prepare(flags)
        if flags.profile:
            show_profile(profiled(ready, flags), ready.engine.paths.model, flags.as_json)
            return
        data = run(ready, flags)
        show(data, flags.csv_path, flags.as_json)
        bugs = [m for m in data["mismatches"] if not m["near_tie"]]
        if bugs:
            raise fail(f"{len(bugs)} greedy run(s) did not reproduce AR's tokens")


def prepare(flags: BenchFlags) -> Prepared:
    """The engine loaded for the benchmark (``prepare_engine``: bench's own flags checked
    first, ``check_flags``), its plan ``(prompt set, records, configurations, their
    source)`` (``choose``); greedy unless a flag samples, as every row is checked against
    plain decoding."""
    beam = BeamFlags.of(flags.shape)
    return prepare_engine(
        flags.models.model,
        flags.models.drafter,
        flags.dtype,
        sampling=flags.sampling,
        max_tokens=flags.max_tokens,
        check=lambda: check_flags(flags),
        choose=lambda paths: choose(flags, beam, paths),
        model_defaults=False,  # greedy unless asked: rows are checked against plain decoding
        split_ok=True,
        draft_model=flags.models.draft_model,
    )


def check_flags(flags: BenchFlags):
    """FlagError naming the first bad one of bench's own flags; the machine ``--profile``
    prices its steps on (``bench_profile.mac_cost``)."""
    if flags.num_prompts < 1:
        raise FlagError(f"--num-prompts must be >= 1, got {flags.num_prompts}")
    if flags.turns not in (1, 2):
        raise FlagError(f"--turns must be 1 or 2, got {flags.turns}")
    if flags.csv_path is not None:
        check_csv_path(flags.csv_path)
    return mac_cost(flags.launch_us, flags.bandwidth_gbs, flags.mac_dtype, flags.profile)


def choose(flags: BenchFlags, beam: BeamFlags, paths: ModelPaths) -> tuple[tuple, bool]:
    """(prompt set, its records, the configurations, their source), and whether one of the
    configurations needs the drafter."""
    from redrafter_mlx.cli.bench_report import BenchError
    from redrafter_mlx.engine.base.prompts import PromptSetError, load_records

    prompt_set = flags.prompts or ("demo" if paths.demo else "mt-bench")
    try:
        records = load_records(prompt_set, flags.num_prompts, spread_categories=flags.spread)
    except PromptSetError as e:  # a bad --prompts value
        raise FlagError(f"--prompts: {e}") from None
    try:
        chosen, source = choose_configs(
            paths,
            flags.dtype,
            beam,
            grid=flags.grid,
            shapes=flags.configs,
            with_mlx_lm=flags.with_mlx_lm,
            adapt=False if flags.profile else flags.adapt,
        )
    except BenchError as e:  # a bad --grid / --configs value
        raise FlagError(str(e)) from None
    return (prompt_set, records, chosen, source), any(c.drafts for c in chosen)


def profiled(ready: Prepared, flags: BenchFlags) -> dict:
    """``--profile``: per-phase ms and graph ops of one step per shape, greedy, on the first
    prompt (shapes with lookup chains: the whole step only), each step priced where launches
    dominate (the ``MacCost`` that ``check_flags`` made)."""
    engine = ready.engine
    _, records, chosen, _ = ready.plan
    ids = engine.tokenizer.chat_prompt(
        [{"role": "user", "content": records[0].prompt}], system=flags.system_prompt
    )
    shapes = list(dict.fromkeys(c.shape for c in chosen if c.kind == "redrafter"))
    with err_console().status("profiling"):
        return profile_rows(engine, shapes, ids, repeats=40, cost=ready.checked)


def run(ready: Prepared, flags: BenchFlags) -> dict:
    """The benchmark: each prompt's turns built, every configuration run on them (one warm-up
    each, then interleaved per prompt), and the report's data (``bench_report.report``),
    each greedy mismatch judged and, under ``mlx.launch``, the split model's message cost."""
    from redrafter_mlx.cli import bench_report as logic

    engine, sampling = ready.engine, ready.sampling
    prompt_set, records, chosen, source = ready.plan
    turns = flags.turns
    with err_console().status("answering the first turns" if turns > 1 else "preparing"):
        items = build_prompts(engine, records, turns, flags.system_prompt, flags.max_tokens)
    if turns > 1 and all(item.turn == 1 for item in items):
        err_console().print(
            f"--turns 2: no prompt of {prompt_set} has a second turn; turn 1 only",
            style="yellow",
        )
    rules = branch_flags(engine, flags.branching)
    runner = make_runner(engine, flags.max_tokens, sampling, flags.with_mlx_lm, chosen, rules)
    with err_console().status("benchmarking") as status:
        result = logic.run_bench(
            chosen,
            items,
            runner,
            sampling.greedy,
            progress=lambda m: status.update(f"benchmarking: {m}"),
        )
    data = logic.report(result, run_meta(ready, flags, prompt_set, source))
    if data["mismatches"]:
        judge_mismatches(engine, result, data, sampling)
    data["split"] = split_cost(engine, chosen)
    return data


def run_meta(ready: Prepared, flags: BenchFlags, prompt_set: str, source: str) -> dict:
    """What the report says it ran: the model and draft sources, the dtype, the prompts, the
    token limit, the sampling settings and where the shapes came from."""
    paths = ready.engine.paths
    return dict(
        model=paths.model,
        drafter=paths.drafter,
        draft_model=paths.draft_model,
        demo=paths.demo,
        dtype=ready.engine.dtype,
        prompt_set=prompt_set,
        spread=flags.spread,
        max_tokens=flags.max_tokens,
        sampling=ready.sampling.to_dict(),
        beam_source=source,
    )


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
    from redrafter_mlx.cli.bench_report import AR_CONFIG, MLX_LM_CONFIG, Config

    if grid is not None and shapes is not None:
        raise FlagError("--grid and --configs both choose the shapes to compare; give one of them")
    chains = beam.lookup_chains()  # checked whichever shapes run
    has_drafter = paths.drafter is not None and not beam.no_draft
    # Neither --adapt/--no-adapt nor shapes to compare: what chat runs, adaptive decoding.
    bare = adapt is None and shapes is None and grid is None
    plan = None
    if shapes is not None:
        pinned = [Config(s) for s in configs_shapes(shapes, paths, beam, has_drafter)]
        source = "beam shapes from --configs"
    elif grid is not None and has_drafter:
        pinned, source = grid_configs(grid, beam.capacity, chains)
    else:
        plan = same_plan_everywhere(plan_from_flags(paths, dtype, beam))
        source = plan.source + (" (--grid needs a drafter)" if grid is not None else "")
        pinned, source = planned_configs(plan, chains, has_drafter, not bare, source)
    configs = [AR_CONFIG, *pinned]
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


def configs_shapes(text: str, paths: ModelPaths, beam: BeamFlags, has_drafter: bool) -> list:
    """``--configs``' speculative shapes, each once, in order; FlagError when one needs the
    drafter or a draft model that the run does not have."""
    from redrafter_mlx.cli.bench_report import parse_configs
    from redrafter_mlx.engine.loop.run import missing_sources

    chosen = parse_configs(text)
    has_model = paths.draft_model is not None
    lacks = {s.label: missing_sources(s, has_drafter, has_model) for s in chosen}
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
    return list(dict.fromkeys(s for s in chosen if not s.is_autoregressive))


def grid_configs(grid: str, capacity: int | None, chains: tuple[int, int]) -> tuple[list, str]:
    """``--grid``'s shapes (at ``--capacity``), each with the lookup ``chains`` (count,
    length), and the sentence saying so."""
    from redrafter_mlx.cli.bench_report import Config, parse_grid
    from redrafter_mlx.cli.common import check_shape
    from redrafter_mlx.engine.core.shape import BeamShape

    shapes = [check_shape(BeamShape(w, n, capacity), "--grid") for w, n in parse_grid(grid)]
    configs = [Config(with_lookup(s, *chains)) for s in shapes]
    return configs, "beam shapes from --grid" + (", with context lookup" if chains[0] else "")


def planned_configs(
    plan, chains: tuple[int, int], has_drafter: bool, pinned: bool, source: str
) -> tuple[list, str]:
    """The plan's shape pinned (when ``pinned``: a flag asked for pinned shapes), or, when
    tuning found plain decoding faster, the engine default with the lookup ``chains`` to
    show why; and ``source``, the sentence saying where they came from, told so."""
    from redrafter_mlx.cli.bench_report import Config
    from redrafter_mlx.engine.loop.generation import DEFAULT_SHAPE

    if plan.speculative:
        return ([Config(plan.shape)] if pinned else []), source
    if not has_drafter:
        return [], source
    fallback = with_lookup(DEFAULT_SHAPE, *chains)  # tuning found AR faster
    return [Config(fallback)], f"{source}; benchmarking the engine default {fallback.label}"


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
