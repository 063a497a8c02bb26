"""``redrafter-mlx convert``: Hugging Face / PyTorch checkpoints (and drafters) to MLX.

Kept light to import: the conversion code (and MLX) loads only when the command runs.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from redrafter_mlx.cli.consoles import out_console
from redrafter_mlx.cli.errors import cli_errors
from redrafter_mlx.cli.options import VerboseOpt


def _sigterm_as_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def convert(
    model: Annotated[
        str,
        typer.Option(
            "--model",
            help="Hugging Face repo id, local folder or .gguf file of a Llama-family model.",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder (mlx-lm layout).")],
    drafter: Annotated[
        str | None,
        typer.Option(
            "--drafter",
            "-d",
            help="Hugging Face repo id or local folder of a ReDrafter drafter "
            "(written to OUT/drafter).",
        ),
    ] = None,
    quantize: Annotated[
        bool,
        typer.Option(
            "--quantize", "-q", help="Quantize the base model (affine, mlx-lm convention)."
        ),
    ] = False,
    q_bits: Annotated[
        int, typer.Option("--q-bits", help="Bits per quantized weight (4 or 8; 2, 3, 5, 6 too).")
    ] = 4,
    q_group_size: Annotated[
        int, typer.Option("--q-group-size", help="Quantization group size (32, 64 or 128).")
    ] = 64,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            help="Storage dtype: float16, bfloat16 or float32 (default: float16; for GGUF "
            "input, its own quantization on Metal and float32 on the CPU backend).",
            show_default=False,
        ),
    ] = None,
    quantize_drafter: Annotated[
        bool, typer.Option("--quantize-drafter", help="Quantize the drafter too.")
    ] = False,
    force: Annotated[
        bool,
        typer.Option("--force", help="Replace a non-empty --out (after the new one is complete)."),
    ] = False,
    exit_layer: Annotated[
        int | None,
        typer.Option(
            "--exit-layer",
            help="With a Kangaroo early-exit adapter as --drafter: the base layers it reads "
            "after (the public Vicuna-7B adapter: 2); its checkpoint does not record it.",
        ),
    ] = None,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="Hide the progress bar.")] = (
        False
    ),
    verbose: VerboseOpt = False,
) -> None:
    """Convert Hugging Face / PyTorch / GGUF checkpoints (and a drafter) to MLX, without torch."""
    previous = signal.getsignal(signal.SIGTERM)
    with_handler = True
    try:
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    except ValueError:  # not in the main thread
        with_handler = False
    try:
        with cli_errors(verbose, interrupted="interrupted: nothing was written"):
            from weights_convert.conversion import convert as run_conversion

            summary = run_conversion(
                model,
                out,
                drafter=drafter,
                quantize=quantize,
                q_bits=q_bits,
                q_group_size=q_group_size,
                dtype=dtype,
                quantize_drafter=quantize_drafter,
                force=force,
                progress=not no_progress,
                exit_layer=exit_layer,
            )
    finally:
        if with_handler:
            signal.signal(signal.SIGTERM, previous)
    console = out_console()
    console.print("[green]converted[/green]")
    for line in summary.lines():
        console.print(line, markup=False)
