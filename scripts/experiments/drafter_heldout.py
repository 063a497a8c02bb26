"""Teacher-forced accuracy of drafters on the model's own greedy answers to held-out prompts.

    python -m scripts.experiments.drafter_heldout \
        --model ~/.cache/redrafter-mlx/models/smollm2-135m-instruct \
        --drafter shipped=redrafter_mlx/smollm2_drafter --drafter new=/tmp/new

The model answers the first turns of a prompt set (MT-Bench by default: never in the built-in
training prompts) greedily, keeping every answer token's hidden states (the feature layers any
of the drafters reads besides the final normed state), once, in ``--work``; each drafter then
predicts the next T tokens at every answer position, fed the true tokens (``chain_score``):
per-draft-step top-1 accuracy and the W1 L4 chain estimate. Those are the figures a distill
run's held-out selection reports, here on a set no run selects on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from redrafter_mlx.engine.base.prompts import load_records
from redrafter_mlx.engine.loop.loading import load, load_drafter
from redrafter_mlx.train.evaluation import chain_score
from redrafter_mlx.train.selfdata import SelfData
from redrafter_mlx.train.training import shortlist_index


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter", action="append", required=True, help="NAME=PATH")
    ap.add_argument("--prompts", default="mt-bench")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=5, help="draft steps scored (T)")
    ap.add_argument("--work", default="/tmp/drafter-heldout")
    ap.add_argument("--by-category", action="store_true", help="also score each category")
    ap.add_argument("--out", help="write the rows as JSON here too")
    args = ap.parse_args(argv)
    model, _, tok = load(Path(args.model).expanduser(), None, "float32")
    drafters = {}
    for spec in args.drafter:
        name, path = spec.split("=", 1)
        drafters[name] = load_drafter(Path(path).expanduser(), model.dtype)
    read = {tuple(d.args.feature_layers or ()) for d in drafters.values()} - {()}
    if len(read) > 1:
        raise SystemExit(f"the drafters read different feature layers {sorted(read)}: score apart")
    layers = list(next(iter(read), ()))  # a last-layer drafter reads the first H values
    model.capture_features(layers)
    records = load_records(args.prompts, args.num_prompts)
    prompts = [dict(id=i, prompt=r.prompt, source=args.prompts) for i, r in enumerate(records)]
    work = (
        Path(args.work)
        / f"{Path(args.prompts).stem}-f{'.'.join(map(str, layers)) or 'last'}-{args.answer_tokens}"
    )
    data = SelfData(
        work, model, tok, temperature=0.0, answer_tokens=args.answer_tokens, batch=16, seed=0
    )
    rows = data.generate(prompts, lambda _n: False)
    category = {p["id"]: r.category or "-" for p, r in zip(prompts, records)}
    rows = [r for r in rows if r["id"] in category]
    groups = {"all": rows}
    if args.by_category:
        for r in rows:
            groups.setdefault(category[r["id"]], []).append(r)
    out = []
    for group, members in groups.items():
        val = data.targets(members, args.depth)
        validation = dict(hidden=val.hidden, tokens=val.tokens, valid=val.valid)
        for name, drafter in drafters.items():
            index = shortlist_index(drafter.args.draft_vocab, model.vocab_size)
            score = chain_score(drafter, model, validation, index, 4)
            row = dict(drafter=name, group=group, positions=int(val.valid[:, 0].sum()), **score)
            out.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
