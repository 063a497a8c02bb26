"""Replay lookup-alone speculation on recorded greedy text: the adaptive chooser against an
oracle and pinned chains, under step costs measured by ``bench --profile``.

    python -m scripts.experiments.lookup_policy_sim --model ~/.cache/redrafter-mlx/models/\
smollm2-135m-instruct --texts /tmp/ar.json --costs "K1xL2=1.14,K1xL4=1.41,K1xL8=1.70,K1xL16=2.44"

Greedy output does not depend on the shape that runs, so one plain-decoding answer per prompt
fixes every step's outcome: at each step start the lookup chain is the engine's own host mirror
(``LookupShadow``, the first chain ``lookup_chains`` proposes), and a chain of Lk tokens emits
``1 + min(accepted, Lk - 1)`` tokens. Policies:

* ``pinned``: one shape at every step;
* ``chooser``: the engine's ``ShapeChooser`` with the per-step choice from match states, fed
  the modelled step times (``--costs``, in plain-decoding steps) and the shadow, exactly as the
  generation loop feeds it; its state persists across prompts, as in ``chat`` and ``bench``;
* ``oracle``: each step the shape with the most tokens per unit cost, knowing the outcome (a
  bound no rule that decides before the step can pass).

Speedup = tokens / modelled time over plain decoding's. It leaves out what the model does not
set (host time per step, prefill), so compare rows with each other, not with ``bench``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.drafting.lookup import LookupShadow
from redrafter_mlx.engine.loop.adaptive import Adaptive, ShapeChooser


def record_texts(model_path: Path, sets: list[str], count: int, max_tokens: int) -> list[dict]:
    """Greedy plain-decoding answers: per prompt turn, its ids and the answer's ids."""
    from redrafter_mlx.cli.bench import build_prompts
    from redrafter_mlx.cli.common import load_engine
    from redrafter_mlx.cli.paths import resolve_paths
    from redrafter_mlx.engine.base.prompts import load_records
    from redrafter_mlx.engine.loop.generation import batch_generate

    engine = load_engine(resolve_paths(str(model_path), None), "float32", with_drafter=False)
    rows = []
    for spec in sets:
        records = load_records(spec, count, spread_categories=spec == "mt-bench")
        for item in build_prompts(engine, records, 2, None, max_tokens):
            out = batch_generate(
                engine.model, None, engine.tokenizer, [item.ids], max_tokens=max_tokens, adapt=False
            )[0]
            rows.append(dict(set=spec, turn=item.turn, prompt=list(item.ids), out=out))
            print(f"recorded {spec} turn {item.turn}: {len(rows)}", flush=True)
    return rows


def load_texts(
    model_path: Path,
    path: Path,
    max_tokens: int,
    sets: list[str] = ("edit", "mt-bench"),
    count: int = 16,
) -> list[dict]:
    """The recorded answers in ``path`` (``record_texts``), recorded there first if missing."""
    if not path.exists():
        texts = record_texts(model_path.expanduser(), list(sets), count, max_tokens)
        path.write_text(json.dumps(texts))
    return json.loads(path.read_text())


def replay(texts: list[dict], shapes: list[BeamShape], cost: dict, policy) -> tuple[float, float]:
    """(tokens per step, speedup over plain decoding) of ``policy`` over ``texts``.

    ``policy(match, accepted)`` -> ``(shape, done)``: the shape of a step that starts in match
    state ``match`` whose chain would have ``accepted`` drafts accepted (only the oracle
    looks), and ``done(shape, emitted, resolved)``, called with the step's outcome."""
    tokens = steps = seconds = 0.0
    horizon = max(s.chain_length for s in shapes if s.lookup) - 1
    for row in texts:
        prompt, out = row["prompt"], row["out"]
        shadow = LookupShadow([prompt + out[:1]], horizon)
        t = 1  # out[:t] is written; out[t - 1] is the init token
        while t < len(out):
            chain, match = shadow.chain(0), shadow.match(0)
            accepted = 0
            while accepted < len(chain) and t + accepted < len(out):
                if chain[accepted] != out[t + accepted]:
                    break
                accepted += 1
            shape, done = policy(match, accepted)
            emit = 1 if shape == AR else 1 + min(accepted, shape.chain_length - 1)
            emit = min(emit, len(out) - t)
            done(shape, emit, shadow.step(0, out[t : t + emit]))
            tokens, steps, seconds = tokens + emit, steps + 1, seconds + cost[shape]
            t += emit
    return tokens / steps, tokens / seconds


def pinned(shape):
    return lambda _m, _a: (shape, lambda *_: None)


def oracle(shapes, cost):
    def choose(_match, accepted):
        def rate(s):
            return (1 if s == AR else 1 + min(accepted, s.chain_length - 1)) / cost[s]

        return max(shapes, key=rate), lambda *_: None

    return choose


def chooser(shapes, cost):
    """The engine's chooser, fed modelled step times and the lookup shadow."""
    picker = ShapeChooser(shapes, start=shapes[1])

    def choose(match, _accepted):
        key = picker.next_shape([match])

        def done(shape, emit, resolved):
            picker.observe(shape, [emit], cost[shape])
            picker.observe_lookup(resolved)

        return key, done

    return choose


def parse_costs(text: str) -> dict:
    costs = {AR: 1.0}
    for part in text.split(","):
        label, value = part.split("=")
        costs[BeamShape.parse(label)] = float(value)
    return costs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--texts", required=True, help="JSON of recorded answers (made if missing)")
    ap.add_argument("--sets", default="edit,mt-bench")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--costs",
        default="K1xL2=1.14,K1xL4=1.41,K1xL8=1.70,K1xL16=2.44",
        help="seconds per step of each chain shape in plain-decoding steps (bench --profile)",
    )
    args = ap.parse_args(argv)
    texts = load_texts(
        Path(args.model), Path(args.texts), args.max_tokens, args.sets.split(","), args.num_prompts
    )
    cost = parse_costs(args.costs)
    default = Adaptive().candidates(BeamShape.lookup_only(1, 8))
    short = [*default, *(s for s in cost if s != AR and s not in default)]
    print("| set | policy | candidates | tokens/step | modelled speedup |")
    print("| --- | --- | --- | ---: | ---: |")
    groups = sorted({(t["set"], t["turn"]) for t in texts})
    for name, turn in groups:
        rows = [t for t in texts if (t["set"], t["turn"]) == (name, turn)]
        label = name if name == "edit" else f"{name} turn {turn}"
        # (policy, candidates shown, candidates replayed, policy function)
        runs = [(f"pinned {s.label}", "-", default, pinned(s)) for s in default if s != AR]
        for cands in (default, short):
            names = ", ".join(s.label for s in cands)
            runs += [
                ("chooser", names, cands, chooser(cands, cost)),
                ("oracle", names, cands, oracle(cands, cost)),
            ]
        for policy, names, cands, fn in runs:
            per_step, speedup = replay(rows, cands, cost, fn)
            print(f"| {label} | {policy} | {names} | {per_step:.2f} | {speedup:.2f}× |")


if __name__ == "__main__":
    main()
