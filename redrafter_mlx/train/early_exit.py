"""Train an early-exit (Kangaroo) adapter for a frozen model: ``distill --kind early-exit``.

Only the adapter trains (``engine/drafting/early_exit.py``): its input is the residual stream
after the target's first ``exit_layer`` layers, its output goes through the target's final LM head
(frozen), and the loss is the soft cross-entropy against the target's own next-token
distribution at every training position (DESIGN.md 3c). The adapter attends causally over the
whole sequence, so a training example is a whole sequence (not a position): the exit-layer
states and the target's final hidden states come from one forward of the frozen model per
sequence (``Verifier.capture_features([exit_layer])``), kept in memory for the run.

Data: the same as the recurrent drafter's. Data files (``--data``) are rendered and windowed
by ``data.load_training_data``; without them the built-in data (``selfdata``: built-in and
model-written prompts, the model's own answers, resumable) is made and read from the same
folder the recurrent drafter's run uses. Checkpoints, ``--resume`` and the output folder's
rules are ``checkpoints``'s: ``out/`` ends as an adapter folder (``config.json`` with
``"kind": "early-exit"`` + ``model.safetensors``).

The data order is a pure function of (seed, step) (``training.DataOrder`` over sequences), so
a resumed run gives the weights of an uninterrupted one.

Shapes: B sequences per batch, T tokens (padded), H hidden, V vocabulary.
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from ..engine.base.errors import ParamError
from ..engine.core.tree import cache_mask, chain_mask
from ..engine.drafting.early_exit import (
    EarlyExitAdapter,
    EarlyExitArgs,
    bind_head,
    check_exit_layer,
)
from ..engine.drafting.early_exit_chain import ETA, GAMMA, adapter_write, draft_chain
from ..engine.verifier.entries import rows_of
from ..engine.verifier.protocol import Verifier
from .checkpoints import (
    install_output,
    list_checkpoints,
    load_checkpoint,
    plan_output,
    resumed_state,
    save_checkpoint,
)
from .data import Sequence, files_digest, load_training_data
from .options import AUTO_DRAFT_VOCAB, DistillOptions, NullProgress, check_draft_vocab
from .training import CLIP_GRAD_NORM, DataOrder, lr_schedule, shortlist_vocab

PAD_TO = 32  # batches are padded to a multiple of this many tokens (few distinct shapes)
HELD_OUT_SHARE = 0.05  # of the data-file sequences, for the held-out scores
CHAIN_STARTS = 8  # drafting starts per held-out sequence in the chain score


def default_exit_layer(layers: int) -> int:
    """The paper's exit, 2 of Vicuna-7B's 32 layers and 3 of 13B's 40: about layers / 15."""
    return min(max(1, round(layers / 15)), layers - 1)


@dataclass
class Example:
    """One training sequence's frozen-model features. exits, finals: (N, H); valid: (N,) bool,
    position t trains when token t+1 is a training token."""

    exits: mx.array
    finals: mx.array
    valid: np.ndarray
    tokens: list[int]


def sequence_features(model: Verifier, seq: Sequence, exit_layer: int) -> Example:
    """One forward of the frozen model over ``seq``: exit-layer and final normed states."""
    N = len(seq.tokens)
    H = model.hidden_size
    tokens = mx.array([seq.tokens], dtype=mx.int32)
    pos = mx.arange(N, dtype=mx.int32)[None]
    mask = cache_mask(mx.array([0], dtype=mx.int32), chain_mask(N), N)
    cache = model.make_cache(1, N)
    before = model.feature_layers
    model.capture_features([exit_layer])
    try:
        hidden, _ = model(tokens, pos, mask, cache, pos)
    finally:
        model.capture_features(before)
    hidden = hidden[0].astype(mx.float32)
    mx.eval(hidden)
    valid = np.array(list(seq.train[1:]) + [False], dtype=bool)
    return Example(hidden[:, H:], hidden[:, :H], valid, list(seq.tokens))


def batch_sequences(examples: list[Example], positions: int) -> int:
    """Sequences per batch for about ``positions`` training positions (``--batch-size``
    counts positions for both kinds), at least one, at most all."""
    mean = sum(int(e.valid.sum()) for e in examples) / max(len(examples), 1)
    return min(len(examples), max(1, round(positions / max(mean, 1.0))))


def collate(examples: list[Example]) -> tuple[mx.array, mx.array, mx.array]:
    """Right-padded batch: exits, finals (B, T, H) float32 and valid (B, T) bool."""
    longest = max(len(e.valid) for e in examples)
    T = -(-longest // PAD_TO) * PAD_TO
    H = examples[0].exits.shape[-1]

    def pad(x):
        return mx.concatenate([x, mx.zeros((T - x.shape[0], H), x.dtype)]) if x.shape[0] < T else x

    exits = mx.stack([pad(e.exits) for e in examples])
    finals = mx.stack([pad(e.finals) for e in examples])
    valid = np.zeros((len(examples), T), dtype=bool)
    for i, e in enumerate(examples):
        valid[i, : len(e.valid)] = e.valid
    return exits, finals, mx.array(valid)


def adapter_outputs(adapter: EarlyExitAdapter, exits: mx.array) -> mx.array:
    """The adapter over whole sequences from scratch: exits (B, T, H) -> (B, T, H)."""
    B, T, _ = exits.shape
    pos = mx.broadcast_to(mx.arange(T, dtype=mx.int32)[None], (B, T))
    mask = cache_mask(mx.zeros((B,), dtype=mx.int32), chain_mask(T), T)
    return adapter(exits, pos, mask, adapter.make_cache(B, T, exits.dtype), pos)[0]


def soft_loss(adapter, model: Verifier, exits, finals, valid):
    """Soft cross-entropy of the adapter's next-token distribution against the target's, and
    top-1 agreement, both averaged over valid positions: (B, T, H), (B, T, H), (B, T) -> ()."""
    student = model.logits(adapter_outputs(adapter, exits))  # (B, T, V)
    teacher = mx.stop_gradient(mx.softmax(model.logits(finals), axis=-1))
    log_p = student - mx.logsumexp(student, axis=-1, keepdims=True)
    ce = -(teacher * log_p).sum(axis=-1)
    w = valid.astype(mx.float32)
    n = mx.maximum(w.sum(), 1.0)
    agree = (mx.argmax(student, axis=-1) == mx.argmax(teacher, axis=-1)).astype(mx.float32)
    return (ce * w).sum() / n, (agree * w).sum() / n


class AdapterTrainer:
    """The adapter, AdamW (warm-up + cosine) and the clipped gradient step. ``drafter`` and
    ``optimizer`` are the names ``checkpoints.save_checkpoint`` / ``load_checkpoint`` read."""

    def __init__(self, adapter: EarlyExitAdapter, model: Verifier, opts, total_steps: int):
        self.drafter = adapter
        self.model = model
        self.optimizer = optim.AdamW(
            learning_rate=lr_schedule(opts.lr, total_steps, opts.warmup),
            weight_decay=opts.weight_decay,
        )
        self.optimizer.init(adapter.trainable_parameters())

        def loss(adapter, *batch):
            return soft_loss(adapter, model, *batch)

        self._value_and_grad = nn.value_and_grad(adapter, loss)

    def set_optimizer_state(self, state: dict) -> None:
        self.optimizer.state = state

    def step(self, batch) -> tuple[float, float]:
        """One update from one batch (exits, finals, valid); returns (loss, top-1 agreement)."""
        (loss, agree), grads = self._value_and_grad(self.drafter, *batch)
        grads, _ = optim.clip_grad_norm(grads, CLIP_GRAD_NORM)
        self.optimizer.update(self.drafter, grads)
        mx.eval(self.drafter.parameters(), self.optimizer.state, loss, agree)
        return float(loss), float(agree)


def new_adapter(model: Verifier, exit_layer: int, seed: int) -> EarlyExitAdapter:
    """A fresh adapter whose output starts as the exit state itself (``o_proj`` zero): the
    target's final norm and head read the exit layer's residual ('logit lens'); the norms
    start from the target's (its final norm; the input norm of layer ``exit_layer``)."""
    mx.random.seed(seed)
    adapter = EarlyExitAdapter(EarlyExitArgs.for_target(model.args, exit_layer))
    H = model.hidden_size
    for layer in adapter.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.input_layernorm.weight = norm_scale(model.layers[exit_layer].input_layernorm, H)
    adapter.norm.weight = norm_scale(model.model.norm, H)
    adapter.set_dtype(mx.float32)
    mx.eval(adapter.parameters())
    return adapter


def norm_scale(norm, size: int) -> mx.array:
    """The per-channel scale a norm module applies, (size,) float32: its output on a vector
    of a large constant (so its eps is lost in the RMS), whatever its weight convention
    (``w``, or Gemma's ``1 + w``)."""
    return norm(mx.full((1, size), 1e3, dtype=mx.float32))[0].astype(mx.float32)


def held_out_scores(model: Verifier, adapter: EarlyExitAdapter, examples: list[Example]) -> dict:
    """Top-1 agreement with the target over held-out positions, and mean soft CE."""
    ce_sum = agree_sum = n = 0.0
    for e in examples:
        exits, finals, valid = collate([e])
        ce, agree = soft_loss(adapter, model, exits, finals, valid)
        k = float(valid.sum())
        ce_sum, agree_sum, n = ce_sum + float(ce) * k, agree_sum + float(agree) * k, n + k
    return dict(top1_agreement=agree_sum / max(n, 1), soft_ce=ce_sum / max(n, 1))


def chain_score(
    model: Verifier, adapter: EarlyExitAdapter, examples: list[Example], gamma=GAMMA, eta=ETA
):
    """Greedy chains drafted at CHAIN_STARTS positions of each held-out sequence that is the
    model's own greedy output (the built-in data): mean drafts accepted (leading drafts equal
    to the sequence's next tokens, within the confidence cut) and mean drafts kept by the
    cut. Tokens per step = 1 + accepted. The caches hold the whole sequence; each row's
    length is its start (slots above it are junk that the drafting overwrites)."""
    accepted, kept, rows = 0.0, 0.0, 0
    for e in examples:
        starts = [t for t in range(1, len(e.tokens) - gamma - 1) if e.valid[t - 1]]
        if not starts:
            continue
        step = max(1, len(starts) // CHAIN_STARTS)
        starts = starts[::step][:CHAIN_STARTS]
        N, B = len(e.tokens), len(starts)
        tokens = mx.array([e.tokens], dtype=mx.int32)
        pos = mx.arange(N, dtype=mx.int32)[None]
        zero = mx.zeros((1,), dtype=mx.int32)
        cache = model.make_cache(1, N + gamma + 1)
        _, cache = model(tokens, pos, cache_mask(zero, chain_mask(N), N), cache, pos)
        own = adapter.make_cache(1, N + gamma + 1)
        _, own = adapter_write(adapter, e.exits[None], zero, own, N)
        broadcast = functools.partial(_rows, B)
        lengths = mx.array(starts, dtype=mx.int32)
        init = mx.array([e.tokens[t] for t in starts], dtype=mx.int32)
        chain = draft_chain(
            model, adapter, init, lengths, broadcast(cache), broadcast(own), N + gamma + 1,
            gamma, eta,
        )  # fmt: skip
        drafts = np.array(chain.tokens)[:, 1:]
        want = np.array([e.tokens[t + 1 : t + 1 + gamma] for t in starts])
        run = np.cumprod(drafts == want, axis=1).sum(axis=1)
        accepted += float(run.sum())
        kept += float(np.array(chain.present)[:, 1:].sum())
        rows += B
    if not rows:
        return None
    return dict(mean_accepted=accepted / rows, mean_drafted=kept / rows, chains=rows)


def coverage(sequences: list[Sequence], ids: list[int]) -> float:
    """The share of ``sequences``' training tokens that ``ids`` holds."""
    keep = set(ids)
    targets = [t for s in sequences for t, train in zip(s.tokens, s.train) if train]
    return sum(t in keep for t in targets) / max(len(targets), 1)


def _rows(B: int, cache: tuple) -> tuple:
    """A cache of one row with each array broadcast to B rows."""
    return rows_of(cache, lambda c: mx.broadcast_to(c, (B, *c.shape[1:])))


def distill_early_exit(model_dir, data_files, out_dir, progress=None, **options) -> dict:
    """Train an early-exit adapter for ``model_dir`` into ``out_dir``; returns a summary.

    ``exit_layer`` (None: ``default_exit_layer``) and the options of ``DistillOptions`` that
    apply (steps / epochs, batch_size in training positions (whole sequences of about that
    many positions in all), seq_len, lr, warmup, weight_decay,
    resume, overwrite, save_every, seed, cache_dir, dtype, and for the built-in data budget,
    gen_temp, answer_tokens, gen_batch, own_prompts, val_prompts, quiet).
    """
    exit_layer = options.pop("exit_layer", None)
    data_files = [Path(f).expanduser() for f in data_files or []]
    opts = DistillOptions(**options).for_data(builtin=not data_files)
    out = Path(out_dir).expanduser()
    inputs = [Path(model_dir).expanduser(), *data_files]
    plan = plan_output(out, opts, [p for p in inputs if p.exists()])
    progress = NullProgress() if opts.quiet or progress is None else progress
    if not plan.staged:
        return _run(model_dir, data_files, plan, opts, exit_layer, progress)
    shutil.rmtree(plan.work, ignore_errors=True)
    try:
        summary = _run(model_dir, data_files, plan, opts, exit_layer, progress)
        install_output(plan)
    except BaseException:
        shutil.rmtree(plan.work, ignore_errors=True)
        raise
    return summary


def _run(model_dir, data_files, plan, opts: DistillOptions, exit_layer, progress) -> dict:
    from .distill import load_serving

    tic = time.perf_counter()
    started = time.time()
    opts.feature_layers = "last"
    model, tokenizer, path, dtype = load_serving(model_dir, opts)
    n_layers = model.args.num_hidden_layers
    exit_layer = default_exit_layer(n_layers) if exit_layer is None else exit_layer
    try:
        check_exit_layer(exit_layer, n_layers)
    except ValueError as e:  # a flag's value: named by it, exit code 2
        raise ParamError("exit_layer", str(e)) from None
    check_draft_vocab(opts.draft_vocab, model.vocab_size)
    size = opts.draft_vocab
    if size is None and not data_files and model.vocab_size > 4 * AUTO_DRAFT_VOCAB:
        size = AUTO_DRAFT_VOCAB
    work = plan.work
    work.mkdir(parents=True, exist_ok=True)
    resumed = _resumed(work, opts)
    if resumed:  # before the data and the features: a changed setting is refused first
        _check_resume(plan.out, resumed["run"], opts, exit_layer, size)
    if data_files:
        train_seqs, held_seqs, data = _file_data(data_files, tokenizer, opts)
    else:
        train_seqs, held_seqs, data = _builtin_data(
            model, tokenizer, path, dtype, plan, opts, progress, started, resumed
        )
    progress.start("features (frozen model)", total=len(train_seqs) + len(held_seqs), unit="seq")
    try:
        examples, held = [], []
        for seqs, into in ((train_seqs, examples), (held_seqs, held)):
            for s in seqs:
                into.append(sequence_features(model, s, exit_layer))
                progress.update(1)
    finally:
        progress.stop()
    order = DataOrder(len(examples), batch_sequences(examples, opts.batch_size), opts.seed)
    if resumed:
        total = int(resumed["run"]["total_steps"])
    elif opts.steps is not None:
        total = opts.steps
    else:
        total = max(1, int((opts.epochs or 1.0) * order.per_epoch))
    run = dict(
        kind="early-exit",
        exit_layer=exit_layer,
        total_steps=total,
        batch_sequences=order.batch_size,
        batch_size=opts.batch_size,
        seed=opts.seed,
        data=data,
    )
    if size:
        run["draft_vocab"] = size
    trainer = AdapterTrainer(new_adapter(model, exit_layer, opts.seed), model, opts, total)
    if size:  # drafting reads these head rows only; training reads the whole head
        ids = shortlist_vocab(train_seqs, size, model.vocab_size, sorted(tokenizer.eos_token_ids))
        trainer.drafter.set_shortlist(ids)
        bind_head(model, trainer.drafter)
        progress.note(f"shortlist: {len(ids)} ids cover {coverage(train_seqs, ids):.1%} of the "
                      "training targets")  # fmt: skip
    start = 0
    if resumed:
        info = load_checkpoint(list_checkpoints(work)[-1], trainer)
        start = int(info["step"])
        progress.note(f"resuming from step {start} of {total}")
    config = trainer.drafter.args.to_config()
    history = []
    progress.start("training (adapter)", total=total - start, unit="steps")
    try:
        for step in range(start, total):
            batch = collate([examples[i] for i in order.batch(step)])
            loss, agree = trainer.step(batch)
            history.append(dict(step=step + 1, loss=loss, top1=agree))
            progress.update(1, loss=loss, top1=agree)
            done = step + 1
            if opts.save_every and done % opts.save_every == 0 and done < total:
                save_checkpoint(work, trainer, done, config, run)
    finally:
        progress.stop()
    if history or not list_checkpoints(work):
        save_checkpoint(work, trainer, total, config, run)
    scores = held_out_scores(model, trainer.drafter, held) if held else {}
    chains = chain_score(model, trainer.drafter, held) if held and not data_files else None
    result = dict(exit_layer=exit_layer, held_out=scores, chains=chains, data=data)
    (work / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    first = history[0]["loss"] if history else None
    tail = history[-max(1, len(history) // 10) :]
    return dict(
        out_dir=str(plan.out),
        kind="early-exit",
        exit_layer=exit_layer,
        steps=total,
        resumed_from=start,
        first_loss=first,
        final_loss=sum(h["loss"] for h in tail) / len(tail) if tail else None,
        history=history,
        eval=result,
        rank=0,
        seconds=round(time.perf_counter() - tic, 2),
    )


def _check_resume(out: Path, run: dict, opts: DistillOptions, exit_layer: int, size) -> None:
    """ValueError naming each setting (as its flag) that differs from the run being resumed:
    a resumed run continues the one it was started as (its exit layer, seed, batch, head
    shortlist and, when ``--steps`` is given, its step count), never a mix of two."""
    now = {"exit_layer": exit_layer, "seed": opts.seed, "draft_vocab": size or None}
    if "batch_size" in run:  # runs saved before it was recorded: not compared
        now["batch_size"] = opts.batch_size
    if opts.steps is not None:
        now["total_steps"] = opts.steps
    flags = {"total_steps": "--steps"}
    then = {k: run.get(k) for k in now}
    differ = [k for k in now if then[k] != now[k]]
    if differ:
        detail = ", ".join(
            f"{flags.get(k, '--' + k.replace('_', '-'))} {_shown(then[k])} (now {_shown(now[k])})"
            for k in differ
        )
        raise ValueError(
            f"{out} was trained with {detail}; resume with the same settings, or start over "
            "with --overwrite"
        )


def _shown(value) -> str:
    return "not given" if value is None else str(value)


def _resumed(work: Path, opts: DistillOptions) -> dict | None:
    """training_state.json of the newest checkpoint when resuming an early-exit run."""
    return resumed_state(work, "early-exit") if opts.resume else None


def _file_data(files, tokenizer, opts: DistillOptions):
    """Training and held-out sequences from data files (the last HELD_OUT_SHARE held out)."""
    seqs = [s for s in load_training_data(files, tokenizer, opts.seq_len) if any(s.train[1:])]
    if not seqs:
        raise ValueError(f"{[str(f) for f in files]} hold no training tokens")
    held = int(len(seqs) * HELD_OUT_SHARE) if len(seqs) >= 20 else 0
    train, val = seqs[: len(seqs) - held], seqs[len(seqs) - held :]
    return train, val, dict(files=files_digest(files), sequences=len(train), held_out=len(val))


def _builtin_data(model, tokenizer, path, dtype, plan, opts, progress, started, resumed):
    """The recurrent drafter's built-in data (``selfdata``, same folder and stages): each
    answer is a sequence of prompt + answer tokens, training on the answer's."""
    from .builtin import answered, self_data, within_positions
    from .selfdata import parse_budget, work_folder, work_key
    from .targets import model_fingerprint

    kind, amount = parse_budget(opts.budget)
    key = work_key(model_fingerprint(path, dtype), opts.gen_temp, opts.answer_tokens, opts.seed)
    folder = work_folder(plan.cache_root, key, ())
    data = self_data(folder, model, tokenizer, opts, _folder_features(folder))
    # the answer stage stops at the budget's answering share (half a time budget)
    run = resumed["run"] if resumed else None
    train_rows, val_rows, _ = answered(data, opts, kind, amount, started, run, progress)
    if kind == "positions" and not resumed:  # a larger earlier run's answers: the budget's
        train_rows = within_positions(train_rows, amount)
    if not train_rows:
        raise ValueError(f"the budget {opts.budget} left no time to answer any training prompt")

    def seq(r):
        p, a = list(r["prompt_ids"]), list(r["response_ids"])
        return Sequence(p + a, [False] * len(p) + [True] * len(a))

    data = dict(answers=len(train_rows), held_out_answers=len(val_rows), folder=folder.name)
    return [seq(r) for r in train_rows], [seq(r) for r in val_rows], data


def _folder_features(folder: Path):
    """The feature layers a reused self-data folder's rows hold (None: the final state)."""
    if "-f" not in folder.name:
        return None
    return tuple(int(i) for i in folder.name.rsplit("-f", 1)[1].split("."))
