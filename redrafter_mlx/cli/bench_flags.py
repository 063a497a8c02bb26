"""``redrafter-mlx bench``'s options (``BenchFlags``), in the order ``--help`` lists them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from redrafter_mlx.cli.options import (
    MAX_TOKENS_BRANCHES,
    BranchFlags,
    DtypeOpt,
    ModelFlags,
    SamplingFlags,
    ShapeFlags,
    SystemPromptOpt,
    VerboseOpt,
)


@dataclass(frozen=True)
class BenchFlags:
    """What to benchmark (the prompts, the shapes, mlx-lm beside), how to report it (a table,
    ``--json``, ``--csv``), or instead one step's profile (``--profile``) or the verify cost
    (``--verify-cost``); then the flags bench shares with chat."""

    models: ModelFlags = field(default_factory=ModelFlags)
    prompts: Annotated[
        str | None,
        typer.Option(
            "--prompts",
            help='mt-bench, vicuna-bench, edit, demo, or a JSONL file of {"turns": [...], '
            '"category": ...} (default: demo with the demo model, else mt-bench).',
            show_default=False,
        ),
    ] = None
    num_prompts: Annotated[int, typer.Option("--num-prompts", help="How many prompts to run.")] = 8
    spread: Annotated[
        bool,
        typer.Option(
            "--spread",
            help="Pick the --num-prompts prompts across the set's categories (round-robin: "
            "the first of each category, then the second...) instead of the first N.",
        ),
    ] = False
    turns: Annotated[
        int,
        typer.Option(
            "--turns",
            help="1, or 2: also run each prompt's second turn, after the model's own greedy "
            "answer to the first (as in a chat); each turn is reported apart.",
        ),
    ] = 1
    max_tokens: Annotated[
        int,
        typer.Option(
            "--max-tokens", "-m", "-n", help=f"Most tokens per answer. {MAX_TOKENS_BRANCHES}"
        ),
    ] = 128
    grid: Annotated[
        str | None,
        typer.Option(
            "--grid",
            help="ReDrafter shapes to compare, widths x lengths: 1,2x4,5, each with the "
            "lookup chains (--lookup, --no-lookup) (default: the tuned profile or chip preset).",
            show_default=False,
        ),
    ] = None
    configs: Annotated[
        str | None,
        typer.Option(
            "--configs",
            help='Shapes to compare, comma-separated labels: "W1xL3,W1xL4+K1xL8 C12,K1xL8" '
            "(W beams of L tokens, + K lookup chains of L tokens, C packed slots; K alone: "
            "lookup without the drafter). AR always runs. Instead of --grid.",
            show_default=False,
        ),
    ] = None
    with_mlx_lm: Annotated[
        bool, typer.Option("--mlx-lm", help="Also run mlx-lm's generator on the same base model.")
    ] = False
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print one JSON object to stdout."),
    ] = False
    csv_path: Annotated[
        Path | None,
        typer.Option(
            "--csv", help="Also write the summary rows to this CSV file.", show_default=False
        ),
    ] = None
    verify_cost: Annotated[
        bool,
        typer.Option(
            "--verify-cost", help="Time one verify pass per capacity against one AR step instead."
        ),
    ] = False
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
    ] = False
    launch_us: Annotated[
        float | None,
        typer.Option(
            "--launch-us",
            help="--profile: the cost of one kernel launch on the machine the estimate prices "
            "(default 4 µs, an Apple GPU: ~2.8 µs measured per tiny dependent MLX kernel on an "
            "M3 Ultra, ~5 µs per small Metal dispatch in another engine).",
            show_default=False,
        ),
    ] = None
    bandwidth_gbs: Annotated[
        float | None,
        typer.Option(
            "--bandwidth-gbs",
            help="--profile: its memory bandwidth in GB/s, which the weights read per step "
            "cost (default 100: a base M2/M3; M1 68, M4 120, Pro 150-273, Max 300-546).",
            show_default=False,
        ),
    ] = None
    mac_dtype: Annotated[
        str | None,
        typer.Option(
            "--mac-dtype",
            help="--profile: float16, bfloat16 or float32, the dtype of its float weights "
            "(default float16, as chat loads them on Metal; quantized weights keep their size).",
            show_default=False,
        ),
    ] = None
    hidden: Annotated[int, typer.Option("--hidden", help="--verify-cost: hidden size.")] = 2048
    layers: Annotated[int, typer.Option("--layers", help="--verify-cost: layers.")] = 8
    sampling: SamplingFlags = field(default_factory=SamplingFlags)
    system_prompt: SystemPromptOpt = None
    shape: ShapeFlags = field(default_factory=ShapeFlags)
    branching: BranchFlags = field(default_factory=BranchFlags)
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
    ] = None
    dtype: DtypeOpt = None
    verbose: VerboseOpt = False
