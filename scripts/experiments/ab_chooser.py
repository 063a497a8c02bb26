"""Interleaved A/B of adaptive-chooser settings on the model, in one process.

    python -m scripts.experiments.ab_chooser \
        --model ~/.cache/redrafter-mlx/models/smollm2-135m-instruct \
        --texts /tmp/ar.json --arm A --arm B:run_decay=0.8 --arm C:max_probe=32

Each arm is a name and ``ShapeChooser`` fields to set (``name:field=value,field=value``; a bare
name keeps the defaults). Every arm keeps its own learnt adaptive state across the prompt turns,
as ``chat`` and ``bench`` do; the arms take turns on each prompt turn in an order that rotates,
so machine noise hits them alike. The prompt turns are those of
``scripts.experiments.lookup_policy_sim`` (``--texts``, recorded there if missing), whose
recorded plain-decoding answers also check that every run of every arm produced the same
tokens. Reported per set and turn: decode tokens/s (after the first token), tokens/step, the
ratio to the first arm, and the shapes run most.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.loop.adaptive import Adaptive, ShapeChooser


@dataclass
class Arm(Adaptive):
    """``Adaptive`` whose chooser gets ``settings`` (ShapeChooser field -> value)."""

    settings: dict = field(default_factory=dict)

    def new_chooser(self, shapes, start):
        chooser = super().new_chooser(shapes, start)
        for name, value in self.settings.items():
            setattr(chooser, name, value)
        return chooser


def parse_arm(text: str) -> tuple[str, dict]:
    """``"B:run_decay=0.8,max_probe=32"`` -> ``("B", {"run_decay": 0.8, "max_probe": 32})``."""
    name, _, rest = text.partition(":")
    known = {f.name for f in fields(ShapeChooser)}
    settings = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in known:
            raise SystemExit(f"--arm {text}: ShapeChooser has no field {key!r}")
        settings[key] = json.loads(value)
    return name, settings


def run(engine, texts: list[dict], arms: dict[str, Arm], shape: BeamShape, max_tokens: int):
    """Per (set, turn, arm): [tokens after the first, steps, seconds, Counter of shapes]."""
    from redrafter_mlx.engine.loop.generation import generate_steps

    names, totals = list(arms), {}
    for i, item in enumerate(texts):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            tokens, steps, start = [], 0, None
            events = generate_steps(
                engine.model,
                engine.drafter,
                [item["prompt"]],
                max_tokens=max_tokens,
                shape=shape,
                adapt=arms[name],
                eos_token_ids=engine.tokenizer.eos_token_ids,
            )
            for event in events:
                tokens += event.tokens[0]
                if start is None:
                    start = time.perf_counter()  # decode time starts after the first token
                else:
                    steps += 1
            seconds = time.perf_counter() - start
            if tokens != item["out"]:
                raise SystemExit(f"arm {name}, prompt turn {i}: output differs from plain decoding")
            row = totals.setdefault((item["set"], item["turn"], name), [0, 0, 0.0, Counter()])
            row[0] += len(tokens) - 1
            row[1] += steps
            row[2] += seconds
            row[3].update(s.label for s in arms[name].history)
        print(f"prompt turn {i + 1}/{len(texts)}", flush=True)
    return totals


def report(totals, names: list[str]) -> None:
    for s, turn in sorted({(k[0], k[1]) for k in totals}):
        first = totals[(s, turn, names[0])]
        line = f"{s} turn {turn}:"
        for name in names:
            tok, steps, sec, _ = totals[(s, turn, name)]
            ratio = (tok / sec) / (first[0] / first[2])
            line += f" | {name} {tok / sec:.1f} tok/s {tok / steps:.2f} ({ratio:.3f})"
        print(line)
        for name in names:
            shapes = totals[(s, turn, name)][3]
            n = sum(shapes.values())
            top = ", ".join(f"{k} {v / n:.0%}" for k, v in shapes.most_common(5))
            print(f"   {name}: {top}; plain decoding {shapes['AR'] / n:.0%}")


def main(argv=None) -> None:
    from redrafter_mlx.cli.common import load_engine
    from redrafter_mlx.cli.paths import resolve_paths
    from scripts.experiments.lookup_policy_sim import load_texts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--texts", required=True, help="JSON of recorded answers (made if missing)")
    ap.add_argument("--arm", action="append", required=True, help="name[:field=value,...]")
    ap.add_argument("--shape", default="W1xL4+K1xL8", help="the requested (default) shape")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    arms = {name: Arm(settings=settings) for name, settings in map(parse_arm, args.arm)}
    engine = load_engine(resolve_paths(args.model, None), None, with_drafter=True)
    texts = load_texts(Path(args.model), Path(args.texts), args.max_tokens)
    totals = run(engine, texts, arms, BeamShape.parse(args.shape), args.max_tokens)
    print("arms: " + "; ".join(args.arm) + "; every run = plain decoding")
    report(totals, list(arms))


if __name__ == "__main__":
    main()
