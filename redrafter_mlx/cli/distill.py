"""`redrafter-mlx distill`: train a ReDrafter drafter for a model by distillation.

The work happens in ``redrafter_mlx.train.distill`` (imported when the command runs, so the CLI
starts fast).
"""

from __future__ import annotations

from pathlib import Path

import typer

from redrafter_mlx.cli.common import FlagError, cli_errors, err_console


def distill(
    model: Path = typer.Option(
        ...,
        "--model",
        help="MLX model directory (as it will serve: same dtype/quantization).",
    ),
    data: list[Path] = typer.Option(
        ...,
        "--data",
        help="Training data: ShareGPT .json, .jsonl (conversations | prompt+response | text) "
        "or .txt. Repeat for several files.",
    ),
    out: Path = typer.Option(
        ...,
        "--out",
        "-o",
        help="Output drafter directory (checkpoints, eval.json and the target cache go inside).",
    ),
    predict_tokens: int = typer.Option(
        5,
        "--predict-tokens",
        "-T",
        help="Draft steps T the drafter learns; serves beam length L <= T+1.",
    ),
    layers: int = typer.Option(2, help="Residual blocks in the drafter head."),
    exit_dim: str = typer.Option("auto", help="Drafter width; 'auto' = 2H (no input projection)."),
    rnn: bool = typer.Option(
        True, "--rnn/--no-rnn", help="Recurrent state update (else a running sum of embeddings)."
    ),
    steps: int | None = typer.Option(None, help="Optimizer steps (default: one epoch)."),
    epochs: float | None = typer.Option(
        None, help="Epochs over the training positions (instead of --steps)."
    ),
    batch_size: int = typer.Option(128, help="Training positions per micro-batch (per process)."),
    seq_len: int = typer.Option(512, help="Tokens per training window."),
    lr: float = typer.Option(1e-3, help="Peak learning rate (AdamW)."),
    warmup: float = typer.Option(
        0.1, help="Warm-up: a fraction of the steps (< 1) or a step count."
    ),
    eval_data: list[Path] | None = typer.Option(
        None,
        help="Held-out prompts for the tokens/step evaluation (any data format, or "
        '{"turns": [...]} JSONL).',
    ),
    resume: bool = typer.Option(False, help="Continue from the newest checkpoint in --out."),
    overwrite: bool = typer.Option(
        False,
        help="Replace what --out holds (a model, a drafter, other files or an earlier run); "
        "the new drafter is built beside it and renamed into place only when complete.",
    ),
    targets: str = typer.Option(
        "distill",
        help="'distill' (the LLM's own greedy continuations, rolled out), 'self' (the data "
        "is the model's own greedy output with exact prompt_ids/response_ids: its next tokens "
        "are the continuations, one forward per sequence) or 'ground-truth' (data labels).",
    ),
    draft_vocab: int | None = typer.Option(
        None,
        help="Shortlist vocabulary: the drafter's head covers only the N most frequent "
        "training tokens (e.g. 8192); drafting is cheaper, output is unchanged.",
    ),
    soft_targets: bool = typer.Option(
        False,
        help="With --targets self: train on the model's whole distribution at each target "
        "(read from the cached hidden states), not only its greedy token.",
    ),
    save_every: int = typer.Option(
        500, help="Checkpoint every N steps (and at the end); 0: only at the end."
    ),
    seed: int = typer.Option(0, help="Seed for the drafter init and the data order."),
    grad_accum: int = typer.Option(1, help="Micro-batches per optimizer step."),
    cache_dir: Path | None = typer.Option(
        None, help="Where the hidden states + targets are cached (default: OUT/cache)."
    ),
    eval_prompts: int = typer.Option(8, help="Prompts in the final evaluation."),
    eval_max_tokens: int = typer.Option(64, help="Tokens generated per evaluation prompt."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar or table."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show tracebacks on errors."),
) -> None:
    """Train a ReDrafter drafter for MODEL by distillation (the LLM stays frozen)."""
    with cli_errors(verbose):
        if targets not in ("distill", "self", "ground-truth"):
            raise FlagError(
                f"--targets must be 'distill', 'self' or 'ground-truth', got {targets!r}"
            )
        from redrafter_mlx.train.distill import distill as run_distill

        summary = run_distill(
            model,
            data,
            out,
            predict_tokens=predict_tokens,
            layers=layers,
            exit_dim=exit_dim,
            rnn=rnn,
            steps=steps,
            epochs=epochs,
            batch_size=batch_size,
            seq_len=seq_len,
            lr=lr,
            warmup=warmup,
            eval_data=eval_data,
            resume=resume,
            overwrite=overwrite,
            targets=targets,
            draft_vocab=draft_vocab,
            soft_targets=soft_targets,
            save_every=save_every,
            seed=seed,
            grad_accum=grad_accum,
            cache_dir=cache_dir,
            eval_prompts=eval_prompts,
            eval_max_tokens=eval_max_tokens,
            quiet=quiet,
        )
    if summary["rank"] != 0:
        return  # data-parallel replicas: rank 0 reports
    loss = summary["final_loss"]
    err_console().print(
        f"drafter saved to {summary['out_dir']} ({summary['steps']} steps"
        + (f", final loss {loss:.3f}" if loss is not None else "")
        + ")",
        markup=False,
    )
