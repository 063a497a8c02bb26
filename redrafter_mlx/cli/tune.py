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
from pathlib import Path
from typing import Annotated

import typer

from redrafter_mlx.cli.errors import FlagError, cli_errors
from redrafter_mlx.cli.options import DraftModelOpt, VerboseOpt
from redrafter_mlx.cli.paths import ModelPaths, resolve_draft_model, resolve_paths
from redrafter_mlx.engine.core.shape import BeamShape
from tuning.grid import (
    build_grid,
    limit_lengths,
    parse_capacities,
    parse_int_set,
    parse_lookup,
    parse_lookup_lengths,
    read_predict_tokens,
    shape_sources,
    with_draft_model,
    with_lookup,
)
from tuning.measure import TuneError
from tuning.presets import Preset, get_preset, preset_for, preset_names
from tuning.search import SearchError

PRESET_HELP = "auto (detect and measure this machine) or a preset: " + ", ".join(preset_names())
# Lookup chains tried by default: the commands' default chain (engine.lookup's DEFAULT_CHAINS
# and DEFAULT_CHAIN_LENGTH) beside a drafter; a few more shapes without one (cheap to measure).
LOOKUP_DEFAULTS = {True: ("1", "8"), False: ("1-2", "4,8")}  # has a drafter -> (K, Lk)


def _console(stderr: bool = False):
    """A rich console on stdout (or stderr for progress and warnings)."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


# --------------------------------------------------------------------------- --show / --clear


def _short(path: str) -> str:
    """Last component of a path (hub ids and 'none' unchanged)."""
    return Path(path).name if "/" in path and Path(path).name else path


def show_profiles(as_json: bool) -> None:
    """List saved profiles (rich table, or JSON with ``--json``)."""
    from tuning.profiles import ProfileStore, package_version

    store = ProfileStore()
    profiles = store.load()
    if as_json:
        print(
            json.dumps(
                {"path": str(store.path), "profiles": [p.to_json() for p in profiles.values()]},
                indent=2,
            )
        )
        return
    console = _console()
    if not profiles:
        console.print(f"No tuned profiles in {store.path}. Run 'redrafter-mlx tune' to make one.")
        return
    from rich.table import Table

    current = package_version()
    table = Table(title=f"tuned profiles ({store.path})")
    for column in ("chip", "model", "drafter", "dtype", "version", "shape", "speedup", "date"):
        table.add_column(column, no_wrap=column in ("shape", "date"), overflow="fold")
    for p in sorted(profiles.values(), key=lambda p: (p.key.chip_id, p.created)):
        k = p.key
        version = k.version if k.version == current else f"{k.version} (old, unused)"
        dtype = k.dtype if k.quantization == "none" else f"{k.dtype} {k.quantization}"
        table.add_row(
            k.chip_id,
            _short(k.model),
            _short(k.drafter),
            dtype,
            version,
            p.shape.label if p.speculative else "AR",
            f"{p.speedup:.2f}×" if p.speedup else "–",
            p.date,
        )
    console.print(table)


def clear_profiles(as_json: bool) -> None:
    """Delete every saved profile."""
    from tuning.profiles import ProfileStore

    warnings: list[str] = []
    store = ProfileStore(warn=warnings.append)
    store.load()  # an unreadable or corrupt file warns: it is removed all the same
    count = store.clear()
    unreadable = bool(warnings)
    if as_json:
        print(json.dumps({"path": str(store.path), "removed": count}))
    elif unreadable:
        _console().print(f"Removed the unreadable tuned-profile file {store.path}.")
    else:
        _console().print(f"Removed {count} tuned profile(s) from {store.path}.")


# --------------------------------------------------------------------------- presets


def preset_report(preset: Preset, drafter: str | None, force_lengths: bool) -> dict:
    """The preset's shape (capped by the drafter's trained length) as a JSON-ready dict."""
    from tuning.defaults import ShapeChoice, cap_length

    choice = ShapeChoice(preset.shape, f"preset for {preset.name}")
    if not force_lengths:
        choice = cap_length(choice, read_predict_tokens(drafter))
    return {
        "mode": "preset",
        "preset": preset.name,
        **choice.to_dict(),
        "note": preset.note,
    }


def print_preset(report: dict, as_json: bool) -> None:
    """Print a preset report as JSON or one friendly paragraph."""
    if as_json:
        print(json.dumps(report, indent=2))
        return
    console = _console()
    console.print(f"[bold]{report['label']}[/bold]  ({report['source']})")
    console.print(f"  {report['note']}")
    console.print(
        "  Presets are not measured; run 'redrafter-mlx tune' on the machine itself "
        "to find its best shape."
    )


# --------------------------------------------------------------------------- measuring


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
        check_step_memory(llm, loaded_drafter if shape.drafts else None, shape, draft_model=dm)
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


def lookup_on(lookup: str | None, no_lookup: bool) -> bool:
    """Whether the grid tries context lookup (not --no-lookup, not --lookup 0)."""
    asked = parse_lookup(lookup, "1")
    if no_lookup and lookup is not None and asked:
        raise FlagError(f"--no-lookup contradicts --lookup {lookup}; give one of them")
    return bool(asked) and not no_lookup


def lookup_grid(
    lookup: str | None, lookup_length: str | None, no_lookup: bool, has_drafter: bool
) -> tuple[list[int], list[int]]:
    """(chain counts, chain lengths) to try; ``([], [])`` with --no-lookup or --lookup 0."""
    if not lookup_on(lookup, no_lookup):
        return [], []
    chains_default, lengths_default = LOOKUP_DEFAULTS[has_drafter]
    return (
        parse_lookup(lookup, chains_default),
        parse_lookup_lengths(lookup_length, lengths_default),
    )


def grid_for(
    widths: str,
    lengths: str,
    capacities: str | None,
    drafter: str | None,
    force_lengths: bool,
    first: BeamShape | None,
    chains: list[int] = (),
    chain_lengths: list[int] = (),
    draft_lengths: list[int] = (),
    early_exit: bool = False,
) -> tuple[list[BeamShape], str]:
    """The shapes to search and a note about dropped lengths: the W×L[ C] grid, each with
    its lookup variants (``chains`` × ``chain_lengths``) and the lookup-only shapes first;
    ``first`` (the chip's preset) and its lookup variants moved to the very front. Without
    a drafter: the lookup-only shapes alone. ``draft_lengths``: a draft model's chains
    alone first, then beside every shape (``with_draft_model``). ``early_exit``: the
    drafter is an early-exit adapter (one chain: W = 1 only)."""
    chains, chain_lengths = list(chains), list(chain_lengths)
    if drafter is None:
        return with_draft_model(with_lookup([], chains, chain_lengths), list(draft_lengths)), ""
    width_list = parse_int_set(widths, "--widths")
    length_list = parse_int_set(lengths, "--lengths")
    predict = read_predict_tokens(drafter)
    kept, dropped = limit_lengths(length_list, predict, force_lengths)
    note = ""
    if early_exit and width_list != [1]:
        width_list = [1]
        note = "the early-exit drafter drafts one chain: widths 1 only; "
    if dropped:
        note += (
            f"lengths {dropped} skipped: the drafter predicts {predict} tokens "
            f"(max length {predict + 1}); pass --force-lengths to try them anyway"
        )
    if not kept:
        raise ValueError(f"--lengths {lengths}: nothing left to try; {note}")
    shapes = with_lookup(
        build_grid(width_list, kept, parse_capacities(capacities)), chains, chain_lengths
    )
    if first in shapes:
        front = with_lookup([first], chains, chain_lengths)[len(chains) * len(chain_lengths) :]
        shapes = front + [s for s in shapes if s not in front]
    return with_draft_model(shapes, list(draft_lengths)), note.rstrip("; ")


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


def print_tuning(
    result,
    chip,
    note: str,
    profile_path: str | None,
    plot: str | None,
    save_error: str | None = None,
) -> None:
    """Results table, heatmap and the recommendation, for humans (``profile_path`` None: the
    search measured too little and nothing was saved, or saving failed: ``save_error``)."""
    from tuning.render import has_heatmap, heatmap_table, results_table

    console = _console()
    console.print(f"chip: [bold]{chip.chip_id}[/bold] ({chip.name}, {chip.backend})")
    if note:
        console.print(f"note: {note}")
    console.print(results_table(result))
    if has_heatmap(result):
        console.print(heatmap_table(result))
    if profile_path is None and save_error is None:
        console.print("no recommendation: too little was measured (see below)")
    else:
        console.print(f"[bold]recommended: {result.recommended.label}[/bold] — {result.reason}")
    if profile_path is not None:
        console.print(f"saved to {profile_path}; chat/generate/bench now use it by default.")
    elif save_error is not None:
        label = result.recommended.label if result.speculation_wins else "--no-draft"
        console.print(f"not saved ({save_error}); pass the shape as flags meanwhile: {label}")
    skipped = result.skipped
    if skipped:
        console.print(
            f"{len(skipped)} shape(s) not measured within the budget or failed; "
            f"raise --budget-seconds to cover them."
        )


def run_tuning(
    chip, model: str, drafter: str | None, shapes: list[BeamShape], note: str, options: dict
) -> None:
    """Measure, decide, save and report."""
    from tuning.search import SearchPlan, successive_halving

    draft_model = options.get("draft_model")
    measure, clock = build_measure(
        model,
        drafter,
        options["dtype"],
        options["prompts"],
        options["num_prompts"],
        shapes,
        draft_model=draft_model,
    )
    max_tokens = options["max_tokens"]
    plan = SearchPlan(
        min_tokens=min(16, max_tokens), short_tokens=min(64, max_tokens), long_tokens=max_tokens
    )
    progress = _console(stderr=True)
    result = successive_halving(
        measure,
        shapes,
        options["budget_seconds"],
        clock=clock,
        plan=plan,
        log=lambda m: progress.print(f"[dim]{m}[/dim]"),
    )
    gap = result.evidence_gap()
    lookup = options.get("lookup") or {}
    path = failure = None
    group = world()
    leader = group is None or group.rank() == 0  # under mlx.launch rank 0 saves
    if gap is None and leader:
        try:
            path = save_profile(
                chip.chip_id,
                model,
                drafter,
                options["dtype"],
                result,
                bool(lookup.get("chains")),
                draft_model,
                options.get("early_exit", False),
            )
        except OSError as e:  # the measurement is still shown below, then the error
            failure = e
    save_error = None if failure is None else str(failure)
    if options["plot"] and leader:
        from tuning.render import save_heatmap_png

        save_heatmap_png(result, options["plot"])
    if options["json"]:
        print(
            json.dumps(
                {
                    "mode": "tuned",
                    "chip": chip.to_dict(),
                    "model": model,
                    "drafter": drafter,
                    "draft_model": draft_model,
                    "sources": shape_sources(
                        result.recommended,
                        options.get("early_exit", False),
                        slot_sources(draft_model),
                    ),
                    "lookup": lookup or None,
                    "note": note,
                    "profile_path": path,
                    "saved": path is not None,
                    "save_error": save_error,
                    "plot": options["plot"],
                    **result.to_dict(),
                },
                indent=2,
            )
        )
    else:
        print_tuning(result, chip, note, path, options["plot"], save_error)
    if failure is not None:
        raise failure
    if gap is not None:
        raise TuneError(
            f"no profile was saved: {gap}; any earlier profile is unchanged. Raise "
            f"--budget-seconds, or leave it out to size the budget from plain decoding's speed"
        )


# --------------------------------------------------------------------------- the command


def tune(
    chip: Annotated[str, typer.Option(help=PRESET_HELP)] = "auto",
    model: Annotated[
        str | None,
        typer.Option(
            help="Model directory, hub id, smollm2 or demo (default: as for chat).",
        ),
    ] = None,
    drafter: Annotated[
        str | None, typer.Option("--drafter", "-d", help="Drafter directory.")
    ] = None,
    widths: Annotated[str, typer.Option(help="Beam widths: a range 1-4 or a list 1,2,4.")] = "1-4",
    lengths: Annotated[
        str, typer.Option(help="Beam lengths, counting the init token: 2-6 or 2,4,5.")
    ] = "2-6",
    capacities: Annotated[
        str | None,
        typer.Option(help="Packing capacities to try besides no cap, e.g. 8,12 (default: none)."),
    ] = None,
    lookup: Annotated[
        str | None,
        typer.Option(
            "--lookup",
            help="Context-lookup chains to try beside every drafter shape and alone: K, or a "
            "set like 1-2 (0 = off; default 1, without a drafter 1-2).",
            show_default=False,
        ),
    ] = None,
    lookup_length: Annotated[
        str | None,
        typer.Option(
            "--lookup-length",
            help="Tokens per lookup chain, counting the init token: 8 or a set like 4,8 "
            "(default 8, without a drafter 4,8).",
            show_default=False,
        ),
    ] = None,
    no_lookup: Annotated[
        bool,
        typer.Option("--no-lookup", help="Search drafter shapes only, no context lookup."),
    ] = False,
    draft_model: DraftModelOpt = None,
    draft_length: Annotated[
        str | None,
        typer.Option(
            "--draft-length",
            help="With --draft-model: its chain's tokens, counting the init token, to try "
            "alone and beside every shape: 4 or a set like 3-5 (default: 4).",
            show_default=False,
        ),
    ] = None,
    budget_seconds: Annotated[
        float | None,
        typer.Option(
            help="Time to spend measuring, in seconds (default: what the search needs on this "
            "model and machine, judged from plain decoding's speed, 120-600 s).",
            show_default=False,
        ),
    ] = None,
    prompts: Annotated[
        str | None,
        typer.Option(
            help="mt-bench, vicuna-bench, demo or a .jsonl/.txt FILE (default: demo for the demo "
            "model, else mt-bench).",
            show_default=False,
        ),
    ] = None,
    num_prompts: Annotated[int, typer.Option(help="Prompts per measurement.")] = 4,
    max_tokens: Annotated[int, typer.Option(help="Tokens per run in the longest runs.")] = 128,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="float16, bfloat16 or float32 (default: float16 on a GPU, Metal or CUDA; "
            "float32 on CPU)."
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON only.")] = False,
    plot: Annotated[
        str | None,
        typer.Option(help="Also save the heatmap as a PNG (needs matplotlib).", metavar="FILE.png"),
    ] = None,
    show: Annotated[bool, typer.Option("--show", help="List saved profiles.")] = False,
    clear: Annotated[bool, typer.Option("--clear", help="Delete saved profiles.")] = False,
    force_lengths: Annotated[
        bool,
        typer.Option(
            "--force-lengths", help="Allow lengths beyond what the drafter was trained for."
        ),
    ] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Find the fastest beam shape (width W, length L, capacity C, lookup chains K×Lk) for
    this machine.

    With --chip NAME, print that chip's built-in preset instead of measuring.
    """
    with cli_errors(verbose):
        if clear:
            clear_profiles(json_output)
            return
        if show:
            show_profiles(json_output)
            return
        if chip.lower() != "auto":
            preset = get_preset(chip)
            if preset is None:
                raise FlagError(f"--chip: unknown chip {chip!r}; use {PRESET_HELP}")
            print_preset(preset_report(preset, drafter, force_lengths), json_output)
            return
        finite = budget_seconds is None or math.isfinite(budget_seconds)
        if not finite or (budget_seconds is not None and budget_seconds <= 0):
            raise FlagError(
                f"--budget-seconds must be a finite number of seconds > 0, got {budget_seconds:g}"
            )
        if plot:
            _check_plot_available()
        from redrafter_mlx.cli.common import follow_rank0
        from redrafter_mlx.engine.loop.loading import LoadError
        from tuning.chip import detect_chip

        group = world()
        follow_rank0(group)  # under mlx.launch: rank 0 prints, the others only their errors
        info = detect_chip()
        paths = resolve_models(model, drafter, lookup_on(lookup, no_lookup))
        model, drafter = paths.model, paths.drafter
        if plot and drafter is None:
            raise FlagError("--plot draws the W x L heatmap of drafter shapes; this has no drafter")
        chains, chain_lengths = lookup_grid(lookup, lookup_length, no_lookup, drafter is not None)
        if draft_length is not None and not draft_model:
            raise FlagError(
                f"--draft-length {draft_length} sizes the draft model's chain; add --draft-model "
                "(a draft model or an early-exit adapter's folder) or drop --draft-length"
            )
        draft_model = resolve_draft_model(draft_model)
        draft_lengths = parse_draft_lengths(draft_length or "4") if draft_model is not None else []
        early = drafter is not None and drafter_is_early_exit(drafter)
        shapes, note = grid_for(
            widths,
            lengths,
            capacities,
            drafter,
            force_lengths,
            preset_for(info.preset)[0].shape,
            chains,
            chain_lengths,
            draft_lengths,
            early,
        )
        shapes = same_shapes_everywhere(shapes, group)
        if group is None or group.rank() == 0:  # rank 0 saves: refuse before measuring
            from tuning.profiles import ProfileStore

            ProfileStore().check_writable()
        options = {
            "dtype": dtype,
            "prompts": prompts or ("demo" if paths.demo else "mt-bench"),
            "num_prompts": num_prompts,
            "max_tokens": max_tokens,
            "budget_seconds": budget_seconds,
            "json": json_output,
            "plot": plot,
            "lookup": {"chains": chains, "lengths": chain_lengths} if chains else None,
            "draft_model": draft_model,
            "early_exit": early,
        }
        try:
            run_tuning(info, model, drafter, shapes, note, options)
        except (TuneError, SearchError, LoadError) as e:
            preset = preset_for(info.preset)[0]
            raise TuneError(
                f"{e} (detected {info.chip_id}; its preset is {preset.shape.label}: "
                f"redrafter-mlx tune --chip {preset.name})"
            ) from None


def parse_draft_lengths(text: str) -> list[int]:
    """``--draft-length``: chain lengths >= 2 (they count the init token)."""
    try:
        lengths = parse_int_set(text, "--draft-length")
    except ValueError as e:
        raise FlagError(str(e)) from None
    if min(lengths) < 2:
        raise FlagError(f"--draft-length {text}: a chain counts the init token, use >= 2")
    return lengths


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
