"""``redrafter-mlx convert``: Hugging Face / PyTorch checkpoints (and drafters) to MLX.

Kept light to import: the conversion code (and MLX) loads only when the command runs.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from redrafter_mlx.cli.consoles import out_console
from redrafter_mlx.cli.errors import cli_errors
from redrafter_mlx.cli.options import VerboseOpt, flag_groups


def _sigterm_as_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@dataclass(frozen=True, kw_only=True)
class ConvertFlags:
    """``convert``'s options, in the order ``--help`` lists them (``--model`` and ``--out``
    are required)."""

    model: Annotated[
        str,
        typer.Option(
            "--model",
            help="Hugging Face repo id, local folder or .gguf file of a Llama-family model.",
        ),
    ]
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder (mlx-lm layout).")]
    drafter: Annotated[
        str | None,
        typer.Option(
            "--drafter",
            "-d",
            help="Hugging Face repo id or local folder of a ReDrafter drafter "
            "(written to OUT/drafter).",
        ),
    ] = None
    quantize: Annotated[
        bool,
        typer.Option(
            "--quantize", "-q", help="Quantize the base model (affine, mlx-lm convention)."
        ),
    ] = False
    q_bits: Annotated[
        int, typer.Option("--q-bits", help="Bits per quantized weight (4 or 8; 2, 3, 5, 6 too).")
    ] = 4
    q_group_size: Annotated[
        int, typer.Option("--q-group-size", help="Quantization group size (32, 64 or 128).")
    ] = 64
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            help="Storage dtype: float16, bfloat16 or float32 (default: float16; for GGUF "
            "input, its own quantization on Metal and float32 on the CPU backend).",
            show_default=False,
        ),
    ] = None
    quantize_drafter: Annotated[
        bool, typer.Option("--quantize-drafter", help="Quantize the drafter too.")
    ] = False
    force: Annotated[
        bool,
        typer.Option("--force", help="Replace a non-empty --out (after the new one is complete)."),
    ] = False
    exit_layer: Annotated[
        int | None,
        typer.Option(
            "--exit-layer",
            help="With a Kangaroo early-exit adapter as --drafter: the base layers it reads "
            "after (the public Vicuna-7B adapter: 2); its checkpoint does not record it.",
        ),
    ] = None
    no_progress: Annotated[
        bool,
        typer.Option("--no-progress", help="Hide the progress bar."),
    ] = False
    verbose: VerboseOpt = False


@flag_groups
def convert(flags: ConvertFlags) -> None:
    """Convert Hugging Face / PyTorch / GGUF checkpoints (and a drafter) to MLX, without torch."""
    interrupted = "interrupted: nothing was written"
    with sigterm_as_interrupt(), cli_errors(flags.verbose, interrupted=interrupted):
        summary = run_conversion(flags)
    console = out_console()
    console.print("[green]converted[/green]")
    for line in summary.lines():
        console.print(line, markup=False)


def run_conversion(flags: ConvertFlags):
    """The conversion the flags ask for (``weights_convert.conversion.convert``); its summary."""
    from weights_convert.conversion import convert as conversion

    return conversion(
        flags.model,
        flags.out,
        drafter=flags.drafter,
        quantize=flags.quantize,
        q_bits=flags.q_bits,
        q_group_size=flags.q_group_size,
        dtype=flags.dtype,
        quantize_drafter=flags.quantize_drafter,
        force=flags.force,
        progress=not flags.no_progress,
        exit_layer=flags.exit_layer,
    )


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while the block runs (so a conversion stopped by it
    cleans up as on Ctrl-C), the previous handler restored after; outside the main thread,
    where no handler can be set, nothing changes."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    except ValueError:  # not in the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
