"""``redrafter-mlx tune``: find the best beam shape for this machine, or show a preset.

* ``tune`` (``--chip auto``) measures autoregressive decoding and the (W, L[, C]) grid on
  this machine within ``--budget-seconds`` (default: sized from plain decoding's speed),
  prints a table and a W x L heatmap, and saves a profile that chat/generate/bench then use
  by default. Context lookup is part of the shape: beside every W×L the grid holds W×L with
  ``--lookup`` K chains of ``--lookup-length`` tokens added (W×L+K×Lk) and the chains alone
  (K×Lk), so the profile says whether lookup pays here; ``--no-lookup`` searches W×L only. A
  model without a drafter is tuned over the lookup-only shapes (against plain decoding).
  ``--draft-model`` adds a draft model's chain (``D1×Ld`` for each ``--draft-length``) alone
  and beside every shape, and the profile (keyed by the draft model too) says which draft
  sources the recommended shape runs; given twice (a draft model and an early-exit
  adapter's folder) the ``D1×Ld`` part is both chains. An early-exit adapter as
  ``--drafter`` drafts one chain: the grid keeps W = 1.
* ``tune --chip m2`` prints the built-in preset for that chip without measuring.
* ``tune --show`` lists saved profiles, ``tune --clear`` deletes them.

Under ``mlx.launch`` each rank loads its shard of the model and every rank runs the same
measurements in the same order (the split model needs them all); rank 0's timings and
clock are everyone's (``shared_measure``, ``shared_clock``: one broadcast each), so the
search makes the same decisions on every rank, and rank 0 alone saves the profile.

Heavy modules (MLX, the engine, rich, matplotlib) are imported only when needed.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from redrafter_mlx.cli.errors import FlagError, cli_errors
from redrafter_mlx.cli.options import DraftModelOpt, VerboseOpt, flag_groups
from redrafter_mlx.cli.paths import ModelPaths, resolve_draft_model, resolve_paths
from redrafter_mlx.cli.tune_grid import grid_for, lookup_grid, lookup_on, parse_draft_lengths
from redrafter_mlx.cli.tune_report import (
    clear_profiles,
    console,
    preset_report,
    print_preset,
    print_tuned_json,
    print_tuning,
    show_profiles,
)
from redrafter_mlx.engine.core.shape import BeamShape
from tuning.grid import shape_sources
from tuning.measure import TuneError
from tuning.presets import get_preset, preset_for, preset_names
from tuning.search import SearchError

PRESET_HELP = "auto (detect and measure this machine) or a preset: " + ", ".join(preset_names())


@dataclass(frozen=True)
class TuneFlags:
    """``tune``'s options, in the order ``--help`` lists them."""

    chip: Annotated[str, typer.Option(help=PRESET_HELP)] = "auto"
    model: Annotated[
        str | None,
        typer.Option(
            help="Model directory, hub id, smollm2 or demo (default: as for chat).",
        ),
    ] = None
    drafter: Annotated[
        str | None,
        typer.Option("--drafter", "-d", help="Drafter directory."),
    ] = None
    widths: Annotated[str, typer.Option(help="Beam widths: a range 1-4 or a list 1,2,4.")] = "1-4"
    lengths: Annotated[
        str, typer.Option(help="Beam lengths, counting the init token: 2-6 or 2,4,5.")
    ] = "2-6"
    capacities: Annotated[
        str | None,
        typer.Option(help="Packing capacities to try besides no cap, e.g. 8,12 (default: none)."),
    ] = None
    lookup: Annotated[
        str | None,
        typer.Option(
            "--lookup",
            help="Context-lookup chains to try beside every drafter shape and alone: K, or a "
            "set like 1-2 (0 = off; default 1, without a drafter 1-2).",
            show_default=False,
        ),
    ] = None
    lookup_length: Annotated[
        str | None,
        typer.Option(
            "--lookup-length",
            help="Tokens per lookup chain, counting the init token: 8 or a set like 4,8 "
            "(default 8, without a drafter 4,8).",
            show_default=False,
        ),
    ] = None
    no_lookup: Annotated[
        bool,
        typer.Option("--no-lookup", help="Search drafter shapes only, no context lookup."),
    ] = False
    draft_model: DraftModelOpt = None
    draft_length: Annotated[
        str | None,
        typer.Option(
            "--draft-length",
            help="With --draft-model: its chain's tokens, counting the init token, to try "
            "alone and beside every shape: 4 or a set like 3-5 (default: 4).",
            show_default=False,
        ),
    ] = None
    budget_seconds: Annotated[
        float | None,
        typer.Option(
            help="Time to spend measuring, in seconds (default: what the search needs on this "
            "model and machine, judged from plain decoding's speed, 120-600 s).",
            show_default=False,
        ),
    ] = None
    prompts: Annotated[
        str | None,
        typer.Option(
            help="mt-bench, vicuna-bench, demo or a .jsonl/.txt FILE (default: demo for the demo "
            "model, else mt-bench).",
            show_default=False,
        ),
    ] = None
    num_prompts: Annotated[int, typer.Option(help="Prompts per measurement.")] = 4
    max_tokens: Annotated[int, typer.Option(help="Tokens per run in the longest runs.")] = 128
    dtype: Annotated[
        str | None,
        typer.Option(
            help="float16, bfloat16 or float32 (default: float16 on a GPU, Metal or CUDA; "
            "float32 on CPU)."
        ),
    ] = None
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON only.")] = False
    plot: Annotated[
        str | None,
        typer.Option(help="Also save the heatmap as a PNG (needs matplotlib).", metavar="FILE.png"),
    ] = None
    show: Annotated[bool, typer.Option("--show", help="List saved profiles.")] = False
    clear: Annotated[bool, typer.Option("--clear", help="Delete saved profiles.")] = False
    force_lengths: Annotated[
        bool,
        typer.Option(
            "--force-lengths", help="Allow lengths beyond what the drafter was trained for."
        ),
    ] = False
    verbose: VerboseOpt = False


@flag_groups
def tune(flags: TuneFlags) -> None:
    """Find the fastest beam shape (width W, length L, capacity C, lookup chains K×Lk) for
    this machine.

    With --chip NAME, print that chip's built-in preset instead of measuring.
    """
    with cli_errors(flags.verbose):
        if flags.clear:
            clear_profiles(flags.json_output)
        elif flags.show:
            show_profiles(flags.json_output)
        elif flags.chip.lower() != "auto":
            preset = get_preset(flags.chip)
            if preset is None:
                raise FlagError(f"--chip: unknown chip {flags.chip!r}; use {PRESET_HELP}")
            report = preset_report(preset, flags.drafter, flags.force_lengths)
            print_preset(report, flags.json_output)
        else:
            tune_here(flags)


@dataclass(frozen=True)
class Search:
    """One tuning run on this machine: the chip, the model and drafter, the shapes to
    measure (and a note on those left out), the flags, and what the grid tried: the lookup
    chains (None: none), the draft slot and whether the drafter is an early-exit adapter."""

    chip: Any
    model: str
    drafter: str | None
    shapes: list[BeamShape]
    note: str
    flags: TuneFlags
    prompts: str
    lookup: dict | None = None
    draft_model: str | tuple[str, str] | None = None
    early_exit: bool = False


def tune_here(flags: TuneFlags) -> None:
    """``tune --chip auto``: the flags checked, the grid built, then measured, decided, saved
    and reported (``run_tuning``); a failure names the chip's preset to use meanwhile."""
    budget = flags.budget_seconds
    finite = budget is None or math.isfinite(budget)
    if not finite or (budget is not None and budget <= 0):
        raise FlagError(f"--budget-seconds must be a finite number of seconds > 0, got {budget:g}")
    if flags.plot:
        _check_plot_available()
    from redrafter_mlx.cli.common import follow_rank0
    from redrafter_mlx.engine.loop.loading import LoadError
    from tuning.chip import detect_chip

    group = world()
    follow_rank0(group)  # under mlx.launch: rank 0 prints, the others only their errors
    info = detect_chip()
    search = plan_search(flags, info, group)
    if group is None or group.rank() == 0:  # rank 0 saves: refuse before measuring
        from tuning.profiles import ProfileStore

        ProfileStore().check_writable()
    try:
        run_tuning(search)
    except (TuneError, SearchError, LoadError) as e:
        preset = preset_for(info.preset)[0]
        raise TuneError(
            f"{e} (detected {info.chip_id}; its preset is {preset.shape.label}: "
            f"redrafter-mlx tune --chip {preset.name})"
        ) from None


def plan_search(flags: TuneFlags, info, group) -> Search:
    """The model, drafter and draft slot resolved, and the shapes to measure (rank 0's on
    every rank): the W×L[ C] grid from the chip's preset on, with the lookup chains and the
    draft slot's chains the flags ask for."""
    paths = resolve_models(flags.model, flags.drafter, lookup_on(flags.lookup, flags.no_lookup))
    drafter = paths.drafter
    if flags.plot and drafter is None:
        raise FlagError("--plot draws the W x L heatmap of drafter shapes; this has no drafter")
    chains, chain_lengths = lookup_grid(
        flags.lookup, flags.lookup_length, flags.no_lookup, drafter is not None
    )
    if flags.draft_length is not None and not flags.draft_model:
        raise FlagError(
            f"--draft-length {flags.draft_length} sizes the draft model's chain; add "
            "--draft-model (a draft model or an early-exit adapter's folder) or drop "
            "--draft-length"
        )
    draft_model = resolve_draft_model(flags.draft_model)
    draft_lengths = []
    if draft_model is not None:
        draft_lengths = parse_draft_lengths(flags.draft_length or "4")
    early = drafter is not None and drafter_is_early_exit(drafter)
    shapes, note = grid_for(
        flags.widths,
        flags.lengths,
        flags.capacities,
        drafter,
        flags.force_lengths,
        preset_for(info.preset)[0].shape,
        chains,
        chain_lengths,
        draft_lengths,
        early,
    )
    return Search(
        info,
        paths.model,
        drafter,
        same_shapes_everywhere(shapes, group),
        note,
        flags,
        flags.prompts or ("demo" if paths.demo else "mt-bench"),
        {"chains": chains, "lengths": chain_lengths} if chains else None,
        draft_model,
        early,
    )


def build_measure(
    model: str,
    drafter: str | None,
    dtype: str | None,
    prompts: str,
    num_prompts: int,
    shapes: list[BeamShape] = (),
    draft_model: str | tuple[str, str] | None = None,
):
    """(measure, clock) for the real engine; the tests replace this with a fake cost model.
    Every one of ``shapes`` must fit the loaded model's context and memory (a
    ``ShapeTooLarge`` naming the flag otherwise), so none is skipped without a word.
    ``draft_model``: the draft slot of the shapes with a ``D1×Ld`` part (a draft model, an
    early-exit adapter's folder, or (draft model, adapter): both chains)."""
    from redrafter_mlx.engine.base.platform import fit_blas_threads
    from redrafter_mlx.engine.base.prompts import PromptSetError, load_prompts
    from redrafter_mlx.engine.drafting.held import held_sources
    from redrafter_mlx.engine.loop.loading import load
    from redrafter_mlx.engine.loop.memory import check_step_memory
    from tuning.measure import EngineMeasure

    if num_prompts < 1:
        raise TuneError("--num-prompts must be at least 1")
    try:
        questions = load_prompts(prompts, num_prompts)
    except PromptSetError as e:
        raise TuneError(f"--prompts: {e}") from None
    group = world()
    loaded = load(model, drafter, dtype=dtype, group=group, draft_model=draft_model)
    llm, loaded_drafter, tokenizer = loaded[:3]  # a LoadError: a TuneError
    chain = loaded[3] if draft_model is not None else None
    fit_blas_threads(llm, loaded_drafter)
    for shape in shapes:
        dm = chain if shape.model_length else None
        sources = held_sources(loaded_drafter if shape.drafts else None, dm)  # the boundary
        check_step_memory(llm, sources, shape)
    measure = EngineMeasure(llm, loaded_drafter, tokenizer, questions, chain)
    if group is None:
        return measure, time.perf_counter
    return shared_measure(measure, group), shared_clock(group)


def world():
    """The ``mlx.launch`` group, None alone (MLX imported only when measuring)."""
    from redrafter_mlx.engine.base.distributed import world

    return world()


def shared_measure(measure, group):
    """``measure`` run on every rank (a split model's run needs all of them), returning rank
    0's measurement everywhere. A failure on rank 0 is every rank's (the search marks the
    shape); one on another rank alone ends that rank."""
    from dataclasses import asdict

    from redrafter_mlx.engine.base.distributed import broadcast_text
    from tuning.search import Measurement

    def shared(shape: BeamShape, n_tokens: int) -> Measurement:
        try:
            mine = {"ok": asdict(measure(shape, n_tokens))}
        except Exception as e:
            mine = {"error": f"{type(e).__name__}: {e}"}
        got = json.loads(broadcast_text(json.dumps(mine), group))
        if "error" in got:
            raise TuneError(got["error"])
        if "error" in mine:
            raise SystemExit(f"error: rank {group.rank()}: {mine['error']}")
        ok = got["ok"]
        return Measurement(
            tuple(ok["tokens_per_s"]), tuple(ok["tokens_per_step"]), ok["mean_packed"]
        )

    return shared


def shared_clock(group):
    """Rank 0's ``time.perf_counter`` on every rank (the search's budget is rank 0's)."""
    from redrafter_mlx.engine.base.distributed import broadcast_text

    return lambda: float(broadcast_text(repr(time.perf_counter()), group))


def resolve_models(model: str | None, drafter: str | None, lookup: bool) -> ModelPaths:
    """The model and drafter to tune (the CLI's one resolver: no --model is the default
    bundled model). Without a drafter only context lookup speculates, so ``lookup`` must
    be on."""
    if model is None and drafter is not None:
        raise TuneError("--drafter needs --model (the base model the drafter was trained for)")
    paths = resolve_paths(model, drafter)
    if paths.drafter is None and not lookup:
        raise TuneError(
            f"{paths.model} has no drafter and --no-lookup leaves nothing to speculate with; "
            "pass --model DIR --drafter DIR, or drop --no-lookup to tune context lookup alone"
        )
    return paths


def save_profile(
    chip_id: str,
    model: str,
    drafter: str | None,
    dtype: str | None,
    result,
    lookup: bool,
    draft_model: str | tuple[str, str] | None = None,
    early_exit: bool = False,
) -> str:
    """Store the search outcome as this setup's profile (``lookup``: the grid tried context
    lookup, so the shape's lookup fields are measured; keyed by ``draft_model`` too, and
    naming the draft sources the shape runs); returns the file path."""
    from tuning.profiles import Profile, ProfileKey, ProfileStore, now_iso

    best = result.best if result.speculation_wins else None
    profile = Profile(
        key=ProfileKey.build(chip_id, model, drafter, dtype, draft_model_path=draft_model),
        shape=result.recommended,
        speculative=result.speculation_wins,
        speedup=result.speedup(best).median if best else None,
        tokens_per_s=(best or result.autoregressive).spread().median,
        created=now_iso(),
        summary={
            "reason": result.reason,
            "budget_s": result.budget_s,
            "elapsed_s": round(result.elapsed_s, 2),
        },
        lookup_searched=lookup,
        sources=tuple(shape_sources(result.recommended, early_exit, slot_sources(draft_model))),
    )
    store = ProfileStore()
    store.put(profile)
    return str(store.path)


def run_tuning(search: Search) -> None:
    """Measure, decide, save and report."""
    result = measured(search)
    gap = result.evidence_gap()
    group = world()
    leader = group is None or group.rank() == 0  # under mlx.launch rank 0 saves
    path = failure = None
    if gap is None and leader:
        try:
            path = save_profile(
                search.chip.chip_id,
                search.model,
                search.drafter,
                search.flags.dtype,
                result,
                bool((search.lookup or {}).get("chains")),
                search.draft_model,
                search.early_exit,
            )
        except OSError as e:  # the measurement is still shown below, then the error
            failure = e
    save_error = None if failure is None else str(failure)
    plot = search.flags.plot
    if plot and leader:
        from tuning.render import save_heatmap_png

        save_heatmap_png(result, plot)
    if search.flags.json_output:
        sources = shape_sources(
            result.recommended, search.early_exit, slot_sources(search.draft_model)
        )
        print_tuned_json(search, result, sources, path, save_error)
    else:
        print_tuning(result, search.chip, search.note, path, plot, save_error)
    if failure is not None:
        raise failure
    if gap is not None:
        raise TuneError(
            f"no profile was saved: {gap}; any earlier profile is unchanged. Raise "
            f"--budget-seconds, or leave it out to size the budget from plain decoding's speed"
        )


def measured(search: Search):
    """The search's result: successive halving over the shapes within the budget, on the
    real engine (``build_measure``), its progress on stderr."""
    from tuning.search import SearchPlan, successive_halving

    flags = search.flags
    measure, clock = build_measure(
        search.model,
        search.drafter,
        flags.dtype,
        search.prompts,
        flags.num_prompts,
        search.shapes,
        draft_model=search.draft_model,
    )
    n = flags.max_tokens
    plan = SearchPlan(min_tokens=min(16, n), short_tokens=min(64, n), long_tokens=n)
    progress = console(stderr=True)
    return successive_halving(
        measure,
        search.shapes,
        flags.budget_seconds,
        clock=clock,
        plan=plan,
        log=lambda m: progress.print(f"[dim]{m}[/dim]"),
    )


def slot_sources(draft_model: str | tuple[str, str] | None) -> tuple[str, ...]:
    """The sources of the draft slot's ``D1×L`` part (``--draft-model``, resolved): a draft
    model and an early-exit adapter (given twice): both; an early-exit folder: its chain;
    else a draft model's."""
    if isinstance(draft_model, tuple):
        return ("early_exit", "draft_model")
    if draft_model is not None and drafter_is_early_exit(draft_model):
        return ("early_exit",)
    return ("draft_model",)


def drafter_is_early_exit(drafter: str) -> bool:
    """Whether the ``--drafter`` folder is an early-exit adapter (its config.json's kind)."""
    from redrafter_mlx.engine.drafting.early_exit import is_early_exit

    return is_early_exit(drafter)


def same_shapes_everywhere(shapes: list[BeamShape], group) -> list[BeamShape]:
    """Rank 0's grid on every rank (alone: ``shapes``): the ranks measure the same shapes."""
    if group is None:
        return shapes
    from redrafter_mlx.engine.base.distributed import broadcast_text

    labels = broadcast_text("\n".join(s.label for s in shapes), group)
    return [BeamShape.parse(label) for label in labels.split("\n") if label]


def _check_plot_available() -> None:
    """Fail early, before measuring, when --plot cannot be honoured."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise TuneError(
            "--plot needs matplotlib: pip install 'redrafter-mlx[plot]' (or pip install matplotlib)"
        )
