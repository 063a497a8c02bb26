"""Train a ReDrafter drafter for a frozen LLM by knowledge distillation.

See docs/design/distillation.md.

    from redrafter_mlx.train.distill import distill
    summary = distill("~/models/vicuna-7b", ["sharegpt.json"], "~/models/vicuna-7b-drafter",
                      predict_tokens=5, steps=20000, batch_size=256)

or ``redrafter-mlx distill --model DIR --data FILE --out DIR``; without data files (``--data``
omitted) the model makes its own (``selfdata``: built-in and model-written prompts, the
model's answers with the hidden states kept from decoding, ``targets="self"``, soft targets,
held-out checkpoint selection), within ``budget`` (a time like ``45m`` or a position count).
The output directory is a drafter directory (``config.json`` with ``predict_tokens`` +
``model.safetensors``) that ``redrafter_mlx.load(model_dir, out_dir)`` serves.

Modules: ``options`` (the options and the run's shared planning), ``targets`` (targets and
their cache), ``training`` (loss, data order, optimizer step), ``checkpoints`` (checkpoints
and the output folder), ``evaluation``, ``selfdata`` (the built-in data's stages) and
``builtin`` (their plan within a budget); this one holds the run and its loop. Progress is
reported through a ``progress`` object the caller passes (the CLI draws bars; ``NullProgress``
otherwise).

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
import os
import shutil
import time
from pathlib import Path

import mlx.core as mx

from ..engine.base.errors import ParamError
from ..engine.verifier.protocol import Verifier
from . import builtin
from .builtin import budget_steps  # noqa: F401
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
    resumed_state,
    save_checkpoint,
    write_drafter_files,
)
from .data import files_digest, load_prompts, load_training_data
from .evaluation import chain_score, eval_shapes, evaluate
from .options import (  # noqa: F401
    AUTO_DRAFT_VOCAB,
    DEFAULT_BUDGET,
    GEN_SHARE,
    MAX_EPOCHS,
    OWN_PROMPT_SHARE,
    SELECTIONS,
    TARGET_MODES,
    TRAIN_SHARE,
    DistillOptions,
    NullProgress,
    RunContext,
    choose_shortlist,
    planned_steps,
    run_record,
    training_order,
)
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
    TrainingDiverged,
    drafter_args,
    drafter_loss,
    lr_schedule,
    new_drafter,
    read_batch,
    resolve_feature_layers,
    shortlist_index,
    shortlist_vocab,
    teacher_targets,
)


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
    if opts.resume:  # before the model and the data: another kind's run is named first
        resumed_state(plan.work, "recurrent")
    group = mx.distributed.init() if mx.distributed.is_available() else None
    rank = group.rank() if group is not None else 0
    quiet = opts.quiet or rank != 0 or progress is None
    progress = NullProgress() if quiet else progress
    try:
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
    except TrainingDiverged as e:
        raise TrainingDiverged(diverged(e, plan, opts), e.step) from None
    return summary


def diverged(e: TrainingDiverged, plan: OutputPlan, opts: DistillOptions) -> str:
    """What a run that diverged says: the step, what went non-finite, what was kept."""
    if plan.staged:
        kept = f"{plan.out} is unchanged"
    else:
        saved = list_checkpoints(plan.out)
        kept = (
            f"the last checkpoint with finite weights, {saved[-1]}, and the drafter files in "
            f"{plan.out} are kept"
            if saved
            else "no checkpoint had been saved"
        )
    return (
        f"training diverged at step {e.step}: {e.what} (learning rate {opts.lr:g}); nothing "
        f"from that step on was saved and {kept}; train with a lower --lr"
    )


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
        ctx = builtin.prepare(model, tokenizer, path, dtype, plan, opts, progress, world, started)
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
    from ..engine.base.platform import default_dtype, fit_blas_threads
    from ..engine.base.tokenizer import load_tokenizer
    from ..engine.loop.loading import load_model

    dtype = getattr(mx, opts.dtype) if opts.dtype else default_dtype()
    model, path = load_model(model_dir, dtype)
    fit_blas_threads(model)  # as serving does: a weight-bound model gets every core
    model.freeze()
    try:  # the data keeps the hidden states the drafter will read (its feature layers)
        model.capture_features(resolve_feature_layers(opts.feature_layers, model))
    except ValueError as e:
        raise ParamError("feature_layers", str(e)) from None
    return model, load_tokenizer(path), path, dtype


def prepare(
    model: Verifier,
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
        model.feature_layers,
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
            try:
                loss, _, accs = trainer.step(batches)
            except TrainingDiverged as e:
                e.step = step
                raise
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
    from ..engine.loop.loading import load_drafter

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
    drafter = load_drafter(ctx.out, ctx.model.dtype)
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
