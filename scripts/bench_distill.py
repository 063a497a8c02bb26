"""Positions/s of distill's two heavy stages, answering and training, on this machine.

    python -m scripts.bench_distill                      # both stages, the shipped recipe
    python -m scripts.bench_distill --stage train --exit-dim auto --feature-layers auto

**answers**: ``SelfData.generate`` (the answer stage of ``distill`` without ``--data``) on
``--prompts`` built-in prompts (a fixed random draw), greedy, ``--answer-tokens`` per answer,
batches of ``--gen-batch``, ``--lanes`` batches at once (a list compares them in one run and
says whether their answers are the same), in a temporary folder; positions/s = answer
positions / seconds.

**training**: ``Trainer.step`` on batches of ``--batch-size`` positions with soft targets
(``teacher_targets``) from a synthetic cache of the model's width (random hidden states and
tokens: the cost depends on the shapes, not the values), ``--draft-vocab`` head ids, ``T=5``;
three warm-up steps, then ``--steps`` timed; positions/s = positions / seconds.

Run it with the code before and after a change, on a quiet machine, back to back; the
figures in redrafter_mlx/smollm2_drafter/BUILD.md came from it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path

import mlx.core as mx
import numpy as np


def answers_per_s(
    model, tokenizer, prompts: int, batch: int, answer_tokens: int, lanes: int
) -> tuple:
    """(positions, seconds, {prompt id: answer ids}) of answering ``prompts`` built-in
    prompts, ``lanes`` batches at a time."""
    from redrafter_mlx.train.selfdata import SelfData, builtin_prompts

    rows = builtin_prompts()
    order = np.random.default_rng(1).permutation(len(rows))[:prompts]
    todo = [dict(id=int(i), **rows[i]) for i in order]
    work = Path(tempfile.mkdtemp(prefix="bench-distill-"))
    try:
        settings = dict(
            temperature=0.0, answer_tokens=answer_tokens, batch=batch, seed=0, lanes=lanes
        )
        data = SelfData(work, model, tokenizer, **settings)
        t = time.perf_counter()
        out = data.generate(todo, lambda _made: False)
        seconds = time.perf_counter() - t
    finally:
        shutil.rmtree(work, ignore_errors=True)
    answers = {r["id"]: r["response_ids"] for r in out}
    return sum(len(r["response_ids"]) for r in out), seconds, answers


def training_per_s(model, args) -> tuple:
    """(positions, seconds) of ``args.steps`` training steps on a synthetic cache."""
    from redrafter_mlx.train.targets import TargetCache
    from redrafter_mlx.train.training import (
        DataOrder,
        Trainer,
        drafter_args,
        new_drafter,
        read_batch,
        shortlist_index,
        teacher_targets,
    )

    P, T = 60_000, 5
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((P, model.state_width)).astype(np.float16)
    draft_vocab = list(range(args.draft_vocab))
    run = rng.integers(0, args.draft_vocab, P + T + 1).astype(np.int32)
    tokens = np.stack([run[i : i + P] for i in range(T + 1)], axis=1)
    cache = TargetCache(Path(tempfile.gettempdir()), hidden, tokens, np.ones((P, T), bool))
    opts = types.SimpleNamespace(
        exit_dim=args.exit_dim, layers=2, rnn=True, grad_accum=1, lr=1e-3, warmup=0.1,
        weight_decay=0.1,
    )  # fmt: skip
    trainer = Trainer(new_drafter(drafter_args(model, opts, draft_vocab), 0), opts, 1000)
    index = shortlist_index(draft_vocab, model.vocab_size)
    order = DataOrder(P, args.batch_size, 0)

    def batch(micro):
        idx = order.batch(micro)
        soft = teacher_targets(cache, model, idx, draft_vocab)
        return read_batch(cache, model, idx, index) + soft

    for micro in range(3):
        trainer.step([batch(micro)])
    t = time.perf_counter()
    for micro in range(3, 3 + args.steps):
        trainer.step([batch(micro)])
    return args.steps * args.batch_size, time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the bundled SmolLM2)")
    p.add_argument("--stage", choices=("answers", "train", "both"), default="both")
    p.add_argument("--feature-layers", default="last", help="last | auto | i,j,k")
    p.add_argument("--prompts", type=int, default=192)
    p.add_argument("--gen-batch", type=int, default=48)
    p.add_argument("--answer-tokens", type=int, default=160)
    p.add_argument(
        "--lanes", default="auto", help="batches answered at once: auto, or a list (1,2)"
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--exit-dim", default="576", help="drafter width, or auto (2H)")
    p.add_argument("--draft-vocab", type=int, default=8192)
    args = p.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from redrafter_mlx.engine.base.platform import fit_blas_threads
    from redrafter_mlx.engine.base.tokenizer import load_tokenizer
    from redrafter_mlx.engine.loop.loading import load_model
    from redrafter_mlx.train.training import resolve_feature_layers

    if args.model is None:
        from weights_convert.smollm2 import smollm2_path

        args.model = smollm2_path()
    model, path = load_model(args.model, dtype=mx.float32)
    fit_blas_threads(model)  # the BLAS threads distill runs with
    model.capture_features(resolve_feature_layers(args.feature_layers, model))
    table = Table(title=f"{Path(path).name} · features {args.feature_layers}")
    for name in ("stage", "shape", "positions", "seconds", "positions/s"):
        table.add_column(name, justify="left" if name in ("stage", "shape") else "right")
    if args.stage in ("answers", "both"):
        from redrafter_mlx.engine.base.platform import answer_lanes

        tok = load_tokenizer(path)
        lanes = [answer_lanes()] if args.lanes == "auto" else map(int, args.lanes.split(","))
        first = None
        for n_lanes in lanes:
            n, s, answers = answers_per_s(
                model, tok, args.prompts, args.gen_batch, args.answer_tokens, n_lanes
            )
            first = answers if first is None else first
            same = "same answers" if answers == first else "ANSWERS DIFFER"
            shape = (
                f"{args.prompts} prompts, batch {args.gen_batch}, ≤{args.answer_tokens} "
                f"tokens, {n_lanes} lane{'s' * (n_lanes > 1)} ({same})"
            )
            table.add_row("answers", shape, f"{n:,}", f"{s:.1f}", f"{n / s:.1f}")
    if args.stage in ("train", "both"):
        n, s = training_per_s(model, args)
        shape = f"batch {args.batch_size}, exit {args.exit_dim}, head {args.draft_vocab}, T 5"
        table.add_row("training", shape, f"{n:,}", f"{s:.1f}", f"{n / s:.1f}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
