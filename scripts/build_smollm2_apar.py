"""Build an APAR (parallel branches) SmolLM2 with LoRA (make smollm2-apar).

    python -m scripts.build_smollm2_apar                       # the full recipe, resumable
    python -m scripts.build_smollm2_apar --prompts 16 --answer-tokens 256 --iters 4   # smoke

1. Answers: SmolLM2-135M-Instruct's own greedy answers to the built-in prompts
   (``train.selfdata.builtin_prompts``, seeded order; a conversation's first turn only),
   appended to ``answers.jsonl`` in the work folder, so a rerun answers only what is missing.
2. Data: each answer (one cut at the token limit ends at its last paragraph break) made a
   paragraph tree by rule (``train.apar_data``), the counts per rule printed; structured and
   unstructured samples mixed half and half; each branch one causal sequence with its loss
   after the last child token (``data.jsonl``).
3. Training: mlx-lm's LoRA trainer with the split tokens added to the vocabulary (the
   embedding and its tied head grow by two trainable rows); checkpoints every
   ``--save-every`` steps, a rerun resumes from the newest (``train.apar_lora``).
4. The fused model (a branching model: config ``branches`` block) into ``--out``.

Work folder: HOME/build/smollm2-apar (``engine.bundled.home()``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from redrafter_mlx.engine.bundled import home, smollm2_path
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
    export,
    prepare_model,
    train,
)
from redrafter_mlx.train.selfdata import append_jsonl, builtin_prompts, read_jsonl


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="SmolLM2 folder (default: make smollm2's)")
    p.add_argument("--work", type=Path, default=None, help="work folder (resumable)")
    p.add_argument("--out", type=Path, default=None, help="fused model folder (default WORK/model)")
    p.add_argument("--prompts", type=int, default=2000, help="built-in prompts to answer")
    p.add_argument("--answer-tokens", type=int, default=384, help="most tokens per answer")
    p.add_argument("--gen-batch", type=int, default=16, help="prompts answered per batch")
    p.add_argument("--iters", type=int, default=2000, help="training steps in all")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--lora-layers", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def answer_prompts(model_dir: Path, prompts: list[str], file: Path, args) -> list[dict]:
    """Greedy answers to ``prompts``, those already in ``file`` kept; -> rows in prompt order."""
    from redrafter_mlx.engine.loading import load_model
    from redrafter_mlx.engine.tokenizer import load_tokenizer
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
    prompts = [r["prompt"] for r in builtin_prompts()]
    random.Random(f"apar/{args.seed}").shuffle(prompts)
    rows = answer_prompts(model_dir, prompts[: args.prompts], work / "answers.jsonl", args)
    # an answer cut at the token limit ends at its last paragraph break (or is left out)
    ended = [{**r, "answer": trim_cut(r["answer"])} if r["finish"] == "length" else r for r in rows]
    ended = [r for r in ended if r["answer"]]
    answers = [r["answer"] for r in ended]
    stopped = sum(r["finish"] == "stop" for r in rows)
    print(
        f"{len(rows)} answers: {stopped} ended within {args.answer_tokens} tokens, "
        f"{len(ended) - stopped} cut ones kept up to their last paragraph break"
    )

    results = [paragraph_tree(a) for a in answers]
    print("samples per rule:", json.dumps(dict(sorted(rule_counts(results).items()))))

    import mlx_lm

    model, tokenizer, config = mlx_lm.load(str(model_dir), return_config=True)
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

    settings = LoraSettings(
        layers=args.lora_layers,
        lr=args.lr,
        batch_size=args.batch_size,
        iters=args.iters,
        save_every=args.save_every,
        seed=args.seed,
    )
    prepare_model(model, settings, [fork, child])
    result = train(model, samples, work / "checkpoints", settings)
    print(
        f"trained {result['iters']} steps; {result['tokens_per_s']:.0f} training tokens/s; "
        f"loss {result['train_loss']}"
    )
    out = args.out or work / "model"
    export(model, tokenizer, config, out)
    print(f"branching model in {out}")


if __name__ == "__main__":
    main()
