"""Build an APAR (parallel branches) SmolLM2 with LoRA (make smollm2-apar).

    python -m scripts.build_smollm2_apar                       # the full recipe, resumable
    python -m scripts.build_smollm2_apar --prompts 16 --answer-tokens 256 --iters 4   # smoke

1. Answers: SmolLM2-135M-Instruct's own greedy answers (a conversation's first turn only),
   appended to ``answers.jsonl`` in the work folder, so a rerun answers only what is missing.
   The prompts: ``--list-share`` of them ask for a list (``LIST_TEMPLATES`` over the
   distillation topics, ``train.selfdata.ASKS_FILE``; the ``lists`` bench set's topics are
   held out), the rest are the built-in prompts (``train.selfdata.builtin_prompts``), both
   in a seeded order. SmolLM2 answers most list requests as ``N. **Title** - details``.
2. Data: each answer (one cut at the token limit ends at its last paragraph break) made a
   paragraph tree by rule (``train.apar_data``), the counts per rule printed; structured and
   unstructured samples mixed half and half; each branch one causal sequence with its loss
   after the last child token (``data.jsonl``).
3. Training: mlx-lm's LoRA trainer with the split tokens added to the vocabulary (the
   embedding and its tied head grow by two trainable rows); checkpoints every
   ``--save-every`` steps, a rerun resumes from the newest (``train.apar_lora``).
4. The adapter (LoRA matrices and the two new embedding rows, ~2.6 MB) into the package,
   ``redrafter_mlx/smollm2_apar/`` (``--out``), and fused into ``HOME/models/smollm2-apar``
   (``weights_convert.smollm2_apar``, what ``make smollm2`` runs): ``--model smollm2-apar``
   (with ``--model DIR``: into ``WORK/model``).

Work folder: HOME/build/smollm2-apar (``engine.base.bundled.home()``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from redrafter_mlx.engine.base.bundled import (
    SMOLLM2_APAR_ADAPTER,
    home,
    smollm2_apar_path,
    smollm2_path,
)
from redrafter_mlx.train.apar_data import (
    SplitIds,
    branch_sequences,
    mixed_samples,
    paragraph_tree,
    rule_counts,
    trim_cut,
)
from redrafter_mlx.train.apar_lora import (
    LoraSettings,
    add_split_tokens,
    prepare_model,
    save_adapter,
    split_rows_start,
    train,
)
from redrafter_mlx.train.selfdata import ASKS_FILE, append_jsonl, builtin_prompts, read_jsonl

# Requests for a list, filled with a distillation topic and a count; the ``lists`` bench set
# (redrafter_mlx/data/list_prompts.jsonl) asks about other topics.
LIST_TEMPLATES = (
    "Give me {n} tips for {topic}.",
    "What are {n} ways to get better at {topic}?",
    "List {n} common mistakes people make with {topic} and how to avoid them.",
    "What are the main benefits of {topic}? Answer with a numbered list.",
    "What are the key steps to get started with {topic}?",
    "Suggest {n} ideas for a weekend project about {topic}.",
    "What should a beginner know about {topic}? List the essentials.",
    "Name {n} important facts about {topic}.",
)
COUNTS = ("three", "four", "five", "six")
POOL = 560  # prompts in the seeded mix that --prompts takes a prefix of


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="SmolLM2 folder (default: make smollm2's)")
    p.add_argument("--work", type=Path, default=None, help="work folder (resumable)")
    p.add_argument(
        "--out", type=Path, default=SMOLLM2_APAR_ADAPTER, help="adapter folder (the package's)"
    )
    p.add_argument("--prompts", type=int, default=224, help="prompts to answer")
    p.add_argument("--list-share", type=float, default=0.65, help="share asking for a list")
    p.add_argument("--answer-tokens", type=int, default=256, help="most tokens per answer")
    p.add_argument("--gen-batch", type=int, default=16, help="prompts answered per batch")
    p.add_argument("--iters", type=int, default=200, help="training steps in all")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--save-every", type=int, default=20, help="steps between checkpoints")
    p.add_argument("--lora-layers", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4, help="LoRA's learning rate")
    p.add_argument("--rows-lr", type=float, default=5e-3, help="the split tokens' rows' rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stop-after", choices=("answers", "data"), default=None, help="stop after a stage"
    )
    return p.parse_args(argv)


def list_prompts(seed: int) -> list[str]:
    """Every list request (``LIST_TEMPLATES`` x topics, a seeded count each), seeded order."""
    topics = [r["topic"] for r in read_jsonl(ASKS_FILE) if "topic" in r]
    rng = random.Random(f"apar-lists/{seed}")
    out = [t.format(n=rng.choice(COUNTS), topic=topic) for t in LIST_TEMPLATES for topic in topics]
    rng.shuffle(out)
    return out


def training_prompts(n: int, list_share: float, seed: int) -> list[str]:
    """The first ``n`` prompts of a seeded mix of ``max(n, POOL)``: ``list_share`` of them
    list requests, the rest built-in prompts. Fewer prompts are a prefix of more (a run
    with a smaller ``--prompts`` reuses the answers of a larger one)."""
    pool = max(n, POOL)
    lists = list_prompts(seed)[: round(pool * list_share)]
    others = [r["prompt"] for r in builtin_prompts()]
    rng = random.Random(f"apar/{seed}")
    rng.shuffle(others)
    mixed = lists + others[: pool - len(lists)]
    rng.shuffle(mixed)
    return mixed[:n]


def answer_prompts(model_dir: Path, prompts: list[str], file: Path, args) -> list[dict]:
    """Greedy answers to ``prompts``, those already in ``file`` kept; -> rows in prompt order."""
    from redrafter_mlx.engine.base.tokenizer import load_tokenizer
    from redrafter_mlx.engine.loop.loading import load_model
    from redrafter_mlx.train.selfgen import greedy_with_hidden

    done = {r["prompt"]: r for r in read_jsonl(file)} if file.exists() else {}
    todo = [p for p in prompts if p not in done]
    if todo:
        model, _ = load_model(model_dir)
        tok = load_tokenizer(model_dir)
        tic, produced = time.perf_counter(), 0
        for i in range(0, len(todo), args.gen_batch):
            batch = todo[i : i + args.gen_batch]
            ids = [tok.chat_prompt([{"role": "user", "content": p}]) for p in batch]
            answers = greedy_with_hidden(model, ids, args.answer_tokens, tok.eos_token_ids)
            rows = []
            for prompt, answer in zip(batch, answers):
                text_ids = [t for t in answer.ids if t not in tok.eos_token_ids]
                produced += len(answer.ids)
                rows.append(
                    {"prompt": prompt, "answer": tok.decode(text_ids), "finish": answer.finish}
                )
            append_jsonl(file, rows)
            done.update((r["prompt"], r) for r in rows)
            rate = produced / (time.perf_counter() - tic)
            print(f"answered {len(done)}/{len(prompts)} ({rate:.0f} tok/s)")
    return [done[p] for p in prompts]


def main(argv=None) -> None:
    args = parse_args(argv)
    model_dir = Path(args.model) if args.model else smollm2_path()
    if not (model_dir / "config.json").exists():
        raise SystemExit(f"no model at {model_dir}: run `make smollm2` first (or pass --model)")
    work = args.work or home() / "build" / "smollm2-apar"
    work.mkdir(parents=True, exist_ok=True)
    prompts = training_prompts(args.prompts, args.list_share, args.seed)
    rows = answer_prompts(model_dir, prompts, work / "answers.jsonl", args)
    # an answer cut at the token limit ends at its last paragraph break (or is left out)
    ended = [{**r, "answer": trim_cut(r["answer"])} if r["finish"] == "length" else r for r in rows]
    ended = [r for r in ended if r["answer"]]
    if args.stop_after == "answers":
        return
    answers = [r["answer"] for r in ended]
    stopped = sum(r["finish"] == "stop" for r in rows)
    print(
        f"{len(rows)} answers: {stopped} ended within {args.answer_tokens} tokens, "
        f"{len(ended) - stopped} cut ones kept up to their last paragraph break"
    )

    results = [paragraph_tree(a) for a in answers]
    print("samples per rule:", json.dumps(dict(sorted(rule_counts(results).items()))))

    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir))
    fork, child = add_split_tokens(tokenizer)
    ids = SplitIds(fork=fork, child=child, eos=tokenizer.eos_token_id)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    mixed = mixed_samples(results, answers, seed=args.seed)
    samples = []
    for i, tree in mixed:
        chat = [{"role": "user", "content": ended[i]["prompt"]}]
        prompt = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True))
        samples += branch_sequences(prompt, tree, encode, ids)
    structured = sum(1 for _, tree in mixed if tree.children())
    print(
        f"mixed: {structured} structured + {len(mixed) - structured} unstructured answers -> "
        f"{len(samples)} branch sequences, {sum(len(s) for s, _ in samples)} tokens"
    )
    rows_out = [json.dumps({"tokens": s, "loss_from": o}) + "\n" for s, o in samples]
    (work / "data.jsonl").write_text("".join(rows_out))
    if args.stop_after == "data":
        return

    settings = LoraSettings(
        layers=args.lora_layers,
        lr=args.lr,
        rows_lr=args.rows_lr,
        batch_size=args.batch_size,
        iters=args.iters,
        save_every=args.save_every,
        seed=args.seed,
    )
    start = split_rows_start(model.model.embed_tokens.weight, samples, fork, child)
    prepare_model(model, settings, [fork, child], start)
    result = train(model, samples, work / "checkpoints", settings)
    print(
        f"trained {result['iters']} steps; {result['tokens_per_s']:.0f} training tokens/s; "
        f"loss {result['train_loss']}"
    )
    save_adapter(model, settings, args.out)
    print(f"adapter in {args.out}")
    from weights_convert.smollm2_apar import build

    fused = build(model_dir, args.out, work / "model" if args.model else smollm2_apar_path())
    print(f"branching model in {fused} (--model smollm2-apar)")


if __name__ == "__main__":
    main()
