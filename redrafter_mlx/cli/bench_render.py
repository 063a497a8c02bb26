"""What ``redrafter-mlx bench`` prints: the summary table per turn (``--json``: one object;
``--csv``: the rows in a file too), the note on the shapes' source and mlx-lm's agreement,
the split model's message cost, one line per greedy mismatch (a near-tie or a bug), and the
``--profile`` and ``--verify-cost`` tables. Rendering only: ``bench.py`` and
``bench_profile.py`` run what it shows."""

from __future__ import annotations

import json
from pathlib import Path

from redrafter_mlx.cli.consoles import err_console, out_console


def show(data: dict, csv_path: Path | None, as_json: bool) -> None:
    """The benchmark's report: the CSV file (``--csv``), then the JSON object (``--json``) or
    the tables and notes, then a line per greedy mismatch."""
    from redrafter_mlx.cli.bench_report import write_csv

    if csv_path is not None:
        write_csv(data["configs"], str(csv_path))
    if as_json:
        print(json.dumps(data))
    else:
        print_report(data)
    if data["mismatches"]:
        print_mismatches(data["mismatches"], data["dtype"])


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


def show_profile(data: dict, model: str, as_json: bool) -> None:
    """``--profile``'s step profile (``bench_profile.profile_rows`` of ``model``): the JSON
    object, or its tables (ms and graph ops per phase, the launch-bound estimate)."""
    if as_json:
        print(json.dumps(data))
        return
    from rich.console import Console

    title = f"{Path(model).name} · {data['device']} · window {data['window']}"
    console = out_console()
    wide = Console(width=max(console.width, 112), highlight=False)  # 11 columns of numbers
    for table in render_profile(data, title):
        wide.print(table)


def show_verify_cost(rows: list[dict], hidden: int, layers: int, as_json: bool) -> None:
    """``--verify-cost``'s rows: the JSON object, or the table."""
    if as_json:
        print(json.dumps({"hidden": hidden, "layers": layers, "rows": rows}))
    else:
        out_console().print(render_verify_cost(rows, hidden, layers))


def render_verify_cost(rows: list[dict], hidden: int, layers: int):
    """A rich table: verify time per capacity vs one autoregressive step."""
    from rich.table import Table

    table = Table(
        title=f"verify cost vs one AR step (hidden {hidden}, {layers} layers)",
        caption="timed in interleaved rounds; paired: median of per-round verify/AR ratios",
    )
    for column in ("capacity", "AR step ms", "verify ms", "verify / AR", "paired"):
        table.add_column(column, justify="right")
    for row in rows:
        paired = row.get("paired_ratio")
        table.add_row(
            str(row["capacity"]),
            f"{row['ar_ms']:.2f}",
            f"{row['verify_ms']:.2f}",
            f"{row['ratio']:.2f}×",
            "–" if paired is None else f"{paired:.2f}×",
        )
    return table


def render_profile(data: dict, title: str):
    """Rich tables: ms per phase, graph ops (kernels = ops that compute) per phase, and (when
    ``data`` has it) the launch-bound estimate per shape."""
    from rich import box
    from rich.table import Table

    phases = ("draft", "pack", "verify", "accept", "commit")
    ms = Table(
        title=f"{title} · ms per step (medians, interleaved)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        caption="step: one compiled step · Σ: phases compiled apart · over: step - verify · "
        "loop: generation loop wall ms/step · host: loop - step · lookup shapes: "
        "whole step only",
    )
    ops = Table(
        title=f"{title} · graph ops per step (kernels/all)", box=box.SIMPLE_HEAD, pad_edge=False
    )
    for col in ("config", *phases, "Σ", "step", "over", "loop", "host"):
        ms.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)
    for col in ("config", *phases, "step"):
        ops.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)
    for r in data["rows"]:

        def cell(key, r=r):
            return f"{r[key]:.2f}" if key in r else "–"

        def op_cell(phase, r=r):
            k = f"{phase}_kernels"
            return f"{r[k]}/{r[f'{phase}_ops']}" if k in r else "–"

        ms.add_row(
            r["config"],
            *[cell(f"{p}_ms") for p in phases],
            cell("phases_ms"),
            cell("step_ms"),
            cell("overhead_ms"),
            cell("loop_ms"),
            cell("host_ms"),
        )
        ops.add_row(r["config"], *[op_cell(p) for p in phases], op_cell("step"))
    if "mac" not in data:
        return ms, ops
    return ms, ops, render_mac_estimate(data, title)


def render_mac_estimate(data: dict, title: str):
    """A rich table: each step priced where launches dominate (``measure.profile.launch_bound``),
    beside the step measured here, both over AR's."""
    from rich import box
    from rich.table import Table

    mac = data["mac"]
    table = Table(
        title=f"{title} · launch-bound estimate (an Apple GPU): {mac['launch_us']:g} µs per "
        f"kernel, {mac['bandwidth_gbs']:g} GB/s, {mac['dtype']} weights",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        caption="est = kernels × --launch-us + weight MB read per step (the model once, the "
        "drafter once per draft step) ÷ --bandwidth-gbs; compute and cache reads left out · "
        "est × AR: the tokens/step a shape must average to beat plain decoding there · "
        "here × AR: the step measured on this machine",
    )
    for col in ("config", "kernels", "MB", "launch", "memory", "est ms", "est × AR", "here × AR"):
        table.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)

    def ratio(value):
        return "–" if value is None else f"{value:.2f}×"

    for r in data["rows"]:
        table.add_row(
            r["config"],
            str(r["step_kernels"]),
            f"{r['mac_bytes'] / 1e6:.1f}",
            f"{r['mac_launch_ms']:.2f}",
            f"{r['mac_memory_ms']:.2f}",
            f"{r['mac_ms']:.2f}",
            ratio(r["mac_x_ar"]),
            ratio(r["step_x_ar"]),
        )
    return table
