"""Build the SmolLM2-135M-Instruct drafter that ships in the package (make smollm2-drafter).

    python -m scripts.build_smollm2_drafter                       # all stages, resumable
    python -m scripts.build_smollm2_drafter --stages prompts,generate --deadline 17:30
    python -m scripts.build_smollm2_drafter --stages distill --steps 3000

Stages (each writes its outputs atomically, or appends whole batches, and is skipped or
continued when its outputs exist; everything is seeded):

1. ``prompts``  -> WORK/prompts.jsonl: diverse offline user turns:
   ``model``    the model itself writing user turns for (topic x style x kind) combinations,
   ``stdlib``   instructions derived from the Python standard library's docstrings (present on
                every machine: read with ``ast``, nothing imported),
   ``sharegpt`` the human turns of tests/fixtures/sharegpt_tiny.json,
   ``template`` (template x topic) turns,
   and scripts/smollm2_prompts.py's synthetic turns over MT-Bench-like kinds of request
   (``topic``, ``roleplay``, ``math``, ``reasoning``, ``coding``, ``extraction``,
   ``knowledge``; --diverse-prompts of them, interleaved).
   MT-Bench and Vicuna-bench (redrafter_mlx/data/*.jsonl) are held out for evaluation: any
   prompt that equals one of their turns (case- and space-insensitive) is dropped.
2. ``generate`` -> WORK/generations.jsonl + WORK/hidden/*.npy: the model's greedy answers
   (<= --max-answer tokens) decoded in batches of --batch rows, one JSON line per prompt,
   appended per batch (a torn last line is dropped on resume), with the exact token ids
   (``prompt_ids``, ``response_ids``: the end-of-turn id included when the answer ended),
   and the hidden state of every answer position kept from decoding
   (``redrafter_mlx.train.selfgen``): self-distillation needs no further forward pass. Stops
   at --deadline and continues where it stopped on the next run.
3. ``distill``  -> WORK/drafter: scripts/smollm2_train.py: targets read off the answers
   (``targets="self"``) with the model's distribution at each target as a soft target
   (--soft-targets), a frequency-ranked shortlist vocabulary (--draft-vocab), trained with a
   held-out score every --every steps (Vicuna-bench answers; selection only), keeping the
   best; resumable from WORK/train/checkpoints.
4. ``ship``     -> redrafter_mlx/smollm2_drafter/: the drafter in float16 (config.json with its
   ``draft_vocab`` shortlist, model.safetensors) and BUILD.md.
5. ``eval``     -> WORK/eval.json (+ the shipped eval.json and BUILD.md): tokens/step at a few
   shapes on held-out MT-Bench prompts, greedy and at temperature 0.7, for the shipped float16
   drafter and (greedy) the float32 training output.
6. ``coverage`` -> WORK/coverage.json: the share of held-out greedy answer tokens the
   shortlist can draft.

More data later: raise --diverse-prompts (or --template-prompts) and rerun: new prompts are
appended to prompts.jsonl and answered; old answers are kept.

WORK defaults to HOME/build/smollm2-drafter (HOME: $REDRAFTER_MLX_HOME, else
$XDG_CACHE_HOME/redrafter-mlx, else ~/.cache/redrafter-mlx); the small artefacts (prompts,
metrics, the training history) can be committed under scripts/smollm2_build/ with --snapshot.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import os
import random
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

from scripts.smollm2_prompts import diverse_prompts

ROOT = Path(__file__).resolve().parent.parent
SHIP = ROOT / "redrafter_mlx" / "smollm2_drafter"
SNAPSHOT = ROOT / "scripts" / "smollm2_build"
SHAREGPT = ROOT / "tests" / "fixtures" / "sharegpt_tiny.json"
HELDOUT = [
    ROOT / "redrafter_mlx" / "data" / f
    for f in ("mt_bench_questions.jsonl", "vicuna_bench_questions.jsonl")
]
# Benchmarks of the shipped drafter quoted in BUILD.md: scripts/smollm2_build/NAME.txt (and
# .csv) are the output of the command beside the name, run by hand after a build.
_BENCH = "redrafter-mlx bench --model smollm2 --prompts mt-bench --num-prompts 8 --max-tokens 96"
BENCHES = (
    ("bench_mt_bench", f"{_BENCH} --grid 1,2,4x2,3,4,5 --adapt --mlx-lm"),
    ("bench_mt_bench_t07", f"{_BENCH} --temp 0.7 --seed 0 --grid 1x2,3,4"),
)
STAGES = ("prompts", "generate", "distill", "ship", "eval", "coverage")

TOPICS = (
    "cooking",
    "personal finance",
    "travel in Japan",
    "gardening",
    "the solar system",
    "ancient Rome",
    "machine learning",
    "Python programming",
    "JavaScript",
    "SQL databases",
    "linear algebra",
    "probability",
    "climate change",
    "renewable energy",
    "healthy sleep",
    "running a marathon",
    "learning a language",
    "job interviews",
    "writing a resume",
    "starting a small business",
    "marketing",
    "photography",
    "music theory",
    "guitar",
    "chess",
    "video games",
    "movies",
    "poetry",
    "world history",
    "philosophy",
    "psychology",
    "parenting",
    "pets",
    "dog training",
    "home repair",
    "cars",
    "electric vehicles",
    "cybersecurity",
    "networking",
    "Linux",
    "cloud computing",
    "mobile apps",
    "web design",
    "statistics",
    "economics",
    "the stock market",
    "nutrition",
    "yoga",
    "meditation",
    "time management",
    "public speaking",
    "friendship",
    "biology",
    "chemistry",
    "physics",
    "geography",
    "space exploration",
    "art history",
    "fashion",
    "architecture",
    "law",
    "medicine",
    "mental health",
    "education",
    "mathematics puzzles",
    "recipes for dinner",
    "baking bread",
    "coffee",
    "wine",
    "hiking",
    "camping",
    "birds",
    "oceans",
    "volcanoes",
    "dinosaurs",
    "robots",
    "smartphones",
    "social media",
    "email etiquette",
    "negotiation",
)
STYLES = (
    "a curious student",
    "a busy parent",
    "a software engineer",
    "a retired teacher",
    "a small business owner",
    "a teenager",
    "a scientist",
    "a beginner",
    "a journalist",
    "a traveler",
    "a novelist",
    "a job seeker",
)
KINDS = (
    "a question",
    "a request for a step-by-step explanation",
    "a request for a short list of tips",
    "a request to write a short email",
    "a request for a short story or poem",
    "a request to compare two things",
    "a request for advice",
    "a request to explain a concept simply",
    "a request for a short piece of code",
    "a request to summarize an idea",
)
STDLIB_TEMPLATES = (
    "Write a Python function `{sig}` that does this: {doc}",
    "What does `{mod}.{name}` do in Python? Give a short example.",
    "Explain Python's `{mod}.{name}`: {doc}",
    "How would I use `{mod}.{name}` in a script? Show a small example.",
    "Implement `{name}` in Python without using `{mod}`: {doc}",
)
MODULE_TEMPLATES = (
    "What is Python's `{mod}` module for? {doc}",
    "Give me an overview of the `{mod}` module in the Python standard library.",
)


# ------------------------------------------------------------------------------------------
# small helpers


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def write_jsonl_atomic(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    """Complete lines of a JSONL file; a torn last line (a crash mid-append) is dropped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def append_jsonl(path: Path, rows: list[dict]) -> None:
    """Append whole rows in one write + fsync (a crash leaves at most one torn last line)."""
    valid = read_jsonl(path)
    if path.exists() and len(path.read_text(encoding="utf-8").splitlines()) != len(valid):
        write_jsonl_atomic(path, valid)  # drop a torn tail before appending
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def heldout_turns() -> set[str]:
    out = set()
    for f in HELDOUT:
        for line in f.read_text().splitlines():
            if line.strip():
                out.update(normalize(t) for t in json.loads(line)["turns"])
    return out


def load_engine():
    from redrafter_mlx.engine.loading import load
    from weights_convert.smollm2 import smollm2_path

    path = smollm2_path()
    model, _, tok = load(path)
    model.freeze()
    return path, model, tok


def greedy_batch(model, tok, prompts: list[list[int]], max_tokens: int):
    """Greedy answers of a batch: [(ids, finish)] in prompt order, and the decode stats."""
    from redrafter_mlx.engine.generation import decode
    from redrafter_mlx.engine.shape import AR

    out = [[] for _ in prompts]
    finish = [None] * len(prompts)
    stats = None
    for ev in decode(
        model,
        None,
        prompts,
        max_tokens=max_tokens,
        shape=AR,
        eos_token_ids=sorted(tok.eos_token_ids),
        seed=0,
    ):
        for r, t in enumerate(ev.tokens):
            out[r].extend(t)
        finish = ev.finish
        stats = ev.stats
    return list(zip(out, finish)), stats


# ------------------------------------------------------------------------------------------
# stage 1: prompts


def stdlib_prompts(n: int, seed: int) -> list[dict]:
    """Instructions derived from documented public stdlib functions, classes and modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    items, modules = [], []
    for file in sorted(root.glob("*.py")):
        mod = file.stem
        if mod.startswith("_") or mod in ("this", "antigravity"):
            continue
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        doc = ast.get_docstring(tree)
        if doc:
            first = doc.strip().split("\n")[0].strip()
            if 15 <= len(first) <= 160:
                modules.append(dict(mod=mod, doc=first))
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            d = ast.get_docstring(node)
            if not d:
                continue
            first = d.strip().split("\n")[0].strip()
            if not 15 <= len(first) <= 160 or not first[0].isupper():
                continue
            if isinstance(node, ast.FunctionDef):
                sig = f"{node.name}({ast.unparse(node.args)})"
            else:
                sig = node.name
            items.append(dict(mod=mod, name=node.name, sig=sig, doc=first))
    rng = random.Random(seed)
    rng.shuffle(items)
    rng.shuffle(modules)
    out = []
    n_mod = min(len(modules), n // 5)
    for m in modules[:n_mod]:
        out.append(rng.choice(MODULE_TEMPLATES).format(**m))
    for it in items[: n - n_mod]:
        out.append(rng.choice(STDLIB_TEMPLATES).format(**it))
    return [dict(source="stdlib", prompt=p) for p in out]


def sharegpt_prompts() -> list[dict]:
    data = json.loads(SHAREGPT.read_text())
    return [
        dict(source="sharegpt", prompt=t["value"])
        for conv in data
        for t in conv["conversations"]
        if t["from"] == "human"
    ]


def model_prompts(model, tok, n: int, seed: int, batch: int) -> tuple[list[dict], dict]:
    """The model writes user turns for random (topic, style, kind) combinations."""
    rng = random.Random(seed)
    combos = [(t, s, k) for t in TOPICS for s in STYLES for k in KINDS]
    rng.shuffle(combos)
    asks = [
        f"Write {k} about {t} that {s} might send to an AI assistant. "
        f"Reply with the message only, in one or two sentences."
        for t, s, k in combos[: int(n * 1.3)]
    ]
    rows, tokens, t0 = [], 0, time.perf_counter()
    for i in range(0, len(asks), batch):
        chunk = asks[i : i + batch]
        ids = [tok.chat_prompt([{"role": "user", "content": a}]) for a in chunk]
        res, _stats = greedy_batch(model, tok, ids, 48)
        for a, (toks, fin) in zip(chunk, res):
            tokens += len(toks)
            text = tok.decode(toks).strip().strip('"').strip()
            if fin == "stop" and 15 <= len(text) <= 300 and "\n\n" not in text:
                rows.append(dict(source="model", prompt=text, ask=a))
        log(
            f"prompts: model-written {len(rows)} ({i + len(chunk)}/{len(asks)} asks, "
            f"{tokens / (time.perf_counter() - t0):.1f} tok/s)"
        )
        if len(rows) >= n:
            break
    secs = time.perf_counter() - t0
    return rows[:n], dict(asks=i + len(chunk), tokens=tokens, seconds=round(secs, 1))


TEMPLATES = (
    "Write a short story about {t}.",
    "Explain {t} to a complete beginner.",
    "Give me five practical tips about {t}.",
    "Write a polite email to a colleague about {t}.",
    "What are the pros and cons of {t}?",
    "Write a short poem about {t}.",
    "Summarize the most important facts about {t} in a paragraph.",
    "What are common misconceptions about {t}?",
    "Describe a typical day for someone who works in {t}.",
    "Write a persuasive paragraph about why people should learn about {t}.",
    "Create a simple step-by-step plan for getting started with {t}.",
    "Answer as a friendly expert: what should I know first about {t}?",
)


def template_prompts(n: int, seed: int) -> list[dict]:
    """User turns from (template x topic) combinations: writing, advice, explanation, roleplay."""
    combos = [tpl.format(t=t) for tpl in TEMPLATES for t in TOPICS]
    random.Random(seed + 1).shuffle(combos)
    return [dict(source="template", prompt=p) for p in combos[:n]]


def extend_prompts(path: Path, candidates: list[dict]) -> int:
    """Append the candidates not yet in prompts.jsonl (atomically, in their order; held-out
    turns dropped); returns how many."""
    rows = read_jsonl(path)
    have = {normalize(r["prompt"]) for r in rows}
    held = heldout_turns()
    new = []
    for r in candidates:
        key = normalize(r["prompt"])
        if key not in have and key not in held:
            have.add(key)
            new.append(r)
    if not new:
        return 0
    start = max(r["id"] for r in rows) + 1
    for i, r in enumerate(new):
        r["id"] = start + i
    write_jsonl_atomic(path, rows + new)
    return len(new)


def stage_prompts(work: Path, a) -> None:
    path = work / "prompts.jsonl"
    if path.exists():
        added = extend_prompts(path, template_prompts(a.template_prompts, a.seed))
        more = extend_prompts(path, diverse_prompts(a.diverse_prompts, a.seed))
        meta = _read(work, "prompts_meta.json")
        meta["counts"] = dict(Counter(r["source"] for r in read_jsonl(path)))
        write_json_atomic(work / "prompts_meta.json", meta)
        log(f"prompts: {path} exists; added {added} template and {more} diverse prompts")
        return
    t0 = time.perf_counter()
    _, model, tok = load_engine()
    rows, gen = model_prompts(model, tok, a.model_prompts, a.seed, a.batch)
    rows += stdlib_prompts(a.stdlib_prompts, a.seed)
    rows += sharegpt_prompts()
    rows += template_prompts(a.template_prompts, a.seed)
    rows += diverse_prompts(a.diverse_prompts, a.seed)
    held = heldout_turns()
    seen, kept, dropped = set(), [], 0
    for r in rows:
        key = normalize(r["prompt"])
        if key in held:
            dropped += 1
            continue
        if key in seen:
            continue
        seen.add(key)
        kept.append(r)
    random.Random(a.seed).shuffle(kept)
    for i, r in enumerate(kept):
        r["id"] = i
    write_jsonl_atomic(path, kept)
    counts = dict(Counter(r["source"] for r in kept))
    write_json_atomic(
        work / "prompts_meta.json",
        dict(
            counts=counts,
            heldout_dropped=dropped,
            model_generation=gen,
            seconds=round(time.perf_counter() - t0, 1),
            seed=a.seed,
        ),
    )
    log(f"prompts: wrote {len(kept)} ({counts}); held-out matches dropped: {dropped}")


# ------------------------------------------------------------------------------------------
# stage 2: generation


def deadline_ts(spec: str | None) -> float | None:
    """'HH:MM' (UTC, today) -> epoch seconds; None when not given."""
    if not spec:
        return None
    h, m = map(int, spec.split(":"))
    now = time.gmtime()
    return time.mktime((now.tm_year, now.tm_mon, now.tm_mday, h, m, 0, 0, 0, 0)) - time.timezone


def answer_batch(model, tok, chunk: list[dict], max_answer: int, shards: Path) -> list[dict]:
    """Greedy answers to a batch of prompt rows, as generations.jsonl rows; their hidden
    states go to ``shards/<first id>.npy`` (rows point into it: ``hidden.shard/offset``)."""
    import numpy as np

    from redrafter_mlx.train.selfgen import greedy_with_hidden

    ids = [tok.chat_prompt([{"role": "user", "content": p["prompt"]}]) for p in chunk]
    answers = greedy_with_hidden(model, ids, max_answer, sorted(tok.eos_token_ids))
    # The hidden states first (a whole file, atomically), then the rows that point at it:
    # a crash in between leaves an unreferenced shard that the next run overwrites.
    shard = f"{chunk[0]['id']:07d}.npy"
    tmp = shards / f".{shard}.tmp-{os.getpid()}.npy"
    np.save(tmp, np.concatenate([ans.hidden for ans in answers]))
    os.replace(tmp, shards / shard)
    rows, offset = [], 0
    for p, pid, ans in zip(chunk, ids, answers):
        text_ids = ans.ids[:-1] if ans.finish == "stop" else ans.ids
        rows.append(
            dict(
                id=p["id"],
                source=p["source"],
                prompt=p["prompt"],
                response=tok.decode(text_ids),
                finish=ans.finish,
                prompt_ids=pid,
                response_ids=ans.ids,
                hidden=dict(shard=shard, offset=offset),
            )
        )
        offset += len(ans.ids)
    return rows


def stage_generate(work: Path, a) -> None:
    prompts = read_jsonl(work / "prompts.jsonl")
    path = work / "generations.jsonl"
    done = {r["prompt"] for r in read_jsonl(path)}  # by text: prompt files may be rebuilt
    todo = [p for p in prompts if p["prompt"] not in done][: a.max_prompts]
    if not todo:
        log(f"generate: all {len(done)} prompts answered, skipped")
        return
    _, model, tok = load_engine()
    stop_at = deadline_ts(a.deadline)
    meta_path = work / "generate_meta.json"
    meta = (
        json.loads(meta_path.read_text())
        if meta_path.exists()
        else dict(tokens=0, seconds=0.0, batches=0, batch=a.batch, max_answer=a.max_answer)
    )
    log(f"generate: {len(done)} done, {len(todo)} to go, batches of {a.batch}")
    shards = work / "hidden"
    shards.mkdir(exist_ok=True)
    for i in range(0, len(todo), a.batch):
        if stop_at is not None and time.time() > stop_at:
            log("generate: deadline reached; run again to continue")
            break
        chunk = todo[i : i + a.batch]
        t0 = time.perf_counter()
        rows = answer_batch(model, tok, chunk, a.max_answer, shards)
        secs = time.perf_counter() - t0
        append_jsonl(path, rows)
        n_tok = sum(len(r["response_ids"]) for r in rows)
        meta.update(
            tokens=meta["tokens"] + n_tok,
            seconds=round(meta["seconds"] + secs, 1),
            batches=meta["batches"] + 1,
            answers=len(done) + i + len(chunk),
        )
        write_json_atomic(meta_path, meta)
        log(
            f"generate: {len(done) + i + len(chunk)}/{len(prompts)} answers, "
            f"{n_tok / secs:.1f} tok/s this batch (hidden states kept)"
        )


# ------------------------------------------------------------------------------------------
# stage 3: distillation


def stage_distill(work: Path, a) -> None:
    """Targets (from generation, or one forward for older answers) and training with held-out
    selection: scripts/smollm2_train.py."""
    from scripts.smollm2_train import train

    t0 = time.perf_counter()
    result = train(work, a)
    data, history = result["data"], result["history"]
    if "forward_seconds" in data:
        record_time(
            work, "distill: targets (one forward per older answer)", data["forward_seconds"], 0
        )
    if history:
        last = history[-1]
        seen = last["step"] * result["run"]["batch"]
        times = _read(work, "stage_times.json")
        times["distill: training (positions seen, held-out scoring included)"] = dict(
            seconds=round(seen / last["positions_per_s"], 1), positions=seen
        )
        write_json_atomic(work / "stage_times.json", times)
        summary = dict(
            run=result["run"],
            data=data,
            best_score=result["best"],
            steps=last["step"],
            final_loss=last["loss"],
            final_train_acc=last["train_acc"],
            positions_per_s=last["positions_per_s"],
            wall_seconds=round(time.perf_counter() - t0, 1),
        )
        write_json_atomic(work / "distill_summary.json", summary)
        log(f"distill: {last['step']} steps, best held-out chain score {result['best']}")


# ------------------------------------------------------------------------------------------
# stage 4: evaluation


def stage_eval(work: Path, a) -> dict:
    """Tokens/step on held-out MT-Bench prompts (one batch): the shipped float16 drafter at
    greedy and temperature 0.7, and the float32 training output at greedy (does fp16 hold?)."""
    from redrafter_mlx.engine.generation import decode
    from redrafter_mlx.engine.loading import load_drafter
    from redrafter_mlx.engine.prompts import load_prompts
    from redrafter_mlx.engine.sampling import SamplerConfig
    from redrafter_mlx.engine.shape import BeamShape

    _, model, tok = load_engine()
    texts = load_prompts("mt-bench", a.eval_prompts)
    prompts = [tok.chat_prompt([{"role": "user", "content": t}]) for t in texts]
    runs = [("float32 (trained)", drafter_dir(work, a), (0.0,))]
    if (SHIP / "config.json").exists():
        runs.insert(0, ("float16 (shipped)", SHIP, (0.0, 0.7)))
    results = []
    for label, path, temps in runs:
        drafter = load_drafter(path)
        for temp in temps:
            for w, length in ((1, 4), (2, 5), (4, 5)):
                t0 = time.perf_counter()
                stats = None
                for ev in decode(
                    model,
                    drafter,
                    prompts,
                    max_tokens=a.eval_tokens,
                    shape=BeamShape(w, length),
                    sampler=SamplerConfig(temperature=temp),
                    eos_token_ids=sorted(tok.eos_token_ids),
                    seed=0,
                ):
                    stats = ev.stats
                results.append(
                    dict(
                        drafter=label,
                        temperature=temp,
                        beam_width=w,
                        beam_length=length,
                        tokens_per_step=round(stats.tokens_per_step, 3),
                        generated=stats.generation_tokens,
                        seconds=round(time.perf_counter() - t0, 1),
                    )
                )
                log(f"eval: {label} T={temp} W{w} L{length}: {stats.tokens_per_step:.3f} tok/step")
    report = dict(
        prompts="mt-bench (held out)",
        num_prompts=len(prompts),
        max_tokens=a.eval_tokens,
        batch=len(prompts),
        results=results,
    )
    write_json_atomic(work / "eval.json", report)
    if (SHIP / "config.json").exists():
        write_json_atomic(SHIP / "eval.json", report)
        write_build_md(work, a)
    return report


def stage_coverage(work: Path, a) -> dict:
    """Share of the model's greedy held-out answers (MT-Bench) that the shortlist can draft."""
    from redrafter_mlx.engine.prompts import load_prompts

    _, model, tok = load_engine()
    config = json.loads((drafter_dir(work, a) / "config.json").read_text())
    ids = set(config.get("draft_vocab") or [])
    texts = load_prompts("mt-bench", a.coverage_prompts)
    prompts = [tok.chat_prompt([{"role": "user", "content": t}]) for t in texts]
    res, _ = greedy_batch(model, tok, prompts, a.max_answer)
    answer = [t for toks, _ in res for t in toks]
    inside = sum(t in ids for t in answer) if ids else len(answer)
    report = dict(
        prompts="mt-bench (held out)",
        num_prompts=len(prompts),
        answer_tokens=len(answer),
        in_shortlist=inside,
        coverage=round(inside / max(len(answer), 1), 4),
        shortlist_size=len(ids) or None,
    )
    write_json_atomic(work / "coverage.json", report)
    log(f"coverage: {report['coverage']:.1%} of {len(answer)} held-out answer tokens")
    if (SHIP / "config.json").exists():
        write_build_md(work, a)
    return report


def stage_ship(work: Path, a) -> None:
    import mlx.core as mx

    src = drafter_dir(work, a)
    SHIP.mkdir(parents=True, exist_ok=True)
    weights = mx.load(str(src / "model.safetensors"))
    weights = {
        k: v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }
    tmp = SHIP / f".model.safetensors.tmp-{os.getpid()}.safetensors"
    mx.save_safetensors(str(tmp), weights)
    os.replace(tmp, SHIP / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = "float16"
    write_json_atomic(SHIP / "config.json", config)
    write_build_md(work, a)
    log(f"ship: {SHIP} ({(SHIP / 'model.safetensors').stat().st_size / 1e6:.1f} MB)")


def drafter_dir(work: Path, a) -> Path:
    """The drafter that ships: --drafter-dir (e.g. a selection run's output) or WORK/drafter."""
    return Path(a.drafter_dir).expanduser() if a.drafter_dir else work / "drafter"


def _read(work: Path, name: str) -> dict:
    p = work / name
    return json.loads(p.read_text()) if p.exists() else {}


def training_lines(sel: dict) -> list[str]:
    """BUILD.md lines for the training run and its held-out selection (WORK/drafter)."""
    if not sel:
        return ["- training: not run yet"]
    run, data, hist = sel["run"], sel["data"], sel["history"]
    best = max(hist, key=lambda h: h["score"]) if hist else {}
    lines = [
        f"- positions: {data['positions']} ({data['from_generation']} answers with the hidden "
        f"states kept from generation, {data['from_forward']} with one forward each"
        + (f", {data['forward_seconds']} s" if "forward_seconds" in data else "")
        + ")",
        f"- run: {run['steps']} steps of {run['batch']} positions, AdamW lr {run['lr']} "
        f"(warm-up, cosine), weight decay {run['weight_decay']}, {run['layers']} layers, "
        f"exit_dim {run['exit_dim']}, head init {run['head_init']}"
        + (" (frozen)" if run.get("freeze_head") else "")
        + (
            ", soft targets (cross-entropy to the model's distribution at each target position)"
            if run.get("soft_targets")
            else ", hard targets (the greedy tokens)"
        )
        + f", seed {run['seed']}",
        f"- selection: a score every {run.get('every', '?')} steps on {data['val_positions']} "
        f"held-out positions (the model's greedy answers to Vicuna-bench prompts; MT-Bench is "
        f"only the report); kept: step "
        f"{best.get('step')}, chain score {best.get('score')} (teacher-forced W1 L4 "
        f"tokens/step estimate)",
        "",
        "| step | loss | train acc per draft step | held-out acc per draft step | score "
        "| positions/s |",
        "| ---: | ---: | --- | --- | ---: | ---: |",
    ]
    lines += [
        f"| {h['step']} | {h['loss']} | {h['train_acc']} | {h['val_acc']} | {h['score']} | "
        f"{h['positions_per_s']} |"
        for h in hist
    ]
    return lines


def write_build_md(work: Path, a) -> None:
    pm, gm, ev, cov = (
        _read(work, n)
        for n in ("prompts_meta.json", "generate_meta.json", "eval.json", "coverage.json")
    )
    sel = _read(drafter_dir(work, a), "selection.json")
    gens = read_jsonl(work / "generations.jsonl")
    prompts = read_jsonl(work / "prompts.jsonl")
    cfg = json.loads((SHIP / "config.json").read_text())
    stats = _read(work, "stage_times.json")
    lines = [
        "# How the SmolLM2-135M-Instruct drafter was built",
        "",
        "`make smollm2-drafter` (`python -m scripts.build_smollm2_drafter --snapshot`); every "
        "stage is seeded and resumable (see the script's docstring). Base model: "
        "SmolLM2-135M-Instruct converted to float32 (`python -m weights_convert.smollm2`), "
        "served on the MLX CPU backend with OpenBLAS on a 2-core x86 VM.",
        "",
        "## Data",
        "",
        f"- prompts: {len(prompts)} ({dict(Counter(r['source'] for r in prompts))}); "
        f"held-out MT-Bench / Vicuna-bench turns dropped: {pm.get('heldout_dropped')}. Sources: "
        "the model writing user turns (`model`), the standard library's docstrings (`stdlib`), "
        "the ShareGPT sample (`sharegpt`), (template x topic) turns (`template`) and "
        "scripts/smollm2_prompts.py's synthetic turns (`topic`, `roleplay`, `math`, "
        "`reasoning`, `coding`, `extraction`, `knowledge`)",
        f"- model-written prompts: {pm.get('model_generation')}",
        f"- greedy answers: {len(gens)} of the prompts (<= {gm.get('max_answer')} tokens, "
        f"batches of {gm.get('batch')} rows), {gm.get('tokens')} answer tokens in "
        f"{gm.get('seconds')} s of generation "
        f"= {gm.get('tokens', 0) / max(gm.get('seconds', 1), 1e-9):.1f} tokens/s; "
        f"ended by end-of-turn: {sum(g['finish'] == 'stop' for g in gens)}; by source: "
        f"{dict(Counter(g['source'] for g in gens))}"
        + (f". {gm['note']}" if gm.get("note") else ""),
        "",
        "## Distillation",
        "",
        "- targets: `self` (the answers are the model's own greedy output, so their next T "
        "tokens are its greedy continuations; no rollouts)",
        *training_lines(sel),
        "",
        f"- drafter: exit_dim {cfg.get('exit_dim')}, {cfg.get('num_draft_layers')} layers, "
        f"rnn {cfg.get('rnn')}, predict_tokens {cfg.get('predict_tokens')}, shortlist "
        f"vocabulary {len(cfg.get('draft_vocab') or []) or 'none (full)'} of "
        f"{cfg.get('vocab_size')} ids (the most frequent answer tokens); shipped in float16",
        f"- shortlist coverage of the model's greedy held-out answers: "
        f"{cov.get('coverage', 'not measured')} ({cov.get('in_shortlist')} of "
        f"{cov.get('answer_tokens')} tokens, {cov.get('num_prompts')} MT-Bench prompts; a token "
        f"outside it can still be emitted, as the bonus token, but never drafted)",
        "",
        "## Stage times and throughput",
        "",
        "| stage | seconds | positions (tokens) | positions/s |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, s in stats.items():
        rate = s["positions"] / s["seconds"] if s.get("seconds") else 0
        lines.append(f"| {name} | {s['seconds']:.0f} | {s['positions']} | {rate:.1f} |")
    lines += ["", "## Held-out evaluation (MT-Bench, tokens/step)", ""]
    if ev:
        lines += [
            f"{ev['num_prompts']} prompts, {ev['max_tokens']} tokens, one batch.",
            "",
            "| drafter | temperature | W | L | tokens/step |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {r.get('drafter', '')} | {r['temperature']} | {r['beam_width']} | "
            f"{r['beam_length']} | {r['tokens_per_step']:.3f} |"
            for r in ev["results"]
        ]
    for name, command in BENCHES:
        bench = SNAPSHOT / f"{name}.txt"
        if not bench.exists():
            continue
        lines += [
            "",
            f"## Benchmark (shipped drafter, {name})",
            "",
            f"`{command}` (CSV beside it in scripts/smollm2_build/):",
            "",
            "```",
            *[line.rstrip() for line in bench.read_text().splitlines() if line.strip()],
            "```",
        ]
    lines.append("")
    (SHIP / "BUILD.md").write_text("\n".join(lines))


# ------------------------------------------------------------------------------------------
# driver


def record_time(work: Path, name: str, seconds: float, positions: int) -> None:
    path = work / "stage_times.json"
    times = _read(work, "stage_times.json")
    prev = times.get(name, dict(seconds=0.0, positions=0))
    times[name] = dict(
        seconds=round(prev["seconds"] + seconds, 1), positions=prev["positions"] + positions
    )
    write_json_atomic(path, times)


def default_work() -> Path:
    """The build's work folder in the one home folder (``engine.bundled.home()``)."""
    from redrafter_mlx.engine.bundled import home

    return home() / "build" / "smollm2-drafter"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--work", default=None, help="default: HOME/build/smollm2-drafter")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-prompts", type=int, default=160)
    p.add_argument("--stdlib-prompts", type=int, default=240)
    p.add_argument(
        "--diverse-prompts",
        type=int,
        default=6000,
        help="synthetic offline user turns (scripts/smollm2_prompts.py); added to an existing "
        "prompts.jsonl too",
    )
    p.add_argument(
        "--template-prompts",
        type=int,
        default=960,
        help="(topic x template) user turns; added to an existing prompts.jsonl too",
    )
    p.add_argument("--batch", type=int, default=32, help="decode rows per batch")
    p.add_argument("--max-answer", type=int, default=160)
    p.add_argument("--max-prompts", type=int, default=None, help="answer at most this many now")
    p.add_argument("--deadline", default=None, help="HH:MM UTC: stop generating after it")
    p.add_argument("--predict-tokens", type=int, default=5)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--exit-dim", default="576")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--train-batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--every", type=int, default=200, help="steps between held-out scores")
    p.add_argument("--head-init", choices=("random", "base"), default="random")
    p.add_argument("--freeze-head", action="store_true")
    p.add_argument(
        "--soft-targets",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="train on the model's distribution at each target (from the kept hidden states)",
    )
    p.add_argument("--val-prompts", type=int, default=24, help="Vicuna-bench prompts (selection)")
    p.add_argument("--val-tokens", type=int, default=96)
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--coverage-prompts", type=int, default=32)
    p.add_argument(
        "--drafter-dir",
        default=None,
        help="ship/eval/coverage this drafter (default WORK/drafter)",
    )
    p.add_argument(
        "--snapshot",
        action="store_true",
        help="copy the small artefacts (prompts, generations, metrics) to scripts/smollm2_build/",
    )
    return p.parse_args(argv)


SNAPSHOT_FILES = (
    "prompts.jsonl",  # gzipped in the snapshot
    "prompts_meta.json",
    "generate_meta.json",
    "distill_summary.json",
    "eval.json",
    "coverage.json",
    "stage_times.json",
    "drafter/selection.json",
)


def snapshot(work: Path) -> None:
    """Copy the small artefacts to scripts/smollm2_build/ (the answers are regenerated, not
    committed: thousands of rows of token ids)."""
    SNAPSHOT.mkdir(parents=True, exist_ok=True)
    for name in SNAPSHOT_FILES:
        if not (work / name).exists():
            continue
        data = (work / name).read_bytes()
        dest = SNAPSHOT / name.replace("/", "_")
        if name == "prompts.jsonl":
            data, dest = gzip.compress(data, mtime=0), SNAPSHOT / "prompts.jsonl.gz"
        tmp = SNAPSHOT / f".{dest.name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, dest)


def main(argv=None) -> int:
    a = parse_args(argv)
    work = Path(a.work).expanduser() if a.work is not None else default_work()
    work.mkdir(parents=True, exist_ok=True)
    stages = [s.strip() for s in a.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise SystemExit(f"unknown stage(s) {bad}; choose from {STAGES}")
    fresh = not any((work / n).exists() for n in ("prompts.jsonl", "generations.jsonl"))
    if fresh and SNAPSHOT.joinpath("prompts.jsonl.gz").exists():
        # answer the committed build's prompts (the model-written ones included)
        data = gzip.decompress((SNAPSHOT / "prompts.jsonl.gz").read_bytes())
        (work / "prompts.jsonl").write_bytes(data)
        (work / "prompts_meta.json").write_bytes((SNAPSHOT / "prompts_meta.json").read_bytes())
        log(f"started from the committed prompts in {SNAPSHOT}")
    for s in stages:
        t0 = time.perf_counter()
        before = _count_positions(work, s)
        {
            "prompts": stage_prompts,
            "generate": stage_generate,
            "distill": stage_distill,
            "eval": stage_eval,
            "coverage": stage_coverage,
            "ship": stage_ship,
        }[s](work, a)
        if s in ("prompts", "generate", "eval"):
            record_time(work, s, time.perf_counter() - t0, _count_positions(work, s) - before)
        if a.snapshot:
            snapshot(work)
    return 0


def _count_positions(work: Path, stage: str) -> int:
    """What a stage produced so far, in tokens/positions (for positions/s)."""
    if stage == "prompts":
        return _read(work, "prompts_meta.json").get("model_generation", {}).get("tokens", 0)
    if stage == "generate":
        return _read(work, "generate_meta.json").get("tokens", 0)
    if stage == "eval":
        return sum(r["generated"] for r in _read(work, "eval.json").get("results", []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
