"""`redrafter-mlx distill`: train a ReDrafter drafter for a model by distillation.

The work happens in ``redrafter_mlx.train.distill`` (imported when the command runs, so the CLI
starts fast); this module draws its progress (rich bars with ETA) and the evaluation table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from redrafter_mlx.cli.consoles import err_console
from redrafter_mlx.cli.errors import FlagError, cli_errors
from redrafter_mlx.cli.options import flag_groups
from redrafter_mlx.cli.paths import installed_bundled


@dataclass(frozen=True, kw_only=True)
class DistillFlags:
    """``distill``'s options, in the order ``--help`` lists them (``--model`` and ``--out``
    are required)."""

    model: Annotated[
        str,
        typer.Option(
            "--model",
            help="MLX model directory (as it will serve: same dtype/quantization), or a bundled "
            "model's name (smollm2, demo).",
        ),
    ]
    data: Annotated[
        list[Path] | None,
        typer.Option(
            "--data",
            help="Training data: ShareGPT .json, .jsonl (conversations | prompt+response | text) "
            "or .txt. Repeat for several files. Without it the model makes its own: built-in and "
            "self-written prompts, its own answers (see --budget).",
        ),
    ] = None
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="Output drafter directory (checkpoints, eval.json and the target cache go "
            "inside).",
        ),
    ]
    predict_tokens: Annotated[
        int,
        typer.Option(
            "--predict-tokens",
            "-T",
            help="Draft steps T the drafter learns; serves beam length L <= T+1.",
        ),
    ] = 5
    layers: Annotated[int, typer.Option(help="Residual blocks in the drafter head.")] = 2
    exit_dim: Annotated[
        str, typer.Option(help="Drafter width; 'auto' = 2H (no input projection).")
    ] = "auto"
    rnn: Annotated[
        bool,
        typer.Option(
            "--rnn/--no-rnn", help="Recurrent state update (else a running sum of embeddings)."
        ),
    ] = True
    steps: Annotated[int | None, typer.Option(help="Optimizer steps (default: one epoch).")] = None
    epochs: Annotated[
        float | None, typer.Option(help="Epochs over the training positions (instead of --steps).")
    ] = None
    batch_size: Annotated[
        int, typer.Option(help="Training positions per micro-batch (per process).")
    ] = 128
    seq_len: Annotated[int, typer.Option(help="Tokens per training window.")] = 512
    lr: Annotated[float, typer.Option(help="Peak learning rate (AdamW).")] = 1e-3
    weight_decay: Annotated[float, typer.Option(help="AdamW weight decay.")] = 0.01
    warmup: Annotated[
        float, typer.Option(help="Warm-up: a fraction of the steps (< 1) or a step count.")
    ] = 0.1
    eval_data: Annotated[
        list[Path] | None,
        typer.Option(
            help="Held-out prompts for the tokens/step evaluation (any data format, or "
            '{"turns": [...]} JSONL).'
        ),
    ] = None
    resume: Annotated[
        bool,
        typer.Option(help="Continue from the newest checkpoint in --out."),
    ] = False
    overwrite: Annotated[
        bool,
        typer.Option(
            help="Replace what --out holds (a model, a drafter, other files or an earlier run); "
            "the new drafter is built beside it and renamed into place only when complete."
        ),
    ] = False
    targets: Annotated[
        str | None,
        typer.Option(
            help="With --data: 'distill' (default; the LLM's own greedy continuations, rolled "
            "out), 'self' (the data "
            "is the model's own greedy output with exact prompt_ids/response_ids: its next tokens "
            "are the continuations, one forward per sequence) or 'ground-truth' (data labels)."
        ),
    ] = None
    draft_vocab: Annotated[
        int | None,
        typer.Option(
            help="Shortlist vocabulary: the drafter's head (an early-exit adapter: the rows of "
            "the model's head it drafts from) covers only the N most frequent training tokens "
            "(e.g. 8192); drafting is cheaper, output is unchanged. Built-in data: 8192 when the "
            "vocabulary is over 32768."
        ),
    ] = None
    soft_targets: Annotated[
        bool | None,
        typer.Option(
            "--soft-targets/--hard-targets",
            help="With --targets self: train on the model's whole distribution at each target "
            "(read from the cached hidden states), not only its greedy token. Default: on "
            "without --data, off with it.",
        ),
    ] = None
    budget: Annotated[
        str | None,
        typer.Option(
            help="Without --data: how long the whole run may take (30m, 2h, 1h30m; default 45m: "
            "half answering prompts, then training, then the evaluation) or how many answer "
            "positions to train on (200k, then one epoch; at least one batch of answers, "
            "--gen-batch x --answer-tokens). Resumable: rerun with --resume."
        ),
    ] = None
    gen_temp: Annotated[
        float,
        typer.Option(
            help="Without --data: the model's answers, greedy (0) or sampled at this temperature."
        ),
    ] = 0.0
    answer_tokens: Annotated[
        int,
        typer.Option(help="Without --data: most tokens per answer."),
    ] = 160
    gen_batch: Annotated[int, typer.Option(help="Without --data: prompts answered per batch.")] = 32
    own_prompts: Annotated[
        int,
        typer.Option(
            help="Without --data: user turns the model writes itself (sampled), besides the "
            "built-in prompts."
        ),
    ] = 128
    val_prompts: Annotated[
        int,
        typer.Option(
            help="Without --data: built-in prompts held out (never trained on) to pick the best "
            "checkpoint and for the final evaluation."
        ),
    ] = 16
    select_every: Annotated[
        int | None,
        typer.Option(help="Without --data: steps between held-out scores (default: 6 in a run)."),
    ] = None
    feature_layers: Annotated[
        str,
        typer.Option(
            help="What the drafter reads from the LLM: 'auto' (EAGLE-3's low, middle and high "
            "layers: the residual streams entering layers 2, n/2 and n-3, each normalised, "
            "concatenated and projected to H), layer indices 'i,j,k', or 'last' (the final "
            "normed hidden state, as drafters before). The model captures them in its own "
            "forward (no extra pass); the layers go into the drafter's config.json."
        ),
    ] = "auto"
    save_every: Annotated[
        int, typer.Option(help="Checkpoint every N steps (and at the end); 0: only at the end.")
    ] = 500
    seed: Annotated[int, typer.Option(help="Seed for the drafter init and the data order.")] = 0
    grad_accum: Annotated[int, typer.Option(help="Micro-batches per optimizer step.")] = 1
    cache_dir: Annotated[
        Path | None,
        typer.Option(help="Where the hidden states + targets are cached (default: OUT/cache)."),
    ] = None
    eval_prompts: Annotated[int, typer.Option(help="Prompts in the final evaluation.")] = 8
    eval_max_tokens: Annotated[
        int, typer.Option(help="Tokens generated per evaluation prompt.")
    ] = 64
    kind: Annotated[
        str,
        typer.Option(
            "--kind",
            help="What to train: 'recurrent' (the ReDrafter RNN drafter) or 'early-exit' (a "
            "Kangaroo adapter over the model's first --exit-layer layers; it uses --data or the "
            "built-in data, --steps/--epochs, --batch-size (positions: whole sequences of about "
            "that many), --seq-len, --lr, --warmup, --weight-decay, --resume, --save-every, "
            "--seed, --draft-vocab (the head rows it drafts from) and the built-in data's "
            "options).",
        ),
    ] = "recurrent"
    exit_layer: Annotated[
        int | None,
        typer.Option(
            "--exit-layer",
            help="With --kind early-exit: the adapter reads the residual after this many layers "
            "(default about layers / 15, the paper's 2 of 32).",
        ),
    ] = None
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar or table.")] = False
    verbose: Annotated[
        bool,
        typer.Option("--verbose", "-v", help="Show tracebacks on errors."),
    ] = False


@flag_groups
def distill(flags: DistillFlags) -> None:
    """Train a ReDrafter drafter for MODEL by distillation (the LLM stays frozen)."""
    with cli_errors(flags.verbose):
        model_dir = checked_model(flags)
        if flags.kind == "early-exit":
            return early_exit(
                model_dir,
                flags.data,
                flags.out,
                exit_layer=flags.exit_layer,
                draft_vocab=flags.draft_vocab,
                **shared_settings(flags),
            )
        summary = recurrent(model_dir, flags)
    if summary["rank"] == 0:  # data-parallel replicas: rank 0 reports
        report(summary, model_dir)


def checked_model(flags: DistillFlags) -> Path:
    """The model's folder (a bundled model's name resolved), once the flags that need no model
    are checked: ``--targets``, ``--seed``, ``--kind`` and ``--exit-layer``."""
    from redrafter_mlx.engine.core.sampling import check_seed

    if flags.targets is not None and flags.targets not in ("distill", "self", "ground-truth"):
        raise FlagError(
            f"--targets must be 'distill', 'self' or 'ground-truth', got {flags.targets!r}"
        )
    check_seed(flags.seed)  # 0 ... 2**64 - 1, as every command
    named = installed_bundled(flags.model)
    model_dir = named.base if named is not None else Path(flags.model)
    if flags.kind not in ("recurrent", "early-exit"):
        raise FlagError(f"--kind must be 'recurrent' or 'early-exit', got {flags.kind!r}")
    if flags.exit_layer is not None and flags.kind != "early-exit":
        raise FlagError("--exit-layer needs --kind early-exit")
    return model_dir


SHARED = (  # the settings both kinds of drafter train with
    "steps",
    "epochs",
    "batch_size",
    "seq_len",
    "lr",
    "weight_decay",
    "warmup",
    "resume",
    "overwrite",
    "save_every",
    "seed",
    "cache_dir",
    "quiet",
    "budget",
    "gen_temp",
    "answer_tokens",
    "gen_batch",
    "own_prompts",
    "val_prompts",
)


def shared_settings(flags: DistillFlags) -> dict:
    """The settings both kinds of drafter train with, by name."""
    return {name: getattr(flags, name) for name in SHARED}


def recurrent(model_dir: Path, flags: DistillFlags) -> dict:
    """``distill`` (``--kind recurrent``): train a ReDrafter drafter (train/distill.py); its
    summary."""
    from redrafter_mlx.train.distill import distill as run_distill

    return run_distill(
        model_dir,
        flags.data,
        flags.out,
        progress=Bars(),
        predict_tokens=flags.predict_tokens,
        layers=flags.layers,
        exit_dim=flags.exit_dim,
        rnn=flags.rnn,
        eval_data=flags.eval_data,
        targets=flags.targets,
        draft_vocab=flags.draft_vocab,
        soft_targets=flags.soft_targets,
        grad_accum=flags.grad_accum,
        eval_prompts=flags.eval_prompts,
        eval_max_tokens=flags.eval_max_tokens,
        select_every=flags.select_every,
        feature_layers=flags.feature_layers,
        **shared_settings(flags),
    )


def report(summary: dict, model_dir: Path) -> None:
    """Where the drafter was saved, its steps, final loss and the checkpoint kept; and that
    chat and generate find it without ``--drafter`` when it is the model's own."""
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
