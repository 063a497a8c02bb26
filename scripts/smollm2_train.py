"""Stage 3 of the SmolLM2 drafter build: training targets, then training with held-out selection.

Targets. Every answer in WORK/generations.jsonl is the model's own greedy output, so its
training targets are read off the answer (``targets="self"``). The hidden states come from
generation where it kept them (rows with a ``hidden`` field point into WORK/hidden/*.npy,
see ``redrafter_mlx.train.selfgen``); older rows get one forward per sequence, cached under
WORK/cache/forward-<key> (the key hashes those rows).

Selection. The distilled drafter over-fits its answers long before it stops improving on
new prompts (the first build: 3.89 tokens/step in-sample, 1.2 held out), so training keeps
the weights with the best held-out score: the teacher-forced acceptance chain on the
model's greedy answers to Vicuna-bench prompts (one batched pass, no decoding; it tracks
greedy W=1 tokens/step). MT-Bench is never used here: it stays the report.

Soft targets (``--soft-targets``, the default). Step k's target at position t is the model's
greedy draw at position t+k, whose hidden state is cached too (the next rows of the same
answer), so the model's whole distribution there is one matmul away: the loss is the
cross-entropy to it (``distill.teacher_targets``), which tells the drafter which other tokens
were likely, not only the winner.

Initialisation (``--head-init base``, an option). SmolLM2 ties its input and output
embeddings, so the model's own output head, restricted to the shortlist, can start the
drafter's vocabulary head (frozen with ``--freeze-head``), with ``input_proj`` the identity on
the hidden state.

Measured on the first build's 87k positions (Vicuna-bench chain score after 400 steps of
128): random init 1.292, base head frozen 1.305, base head trained 1.291, random init with
soft targets 1.331; after 200 steps soft targets from random init 1.301, from the frozen base
head 1.262. So the default is random init with soft targets.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from redrafter_mlx.train import distill as D
from redrafter_mlx.train.data import load_training_data
from redrafter_mlx.train.selfgen import Answer, answer_targets, greedy_with_hidden
from scripts.build_smollm2_drafter import log, read_jsonl, write_json_atomic, write_jsonl_atomic

SEQ_LEN = 512


def training_cache(work: Path, model, tok, depth: int) -> tuple[D.TargetCache, dict]:
    """All answers' training positions (hidden float16) and how they were obtained."""
    rows = read_jsonl(work / "generations.jsonl")
    kept = [r for r in rows if "hidden" in r]
    rest = [r for r in rows if "hidden" not in r]
    parts, facts = [], dict(answers=len(rows), from_generation=len(kept), from_forward=len(rest))
    if rest:
        parts.append(forward_targets(work, rest, model, tok, depth, facts))
    if kept:
        parts.append(generation_targets(work, kept, depth))
    hidden, tokens, valid = (np.concatenate([p[i] for p in parts]) for i in range(3))
    facts["positions"] = len(tokens)
    return D.TargetCache(work / "hidden", hidden, tokens, valid), facts


def forward_targets(work: Path, rows: list[dict], model, tok, depth: int, facts: dict):
    """Targets of answers generated without their hidden states: one forward per sequence."""
    data = work / "generations-forward.jsonl"
    write_jsonl_atomic(data, rows)
    key = D.cache_key("forward", D.files_digest([data]), SEQ_LEN, depth, "self")
    path = work / "cache" / f"forward-{key}"
    if not (path / "meta.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        seqs = load_training_data([data], tok, SEQ_LEN)
        log(f"targets: one forward for each of {len(seqs)} answers without hidden states")
        t0 = time.perf_counter()
        D.build_target_cache(model, seqs, depth, "self", path)
        facts["forward_seconds"] = round(time.perf_counter() - t0, 1)
    cache = D.TargetCache.open(path)
    return np.asarray(cache.hidden, np.float16), np.asarray(cache.tokens), np.asarray(cache.valid)


def generation_targets(work: Path, rows: list[dict], depth: int):
    """Targets of answers whose hidden states generation kept (WORK/hidden/<shard>.npy)."""
    shards: dict[str, np.ndarray] = {}
    hidden, tokens, valid = [], [], []
    for r in rows:
        name, at = r["hidden"]["shard"], r["hidden"]["offset"]
        if name not in shards:
            shards[name] = np.load(work / "hidden" / name, mmap_mode="r")
        n = len(r["response_ids"])
        ans = Answer(r["response_ids"], r["finish"], shards[name][at : at + n])
        h, t, v = answer_targets(ans, depth)
        hidden.append(h), tokens.append(t), valid.append(v)
    return np.concatenate(hidden), np.concatenate(tokens), np.concatenate(valid)


def validation_set(work: Path, model, tok, depth: int, prompts: int, tokens: int) -> dict:
    """Greedy answers to Vicuna-bench prompts with their targets (cached in WORK)."""
    from redrafter_mlx.engine.prompts import load_prompts

    path = work / f"val-vicuna-{prompts}x{tokens}-T{depth}.npz"
    if not path.exists():
        texts = load_prompts("vicuna-bench", prompts)
        ids = [tok.chat_prompt([{"role": "user", "content": t}]) for t in texts]
        parts = []
        for i in range(0, len(ids), 16):
            for ans in greedy_with_hidden(model, ids[i : i + 16], tokens, tok.eos_token_ids):
                parts.append(answer_targets(ans, depth))
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.npz")
        np.savez(tmp, **{k: np.concatenate([p[i] for p in parts]) for i, k in enumerate("htv")})
        os.replace(tmp, path)
    z = np.load(path)
    return dict(hidden=z["h"], tokens=z["t"], valid=z["v"])


def chain_score(drafter, model, val: dict, index: np.ndarray | None, length: int = 4) -> dict:
    """Teacher-forced acceptance on held-out answers: per-step top-1 accuracy (T,) and the
    mean accepted run + 1 with ``length - 1`` draft tokens (greedy W=1 tokens/step estimate)."""
    tokens = val["tokens"]
    targets = tokens[:, 1:] if index is None else index[tokens[:, 1:]]
    ok = val["valid"] & (targets >= 0)
    hidden = mx.array(val["hidden"]).astype(mx.float32)
    emb = model.embed(mx.array(tokens[:, :-1])).astype(mx.float32)
    state = mx.zeros(hidden.shape, dtype=mx.float32)
    hits = []
    for k in range(tokens.shape[1] - 1):
        state = drafter.next_state(state, emb[:, k])
        pred = np.array(mx.argmax(drafter(hidden, state), axis=-1))
        hits.append((pred == np.maximum(targets[:, k], 0)) & ok[:, k])
    hits = np.stack(hits, axis=1)
    run = np.cumprod(hits, axis=1)[:, : length - 1].sum(axis=1)
    return dict(acc=hits.mean(axis=0).round(3).tolist(), score=round(1 + float(run.mean()), 4))


def init_from_base(drafter, model, vocab: list[int] | None, freeze_head: bool) -> None:
    """Start from the model's own (tied) output head and an identity ``input_proj``."""
    if not model.args.tie_word_embeddings:
        raise ValueError("--head-init base needs a model with tied input/output embeddings")
    E = model.model.embed_tokens.weight
    rows = E if vocab is None else E[mx.array(vocab)]
    drafter.lm_head[-1].weight = rows.astype(mx.float32)
    H, E_dim = model.hidden_size, drafter.args.exit_dim
    if "input_proj" in drafter:
        if E_dim != H:
            raise ValueError("--head-init base needs --exit-dim equal to the hidden size")
        eye = mx.concatenate([mx.eye(H), mx.zeros((H, H))], axis=1)
        drafter.input_proj.weight = eye + 0.01 * mx.random.normal(eye.shape)
        drafter.input_proj.bias = mx.zeros((H,))
    for block in drafter.lm_head[:-1]:
        block.linear.weight = 0.1 * block.linear.weight
    if freeze_head:
        drafter.lm_head[-1].freeze()
    mx.eval(drafter.parameters())


def train(work: Path, a) -> dict:
    """Train with periodic held-out selection; resumable from WORK/train/checkpoints.

    The best-scoring weights so far are in WORK/drafter (config.json + model.safetensors,
    ``selected`` in the config), the history in WORK/drafter/selection.json.
    """
    from scripts.build_smollm2_drafter import load_engine

    _, model, tok = load_engine()
    depth = a.predict_tokens
    t0 = time.perf_counter()
    cache, facts = training_cache(work, model, tok, depth)
    seqs = [r["response_ids"] for r in read_jsonl(work / "generations.jsonl")]
    vocab = shortlist(seqs, a.draft_vocab, model.vocab_size, tok.eos_token_ids)
    index = D.shortlist_index(vocab, model.vocab_size)
    val = validation_set(work, model, tok, depth, a.val_prompts, a.val_tokens)
    facts.update(shortlist=len(vocab), val_positions=len(val["tokens"]))
    facts["prepare_seconds"] = round(time.perf_counter() - t0, 1)
    log(f"train: {facts}")

    opts = D.DistillOptions(
        predict_tokens=depth,
        layers=a.layers,
        exit_dim=int(a.exit_dim),
        lr=a.lr,
        weight_decay=a.weight_decay,
        batch_size=a.train_batch,
        seed=a.seed,
    ).validate()
    drafter = D.new_drafter(D.drafter_args(model, opts, vocab), a.seed)
    if a.head_init == "base":
        init_from_base(drafter, model, vocab, a.freeze_head)
    trainer = D.Trainer(drafter, opts, a.steps)
    order = D.DataOrder(cache.size, a.train_batch, a.seed)
    run = dict(
        positions=cache.size,
        steps=a.steps,
        batch=a.train_batch,
        every=a.every,
        lr=a.lr,
        weight_decay=a.weight_decay,
        layers=a.layers,
        exit_dim=int(a.exit_dim),
        draft_vocab=a.draft_vocab,
        head_init=a.head_init,
        freeze_head=a.freeze_head,
        soft_targets=a.soft_targets,
        seed=a.seed,
    )
    ckpt_dir, out = work / "train", work / "drafter"
    out.mkdir(parents=True, exist_ok=True)
    sel_path = out / "selection.json"
    start, history, best = 0, [], -1.0
    existing = D.list_checkpoints(ckpt_dir)
    if existing:
        info = D.load_checkpoint(existing[-1], trainer)
        if info["run"] != run:
            raise SystemExit(
                f"{ckpt_dir} holds a run with other settings ({info['run']}); move it away "
                f"to start over"
            )
        start = int(info["step"])
        prev = json.loads(sel_path.read_text())
        history = [h for h in prev["history"] if h["step"] <= start]
        best = max((h["score"] for h in history), default=-1.0)
        log(f"train: resumed at step {start}")
    config = D.drafter_config(drafter.args, depth, "self")
    tic, seen = time.perf_counter(), 0
    for step in range(start + 1, a.steps + 1):
        idx = order.batch(step - 1)
        batch = D.read_batch(cache, model, idx, index)
        if a.soft_targets:
            batch += D.teacher_targets(cache, model, idx, vocab)
        loss, _, accs = trainer.step([batch])
        seen += a.train_batch
        if step % a.every and step != a.steps:
            continue
        score = chain_score(drafter, model, val, index)
        secs = time.perf_counter() - tic
        rec = dict(
            step=step,
            loss=round(loss.item(), 4),
            train_acc=[round(x, 3) for x in accs.tolist()],
            val_acc=score["acc"],
            score=score["score"],
            positions_per_s=round(seen / secs, 1),
        )
        history.append(rec)
        log(f"train: {json.dumps(rec)}")
        if score["score"] > best:
            best = score["score"]
            cfg = dict(config, selected=dict(step=step, vicuna_bench_chain_w1l4=best))
            tmp = out.parent / f".drafter.tmp-{os.getpid()}"
            tmp.mkdir(exist_ok=True)
            D.write_drafter_files(tmp, drafter, cfg)
            for name in ("config.json", "model.safetensors"):
                os.replace(tmp / name, out / name)
            tmp.rmdir()
        D.save_checkpoint(ckpt_dir, trainer, step, config, run)
        write_json_atomic(sel_path, dict(run=run, data=facts, history=history, best=best))
    log(f"train: best held-out chain score {best} -> {out}")
    return dict(run=run, data=facts, history=history, best=best)


def shortlist(responses: list[list[int]], size: int, vocab_size: int, always) -> list[int]:
    """The ``size`` most frequent answer tokens (FR-Spec), end-of-turn ids first; ascending."""
    from redrafter_mlx.train.data import Sequence

    seqs = [Sequence(list(r), [True] * len(r)) for r in responses]
    return D.shortlist_vocab(seqs, size, vocab_size, sorted(always))
