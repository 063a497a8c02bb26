"""Built-in training data for ``distill`` without ``--data``: the model teaches its drafter.

Stages (each resumable, in ``WORK`` = ``CACHE/selfdata-<key>``, key = model fingerprint +
answer settings, so a later run with a larger budget continues the same data, and one with a
grown prompt collection answers its new prompts next):

1. **Prompts** (``WORK/prompts.jsonl``, written once, atomically): the package's prompt
   collection (``redrafter_mlx/data/distill_prompts.jsonl``: our own synthetic user turns
   over MT-Bench-like kinds of request; MT-Bench and Vicuna-bench turns are never in it)
   plus user turns the model writes itself: asked through its own chat template to write a
   message for a (topic, style, kind) (``distill_asks.jsonl``), sampled, deduplicated,
   held-out turns dropped. Seeded shuffle; the first ``val_prompts`` are held out for
   checkpoint selection and the final evaluation, never trained on. Written once; a later
   package's new collection prompts go before the unanswered ones (``extend_prompts``), so
   answers already made, and the held-out prompts, stay as they are.
2. **Answers** (``WORK/answers.jsonl`` + ``WORK/hidden/<batch>.npy``): the model's answers
   (greedy, or sampled at ``temperature``) in batches, with the hidden state of every answer
   position kept from decoding (``selfgen``); one JSON line per prompt, appended per batch
   after its hidden states are on disk (a torn last line is dropped on resume). Stops at a
   position count or a deadline.
3. **Targets** (``WORK/targets-<n>-<ids>-T<T>-shards/``): the answers' training positions as a
   ``TargetCache`` (rows along each answer, so soft targets can read the next rows): tokens
   and valid flags on disk, the hidden states read in place from the answer shards
   (``ShardRows``), so they are stored once.

Shapes: n answer tokens, H hidden, T drafter steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from ..engine.base.platform import answer_lanes, lane_threads
from .data import Sequence
from .selfgen import Answer, Job, answer_targets, answers_in_lanes, answers_with_hidden
from .targets import TargetCache, staged

DATA = Path(__file__).resolve().parent.parent / "data"
PROMPTS_FILE = DATA / "distill_prompts.jsonl"
ASKS_FILE = DATA / "distill_asks.jsonl"
HELDOUT_FILES = (DATA / "mt_bench_questions.jsonl", DATA / "vicuna_bench_questions.jsonl")
ASK = (
    "Write {kind} about {topic} that {style} might send to an AI assistant. "
    "Reply with the message only, in one or two sentences."
)
OWN_PROMPT_TOKENS = 48  # most tokens of a model-written user turn
OWN_PROMPT_TEMPERATURE = 1.0
SELFDATA_VERSION = 2  # 2: the key no longer hashes the prompt collection
POOL_BATCHES = 8  # batches cut from one length-sorted run of prompts (SelfData.generate)


# ------------------------------------------------------------------------------------------
# JSONL files


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


def write_jsonl_atomic(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def append_jsonl(path: Path, rows: list[dict]) -> None:
    """Append whole rows in one write + fsync, after dropping a torn tail."""
    valid = read_jsonl(path)
    if path.exists() and len(path.read_text(encoding="utf-8").splitlines()) != len(valid):
        write_jsonl_atomic(path, valid)
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------------------------------------------------
# prompts


def normalize(text: str) -> str:
    """Case- and space-insensitive key of a prompt (for deduplication and held-out checks)."""
    return " ".join(text.lower().split())


def heldout_turns() -> set[str]:
    """Every MT-Bench and Vicuna-bench turn, normalized: never training prompts."""
    out = set()
    for f in HELDOUT_FILES:
        for row in read_jsonl(f):
            out.update(normalize(t) for t in row["turns"])
    return out


def builtin_prompts() -> list[dict]:
    """The package's prompt collection: ``[{"source": str, "prompt": str}]``."""
    return read_jsonl(PROMPTS_FILE)


def ask_texts(n: int, seed: int) -> list[str]:
    """n requests for the model to write a user turn, over shuffled (topic, style, kind)."""
    parts: dict[str, list[str]] = {"topic": [], "style": [], "kind": []}
    for row in read_jsonl(ASKS_FILE):
        for name, value in row.items():
            parts[name].append(value)
    combos = [(t, s, k) for t in parts["topic"] for s in parts["style"] for k in parts["kind"]]
    random.Random(f"asks/{seed}").shuffle(combos)
    return [ASK.format(topic=t, style=s, kind=k) for t, s, k in combos[:n]]


def own_prompts(
    model,
    tokenizer,
    n: int,
    seed: int,
    batch: int,
    on_batch=None,
    facts: dict | None = None,
    deadline: float | None = None,
) -> list[str]:
    """Up to n user turns the model writes itself (sampled), one or two sentences each: an
    ended answer of 15-300 characters in one paragraph. Stops asking at ``deadline`` (epoch
    seconds). ``facts`` gets how many were asked."""
    facts = {} if facts is None else facts
    facts.update(asked=0, tokens=0)
    if n <= 0:
        return []
    asks = ask_texts(2 * n, seed)
    eos = sorted(tokenizer.eos_token_ids)
    out: list[str] = []
    for i in range(0, len(asks), batch):
        if time_left(deadline) <= 0:
            break
        chunk = asks[i : i + batch]
        ids = [list(tokenizer.chat_prompt([{"role": "user", "content": a}])) for a in chunk]
        answers = answers_with_hidden(
            model, ids, OWN_PROMPT_TOKENS, eos, OWN_PROMPT_TEMPERATURE, seed=seed * 7919 + i
        )
        for ans in answers:
            if ans.finish != "stop":
                continue
            text = tokenizer.decode(ans.ids[:-1]).strip().strip('"').strip()
            if 15 <= len(text) <= 300 and "\n\n" not in text:
                out.append(text)
        facts["asked"] += len(chunk)
        facts["tokens"] += sum(len(a.ids) for a in answers)
        if on_batch:
            on_batch(len(chunk), sum(len(a.ids) for a in answers))
        if len(out) >= n:
            break
    return out[:n]


def unique_prompts(candidates: list[dict], known: set[str]) -> list[dict]:
    """``{source, prompt}`` rows of ``candidates`` whose normalized prompt is new (neither in
    ``known``, which grows, nor an MT-Bench / Vicuna-bench turn), in order."""
    held, rows = heldout_turns(), []
    for r in candidates:
        key = normalize(r["prompt"])
        if key and key not in held and key not in known:
            known.add(key)
            rows.append(dict(source=r["source"], prompt=r["prompt"]))
    return rows


def prompt_list(own: list[str], seed: int) -> list[dict]:
    """Built-in + model-written prompts, deduplicated, held-out turns dropped, shuffled."""
    model = [dict(source="model", prompt=p) for p in own]
    rows = unique_prompts([*builtin_prompts(), *model], set())
    random.Random(f"prompts/{seed}").shuffle(rows)
    return [dict(r, id=i) for i, r in enumerate(rows)]


def extend_prompts(rows: list[dict], answered: set[int], seed: int) -> list[dict]:
    """``rows`` (a folder's prompt list) with the collection's prompts it lacks added.

    The answered rows keep their order at the front (so the held-out prompts, answered
    first, stay the first ones); then the new prompts, with new ids, shuffled (seeded); then
    the unanswered rows in their order. A run continuing after a package update spends its
    budget on what the update added first. Returns ``rows`` itself when nothing is new.
    """
    new = unique_prompts(builtin_prompts(), {normalize(r["prompt"]) for r in rows})
    if not new:
        return rows
    first = max((r["id"] for r in rows), default=-1) + 1
    new = [dict(r, id=first + i) for i, r in enumerate(new)]
    random.Random(f"prompts/{seed}/{len(rows)}").shuffle(new)
    done = [r for r in rows if r["id"] in answered]
    return done + new + [r for r in rows if r["id"] not in answered]


# ------------------------------------------------------------------------------------------
# the work folder


def work_key(fingerprint: str, temperature: float, answer_tokens: int, seed: int) -> str:
    """What the answers depend on: the serving weights and how they were drawn (not the
    prompt collection: a grown one extends the folder's prompt list, ``extend_prompts``)."""
    blob = json.dumps(
        dict(
            v=SELFDATA_VERSION,
            model=fingerprint,
            temperature=float(temperature),
            answer_tokens=answer_tokens,
            seed=seed,
        ),
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def work_folder(root: Path, key: str, features=()) -> Path:
    """The answers' folder for ``key`` (``work_key``) whose hidden states hold ``features``
    (feature layers) besides the final normed state: ``selfdata-<key>`` without any (the
    folder every run used before them), ``selfdata-<key>-f<i.j.k>`` with them.

    A run without feature layers whose own folder does not exist reuses one with features
    (the same answers; it reads the first H values of each row, the final normed state, which
    is what its own folder would hold), so a last-layer and a multi-layer drafter can be
    trained on the same generated answers (the feature-layer ablation).
    """
    root = Path(root)
    if features:
        return root / f"selfdata-{key}-f{'.'.join(str(int(i)) for i in features)}"
    own = root / f"selfdata-{key}"
    if not (own / "answers.jsonl").exists():
        wider = sorted(p for p in root.glob(f"selfdata-{key}-f*") if (p / "answers.jsonl").exists())
        if wider:
            return wider[0]
    return own


class SelfData:
    """The answers of one (model, settings) pair in ``work``; every method resumes."""

    def __init__(
        self,
        work: Path,
        model,
        tokenizer,
        *,
        temperature: float,
        answer_tokens: int,
        batch: int,
        seed: int,
        features=None,
        lanes: int | None = None,
    ):
        """``features``: the feature layers this folder's answers hold (``work_folder``),
        captured while answering when the model captures others; None: the model's own.
        ``lanes``: batches decoded at once (None: ``answer_lanes()``, by the backend)."""
        self.work, self.model, self.tokenizer = Path(work), model, tokenizer
        self.features = None if features is None else tuple(features)
        self.temperature, self.answer_tokens = temperature, answer_tokens
        self.batch, self.seed = batch, seed
        self.lanes = answer_lanes() if lanes is None else max(1, int(lanes))
        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / "hidden").mkdir(exist_ok=True)

    @property
    def prompts_path(self) -> Path:
        return self.work / "prompts.jsonl"

    @property
    def answers_path(self) -> Path:
        return self.work / "answers.jsonl"

    def prompts(self, own: int, on_batch=None, deadline: float | None = None) -> list[dict]:
        """The prompt list (built once: the model writes up to ``own`` of them, asking until
        ``deadline``; extended by a grown collection, ``extend_prompts``)."""
        if not self.prompts_path.exists():
            facts: dict = {}
            t0 = time.perf_counter()
            texts = own_prompts(
                self.model, self.tokenizer, own, self.seed, self.batch, on_batch, facts, deadline
            )
            rows = prompt_list(texts, self.seed)
            facts.update(
                written=len(texts),
                kept=sum(r["source"] == "model" for r in rows),
                prompts=len(rows),
                seconds=round(time.perf_counter() - t0, 2),
            )
            write_json_atomic(self.work / "prompts_meta.json", facts)
            write_jsonl_atomic(self.prompts_path, rows)
        rows, answered = read_jsonl(self.prompts_path), {r["id"] for r in self.answers()}
        grown = extend_prompts(rows, answered, self.seed)
        if grown is not rows:
            write_jsonl_atomic(self.prompts_path, grown)
            meta_path = self.work / "prompts_meta.json"
            meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
            added = dict(prompts=len(grown) - len(rows), answered_before=len(answered))
            meta.setdefault("added", []).append(added)
            write_json_atomic(meta_path, meta)
        return grown

    def answers(self) -> list[dict]:
        return read_jsonl(self.answers_path)

    def generate(
        self,
        todo: list[dict],
        stop: Callable[[int], bool],
        on_batch: Callable[[int, int], None] | None = None,
    ) -> list[dict]:
        """Answer the prompts of ``todo`` not yet answered, batch by batch, until ``stop(new
        positions so far)``; returns all answer rows in ``answers.jsonl``.

        Each run of ``POOL_BATCHES`` batches is sorted by prompt length and cut into
        batches, so a batch's rows have about the same length: little padding to prefill and
        narrow attention windows (a batch runs at the width of its longest prompt). The
        batches start in a seeded random order, so a budget that ends inside a run keeps
        prompts of every length (shortest first would keep its short ones only). ``lanes``
        batches decode at once (``selfgen.answers_in_lanes``); each is appended as it ends,
        and ``stop`` is asked before a batch starts (the batches in flight then finish).
        """
        done = {r["id"] for r in self.answers()}
        todo = [p for p in todo if p["id"] not in done]
        made = [0]

        def batches():
            pool = self.batch * POOL_BATCHES
            for start in range(0, len(todo), pool):
                ranked = sorted(todo[start : start + pool], key=lambda p: len(self.prompt_ids(p)))
                cut = [ranked[i : i + self.batch] for i in range(0, len(ranked), self.batch)]
                random.Random(f"batches/{self.seed}/{ranked[0]['id']}").shuffle(cut)
                for batch in cut:
                    if stop(made[0]):
                        return
                    yield batch

        for rows in self.answer_batches(batches()):
            append_jsonl(self.answers_path, rows)
            n = sum(len(r["response_ids"]) for r in rows)
            made[0] += n
            if on_batch:
                on_batch(len(rows), n)
        return self.answers()

    def prompt_ids(self, prompt: dict) -> list[int]:
        """A prompt row's text as the model's chat prompt (token ids)."""
        return list(self.tokenizer.chat_prompt([{"role": "user", "content": prompt["prompt"]}]))

    def answer_batches(self, batches) -> Iterator[list[dict]]:
        """The saved answer rows (``save``) of each batch of prompt rows in ``batches`` (an
        iterable, drawn as lanes free up), as each batch ends: ``lanes`` at a time, with the
        BLAS threads shared between them (``platform.lane_threads``)."""
        own = self.model.feature_layers
        if self.features is not None:
            self.model.capture_features(self.features)
        try:
            with lane_threads(self.lanes):
                jobs = (self.job(batch) for batch in batches)
                for job, answers in answers_in_lanes(self.model, jobs, self.lanes):
                    yield self.save(job, answers)
        finally:
            self.model.capture_features(own)

    def job(self, chunk: list[dict]) -> Job:
        """The decoding job of a batch of prompt rows (its key: the rows)."""
        return Job(
            chunk,
            [self.prompt_ids(p) for p in chunk],
            self.answer_tokens,
            tuple(sorted(self.tokenizer.eos_token_ids)),
            self.temperature,
            seed=self.seed * 1_000_003 + chunk[0]["id"],
        )

    def save(self, job: Job, answers: list[Answer]) -> list[dict]:
        """The answers to a ``job`` (its key: the prompt rows): their hidden states go to
        ``hidden/<first id>.npy`` first (atomically), then the answer rows that point into it
        are returned."""
        chunk = job.key
        shard = f"{chunk[0]['id']:07d}.npy"
        tmp = self.work / "hidden" / f".{shard}.tmp-{os.getpid()}.npy"
        np.save(tmp, np.concatenate([a.hidden for a in answers]))
        os.replace(tmp, self.work / "hidden" / shard)
        rows, offset = [], 0
        for p, ids, ans in zip(chunk, job.prompts, answers):
            rows.append(
                dict(
                    id=p["id"],
                    source=p["source"],
                    finish=ans.finish,
                    prompt_ids=ids,
                    response_ids=ans.ids,
                    hidden=dict(shard=shard, offset=offset),
                )
            )
            offset += len(ans.ids)
        return rows

    def targets(self, rows: list[dict], depth: int) -> TargetCache:
        """The training positions of ``rows`` (answer rows) as a cache (built once): tokens
        and valid on disk, hidden read from the answers' shards (not copied)."""
        digest = hashlib.sha256(json.dumps([r["id"] for r in rows]).encode()).hexdigest()[:12]
        path = self.work / f"targets-{len(rows)}-{digest}-T{depth}-shards"
        if not (path / "meta.json").exists():
            write_targets(path, rows, depth)
        segments = json.loads((path / "segments.json").read_text())
        hidden = ShardRows(self.work / "hidden", segments)
        load = lambda name: np.load(path / name, mmap_mode="r")
        return TargetCache(path, hidden, load("tokens.npy"), load("valid.npy"))


class ShardRows:
    """Hidden states (P, H) of a target cache read from the answer shards, without a copy.

    ``segments``: ``[shard, offset, n]`` in row order (rows [start, start + n) are the shard's
    rows [offset, offset + n)). Indexing takes an integer array (any shape) like a numpy
    array's first axis; ``np.asarray`` gives all rows.
    """

    def __init__(self, folder: Path, segments: list):
        self.arrays = [np.load(folder / name, mmap_mode="r") for name, _, _ in segments]
        self.offsets = np.array([at for _, at, _ in segments], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum([n for _, _, n in segments])])
        self.dtype = self.arrays[0].dtype
        self.shape = (int(self.starts[-1]), self.arrays[0].shape[1])

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64)
        flat = idx.reshape(-1)
        seg = np.searchsorted(self.starts, flat, side="right") - 1
        out = np.empty((len(flat), self.shape[1]), self.dtype)
        for k in np.unique(seg):
            sel = seg == k
            out[sel] = self.arrays[k][self.offsets[k] + flat[sel] - self.starts[k]]
        return out.reshape(*idx.shape, self.shape[1])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        rows = self[np.arange(len(self))]
        return rows if dtype is None else rows.astype(dtype)


def segments_of(rows: list[dict]) -> list[list]:
    """``[shard, offset, n]`` runs of the answers' hidden states, consecutive ones merged."""
    out: list[list] = []
    for r in rows:
        name, at, n = r["hidden"]["shard"], r["hidden"]["offset"], len(r["response_ids"])
        if out and out[-1][0] == name and out[-1][1] + out[-1][2] == at:
            out[-1][2] += n
        else:
            out.append([name, at, n])
    return out


def write_targets(path: Path, rows: list[dict], depth: int) -> None:
    """Every answer's tokens (P, T+1) and valid (P, T) (``answer_targets``) and where its
    hidden states are (``segments.json``) into ``path`` (a temp folder renamed into place)."""
    total = sum(len(r["response_ids"]) for r in rows)
    if total == 0:
        raise ValueError("the model's answers have no tokens to train on")
    with staged(path) as tmp:
        mm = np.lib.format.open_memmap
        tokens = mm(tmp / "tokens.npy", "w+", np.int32, (total, depth + 1))
        valid = mm(tmp / "valid.npy", "w+", np.bool_, (total, depth))
        at = 0
        for r in rows:
            no_hidden = Answer(r["response_ids"], r["finish"], np.zeros((0, 0)))
            _, t, v = answer_targets(no_hidden, depth)
            tokens[at : at + len(t)], valid[at : at + len(t)] = t, v
            at += len(t)
        for a in (tokens, valid):
            a.flush()
        del tokens, valid
        (tmp / "segments.json").write_text(json.dumps(segments_of(rows)))
        meta = dict(positions=total, sequences=len(rows), T=depth, mode="self", answers=True)
        (tmp / "meta.json").write_text(json.dumps(meta))


def answer_sequences(rows: list[dict]) -> list[Sequence]:
    """Answer rows as Sequences of response tokens (all training tokens: for the shortlist)."""
    return [Sequence(list(r["response_ids"]), [True] * len(r["response_ids"])) for r in rows]


# ------------------------------------------------------------------------------------------
# budget


def parse_budget(text: str) -> tuple[str, float]:
    """``30m``, ``2h``, ``90s``, ``1h30m`` -> ("seconds", s); ``200k`` or ``500000`` ->
    ("positions", n). Raises ValueError with the accepted forms."""
    import re

    t = text.strip().lower().replace(" ", "").replace("_", "")
    if re.fullmatch(r"\d+k?", t) and int(t.rstrip("k")) > 0:
        return "positions", float(int(t.rstrip("k")) * (1000 if t.endswith("k") else 1))
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|min|m|s)", t)
    if parts and "".join(a + b for a, b in parts) == t:
        scale = {"h": 3600, "m": 60, "min": 60, "s": 1}
        seconds = sum(float(a) * scale[b] for a, b in parts)
        if seconds > 0:
            return "seconds", seconds
    raise ValueError(
        f"budget must be a time > 0 (e.g. 30m, 2h, 1h30m, 90s) or a number of training "
        f"positions > 0 (e.g. 200k, 500000), got {text!r}"
    )


def time_left(deadline: float | None) -> float:
    return float("inf") if deadline is None else deadline - time.time()
