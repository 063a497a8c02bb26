"""The run's plan for the built-in data (``distill`` without data files): the ``selfdata``
stages fitted to the budget, the held-out answers for selection, and the step count.

A time budget is shared out in order: the model writes its prompts until OWN_PROMPT_SHARE of
it, answers until GEN_SHARE, trains until TRAIN_SHARE (steps sized from three measured
steps), and the final evaluation has the rest. A position budget answers until that many
answer positions exist, then trains one epoch (or ``steps`` / ``epochs``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..engine.verifier.protocol import Verifier
from .checkpoints import OutputPlan, list_checkpoints
from .options import (
    AUTO_DRAFT_VOCAB,
    GEN_SHARE,
    MAX_EPOCHS,
    OWN_PROMPT_SHARE,
    SELECTIONS,
    TRAIN_SHARE,
    DistillOptions,
    RunContext,
    choose_shortlist,
    planned_steps,
    run_record,
    training_order,
)
from .targets import model_fingerprint
from .training import (
    DataOrder,
    Trainer,
    drafter_args,
    new_drafter,
    read_batch,
    shortlist_index,
    teacher_targets,
)


def prepare(
    model: Verifier,
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
    from .selfdata import answer_sequences, parse_budget, work_folder, work_key

    if world > 1:
        raise ValueError(
            "without --data, distill makes its data in one process: run it without "
            "mlx.launch, or give --data for data-parallel training"
        )
    kind, amount = parse_budget(opts.budget)
    key = work_key(model_fingerprint(path, dtype), opts.gen_temp, opts.answer_tokens, opts.seed)
    folder = work_folder(plan.cache_root, key, model.feature_layers)
    reused_layers = None  # the feature layers of a reused folder's answers
    if model.feature_layers:
        key = folder.name.removeprefix("selfdata-")  # the run record names the data it read
    elif folder.name != f"selfdata-{key}":
        progress.note(f"answers: reusing {folder} (its final normed hidden states)")
        # answers added to that folder keep its rows' width: they capture its layers
        reused_layers = tuple(int(i) for i in folder.name.rsplit("-f", 1)[1].split("."))
    data = self_data(folder, model, tokenizer, opts, reused_layers)
    resumed = resumed_run(plan.work, opts)
    train_rows, val_rows, held = answered(data, opts, kind, amount, started, resumed, progress)
    if kind == "positions" and not resumed:  # the budget's share of the answers written
        train_rows = within_positions(train_rows, amount)
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


def self_data(folder: Path, model, tokenizer, opts: DistillOptions, features):
    """The model's own answers in ``folder`` (a ``selfdata.SelfData``), written with
    ``opts``' generation settings; ``features``: the layers its rows hold (None: the final
    normed hidden state)."""
    from .selfdata import SelfData

    return SelfData(
        folder,
        model,
        tokenizer,
        temperature=opts.gen_temp,
        answer_tokens=opts.answer_tokens,
        batch=opts.gen_batch,
        seed=opts.seed,
        features=features,
    )


def answered(data, opts: DistillOptions, kind, amount, started, resumed, progress):
    """The model's own prompts, then its answers (``own_prompt_stage``, ``answer_stage``):
    (training rows, held-out rows, held-out prompts). ``resumed``: the run record of a
    resumed run, whose training data stays its first ``data.answers`` rows."""
    own_deadline = started + OWN_PROMPT_SHARE * amount if kind == "seconds" else None
    prompts = own_prompt_stage(data, opts, progress, own_deadline)
    held, pool = prompts[: opts.val_prompts], prompts[opts.val_prompts :]
    rows = answer_stage(data, held, pool, kind, amount, started, resumed, progress)
    held_ids = {p["id"] for p in held}
    train_rows = [r for r in rows if r["id"] not in held_ids]
    if resumed:
        train_rows = train_rows[: resumed["data"]["answers"]]
    return train_rows, [r for r in rows if r["id"] in held_ids], held


def within_positions(rows: list[dict], amount: float) -> list[dict]:
    """The first answer rows whose answer positions reach ``amount`` (all of them when they
    hold fewer): a positions budget trains on that many even when the self-data folder
    holds more (answers a larger run wrote). Each sequence's features are kept in memory
    for the run (``sequence_features``: an early-exit adapter's run), and a drafter's targets
    are computed for these, so this bounds the run's memory and time too."""
    kept, total = [], 0
    for r in rows:
        if total >= amount:
            break
        kept.append(r)
        total += len(r["response_ids"])
    return kept


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
    model: Verifier, cache, order: DataOrder, opts: DistillOptions, draft_vocab, seconds: float
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
