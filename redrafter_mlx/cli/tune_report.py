"""What ``redrafter-mlx tune`` shows: the saved profiles (``--show``; ``--clear`` removes
them), a chip's preset (``--chip NAME``), and a search's results (a table, the W x L
heatmap and the recommendation, or one JSON object). Rendering only: the measuring, the
search and the saving are ``cli/tune.py``'s."""

from __future__ import annotations

import json
from pathlib import Path

from tuning.grid import read_predict_tokens
from tuning.presets import Preset


def console(stderr: bool = False):
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
    out = console()
    if not profiles:
        out.print(f"No tuned profiles in {store.path}. Run 'redrafter-mlx tune' to make one.")
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
    out.print(table)


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
        console().print(f"Removed the unreadable tuned-profile file {store.path}.")
    else:
        console().print(f"Removed {count} tuned profile(s) from {store.path}.")


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
    out = console()
    out.print(f"[bold]{report['label']}[/bold]  ({report['source']})")
    out.print(f"  {report['note']}")
    out.print(
        "  Presets are not measured; run 'redrafter-mlx tune' on the machine itself "
        "to find its best shape."
    )


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

    out = console()
    out.print(f"chip: [bold]{chip.chip_id}[/bold] ({chip.name}, {chip.backend})")
    if note:
        out.print(f"note: {note}")
    out.print(results_table(result))
    if has_heatmap(result):
        out.print(heatmap_table(result))
    if profile_path is None and save_error is None:
        out.print("no recommendation: too little was measured (see below)")
    else:
        out.print(f"[bold]recommended: {result.recommended.label}[/bold] — {result.reason}")
    if profile_path is not None:
        out.print(f"saved to {profile_path}; chat/generate/bench now use it by default.")
    elif save_error is not None:
        label = result.recommended.label if result.speculation_wins else "--no-draft"
        out.print(f"not saved ({save_error}); pass the shape as flags meanwhile: {label}")
    skipped = result.skipped
    if skipped:
        out.print(
            f"{len(skipped)} shape(s) not measured within the budget or failed; "
            f"raise --budget-seconds to cover them."
        )


def print_tuned_json(search, result, sources, profile_path: str | None, save_error) -> None:
    """A search's results as one JSON object: the chip, the model and draft sources, what
    the grid tried, where the profile went (or why not) and the search's own record."""
    print(
        json.dumps(
            {
                "mode": "tuned",
                "chip": search.chip.to_dict(),
                "model": search.model,
                "drafter": search.drafter,
                "draft_model": search.draft_model,
                "sources": sources,
                "lookup": search.lookup,
                "note": search.note,
                "profile_path": profile_path,
                "saved": profile_path is not None,
                "save_error": save_error,
                "plot": search.flags.plot,
                **result.to_dict(),
            },
            indent=2,
        )
    )
