"""Train a ReDrafter drafter for a frozen LLM by knowledge distillation.

See docs/design.md, "Distillation".

    from redrafter_mlx.train.distill import distill
    summary = distill("~/models/vicuna-7b", ["sharegpt.json"], "~/models/vicuna-7b-drafter",
                      predict_tokens=5, steps=20000, batch_size=256)

or ``redrafter-mlx distill --model DIR --data FILE --out DIR``; without data files (``--data``
omitted) the model makes its own (``selfdata``: built-in and model-written prompts, the
model's answers with the hidden states kept from decoding, ``targets="self"``, soft targets,
held-out checkpoint selection), within ``budget`` (a time like ``45m`` or a position count).
The output directory is a drafter directory (``config.json`` with ``predict_tokens`` +
``model.safetensors``) that ``redrafter_mlx.load(model_dir, out_dir)`` serves.

Modules: ``targets`` (targets and their cache), ``training`` (loss, data order, optimizer
step), ``checkpoints`` (checkpoints and the output folder), ``evaluation``, ``selfdata``
(the built-in data); this one holds the options and the run. Progress is reported through a
``progress`` object the caller passes (the CLI draws bars; ``NullProgress`` otherwise).

Pipeline
--------
1. **Data** (``distill_data``): chats rendered in the model's chat format, cut into windows of
   ``seq_len`` tokens; training positions t are those whose next token is an assistant token
   (every token for plain text).
2. **Targets** (cached on disk): for each training position t, the LLM's hidden state h_t (after
   the final norm, from the weights *as they will serve*: same dtype and quantization) and
   T+1 tokens. ``targets="distill"`` (default): the LLM's own greedy continuation
   ŷ_{t+1..t+T+1} of the ground-truth prefix y_{1..t}; x0 = ŷ_{t+1} is the init token the
   engine gets from the LLM, the drafter learns ŷ_{t+2..t+T+1}. All positions of a sequence
   roll out together, one forward per depth, through a tree mask (``rollout_targets``).
   ``targets="ground-truth"``: x0 = y_{t+1}, drafter targets y_{t+2..t+T+1} (the reference
   trainer's labels). The cache lives in ``cache_dir/<key>`` with key = model fingerprint +
   data hash + seq_len + T + mode, so epochs, resumed runs and new runs reuse it.
3. **Training**: only the drafter trains. Loss = Σ_k CE(step k) over the T steps, each step
   averaged over its valid positions, teacher-forced through the RNN state:
   s_1 = next_state(0, E[x0]), s_k = next_state(s_{k-1}, E[target_{k-1}]). AdamW with linear
   warm-up and cosine decay, gradient clipping at 1.0, gradient accumulation.
   The data order is a pure function of (seed, epoch), so a resumed run replays it exactly.
4. **Checkpoints**: ``out/checkpoints/step-NNNNNNNN/`` (drafter files + ``training_state.*``:
   optimizer state, step, run config) written into a temp dir and renamed (atomic); the newest
   weights are also copied to ``out/`` (each file replaced atomically). ``resume=True``
   continues from the newest checkpoint and gives the same weights as an uninterrupted run.
   ``out`` is written in place when it is new, empty or this command's own run; a folder
   holding anything else (a model, a drafter, other files), or a finished run started over, is
   replaced only with ``overwrite``, and then the run writes into a staging folder beside
   ``out`` that is renamed into place at the end (``plan_output``): a failed run leaves the
   old drafter and checkpoints as they were (a reused target cache may gain entries).
5. **Evaluation**: greedy ReDrafter on held-out prompts (``eval_data``, else prompts from the
   training data, marked in-sample) at a few beam shapes (W, L ≤ T+1); mean accepted tokens
   per step is printed, returned and stored in ``out/eval.json``.

Scaling out
-----------
Data parallelism with ``mx.distributed``: launch the same command on several processes or Macs,
e.g. ``mlx.launch --hosts mac1,mac2 -- redrafter-mlx distill ...`` (or ``mlx.launch -n 2`` on
one machine). Every process builds (or reuses) the same target cache, trains on its own slice of
every global batch (global batch = batch_size × processes) and the gradients are averaged with
``mx.distributed.all_sum`` before each update, so all replicas stay identical; only rank 0
writes checkpoints and evaluates. Put ``--cache-dir`` on local disk of each host (the cache is
deterministic, so hosts compute the same one). A single process needs nothing of this.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from ..engine.errors import ParamError
from ..engine.model import Model
from .checkpoints import (  # noqa: F401  (re-exported: the run's API in one place)
    KEEP_CHECKPOINTS,
    RUN_ENTRIES,
    STAGING_SUFFIX,
    OutputPlan,
    checkpoint_root,
    clean_stale_temps,
    drafter_config,
    install_output,
    is_own_run,
    is_temp_name,
    list_checkpoints,
    load_checkpoint,
    plan_output,
    publish_drafter,
    save_checkpoint,
    write_drafter_files,
)
from .data import Sequence, files_digest, load_prompts, load_training_data
from .evaluation import DEFAULT_EVAL_SHAPES, chain_score, eval_shapes, evaluate
from .targets import (  # noqa: F401
    CACHE_VERSION,
    TargetCache,
    build_target_cache,
    cache_key,
    ground_truth_targets,
    model_fingerprint,
    rollout_targets,
    self_targets,
    sequence_hidden,
    sequence_targets,
)
from .training import (  # noqa: F401
    CLIP_GRAD_NORM,
    DataOrder,
    Trainer,
    drafter_args,
    drafter_loss,
    lr_schedule,
    new_drafter,
    read_batch,
    shortlist_index,
    shortlist_vocab,
    teacher_targets,
)

TARGET_MODES = ("distill", "self", "ground-truth")
DEFAULT_BUDGET = "45m"
AUTO_DRAFT_VOCAB = 8192  # built-in data: a shortlist head when the vocabulary is 4x larger
# of a time budget: model-written prompts stop, answers stop, training ends
OWN_PROMPT_SHARE, GEN_SHARE, TRAIN_SHARE = 0.1, 0.5, 0.9
MAX_EPOCHS = 3.0  # a time budget trains at most this many epochs over the answers
SELECTIONS = 6  # held-out scores in a run (built-in data), unless select_every is given


@dataclass
class DistillOptions:
    """All options of a run; names match the CLI flags (underscored)."""

    predict_tokens: int = 5
    layers: int = 2
    exit_dim: int | str = "auto"
    rnn: bool = True
    steps: int | None = None
    epochs: float | None = None
    batch_size: int = 128
    seq_len: int = 512
    lr: float = 1e-3
    warmup: float = 0.1
    weight_decay: float = 0.01
    eval_data: list | None = None
    eval_prompts: int = 8
    eval_max_tokens: int = 64
    eval_shapes: tuple = DEFAULT_EVAL_SHAPES
    resume: bool = False
    overwrite: bool = False
    targets: str | None = None  # None: "distill" with data files, "self" with the built-in data
    save_every: int = 500
    seed: int = 0
    grad_accum: int = 1
    cache_dir: str | None = None
    dtype: str | None = None
    draft_vocab: int | None = None
    soft_targets: bool | None = None  # None: on with the built-in data, else off
    quiet: bool = False
    # the built-in data (no data files): see ``selfdata``
    budget: str | None = None  # "45m", "2h", "200k" positions; None: DEFAULT_BUDGET
    gen_temp: float = 0.0  # answers: 0 greedy, else sampled at this temperature
    answer_tokens: int = 160
    gen_batch: int = 32
    own_prompts: int = 128  # user turns the model writes itself
    val_prompts: int = 16  # built-in prompts held out for selection and the final evaluation
    select_every: int | None = None  # steps between held-out scores; None: SELECTIONS a run

    def validate(self) -> DistillOptions:
        """Return self, or raise ParamError naming the option and its allowed values."""
        if self.predict_tokens < 1:
            raise ParamError(
                "predict_tokens", f"predicted tokens must be >= 1, got {self.predict_tokens}"
            )
        if self.layers < 0:
            raise ParamError("layers", f"layers must be >= 0, got {self.layers}")
        if self.targets is not None and self.targets not in TARGET_MODES:
            raise ParamError(
                "targets", f"targets must be one of {TARGET_MODES}, got {self.targets!r}"
            )
        if self.steps is not None and self.epochs is not None:
            raise ParamError("epochs", "give either steps or epochs, not both")
        if self.steps is not None and self.steps < 1:
            raise ParamError("steps", f"steps must be >= 1, got {self.steps}")
        if self.epochs is not None and self.epochs <= 0:
            raise ParamError("epochs", f"epochs must be > 0, got {self.epochs}")
        for name in ("batch_size", "grad_accum", "seq_len"):
            if getattr(self, name) < 1:
                raise ParamError(
                    name, f"{name.replace('_', ' ')} must be >= 1, got {getattr(self, name)}"
                )
        if not self.warmup >= 0:
            raise ParamError(
                "warmup",
                f"warmup must be >= 0 (a fraction < 1 or a step count), got {self.warmup}",
            )
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ParamError(
                "draft_vocab", f"draft vocab must be >= 1 token ids, got {self.draft_vocab}"
            )
        for name in ("answer_tokens", "gen_batch"):
            if getattr(self, name) < 1:
                raise ParamError(
                    name, f"{name.replace('_', ' ')} must be >= 1, got {getattr(self, name)}"
                )
        if self.own_prompts < 0 or self.val_prompts < 1:
            raise ParamError("val_prompts", "own prompts must be >= 0 and val prompts >= 1")
        if not self.gen_temp >= 0:
            raise ParamError("gen_temp", f"gen temp must be >= 0, got {self.gen_temp}")
        if self.select_every is not None and self.select_every < 1:
            raise ParamError("select_every", f"select every must be >= 1, got {self.select_every}")
        if self.soft_targets and self.targets != "self":
            raise ParamError(
                "soft_targets",
                "soft targets need --targets self (the model's distribution at a target is "
                "read from the cached hidden state where the data drew it: exact only when the "
                "data is the model's own greedy output)",
            )
        if self.budget is not None:
            from .selfdata import parse_budget

            try:
                parse_budget(self.budget)
            except ValueError as e:
                raise ParamError("budget", str(e)) from None
        if self.exit_dim != "auto":
            try:
                self.exit_dim = int(self.exit_dim)
            except ValueError:
                raise ParamError(
                    "exit_dim", f"exit dim must be 'auto' or an integer, got {self.exit_dim!r}"
                ) from None
        return self

    # ------------------------------------------------------------------------------------------
    # ------------------------------------------------------------------------------------------
    # the run

    def for_data(self, builtin: bool) -> DistillOptions:
        """Fill the defaults that depend on the data: the built-in data is the model's own
        answers (``targets="self"``, soft targets on, a budget); data files default to
        rollouts and take no budget. Raises ParamError on a combination that cannot work."""
        if builtin:
            if self.targets not in (None, "self"):
                raise ParamError(
                    "targets",
                    "the built-in data is the model's own answers, so its targets are 'self'; "
                    f"--targets {self.targets} needs --data",
                )
            self.targets = "self"
            self.soft_targets = True if self.soft_targets is None else self.soft_targets
            self.budget = self.budget or DEFAULT_BUDGET
        else:
            if self.budget is not None:
                raise ParamError(
                    "budget",
                    "--budget sizes the built-in data (no --data); with --data use --steps "
                    "or --epochs",
                )
            self.targets = self.targets or "distill"
            self.soft_targets = bool(self.soft_targets)
        return self.validate()


class NullProgress:
    """What the run reports progress to when the caller shows nothing (the CLI passes bars).

    ``start(name, total, unit)``, ``update(advance, **metrics)``, ``stop()``, ``note(text)``
    and ``table(results, title)`` (eval results: tokens/step per beam shape)."""

    def start(self, name: str, total: float, unit: str = "") -> None:
        pass

    def update(self, advance: float = 1, **metrics) -> None:
        pass

    def stop(self) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def table(self, results: list[dict], title: str) -> None:
        pass


@dataclass
class RunContext:
    model: Model
    tokenizer: object
    model_dir: Path
    out: Path
    cache: TargetCache
    order: DataOrder
    total_steps: int
    sequences: list[Sequence]
    run: dict = field(default_factory=dict)
    draft_vocab: list[int] | None = None
    eval_prompts: list[list[int]] | None = None  # held-out prompts (built-in data)
    validation: dict | None = None  # held-out answers for checkpoint selection
    select_every: int = 0


def distill(model_dir, data_files, out_dir, progress=None, **options) -> dict:
    """Train a drafter for ``model_dir`` on ``data_files`` (None or empty: the built-in data,
    ``selfdata``) into ``out_dir``; returns a summary.

    Options are the CLI flags, underscored (see ``DistillOptions``); ``progress`` receives
    the stages (see ``NullProgress``). The summary holds the steps run, first and final loss,
    per-step accuracy, the held-out selection (built-in data), the eval results (tokens/step
    per beam shape), the cache path and the output paths. What ``out_dir`` already holds is
    kept unless ``overwrite``, and then replaced only when the new drafter is complete
    (``plan_output``).
    """
    if isinstance(data_files, (str, os.PathLike)):
        data_files = [data_files]
    data_files = [Path(f).expanduser() for f in data_files or []]
    opts = DistillOptions(**options).for_data(builtin=not data_files)
    if isinstance(opts.eval_data, (str, os.PathLike)):
        opts.eval_data = [opts.eval_data]
    out = Path(out_dir).expanduser()
    inputs = [Path(model_dir).expanduser(), *data_files, *map(Path, opts.eval_data or [])]
    plan = plan_output(out, opts, [p for p in inputs if p.exists()])
    group = mx.distributed.init() if mx.distributed.is_available() else None
    rank = group.rank() if group is not None else 0
    quiet = opts.quiet or rank != 0 or progress is None
    progress = NullProgress() if quiet else progress
    if not plan.staged:
        return run_distill(model_dir, data_files, plan, opts, group, progress)
    if rank == 0:
        shutil.rmtree(plan.work, ignore_errors=True)  # left by a killed run
    try:
        summary = run_distill(model_dir, data_files, plan, opts, group, progress)
        if rank == 0:
            install_output(plan)
    except BaseException:
        if rank == 0:
            shutil.rmtree(plan.work, ignore_errors=True)
        raise
    return summary


def run_distill(
    model_dir, data_files, plan: OutputPlan, opts: DistillOptions, group, progress
) -> dict:
    """Prepare, train, save and evaluate into ``plan.work``; returns the summary of ``distill``."""
    rank, world = (group.rank(), group.size()) if group is not None else (0, 1)
    tic = time.perf_counter()
    started = time.time()
    model, tokenizer, path, dtype = load_serving(model_dir, opts)
    if data_files:
        ctx = prepare(model, tokenizer, path, dtype, data_files, plan, opts, progress, world)
    else:
        ctx = prepare_builtin(model, tokenizer, path, dtype, plan, opts, progress, world, started)
    ctx.order.rank = rank
    trainer = Trainer(
        new_drafter(drafter_args(ctx.model, opts, ctx.draft_vocab), opts.seed),
        opts,
        ctx.total_steps,
        group,
    )
    start, selection = restore(ctx, trainer, opts, progress, rank)
    train_tic = time.perf_counter()
    history = train_loop(ctx, trainer, opts, progress, start, rank, selection)
    train_seconds = time.perf_counter() - train_tic
    config = drafter_config(trainer.drafter.args, opts.predict_tokens, opts.targets)
    if rank == 0 and (not list_checkpoints(ctx.out) or history):
        checkpoint(ctx, trainer, ctx.total_steps, config, selection)
    trained = len(history) * ctx.order.batch_size * opts.grad_accum * world
    summary = dict(
        out_dir=str(plan.out),
        steps=ctx.total_steps,
        resumed_from=start,
        positions=ctx.cache.size,
        cache_dir=str(plan.final_cache_root / ctx.cache.path.name),
        train_seconds=round(train_seconds, 2),
        trained_positions=trained,
        train_positions_per_s=round(trained / max(train_seconds, 1e-9), 1),
        draft_vocab=len(ctx.draft_vocab) if ctx.draft_vocab else None,
        targets=opts.targets,
        predict_tokens=opts.predict_tokens,
        first_loss=history[0]["loss"] if history else None,
        final_loss=_tail_mean([h["loss"] for h in history]),
        final_step_accuracy=history[-1]["step_accuracy"] if history else None,
        history=history,
        selection=selection if ctx.validation is not None else None,
        data=ctx.run.get("data"),
        world_size=world,
        rank=rank,
    )
    if rank == 0:
        summary["eval"] = final_eval(ctx, opts, progress)
    summary["seconds"] = round(time.perf_counter() - tic, 2)
    return summary


def _tail_mean(values: list[float]) -> float | None:
    """Mean of the last tenth (at least one) of a list, for a less noisy final loss."""
    if not values:
        return None
    tail = values[-max(1, len(values) // 10) :]
    return sum(tail) / len(tail)


def load_serving(model_dir, opts: DistillOptions):
    """The frozen model as it will serve, its tokenizer, its folder and dtype."""
    from ..engine.loading import load_model
    from ..engine.platform import default_dtype
    from ..engine.tokenizer import load_tokenizer

    dtype = getattr(mx, opts.dtype) if opts.dtype else default_dtype()
    model, path = load_model(model_dir, dtype)
    model.freeze()
    return model, load_tokenizer(path), path, dtype


def prepare(
    model: Model,
    tokenizer,
    path: Path,
    dtype,
    data_files,
    plan: OutputPlan,
    opts: DistillOptions,
    progress,
    world: int,
) -> RunContext:
    """Render the data files, build or reuse the target cache, plan the steps."""
    sequences = load_training_data(data_files, tokenizer, opts.seq_len)
    for f in opts.eval_data or []:  # fail early on a bad eval file
        load_prompts([f], tokenizer, limit=1)
    bad = [t for s in sequences for t in s.tokens if not 0 <= t < model.vocab_size]
    if bad:
        raise ValueError(
            f"token ids {bad[:5]} are outside the model's vocabulary "
            f"[0, {model.vocab_size}): the tokenizer does not match {path}"
        )
    key = cache_key(
        model_fingerprint(path, dtype),
        files_digest(data_files),
        opts.seq_len,
        opts.predict_tokens,
        opts.targets,
    )
    cache_path = plan.cache_root / key
    if (cache_path / "meta.json").exists():
        progress.note(f"targets: reusing {cache_path}")
        cache = TargetCache.open(cache_path)
    else:
        plan.cache_root.mkdir(parents=True, exist_ok=True)
        progress.start(f"targets ({opts.targets})", total=len(sequences), unit="sequences")
        t0, seen = time.perf_counter(), [0]

        def tick(n_tokens):
            seen[0] += n_tokens
            progress.update(1, tok_s=seen[0] / max(time.perf_counter() - t0, 1e-9))

        try:
            cache = build_target_cache(
                model, sequences, opts.predict_tokens, opts.targets, cache_path, tick
            )
        finally:
            progress.stop()
    order = training_order(cache, opts, world)
    total = planned_steps(opts, order, opts.epochs or 1.0)
    run = run_record(opts, key, order, total, world)
    draft_vocab = choose_shortlist(sequences, opts.draft_vocab, model, tokenizer, cache, progress)
    if draft_vocab:
        run["draft_vocab"] = opts.draft_vocab
    return RunContext(
        model, tokenizer, path, plan.work, cache, order, total, sequences, run, draft_vocab
    )


def training_order(cache: TargetCache, opts: DistillOptions, world: int) -> DataOrder:
    """The data order of this process (rank set by the caller)."""
    return DataOrder(
        cache.size, min(opts.batch_size, cache.size // world or 1), opts.seed, 0, world
    )


def planned_steps(opts: DistillOptions, order: DataOrder, epochs: float) -> int:
    """``steps`` when given, else ``epochs`` over the cached positions."""
    if opts.steps is not None:
        return opts.steps
    return max(1, math.ceil(epochs * order.per_epoch / opts.grad_accum))


def run_record(opts: DistillOptions, key: str, order: DataOrder, total: int, world: int) -> dict:
    """The settings a checkpoint records; a resumed run must match them."""
    run = dict(
        cache_key=key,
        predict_tokens=opts.predict_tokens,
        layers=opts.layers,
        exit_dim=opts.exit_dim,
        rnn=opts.rnn,
        targets=opts.targets,
        batch_size=order.batch_size,
        grad_accum=opts.grad_accum,
        lr=opts.lr,
        warmup=opts.warmup,
        weight_decay=opts.weight_decay,
        seed=opts.seed,
        total_steps=total,
        seq_len=opts.seq_len,
        world_size=world,
    )
    if opts.soft_targets:  # only when on: runs checkpointed before the option still resume
        run["soft_targets"] = True
    return run


def choose_shortlist(sequences, size, model: Model, tokenizer, cache, progress):
    """The shortlist head ids (``size`` most frequent training tokens), or None."""
    if not size:
        return None
    vocab = shortlist_vocab(sequences, size, model.vocab_size, sorted(tokenizer.eos_token_ids))
    covered = shortlist_index(vocab, model.vocab_size)[cache.tokens[:, 1:]] >= 0
    share = float((covered & cache.valid).sum() / max(int(cache.valid.sum()), 1))
    progress.note(f"shortlist: {len(vocab)} ids cover {share:.1%} of the training targets")
    return vocab


def prepare_builtin(
    model: Model,
    tokenizer,
    path: Path,
    dtype,
    plan: OutputPlan,
    opts: DistillOptions,
    progress,
    world: int,
    started: float,
) -> RunContext:
    """The built-in data (``selfdata``): prompts, answers with hidden states, targets; the
    held-out prompts' answers for selection; the steps fitted to the budget."""
    from .selfdata import SelfData, answer_sequences, parse_budget, work_key

    if world > 1:
        raise ValueError(
            "without --data, distill makes its data in one process: run it without "
            "mlx.launch, or give --data for data-parallel training"
        )
    kind, amount = parse_budget(opts.budget)
    key = work_key(model_fingerprint(path, dtype), opts.gen_temp, opts.answer_tokens, opts.seed)
    data = SelfData(
        plan.cache_root / f"selfdata-{key}",
        model,
        tokenizer,
        temperature=opts.gen_temp,
        answer_tokens=opts.answer_tokens,
        batch=opts.gen_batch,
        seed=opts.seed,
    )
    own_deadline = started + OWN_PROMPT_SHARE * amount if kind == "seconds" else None
    prompts = own_prompt_stage(data, opts, progress, own_deadline)
    held, pool = prompts[: opts.val_prompts], prompts[opts.val_prompts :]
    resumed = resumed_run(plan.work, opts)
    rows = answer_stage(data, held, pool, kind, amount, started, resumed, progress)
    held_ids = {p["id"] for p in held}
    val_rows = [r for r in rows if r["id"] in held_ids]
    train_rows = [r for r in rows if r["id"] not in held_ids]
    if resumed:
        train_rows = train_rows[: resumed["data"]["answers"]]
    if not train_rows:
        raise ValueError(
            f"the budget {opts.budget} left no time to answer any training prompt; "
            "give a larger --budget"
        )
    cache = data.targets(train_rows, opts.predict_tokens)
    val = data.targets(val_rows, opts.predict_tokens)
    validation = dict(hidden=val.hidden, tokens=val.tokens, valid=val.valid)
    sequences = answer_sequences(train_rows)
    order = training_order(cache, opts, world)
    size = opts.draft_vocab
    if size is None and model.vocab_size > 4 * AUTO_DRAFT_VOCAB:
        size = AUTO_DRAFT_VOCAB
    draft_vocab = choose_shortlist(sequences, size, model, tokenizer, cache, progress)
    if resumed:
        total = int(resumed["total_steps"])
    elif kind == "positions" or opts.steps is not None or opts.epochs is not None:
        total = planned_steps(opts, order, opts.epochs or 1.0)
    else:
        seconds = started + TRAIN_SHARE * amount - time.time()
        total = budget_steps(model, cache, order, opts, draft_vocab, seconds)
    run = run_record(opts, key, order, total, world)
    run["data"] = dict(
        answers=len(train_rows),
        positions=cache.size,
        held_out_answers=len(val_rows),
        held_out_positions=val.size,
        temperature=opts.gen_temp,
    )
    if draft_vocab:
        run["draft_vocab"] = size
    every = opts.select_every or max(1, total // SELECTIONS)
    held_prompts = [
        list(tokenizer.chat_prompt([{"role": "user", "content": p["prompt"]}])) for p in held
    ]
    return RunContext(
        model,
        tokenizer,
        path,
        plan.work,
        cache,
        order,
        total,
        sequences,
        run,
        draft_vocab,
        eval_prompts=held_prompts,
        validation=validation,
        select_every=every,
    )


def own_prompt_stage(data, opts: DistillOptions, progress, deadline) -> list[dict]:
    """The prompt list, with the model writing ``own_prompts`` of them on the first run
    (asking until ``deadline``, epoch seconds or None)."""
    if data.prompts_path.exists():
        return data.prompts(0)
    # the model is asked at most twice as often as turns are wanted (see own_prompts)
    progress.start("prompts (model-written)", total=2 * opts.own_prompts, unit="asks")
    try:
        tick = lambda n, _toks: progress.update(n)
        return data.prompts(opts.own_prompts, tick, deadline)
    finally:
        progress.stop()


def resumed_run(out: Path, opts: DistillOptions) -> dict | None:
    """The run record of the newest checkpoint when resuming one (its data stays fixed)."""
    existing = list_checkpoints(out) if opts.resume else []
    if not existing:
        return None
    info = json.loads((existing[-1] / "training_state.json").read_text())
    return info["run"] if "data" in info["run"] else None


def answer_stage(data, held, pool, kind, amount, started, resumed, progress) -> list[dict]:
    """Answer the held-out prompts, then training prompts until the budget's share is spent
    (a resumed training run generates nothing more); returns all answer rows."""
    held_ids = {p["id"] for p in held}
    rows = data.answers()
    have = sum(len(r["response_ids"]) for r in rows if r["id"] not in held_ids)
    if kind == "positions":
        total, unit = max(amount - have, 0), "positions"

        def stop(made):
            return have + made >= amount
    else:
        deadline = started + GEN_SHARE * amount
        total, unit = max(deadline - time.time(), 0), "s"

        def stop(_made):
            return time.time() >= deadline

    todo_held = not held_ids <= {r["id"] for r in rows}
    if not todo_held and (resumed or stop(0)):
        return rows
    progress.start("answers (with hidden states)", total=total, unit=unit)
    t0, last, made = time.perf_counter(), [time.perf_counter()], [0]

    def tick(n, counted):
        now = time.perf_counter()
        made[0] += n
        advance = (n if counted else 0) if kind == "positions" else now - last[0]
        last[0] = now
        progress.update(advance, positions=have + made[0], pos_s=made[0] / max(now - t0, 1e-9))

    try:
        rows = data.generate(held, lambda _n: False, lambda _r, n: tick(n, False))
        if resumed:
            return rows
        made[0] = 0
        return data.generate(pool, stop, lambda _r, n: tick(n, True))
    finally:
        progress.stop()


def budget_steps(
    model: Model, cache, order: DataOrder, opts: DistillOptions, draft_vocab, seconds: float
) -> int:
    """Optimizer steps that fit ``seconds`` of training at this machine's measured speed
    (three throwaway steps), at most MAX_EPOCHS epochs, at least one."""
    probe = Trainer(new_drafter(drafter_args(model, opts, draft_vocab), opts.seed), opts, 10)
    index = shortlist_index(draft_vocab, model.vocab_size)
    times = []
    for micro in range(3):
        idx = order.batch(micro)
        batch = read_batch(cache, model, idx, index)
        if opts.soft_targets:
            batch += teacher_targets(cache, model, idx, draft_vocab)
        t = time.perf_counter()
        probe.step([batch] * opts.grad_accum)
        times.append(time.perf_counter() - t)
    per_step = max(sum(times[1:]) / 2, 1e-6) * 1.15  # selection scores and reads on top
    most = planned_steps(opts, order, MAX_EPOCHS)
    return int(min(most, max(1, seconds // per_step)))


def restore(ctx: RunContext, trainer: Trainer, opts: DistillOptions, progress, rank: int = 0):
    """Prepare ``ctx.out`` for this run; with resume, load the newest checkpoint. Returns its
    step and the held-out selection so far (``dict(best, step, history)``).

    ``plan_output`` has chosen the folder: new, empty, or a run to resume. Only rank 0 deletes
    anything (temp dirs of a crashed write).
    """
    out = ctx.out
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        clean_stale_temps(out)
    selection = dict(best=None, step=None, history=[])
    existing = list_checkpoints(out)
    if not existing:
        if opts.resume:
            progress.note(f"resume: no checkpoint in {out}, starting from step 0")
        return 0, selection
    info = load_checkpoint(existing[-1], trainer)
    differ = {k: (info["run"].get(k), v) for k, v in ctx.run.items() if info["run"].get(k) != v}
    if differ:
        detail = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in differ.items())
        raise ValueError(
            f"cannot resume {existing[-1]}: the run settings changed ({detail}); "
            f"use the original settings or --overwrite"
        )
    progress.note(f"resume: {existing[-1].name} (step {info['step']} of {ctx.total_steps})")
    return int(info["step"]), info.get("selection", selection)


def train_loop(
    ctx: RunContext,
    trainer: Trainer,
    opts: DistillOptions,
    progress,
    start: int,
    rank: int,
    selection: dict | None = None,
) -> list[dict]:
    """Optimizer steps start+1..total with periodic checkpoints and (with a validation set)
    held-out selection: the best-scoring weights are the ones in ``out``. Returns per-step
    metrics."""
    config = drafter_config(trainer.drafter.args, opts.predict_tokens, opts.targets)
    head_index = shortlist_index(ctx.draft_vocab, ctx.model.vocab_size)
    selecting = ctx.validation is not None
    selection = selection if selection is not None else dict(best=None, step=None, history=[])
    history = []
    progress.start("distill", total=ctx.total_steps, unit="steps")
    progress.update(start)
    t0, seen = time.perf_counter(), 0
    try:
        for step in range(start + 1, ctx.total_steps + 1):
            micro = [(step - 1) * opts.grad_accum + k for k in range(opts.grad_accum)]
            batches = [training_batch(ctx, opts, m, head_index) for m in micro]
            lr = trainer.learning_rate
            loss, _, accs = trainer.step(batches)
            seen += ctx.order.batch_size * opts.grad_accum
            record = dict(
                step=step,
                loss=loss.item(),
                lr=lr,
                step_accuracy=[round(a, 4) for a in accs.tolist()],
            )
            history.append(record)
            if (
                selecting
                and rank == 0
                and (step % ctx.select_every == 0 or step == ctx.total_steps)
            ):
                select(ctx, trainer, opts, config, head_index, step, selection, progress)
            progress.update(
                1,
                loss=record["loss"],
                acc=record["step_accuracy"],
                tok_s=seen / max(time.perf_counter() - t0, 1e-9),
                lr=lr,
                best=selection["best"],
            )
            if (
                rank == 0
                and opts.save_every
                and step % opts.save_every == 0
                and step < ctx.total_steps
            ):
                checkpoint(ctx, trainer, step, config, selection)
    finally:
        progress.stop()
    return history


def checkpoint(ctx: RunContext, trainer, step: int, config: dict, selection: dict) -> None:
    """Save a checkpoint; with held-out selection ``out`` keeps the best weights instead of
    the newest, and the checkpoint records the selection so far."""
    if ctx.validation is None:
        save_checkpoint(ctx.out, trainer, step, config, ctx.run)
    else:
        extra = dict(selection=selection)
        save_checkpoint(ctx.out, trainer, step, config, ctx.run, publish=False, extra=extra)


def select(ctx: RunContext, trainer, opts, config, head_index, step, selection, progress):
    """Score the drafter on the held-out answers; publish it to ``out`` when it is the best."""
    length = min(4, opts.predict_tokens + 1)
    score = chain_score(trainer.drafter, ctx.model, ctx.validation, head_index, length)
    selection["history"].append(dict(step=step, **score))
    if selection["best"] is None or score["score"] > selection["best"]:
        selection.update(best=score["score"], step=step)
        chosen = dict(config, selected=dict(step=step, held_out_chain_score=score["score"]))
        publish_drafter(ctx.out, trainer.drafter, chosen)


def training_batch(ctx: RunContext, opts: DistillOptions, micro: int, head_index) -> tuple:
    """The drafter_loss inputs of one micro-batch (with soft targets when asked for)."""
    idx = ctx.order.batch(micro)
    batch = read_batch(ctx.cache, ctx.model, idx, head_index)
    if opts.soft_targets:
        batch += teacher_targets(ctx.cache, ctx.model, idx, ctx.draft_vocab)
    return batch


def final_eval(ctx: RunContext, opts: DistillOptions, progress) -> dict | None:
    """Serve the saved drafter (as ``load`` would) on held-out prompts; writes ``out/eval.json``.

    None when ``eval_shapes`` is empty (no evaluation)."""
    from ..engine.loading import load_drafter

    shapes = eval_shapes(opts.eval_shapes, opts.predict_tokens)
    if not shapes:
        return None
    if opts.eval_data:
        prompts = load_prompts(opts.eval_data, ctx.tokenizer, limit=opts.eval_prompts)
        source = [str(f) for f in opts.eval_data]
    elif ctx.eval_prompts:
        prompts = ctx.eval_prompts[: opts.eval_prompts]
        source = "built-in prompts held out from training"
    else:
        prompts = training_prompts(ctx, opts.eval_prompts)
        source = "training data (in-sample: pass --eval-data for held-out prompts)"
    drafter = load_drafter(ctx.out, ctx.model.model.norm.weight.dtype)
    results = evaluate(
        ctx.model, drafter, prompts, shapes, opts.eval_max_tokens, ctx.tokenizer.eos_token_ids
    )
    report = dict(
        source=source,
        prompts=len(prompts),
        max_tokens=opts.eval_max_tokens,
        greedy=True,
        results=results,
    )
    (ctx.out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    progress.table(results, f"tokens/step, {len(prompts)} prompts")
    return report


def training_prompts(ctx: RunContext, limit: int) -> list[list[int]]:
    """Prompts cut from the training sequences: the tokens before their first training token
    (for plain text, its first 16 tokens)."""
    prompts = []
    for seq in ctx.sequences[:limit]:
        first = seq.train.index(True)
        prompts.append(seq.tokens[:first] if first > 1 else seq.tokens[:16])
    return prompts
