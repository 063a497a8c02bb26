"""``redrafter-mlx convert``: the typer command (registered by ``redrafter_mlx.cli``).

Kept light to import: the conversion code (and MLX) loads only when the command runs.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Optional

import typer


def _sigterm_as_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def convert(
    model: str = typer.Option(..., "--model", "-m", help="Hugging Face repo id, local folder or .gguf file of a Llama-family model."),
    out: Path = typer.Option(..., "--out", "-o", help="Output folder (mlx-lm layout)."),
    drafter: Optional[str] = typer.Option(None, "--drafter", help="Hugging Face repo id or local folder of a ReDrafter drafter."),
    quantize: bool = typer.Option(False, "-q", "--quantize", help="Quantize the base model (affine, mlx-lm convention)."),
    q_bits: int = typer.Option(4, "--q-bits", help="Bits per quantized weight (4 or 8; 2, 3, 5, 6 also work)."),
    q_group_size: int = typer.Option(64, "--q-group-size", help="Quantization group size (32, 64 or 128)."),
    dtype: Optional[str] = typer.Option(
        None,
        "--dtype",
        help="Storage dtype: float16, bfloat16 or float32. Default: float16; for GGUF input, keep its "
        "quantization on Metal and float32 on the CPU backend.",
    ),
    quantize_drafter: bool = typer.Option(False, "--quantize-drafter", help="Quantize the drafter too."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty --out (after the new one is complete)."),
    no_progress: bool = typer.Option(False, "--no-progress", help="Hide the progress bar."),
    verbose: bool = typer.Option(False, "--verbose", help="Show a traceback on errors."),
) -> None:
    """Convert Hugging Face / PyTorch / GGUF checkpoints (base model and drafter) to MLX, without torch."""
    from rich.console import Console
    from rich.text import Text

    from weights_convert.conversion import convert as run_conversion
    from weights_convert.errors import ConversionError

    console, errors = Console(), Console(stderr=True)
    previous = signal.getsignal(signal.SIGTERM)
    with_handler = True
    try:
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    except ValueError:  # not in the main thread
        with_handler = False
    try:
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
        )
    except ConversionError as e:
        if verbose:
            errors.print_exception()
        errors.print(Text.assemble(("error: ", "bold red"), (str(e), "red")), soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        errors.print("[red]interrupted:[/red] nothing was written", soft_wrap=True)
        raise typer.Exit(130) from None
    finally:
        if with_handler:
            signal.signal(signal.SIGTERM, previous)
    console.print("[green]converted[/green]", highlight=False)
    for line in summary.lines():
        console.print(line, highlight=False, markup=False, soft_wrap=True)
