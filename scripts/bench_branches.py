"""APAR parallel branches, measured: the same model with branches off and on, with plain
decoding and with speculation in every branch, on list requests and on prompts that do not
ask for lists; and the answers' quality under the original model.

    python -m scripts.bench_branches                       # smollm2-apar, scored by smollm2
    python -m scripts.bench_branches --num-prompts 4 --max-tokens 128 --answers docs/bench/x.md

Prompt sets: ``lists`` (MT-Bench writing and humanities, asks for tips or steps on held-out
topics) and MT-Bench's other categories (``--rest``). Every prompt runs its variants
(plain, speculative pinned, adaptive as chat runs it; each with branches off and on) one
after another, so machine noise falls on all
alike; greedy. Per set and variant: forks per answer (branches past the root), sequential
steps per answer (the loop's steps: branches decode side by side), tokens per answer (all
branches), seconds per answer (prefill included) and tokens/s over those seconds; the
ratios are against branches off with the same decoding (``decoded``: every branch's tokens,
those written past the answer's end included). The ``no fork`` rows repeat the prompts of
both sets on which no variant forked: what branches cost where they are never used.
Quality: the original model's (``--score-model``) mean log-likelihood per token of each
answer (branches on: the rebuilt text) after the prompt, against that of the same model's
answers with branches off.
Numbers, not assertions.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from rich.console import Console
from rich.table import Table

from redrafter_mlx.cli.common import load_engine
from redrafter_mlx.cli.paths import resolve_paths
from redrafter_mlx.engine.base.prompts import load_records
from redrafter_mlx.engine.base.tokenizer import load_tokenizer
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.loop.generation import stream_generate
from redrafter_mlx.engine.loop.plan import default_plan

LIST_CATEGORIES = ("writing", "humanities")  # MT-Bench's, in the lists set
NO_FORK = "no fork"  # the prompts of both sets on which no variant forked


@dataclass
class Tally:
    """One variant's sums over a set's prompts."""

    answers: int = 0
    forks: int = 0
    steps: int = 0
    tokens: int = 0  # the answers' (rebuilt text)
    decoded: int = 0  # every branch's tokens
    seconds: float = 0.0
    loglik: float = 0.0  # sum of per-answer means
    texts: list = field(default_factory=list)

    def add(self, forks, steps, tokens, seconds, text, decoded) -> None:
        self.answers += 1
        self.decoded += decoded
        self.forks += forks
        self.steps += steps
        self.tokens += tokens
        self.seconds += seconds
        self.texts.append(text)


def answer(model, drafter, tok, prompt, shape, adapt, branches, max_tokens, sampler):
    """One greedy answer: (text, answer tokens, steps, forks, seconds, decoded tokens: every
    branch's, those past the answer's end included)."""
    ids = tok.chat_prompt([{"role": "user", "content": prompt}])
    text, tokens, final = [], 0, None
    tic = time.perf_counter()
    for r in stream_generate(
        model, drafter, tok, ids, max_tokens=max_tokens, shape=shape, adapt=adapt,
        branches=branches, sampler=sampler,
    ):  # fmt: skip
        text.append(r.text)
        tokens += len(r.tokens)
        final = r
    seconds = time.perf_counter() - tic
    forks = max(final.branches - 1, 0)
    return "".join(text), tokens, final.steps, forks, seconds, final.generation_tokens


def mean_loglik(scorer, tok, prompt: str, text: str) -> float:
    """The scoring model's mean log-likelihood per token of ``text`` after ``prompt``."""
    ids = tok.chat_prompt([{"role": "user", "content": prompt}])
    answer_ids = tok.encode(text, add_bos=False) if text else []
    if not answer_ids:
        return 0.0
    x = mx.array([ids + answer_ids])
    logits = scorer(x[:, :-1]).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    target = x[:, 1:]
    picked = mx.take_along_axis(logp, target[..., None], axis=-1)[0, :, 0]
    return float(picked[len(ids) - 1 :].mean())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-apar")
    p.add_argument("--drafter", default=None, help="drafter folder (default: the model's own)")
    p.add_argument("--score-model", default="smollm2", help="the original model, for quality")
    p.add_argument("--num-prompts", type=int, default=12, help="per set")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--shape", default=None, help="speculative shape (default: the model's plan)")
    p.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="greedy with this penalty (1: off)"
    )
    p.add_argument("--no-adaptive", action="store_true", help="leave out the adaptive rows")
    p.add_argument("--answers", type=Path, default=None, help="write answers side by side (md)")
    p.add_argument("--json", type=Path, default=None, help="write the raw tallies")
    args = p.parse_args(argv)

    engine = load_engine(resolve_paths(args.model, args.drafter), None)  # as chat resolves
    model, drafter, tok = engine.model, engine.drafter, engine.tokenizer
    sampler = SamplerConfig(repetition_penalty=args.repetition_penalty)
    spec = BeamShape.parse(args.shape) if args.shape else default_plan(drafter).shape
    plain = BeamShape.autoregressive()
    lists = [r.prompt for r in load_records("lists", 40)]
    list_tips = lists[20:]  # the held-out asks for tips or steps
    list_mt = lists[:20]
    half = args.num_prompts // 2
    sets = {
        "lists": list_mt[: args.num_prompts - half] + list_tips[:half],
        "rest": [
            r.prompt for r in load_records("mt-bench", 80) if r.category not in LIST_CATEGORIES
        ][:: max(60 // args.num_prompts, 1)][: args.num_prompts],
    }
    variants = [("plain", plain, False), (f"spec {spec.label}", spec, False)]
    if not args.no_adaptive:  # what chat runs: the shape chosen per batch size
        variants.append(("adaptive", spec, True))
    groups = [*sets, NO_FORK]
    tallies = {(s, v, b): Tally() for s in groups for v, _, _ in variants for b in ("off", "on")}
    never: list[str] = []  # the prompts no variant forked on, from every set
    console = Console(width=200)
    for name, prompts in sets.items():
        for i, prompt in enumerate(prompts):
            got = {}
            for v, shape, adapt in variants:
                for b in ("off", "on"):
                    got[(v, b)] = answer(
                        model, drafter, tok, prompt, shape, adapt, b, args.max_tokens, sampler
                    )  # (text, tokens, steps, forks, seconds, decoded)
            groups = [name] + ([NO_FORK] if all(r[3] == 0 for r in got.values()) else [])
            for group in groups:
                for (v, b), (text, tokens, steps, forks, seconds, decoded) in got.items():
                    tallies[(group, v, b)].add(forks, steps, tokens, seconds, text, decoded)
            if NO_FORK in groups:
                never.append(prompt)
            console.print(f"{name} {i + 1}/{len(prompts)}", end="\r")
    sets[NO_FORK] = never
    del model, drafter
    import mlx_lm

    score_dir = resolve_paths(args.score_model, None).model
    scorer, _ = mlx_lm.load(score_dir)  # the reference forward
    score_tok = load_tokenizer(score_dir)
    for (name, _, _), t in tallies.items():
        t.loglik = sum(mean_loglik(scorer, score_tok, q, a) for q, a in zip(sets[name], t.texts))

    what = f"greedy, repetition penalty {args.repetition_penalty}, max {args.max_tokens} tokens"
    table = Table(title=f"{args.model}: branches off vs on, {what}")
    columns = ("set", "decoding", "branches", "forks/ans", "steps/ans", "tok/ans", "decoded/ans",
               "s/ans", "tok/s", "fewer steps", "speed", "steps vs plain", "speed vs plain",
               "loglik/tok")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col in ("set", "decoding") else "right")

    def rate(t: Tally) -> float:
        return t.tokens / t.seconds if t.seconds else 0.0

    for (name, v, b), t in tallies.items():
        if not t.answers:
            continue  # (no prompt went without a fork)
        off, plain_off = tallies[(name, v, "off")], tallies[(name, "plain", "off")]
        n = max(t.answers, 1)
        table.add_row(
            name, v, b, f"{t.forks / n:.1f}", f"{t.steps / n:.0f}", f"{t.tokens / n:.0f}",
            f"{t.decoded / n:.0f}", f"{t.seconds / n:.2f}", f"{rate(t):.1f}",
            f"{off.steps / max(t.steps, 1):.2f}x", f"{rate(t) / max(rate(off), 1e-9):.2f}x",
            f"{plain_off.steps / max(t.steps, 1):.2f}x",
            f"{rate(t) / max(rate(plain_off), 1e-9):.2f}x", f"{t.loglik / n:.3f}",
        )  # fmt: skip
    console.print(table)
    console.print(
        "tok/ans: the answer's (rebuilt text, at most --max-tokens); decoded/ans: every "
        "branch's tokens; tok/s: answer tokens over wall time, prefill included; fewer steps, "
        "speed: branches off / on with the same decoding; ... vs plain: against plain decoding "
        "with branches off; loglik/tok: the original model's "
        "mean log-likelihood per token of the answers"
    )
    if args.json:
        raw = {"|".join(k): {**t.__dict__, "texts": None} for k, t in tallies.items()}
        args.json.write_text(json.dumps(raw, indent=1) + "\n")
    if args.answers:
        lines = [f"# {args.model}: answers with branches off and on ({what}, plain decoding)\n"]
        for name, prompts in sets.items():
            if name == NO_FORK:
                continue
            off, on = tallies[(name, "plain", "off")], tallies[(name, "plain", "on")]
            for q, a, b in list(zip(prompts, off.texts, on.texts))[:3]:
                lines += [f"## {q}\n", "### branches off\n", a.strip() + "\n"]
                lines += ["### branches on (rebuilt)\n", b.strip() + "\n"]
        args.answers.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
