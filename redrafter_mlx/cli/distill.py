"""`redrafter-mlx distill`: train a ReDrafter drafter for a model by distillation.

The work happens in ``redrafter_mlx.train.distill`` (imported when the command runs, so the CLI
starts fast); this module draws its progress (rich bars with ETA) and the evaluation table.
"""

from __future__ import annotations

from pathlib import Path

import typer

from redrafter_mlx.cli.consoles import err_console
from redrafter_mlx.cli.errors import FlagError, cli_errors
from redrafter_mlx.cli.paths import installed_bundled


def distill(
    model: str = typer.Option(
        ...,
        "--model",
        help="MLX model directory (as it will serve: same dtype/quantization), or a bundled "
        "model's name (smollm2, demo).",
    ),
    data: list[Path] | None = typer.Option(
        None,
        "--data",
        help="Training data: ShareGPT .json, .jsonl (conversations | prompt+response | text) "
        "or .txt. Repeat for several files. Without it the model makes its own: built-in and "
        "self-written prompts, its own answers (see --budget).",
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
    weight_decay: float = typer.Option(0.01, help="AdamW weight decay."),
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
    targets: str | None = typer.Option(
        None,
        help="With --data: 'distill' (default; the LLM's own greedy continuations, rolled out), "
        "'self' (the data "
        "is the model's own greedy output with exact prompt_ids/response_ids: its next tokens "
        "are the continuations, one forward per sequence) or 'ground-truth' (data labels).",
    ),
    draft_vocab: int | None = typer.Option(
        None,
        help="Shortlist vocabulary: the drafter's head (an early-exit adapter: the rows of "
        "the model's head it drafts from) covers only the N most frequent training tokens "
        "(e.g. 8192); drafting is cheaper, output is unchanged. Built-in data: 8192 when the "
        "vocabulary is over 32768.",
    ),
    soft_targets: bool | None = typer.Option(
        None,
        "--soft-targets/--hard-targets",
        help="With --targets self: train on the model's whole distribution at each target "
        "(read from the cached hidden states), not only its greedy token. Default: on "
        "without --data, off with it.",
    ),
    budget: str | None = typer.Option(
        None,
        help="Without --data: how long the whole run may take (30m, 2h, 1h30m; default 45m: "
        "half answering prompts, then training, then the evaluation) or how many answer "
        "positions to train on (200k, then one epoch; at least one batch of answers, "
        "--gen-batch x --answer-tokens). Resumable: rerun with --resume.",
    ),
    gen_temp: float = typer.Option(
        0.0, help="Without --data: the model's answers, greedy (0) or sampled at this temperature."
    ),
    answer_tokens: int = typer.Option(160, help="Without --data: most tokens per answer."),
    gen_batch: int = typer.Option(32, help="Without --data: prompts answered per batch."),
    own_prompts: int = typer.Option(
        128,
        help="Without --data: user turns the model writes itself (sampled), besides the "
        "built-in prompts.",
    ),
    val_prompts: int = typer.Option(
        16,
        help="Without --data: built-in prompts held out (never trained on) to pick the best "
        "checkpoint and for the final evaluation.",
    ),
    select_every: int | None = typer.Option(
        None, help="Without --data: steps between held-out scores (default: 6 in a run)."
    ),
    feature_layers: str = typer.Option(
        "auto",
        help="What the drafter reads from the LLM: 'auto' (EAGLE-3's low, middle and high "
        "layers: the residual streams entering layers 2, n/2 and n-3, each normalised, "
        "concatenated and projected to H), layer indices 'i,j,k', or 'last' (the final "
        "normed hidden state, as drafters before). The model captures them in its own "
        "forward (no extra pass); the layers go into the drafter's config.json.",
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
    kind: str = typer.Option(
        "recurrent",
        "--kind",
        help="What to train: 'recurrent' (the ReDrafter RNN drafter) or 'early-exit' (a "
        "Kangaroo adapter over the model's first --exit-layer layers; it uses --data or the "
        "built-in data, --steps/--epochs, --batch-size (positions: whole sequences of about "
        "that many), --seq-len, --lr, --warmup, --weight-decay, --resume, --save-every, "
        "--seed, --draft-vocab (the head rows it drafts from) and the built-in data's "
        "options).",
    ),
    exit_layer: int | None = typer.Option(
        None,
        "--exit-layer",
        help="With --kind early-exit: the adapter reads the residual after this many layers "
        "(default about layers / 15, the paper's 2 of 32).",
    ),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar or table."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show tracebacks on errors."),
) -> None:
    """Train a ReDrafter drafter for MODEL by distillation (the LLM stays frozen)."""
    with cli_errors(verbose):
        if targets is not None and targets not in ("distill", "self", "ground-truth"):
            raise FlagError(
                f"--targets must be 'distill', 'self' or 'ground-truth', got {targets!r}"
            )
        from redrafter_mlx.engine.core.sampling import check_seed
        from redrafter_mlx.train.distill import distill as run_distill

        check_seed(seed)  # 0 ... 2**64 - 1, as every command
        named = installed_bundled(model)
        model_dir = named.base if named is not None else Path(model)
        if kind not in ("recurrent", "early-exit"):
            raise FlagError(f"--kind must be 'recurrent' or 'early-exit', got {kind!r}")
        if exit_layer is not None and kind != "early-exit":
            raise FlagError("--exit-layer needs --kind early-exit")
        shared = dict(  # the settings both kinds of drafter train with
            steps=steps,
            epochs=epochs,
            batch_size=batch_size,
            seq_len=seq_len,
            lr=lr,
            weight_decay=weight_decay,
            warmup=warmup,
            resume=resume,
            overwrite=overwrite,
            save_every=save_every,
            seed=seed,
            cache_dir=cache_dir,
            quiet=quiet,
            budget=budget,
            gen_temp=gen_temp,
            answer_tokens=answer_tokens,
            gen_batch=gen_batch,
            own_prompts=own_prompts,
            val_prompts=val_prompts,
        )
        if kind == "early-exit":
            return early_exit(
                model_dir, data, out, exit_layer=exit_layer, draft_vocab=draft_vocab, **shared
            )

        summary = run_distill(
            model_dir,
            data,
            out,
            progress=Bars(),
            predict_tokens=predict_tokens,
            layers=layers,
            exit_dim=exit_dim,
            rnn=rnn,
            eval_data=eval_data,
            targets=targets,
            draft_vocab=draft_vocab,
            soft_targets=soft_targets,
            grad_accum=grad_accum,
            eval_prompts=eval_prompts,
            eval_max_tokens=eval_max_tokens,
            select_every=select_every,
            feature_layers=feature_layers,
            **shared,
        )
    if summary["rank"] != 0:
        return  # data-parallel replicas: rank 0 reports
    loss = summary["final_loss"]
    chosen = summary.get("selection") or {}
    err_console().print(
        f"drafter saved to {summary['out_dir']} ({summary['steps']} steps"
        + (f", final loss {loss:.3f}" if loss is not None else "")
        + (
            f"; kept step {chosen['step']}, held-out score {chosen['best']:.3f}"
            if chosen.get("step")
            else ""
        )
        + ")",
        markup=False,
    )
    if Path(summary["out_dir"]).resolve() == (model_dir.expanduser() / "drafter").resolve():
        err_console().print(
            f"chat / generate --model {model_dir} use it without --drafter", markup=False
        )


def early_exit(model_dir: Path, data, out: Path, **options) -> None:
    """``distill --kind early-exit``: train a Kangaroo adapter (train/early_exit.py)."""
    from redrafter_mlx.train.early_exit import distill_early_exit

    summary = distill_early_exit(model_dir, data, out, progress=Bars(), **options)
    held = summary["eval"]["held_out"]
    chains = summary["eval"]["chains"]
    loss = summary["final_loss"]
    err_console().print(
        f"early-exit adapter (exit layer {summary['exit_layer']}) saved to "
        f"{summary['out_dir']} ({summary['steps']} steps"
        + (f", final loss {loss:.3f}" if loss is not None else "")
        + (f"; held-out top-1 agreement {held['top1_agreement']:.3f}" if held else "")
        + (f", mean accepted drafts {chains['mean_accepted']:.2f}" if chains else "")
        + ")",
        markup=False,
    )


class Bars:
    """The run's progress as rich bars with ETA (one per stage) and notes on stderr."""

    def __init__(self):
        self.console = err_console()
        self._bar = None
        self._unit = ""

    def note(self, text: str) -> None:
        self.console.print(text, markup=False)

    def start(self, name: str, total: float, unit: str = "") -> None:
        from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        self._unit = unit
        self._bar = Bar(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[done]}"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
            transient=False,
        )
        self._bar.start()
        self._task = self._bar.add_task(name, total=total, info="", done="")

    def update(self, advance: float = 1, **metrics) -> None:
        if self._bar is None:
            return
        self._bar.update(self._task, advance=advance, info=format_metrics(metrics))
        task = self._bar.tasks[0]
        done = f"{task.completed:,.0f}/{task.total:,.0f} {self._unit}".strip()
        self._bar.update(self._task, done=done)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def table(self, results: list[dict], title: str) -> None:
        self.console.print(eval_table(results, title))


def format_metrics(m: dict) -> str:
    """Progress text: loss, top-1 accuracy per draft step, positions/s, lr, held-out best."""
    parts = []
    if m.get("loss") is not None:
        parts.append(f"loss {m['loss']:.3f}")
    if m.get("acc"):
        parts.append("acc[" + " ".join(f"{a:.2f}" for a in m["acc"]) + "]")
    if m.get("positions") is not None:
        parts.append(f"{m['positions']:,} positions")
    for key, unit in (("tok_s", "tok/s"), ("pos_s", "pos/s")):
        if m.get(key) is not None:
            parts.append(f"{m[key]:,.0f} {unit}")
    if m.get("lr") is not None:
        parts.append(f"lr {m['lr']:.2e}")
    if m.get("best") is not None:
        parts.append(f"held-out {m['best']:.3f}")
    return "  ".join(parts)


def eval_table(results: list[dict], title: str):
    from rich.table import Table

    table = Table(title=title)
    for col in ("W", "L", "tokens/step"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r["beam_width"]), str(r["beam_length"]), f"{r['tokens_per_step']:.3f}")
    return table
