"""Rebuild the bundled demo model from scratch, reproducibly.

    python -m scripts.build_demo                       # all stages (make demo-model)
    python -m scripts.build_demo --stages corpus,tokenizer --work /tmp/demo-build
    python -m scripts.build_demo --stages base --steps 900 --seed 0

Stages (each reads the previous one's output from ``--work`` and ``--out``):

corpus     The Python standard library's own ``*.py`` source (always present offline, wherever the
           app runs), minus tests, generated tables and machine-specific files; files sorted by
           relative path, every 20th file held out for evaluation. From the docstrings of
           functions/classes (``ast``) we also make Vicuna v1.1 chat examples (request from the
           signature + first docstring line, reply = the source). NOTE: the corpus depends on the
           Python version the build runs on; the build records it (manifest.json, BUILD.md).
tokenizer  SentencePiece BPE in LLaMA's ``tokenizer.model`` format (byte fallback, <unk>=0, <s>=1,
           </s>=2, no pad), trained on the training files only, deterministic (one thread,
           fixed order).
base       A small Llama (``mlx_lm.models.llama.Model``) trained with MLX on a mix of raw source and
           chat examples (AdamW, warm-up + cosine, fp32 compute), saved as an mlx-lm model directory
           in float16 (``out/base``).
drafter    Distils a ReDrafter drafter for the base model with ``redrafter_mlx.train.distill`` into
           ``out/drafter`` (not available until that module exists).

Intermediate files (corpus dumps, token arrays) go to ``--work`` (default: a temp dir), never into
the package. On Linux, run with OpenBLAS preloaded (the Makefile does) and, to keep to one core,
``OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import shlex
import sys
import sysconfig
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from redrafter_mlx.engine.base.chat_format import VICUNA_SYSTEM, vicuna_prompt

STAGES = ("corpus", "tokenizer", "base", "drafter")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "demo_model"
DEFAULT_WORK = Path(tempfile.gettempdir()) / "redrafter_mlx_demo_build"

SYSTEM_PROMPT = VICUNA_SYSTEM  # the demo model chats in Vicuna v1.1
HELDOUT_EVERY = 20  # file i (in sorted order) is held out when i % 20 == 19

# Directories (any path component) that are excluded from the corpus.
EXCLUDED_DIRS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "__pycache__",
    "lib-dynload",
    "encodings",  # ~120 generated codec tables; they would dominate the corpus with hex tables
    "__phello__",  # frozen-module test fixtures
}
EXCLUDED_FILES = {
    "pydoc_data/topics.py",  # 750 KB of generated prose in one string literal
    "__hello__.py",
    "this.py",  # rot13 text
}
MAX_FILE_BYTES = 400_000
# Chat examples: keep replies that fit comfortably in the training context.
CHAT_MAX_LINES = 60
CHAT_MAX_CHARS = 2400
CHAT_MIN_LINES = 3


# ----------------------------------------------------------------------------------------------
# corpus


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded(rel: str) -> bool:
    parts = rel.split("/")
    if any(p in EXCLUDED_DIRS for p in parts[:-1]):
        return True
    if parts[0].startswith("config-"):  # build config of this interpreter
        return True
    if parts[-1].startswith("_sysconfigdata"):  # machine-specific
        return True
    return rel in EXCLUDED_FILES


def list_corpus_files(root: Path) -> list[str]:
    """Relative POSIX paths of the corpus files, sorted (the order defines the held-out split)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            p = Path(dirpath) / fn
            rel = p.relative_to(root).as_posix()
            if _excluded(rel) or p.stat().st_size > MAX_FILE_BYTES:
                continue
            out.append(rel)
    return sorted(out)


def read_source(path: Path) -> str | None:
    try:
        text = path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if "\x00" in text:
        return None
    return text


def chat_prompt(request: str) -> str:
    """The prompt a chat engine builds for one user turn (generation continues after it)."""
    return vicuna_prompt([{"role": "user", "content": request}])


def chat_text(request: str, reply: str) -> str:
    """One Vicuna v1.1 exchange, *without* BOS/EOS (the trainer adds token ids 1 and 2; the
    textual form is ``... ASSISTANT: {reply}</s>``)."""
    return f"{chat_prompt(request)} {reply}"


def _first_doc_line(node) -> str | None:
    doc = ast.get_docstring(node)
    if not doc:
        return None
    line = doc.strip().split("\n")[0].strip()
    if len(line) < 8 or len(line) > 200:
        return None
    return line


def _node_source(lines: list[str], node) -> str:
    start = node.lineno
    if getattr(node, "decorator_list", None):
        start = min(d.lineno for d in node.decorator_list)
    seg = "".join(lines[start - 1 : node.end_lineno])
    return textwrap.dedent(seg).rstrip() + "\n"


def _signature(node) -> str:
    try:
        args = ast.unparse(node.args)
    except Exception:  # pragma: no cover - ast.unparse handles all stdlib code
        return f"{node.name}(...)"
    return f"{node.name}({args})"


def chat_examples_from_source(text: str) -> list[dict]:
    """Chat examples for documented functions, methods and classes of one module."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    out = []

    def visit(body, owner: str | None):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first = _first_doc_line(node)
                if first is not None:
                    src = _node_source(lines, node)
                    n_lines = src.count("\n")
                    if CHAT_MIN_LINES <= n_lines <= CHAT_MAX_LINES and len(src) <= CHAT_MAX_CHARS:
                        if isinstance(node, ast.ClassDef):
                            bases = ", ".join(ast.unparse(b) for b in node.bases)
                            what = (
                                f"class `{node.name}({bases})`" if bases else f"class `{node.name}`"
                            )
                        elif owner is not None:
                            what = f"method `{_signature(node)}` of class `{owner}`"
                        else:
                            kind = (
                                "async function"
                                if isinstance(node, ast.AsyncFunctionDef)
                                else "function"
                            )
                            what = f"{kind} `{_signature(node)}`"
                        request = f"Write a Python {what}: {first}"
                        out.append({"request": request, "reply": src, "name": node.name})
                if isinstance(node, ast.ClassDef):
                    visit(node.body, node.name)

    visit(tree.body, None)
    return out


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_corpus(
    work: Path,
    root: Path | None = None,
    files: list[str] | None = None,
    out: Path | None = None,
    n_prompts: int = 50,
) -> dict:
    """Write ``work/corpus.jsonl`` and ``work/corpus_manifest.json``; optionally
    ``out/heldout_prompts.jsonl``. Deterministic for a given stdlib (= Python version)."""
    root = Path(root) if root is not None else stdlib_root()
    files = list_corpus_files(root) if files is None else sorted(files)
    work.mkdir(parents=True, exist_ok=True)
    stats = {
        "train": {"files": 0, "chars": 0, "chat": 0, "chat_chars": 0},
        "heldout": {"files": 0, "chars": 0, "chat": 0, "chat_chars": 0},
    }
    heldout_chat: list[dict] = []
    skipped = []
    corpus_path = work / "corpus.jsonl"
    with open(corpus_path, "w", encoding="utf-8", newline="\n") as f:
        for i, rel in enumerate(files):
            text = read_source(root / rel)
            if text is None or not text.strip():
                skipped.append(rel)
                continue
            split = "heldout" if i % HELDOUT_EVERY == HELDOUT_EVERY - 1 else "train"
            f.write(
                json.dumps(
                    {"split": split, "kind": "source", "path": rel, "text": text},
                    ensure_ascii=False,
                )
                + "\n"
            )
            stats[split]["files"] += 1
            stats[split]["chars"] += len(text)
            for ex in chat_examples_from_source(text):
                f.write(
                    json.dumps(
                        {
                            "split": split,
                            "kind": "chat",
                            "path": rel,
                            "request": ex["request"],
                            "reply": ex["reply"],
                            "text": chat_text(ex["request"], ex["reply"]),
                        },
                        ensure_ascii=False,
                    )
                    + "\n"
                )
                stats[split]["chat"] += 1
                stats[split]["chat_chars"] += len(ex["reply"])
                if split == "heldout":
                    heldout_chat.append({"path": rel, **ex})
    manifest = {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib": str(root),
        "n_files": len(files) - len(skipped),
        "skipped": skipped,
        "heldout_rule": (
            f"file index i (sorted relative paths) with i % {HELDOUT_EVERY} == {HELDOUT_EVERY - 1}"
        ),
        "stats": stats,
        "corpus_sha256": _sha256_file(corpus_path),
    }
    (work / "corpus_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if out is not None:
        write_heldout_prompts(heldout_chat, out / "heldout_prompts.jsonl", n_prompts)
    return manifest


def write_heldout_prompts(heldout_chat: list[dict], path: Path, n: int) -> None:
    """Pick ``n`` held-out chat requests, spread evenly over the held-out files (deterministic)."""
    cands = [ex for ex in heldout_chat if ex["reply"].count("\n") <= 30]
    if len(cands) > n:
        idx = np.linspace(0, len(cands) - 1, n).round().astype(int)
        cands = [cands[i] for i in idx]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for ex in cands:
            f.write(json.dumps({"turns": [ex["request"]]}, ensure_ascii=False) + "\n")


def load_corpus(work: Path) -> list[dict]:
    with open(work / "corpus.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------------------------
# tokenizer

TOKENIZER_CONFIG = {
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": {
        "__type": "AddedToken",
        "content": "<s>",
        "lstrip": False,
        "normalized": True,
        "rstrip": False,
        "single_word": False,
    },
    "clean_up_tokenization_spaces": False,
    "eos_token": {
        "__type": "AddedToken",
        "content": "</s>",
        "lstrip": False,
        "normalized": True,
        "rstrip": False,
        "single_word": False,
    },
    "legacy": False,
    "model_max_length": 512,
    "pad_token": None,
    "padding_side": "right",
    "sp_model_kwargs": {},
    "tokenizer_class": "LlamaTokenizer",
    "unk_token": {
        "__type": "AddedToken",
        "content": "<unk>",
        "lstrip": False,
        "normalized": True,
        "rstrip": False,
        "single_word": False,
    },
}
SPECIAL_TOKENS_MAP = {
    "bos_token": {
        "content": "<s>",
        "lstrip": False,
        "normalized": True,
        "rstrip": False,
        "single_word": False,
    },
    "eos_token": {
        "content": "</s>",
        "lstrip": False,
        "normalized": True,
        "rstrip": False,
        "single_word": False,
    },
    "pad_token": "<unk>",
    "unk_token": {
        "content": "<unk>",
        "lstrip": False,
        "normalized": True,
        "rstrip": False,
        "single_word": False,
    },
}


def build_tokenizer(
    work: Path,
    base_dir: Path,
    vocab_size: int = 4096,
    seed: int = 0,
    input_sentence_size: int = 2_000_000,
) -> dict:
    import sentencepiece as spm

    records = load_corpus(work)
    # Training sentences: the lines of the *training* files (SentencePiece reads one sentence per
    # line), in corpus order. Chat examples add the system prompt / request phrasing once each.
    lines_path = work / "spm_train.txt"
    n = 0
    with open(lines_path, "w", encoding="utf-8", newline="\n") as f:
        seen_req = False
        for r in records:
            if r["split"] != "train":
                continue
            if r["kind"] == "source":
                for line in r["text"].split("\n"):
                    if line.strip():
                        f.write(line + "\n")
                        n += 1
            else:
                if not seen_req:
                    f.write(SYSTEM_PROMPT + "\n")
                    seen_req = True
                f.write(f"USER: {r['request']} ASSISTANT:\n")
                n += 1
    base_dir.mkdir(parents=True, exist_ok=True)
    prefix = work / "tokenizer"
    spm.SentencePieceTrainer.train(
        input=str(lines_path),
        model_prefix=str(prefix),
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        max_sentence_length=16384,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=False,
        seed_sentencepiece_size=1_000_000,
        num_threads=1,
        minloglevel=2,
    )
    # The model proto records the training file paths: blank them so that the bytes do not depend
    # on --work (same corpus -> byte-identical tokenizer.model).
    from sentencepiece import sentencepiece_model_pb2 as spm_pb

    proto = spm_pb.ModelProto()
    proto.ParseFromString((work / "tokenizer.model").read_bytes())
    proto.trainer_spec.input[:] = ["spm_train.txt"]
    proto.trainer_spec.model_prefix = "tokenizer"
    (work / "tokenizer.model").write_bytes(proto.SerializeToString())
    (base_dir / "tokenizer.model").write_bytes(proto.SerializeToString())
    (base_dir / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    (base_dir / "special_tokens_map.json").write_text(
        json.dumps(SPECIAL_TOKENS_MAP, indent=2) + "\n"
    )
    sp = spm.SentencePieceProcessor(model_file=str(base_dir / "tokenizer.model"))
    # Round trip and compression on held-out code.
    held = [r["text"] for r in records if r["split"] == "heldout" and r["kind"] == "source"]
    bad = [i for i, t in enumerate(held) if sp.decode(sp.encode(t)) != t]
    if bad:
        raise RuntimeError(f"tokenizer round trip failed on {len(bad)} held-out files")
    chars = sum(len(t) for t in held)
    toks = sum(len(sp.encode(t)) for t in held)
    info = {
        "vocab_size": sp.get_piece_size(),
        "training_sentences": n,
        "heldout_chars_per_token": round(chars / max(toks, 1), 3),
        "tokenizer_sha256": _sha256_file(base_dir / "tokenizer.model"),
    }
    (work / "tokenizer_info.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


# ----------------------------------------------------------------------------------------------
# base model


@dataclass
class BaseConfig:
    hidden_size: int = 256
    num_hidden_layers: int = 4
    intermediate_size: int = 704
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 512


@dataclass
class TrainConfig:
    steps: int = 900
    tokens_per_step: int = 4096
    seq_len: int = 256  # first phase
    long_seq_len: int = 512  # last `long_frac` of the steps (same tokens per step)
    long_frac: float = 0.25
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 60
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0
    chat_frac: float = 0.35  # fraction of windows that start at a chat example
    eval_every: int = 100
    eval_windows: int = 64
    seed: int = 0


def _tokenize_corpus(work: Path, sp) -> dict[str, np.ndarray]:
    """Token streams (uint16) per (split, kind), each document as [BOS] text [EOS]; plus the
    start offsets of the documents (for windows that start at a chat example)."""
    cache = work / "tokens.npz"
    tok_sha = _sha256_file(work / "tokenizer.model")
    man_sha = json.loads((work / "corpus_manifest.json").read_text())["corpus_sha256"]
    key = np.frombuffer(hashlib.sha256((tok_sha + man_sha).encode()).digest(), dtype=np.uint8)
    if cache.exists():
        z = dict(np.load(cache))
        if np.array_equal(z.get("key"), key):
            return z
    records = load_corpus(work)
    out: dict[str, np.ndarray] = {"key": key}
    for split in ("train", "heldout"):
        for kind in ("source", "chat"):
            texts = [r["text"] for r in records if r["split"] == split and r["kind"] == kind]
            ids = sp.encode(texts)
            starts, chunks, pos = [], [], 0
            for x in ids:
                doc = [1] + x + [2]
                starts.append(pos)
                chunks.append(np.asarray(doc, dtype=np.uint16))
                pos += len(doc)
            out[f"{split}_{kind}"] = np.concatenate(chunks) if chunks else np.zeros(0, np.uint16)
            out[f"{split}_{kind}_starts"] = np.asarray(starts, dtype=np.int64)
    np.savez(cache, **out)
    return out


def model_args(cfg: BaseConfig, vocab_size: int):
    from mlx_lm.models import llama

    return llama.ModelArgs(
        model_type="llama",
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        rms_norm_eps=cfg.rms_norm_eps,
        vocab_size=vocab_size,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
    )


def hf_config(cfg: BaseConfig, vocab_size: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.hidden_size // cfg.num_attention_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": vocab_size,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float16",
    }


class _Sampler:
    """Random training windows from a seeded numpy RNG."""

    def __init__(self, toks: dict, chat_frac: float, seed: int):
        self.src = toks["train_source"].astype(np.int32)
        self.chat = toks["train_chat"].astype(np.int32)
        self.chat_starts = toks["train_chat_starts"]
        self.chat_frac = chat_frac if len(self.chat) else 0.0
        self.rng = np.random.default_rng(seed)

    def batch(self, bsz: int, seq: int) -> np.ndarray:
        rows = []
        for _ in range(bsz):
            if self.rng.random() < self.chat_frac:
                s = int(self.chat_starts[self.rng.integers(len(self.chat_starts))])
                s = min(s, len(self.chat) - seq - 1)
                rows.append(self.chat[s : s + seq + 1])
            else:
                s = int(self.rng.integers(0, len(self.src) - seq - 1))
                rows.append(self.src[s : s + seq + 1])
        return np.stack(rows)


def eval_windows(stream: np.ndarray, seq: int, limit: int | None = None) -> np.ndarray:
    """Non-overlapping windows of ``seq + 1`` tokens (stride ``seq``) over a held-out stream."""
    n = (len(stream) - 1) // seq
    if limit is not None:
        n = min(n, limit)
    return np.stack([stream[i * seq : i * seq + seq + 1] for i in range(n)]).astype(np.int32)


def heldout_nll(model, windows: np.ndarray, batch: int = 16) -> tuple[float, int]:
    """Mean token NLL (nats) of ``model`` on ``windows``, and the number of tokens scored."""
    import mlx.core as mx
    import mlx.nn as nn

    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = mx.array(windows[i : i + batch])
        logits = model(w[:, :-1]).astype(mx.float32)
        nll = nn.losses.cross_entropy(logits, w[:, 1:], reduction="sum")
        total += nll.item()
        count += w.shape[0] * (w.shape[1] - 1)
    return total / count, count


def greedy_generate(model, sp, prompt: str, max_tokens: int = 120) -> str:
    """Plain greedy decoding with mlx-lm's KV cache (BOS + prompt)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    ids = [1] + sp.encode(prompt)
    logits = model(mx.array([ids]), cache=cache)
    out = []
    for _ in range(max_tokens):
        t = int(mx.argmax(logits[0, -1]).item())
        if t == 2:
            break
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)
    return sp.decode(out)


def save_base(model, cfg: BaseConfig, vocab_size: int, base_dir: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    base_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(base_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (base_dir / "config.json").write_text(json.dumps(hf_config(cfg, vocab_size), indent=2) + "\n")


def train_base(
    work: Path,
    base_dir: Path,
    cfg: BaseConfig,
    tcfg: TrainConfig,
    minutes: float | None = None,
    log=print,
) -> dict:
    from functools import partial

    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import sentencepiece as spm
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    sp = spm.SentencePieceProcessor(model_file=str(base_dir / "tokenizer.model"))
    vocab = sp.get_piece_size()
    t_tok = time.time()
    toks = _tokenize_corpus(work, sp)
    log(
        f"tokens: train source {len(toks['train_source']):,}, "
        f"train chat {len(toks['train_chat']):,}, "
        f"held-out source {len(toks['heldout_source']):,} ({time.time() - t_tok:.1f}s)"
    )
    held = toks["heldout_source"].astype(np.int32)
    ev_small = eval_windows(held, tcfg.seq_len, tcfg.eval_windows)

    def fresh():
        mx.random.seed(tcfg.seed)
        m = llama.Model(model_args(cfg, vocab))
        mx.eval(m.parameters())
        return m

    def loss_fn(m, x, y):
        return nn.losses.cross_entropy(m(x), y).mean()

    def make(model, total_steps):
        warm = min(tcfg.warmup, max(1, total_steps // 10))
        sched = optim.join_schedules(
            [
                optim.linear_schedule(tcfg.lr / warm, tcfg.lr, warm),
                optim.cosine_decay(tcfg.lr, max(1, total_steps - warm), tcfg.lr * tcfg.min_lr_frac),
            ],
            [warm],
        )
        opt = optim.AdamW(
            learning_rate=sched, betas=list(tcfg.betas), weight_decay=tcfg.weight_decay
        )
        state = [model.state, opt.state]

        @partial(mx.compile, inputs=state, outputs=state)
        def step(x, y):
            loss, grads = nn.value_and_grad(model, loss_fn)(model, x, y)
            grads, _ = optim.clip_grad_norm(grads, tcfg.grad_clip)
            opt.update(model, grads)
            return loss

        return opt, state, step

    steps = tcfg.steps
    if minutes is not None:
        # Measure throughput on a throw-away copy, then size the run to the budget.
        m = fresh()
        _, state, step = make(m, 100)
        smp = _Sampler(toks, tcfg.chat_frac, tcfg.seed + 1)
        times = {}
        for seq in (tcfg.seq_len, tcfg.long_seq_len):
            bsz = tcfg.tokens_per_step // seq
            for i in range(5):
                if i == 2:
                    t0 = time.time()
                b = mx.array(smp.batch(bsz, seq))
                loss = step(b[:, :-1], b[:, 1:])
                mx.eval(state, loss)
            times[seq] = (time.time() - t0) / 3
        per_step = (1 - tcfg.long_frac) * times[tcfg.seq_len] + tcfg.long_frac * times[
            tcfg.long_seq_len
        ]
        steps = max(10, int(minutes * 60 * 0.95 / per_step))
        log(
            f"throughput: {tcfg.tokens_per_step / times[tcfg.seq_len]:.0f} tok/s "
            f"at T={tcfg.seq_len}, "
            f"{tcfg.tokens_per_step / times[tcfg.long_seq_len]:.0f} tok/s at T={tcfg.long_seq_len} "
            f"-> {steps} steps for {minutes} min"
        )
        del m, state, step

    model = fresh()
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    log(f"model: {asdict(cfg)} vocab={vocab} params={n_params:,}")
    opt, state, step = make(model, steps)
    sampler = _Sampler(toks, tcfg.chat_frac, tcfg.seed)
    long_from = int(round(steps * (1 - tcfg.long_frac)))
    history = []
    t_start = time.time()
    ema = None
    tokens_seen = 0
    progress = Progress(
        TextColumn("[bold]base"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TextColumn("{task.fields[tps]:.0f} tok/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )

    def plain(msg):
        progress.console.print(msg, markup=False, highlight=False)

    with progress:
        task = progress.add_task("train", total=steps, loss=float("nan"), tps=0.0)
        t_last = time.time()
        for it in range(1, steps + 1):
            seq = tcfg.long_seq_len if it > long_from else tcfg.seq_len
            bsz = tcfg.tokens_per_step // seq
            b = mx.array(sampler.batch(bsz, seq))
            loss = step(b[:, :-1], b[:, 1:])
            mx.eval(state, loss)
            lv = loss.item()
            ema = lv if ema is None else 0.95 * ema + 0.05 * lv
            tokens_seen += bsz * seq
            now = time.time()
            tps = bsz * seq / max(now - t_last, 1e-9)
            t_last = now
            progress.update(task, advance=1, loss=ema, tps=tps)
            if it % 25 == 0 or it == steps:
                el = now - t_start
                plain(
                    f"step {it}/{steps} T={seq} loss {lv:.4f} (ema {ema:.4f}) "
                    f"lr {opt.learning_rate.item():.2e} {tokens_seen / el:.0f} tok/s "
                    f"elapsed {el / 60:.1f} min"
                )
            if it % tcfg.eval_every == 0 or it == steps:
                nll, _ = heldout_nll(model, ev_small)
                history.append(
                    {
                        "step": it,
                        "train_loss_ema": round(ema, 4),
                        "heldout_nll_small": round(nll, 4),
                    }
                )
                plain(
                    f"  eval step {it}: held-out nll {nll:.4f} ppl {math.exp(nll):.2f} "
                    f"({len(ev_small)} windows)"
                )
                t_last = time.time()
            if it % 300 == 0 and it < steps:
                save_base(model, cfg, vocab, work / "ckpt")
    train_s = time.time() - t_start
    log(f"training done: {steps} steps, {tokens_seen:,} tokens, {train_s / 60:.1f} min")
    save_base(model, cfg, vocab, base_dir)

    # Final evaluation on the fp16 weights that ship.
    from mlx_lm.utils import load_model

    shipped, _ = load_model(base_dir)
    shipped.set_dtype(mx.float32)
    t0 = time.time()
    res = {}
    # Every held-out token at context 256; the first 100 windows at the long context.
    for seq, limit in ((tcfg.seq_len, None), (tcfg.long_seq_len, 100)):
        w = eval_windows(held, seq, limit)
        nll, count = heldout_nll(shipped, w)
        res[seq] = {"nll": round(nll, 4), "ppl": round(math.exp(nll), 3), "tokens": count}
        log(
            f"held-out (fp16 weights, context {seq}): nll {nll:.4f} ppl {math.exp(nll):.3f} "
            f"over {count:,} tokens"
        )
    eval_s = time.time() - t0
    chat_held = toks["heldout_chat"].astype(np.int32)
    chat_nll = None
    if len(chat_held) > tcfg.seq_len + 1:
        chat_nll, _ = heldout_nll(shipped, eval_windows(chat_held, tcfg.seq_len, 200))
    prompts = (
        [
            json.loads(line)["turns"][0]
            for line in (base_dir.parent / "heldout_prompts.jsonl").read_text().splitlines()
            if line.strip()
        ]
        if (base_dir.parent / "heldout_prompts.jsonl").exists()
        else []
    )
    samples = [
        {"prompt": p, "greedy": greedy_generate(shipped, sp, chat_prompt(p))} for p in prompts[:3]
    ]
    for s in samples:
        log(f"USER: {s['prompt']}\nASSISTANT:{s['greedy']}\n")
    info = {
        "model": asdict(cfg),
        "vocab_size": vocab,
        "params": n_params,
        "train": {**asdict(tcfg), "steps": steps, "betas": list(tcfg.betas)},
        "tokens_seen": tokens_seen,
        "train_seconds": round(train_s, 1),
        "tokens_per_second": round(tokens_seen / train_s, 1),
        "final_train_loss_ema": round(ema, 4),
        "history": history,
        "heldout": {str(k): v for k, v in res.items()},
        "heldout_chat_nll": None if chat_nll is None else round(chat_nll, 4),
        "eval_seconds": round(eval_s, 1),
        "corpus_tokens": {
            k: int(len(toks[k]))
            for k in ("train_source", "train_chat", "heldout_source", "heldout_chat")
        },
        "samples": samples,
        "safetensors_bytes": (base_dir / "model.safetensors").stat().st_size,
        "threads": {
            k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "LD_PRELOAD")
        },
    }
    (work / "base_info.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


# ----------------------------------------------------------------------------------------------
# drafter


def write_distill_data(work: Path, examples: int | None = None, seed: int = 0) -> Path:
    """Training chats for the drafter: the *training-split* chat examples as
    ``{"prompt", "response"}`` JSONL (redrafter_mlx.train.data's format); with ``examples``,
    a seeded random subset of that many (distillation targets cost T+1 forwards each)."""
    import random

    rows = [
        {"prompt": r["request"], "response": r["reply"]}
        for r in load_corpus(work)
        if r["split"] == "train" and r["kind"] == "chat"
    ]
    if examples is not None and examples < len(rows):
        rows = random.Random(seed).sample(rows, examples)
    path = work / "distill_train.jsonl"
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


# The shipped drafter: compact, because on small models and CPU backends the drafter's
# exit_dim x vocab head dominates the cost of a draft step (an exit_dim of 2H doubles it).
DRAFTER_OPTIONS = dict(
    predict_tokens=5,
    layers=1,
    exit_dim=256,
    steps=1200,
    batch_size=256,
    seq_len=512,
    eval_prompts=24,
    eval_max_tokens=128,
    feature_layers="last",  # the shipped demo drafter reads the last layer (distill: auto)
)
DRAFTER_EXAMPLES = 600


DRAFTER_FILES = ("config.json", "model.safetensors", "eval.json")


def build_drafter(work: Path, out: Path, seed: int, steps: int | None = None, log=print) -> dict:
    """Distil a ReDrafter drafter for the demo base model with ``redrafter_mlx.train.distill`` into
    ``out/drafter`` (only the drafter files; checkpoints and target caches stay in ``work``)."""
    import shutil

    from redrafter_mlx.train.distill import distill

    data = write_distill_data(work, DRAFTER_EXAMPLES, seed)
    run_dir = work / "drafter_run"
    options = dict(
        DRAFTER_OPTIONS,
        seed=seed,
        eval_data=[str(out / "heldout_prompts.jsonl")],
        cache_dir=str(work / "distill_cache"),
        overwrite=True,
    )
    if steps is not None:
        options["steps"] = steps
    log(f"drafter: distill({out / 'base'}, {data}, {run_dir}, {options})")
    from redrafter_mlx.cli.distill import Bars  # the command's own progress bars

    summary = distill(out / "base", [data], run_dir, progress=Bars(), **options)
    dst = out / "drafter"
    dst.mkdir(parents=True, exist_ok=True)
    for name in DRAFTER_FILES:
        if name == "model.safetensors":  # shipped in float16, like the base model
            import mlx.core as mx

            weights = {k: v.astype(mx.float16) for k, v in mx.load(str(run_dir / name)).items()}
            mx.save_safetensors(str(dst / name), weights)
        elif (run_dir / name).exists():
            shutil.copyfile(run_dir / name, dst / name)
    info = {"options": options, "summary": {k: v for k, v in summary.items() if k != "history"}}
    (work / "drafter_info.json").write_text(json.dumps(info, indent=1, default=str) + "\n")
    return info


# ----------------------------------------------------------------------------------------------
# BUILD.md


def _fmt_bytes(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def write_build_md(out: Path, work: Path, argv: list[str]) -> None:
    def rd(name):
        p = work / name
        return json.loads(p.read_text()) if p.exists() else None

    man, tok, base = rd("corpus_manifest.json"), rd("tokenizer_info.json"), rd("base_info.json")
    cmd_argv = base["argv"] if base and "argv" in base else argv
    L = [
        "# Demo model build record",
        "",
        "Generated by `python -m scripts.build_demo` (`make demo-model`); do not edit by hand.",
        "",
        "## Command",
        "",
        "The shipped base model was built with:",
        "",
        "```",
        shlex.join(["python", "-m", "scripts.build_demo", *cmd_argv]),
        "```",
        "",
    ]
    if base and "--minutes" in cmd_argv:
        L += [
            "(`--minutes` sized the run from measured throughput; "
            f"`--steps {base['train']['steps']}` reproduces it exactly.)",
            "",
        ]
    L += [
        f"- Python {platform.python_version()} ({platform.python_implementation()}), "
        f"{platform.system()} {platform.machine()}",
        f"- mlx {_version('mlx')}, mlx-lm {_version('mlx-lm')}, "
        f"sentencepiece {_version('sentencepiece')}, numpy {np.__version__}",
    ]
    if base:
        th = base["threads"]
        L.append(
            f"- threads: OPENBLAS_NUM_THREADS={th.get('OPENBLAS_NUM_THREADS')}, "
            f"OMP_NUM_THREADS={th.get('OMP_NUM_THREADS')}, LD_PRELOAD={th.get('LD_PRELOAD')}"
        )
    L.append("")
    if man:
        s = man["stats"]
        L += [
            "## Corpus",
            "",
            f"The `*.py` source of the Python {man['python_version']} standard library "
            "(always available offline), minus tests (`test/`, `tests/`, `idle_test/`), "
            "`site-packages`, the generated codec tables in `encodings/`, `pydoc_data/topics.py`, "
            "machine-specific `_sysconfigdata*` and `config-*`. Files are sorted by relative path; "
            f"held out: {man['heldout_rule']}. "
            "**The corpus depends on the Python version**: a build on "
            "another version gives a different (equally valid) model.",
            "",
            "Chat examples (Vicuna v1.1 format) are made with `ast` from documented functions, "
            f"methods and classes of {CHAT_MIN_LINES}-{CHAT_MAX_LINES} lines (system prompt, then "
            "``USER: Write a Python function `name(args)`: <first docstring line> "
            "ASSISTANT: <source></s>``). "
            "Training mixes raw source and these chat examples.",
            "",
            "| split | files | chars | chat examples | chat reply chars |",
            "|---|---|---|---|---|",
        ]
        for k in ("train", "heldout"):
            L.append(
                f"| {k} | {s[k]['files']} | {s[k]['chars']:,} | {s[k]['chat']:,} "
                f"| {s[k]['chat_chars']:,} |"
            )
        L += ["", f"corpus.jsonl sha256: `{man['corpus_sha256']}`", ""]
    if tok:
        L += [
            "## Tokenizer",
            "",
            "SentencePiece BPE (LLaMA `tokenizer.model` format), "
            f"vocab {tok['vocab_size']}, byte fallback, "
            "identity normalization, dummy prefix, split digits, whitespace-only pieces allowed "
            "(indentation runs become single pieces), `<unk>`=0 `<s>`=1 `</s>`=2, no pad. "
            "Trained on the lines of the "
            f"training files ({tok['training_sentences']:,} sentences), "
            "one thread, input order fixed.",
            "",
            f"- held-out: {tok['heldout_chars_per_token']} chars/token; "
            "decode(encode(x)) == x on every held-out file",
            f"- tokenizer.model sha256: `{tok['tokenizer_sha256']}`",
            "",
        ]
    if base:
        m, t = base["model"], base["train"]
        ho = base["heldout"]
        L += [
            "## Base model",
            "",
            f"Llama (`mlx_lm.models.llama.Model`): hidden {m['hidden_size']}, "
            f"{m['num_hidden_layers']} layers, "
            f"{m['num_attention_heads']} heads (kv {m['num_key_value_heads']}, head dim "
            f"{m['hidden_size'] // m['num_attention_heads']}), MLP {m['intermediate_size']}, vocab "
            f"{base['vocab_size']}, tied embeddings, RoPE theta {m['rope_theta']:g}, "
            f"trained context {m['max_position_embeddings']}. **{base['params']:,} parameters**; "
            f"model.safetensors (float16) {_fmt_bytes(base['safetensors_bytes'])}.",
            "",
            f"Training: {t['steps']} steps x {t['tokens_per_step']} tokens "
            f"(sequence {t['seq_len']} for the first {1 - t['long_frac']:.0%} of the steps, "
            f"then {t['long_seq_len']}), "
            f"random windows from a seeded numpy RNG (seed {t['seed']}); "
            f"{t['chat_frac']:.0%} of windows start at a "
            "chat example, the rest anywhere in the raw source. "
            f"AdamW (lr {t['lr']:g}, betas {tuple(t['betas'])}, "
            f"weight decay {t['weight_decay']}), "
            f"{min(t['warmup'], max(1, t['steps'] // 10))} warm-up steps "
            f"then cosine to "
            f"{t['lr'] * t['min_lr_frac']:g}, grad clip {t['grad_clip']}, fp32 compute, "
            "saved as float16.",
            "",
            f"- corpus tokens: {', '.join(f'{k} {v:,}' for k, v in base['corpus_tokens'].items())}",
            f"- tokens seen: {base['tokens_seen']:,} in {base['train_seconds'] / 60:.1f} min "
            f"({base['tokens_per_second']:.0f} tokens/s)",
            f"- final train loss (EMA): {base['final_train_loss_ema']:.4f}",
        ]
        for k, v in ho.items():
            L.append(
                f"- **held-out perplexity (context {k}, fp16 weights): {v['ppl']:.2f}** "
                f"(nll {v['nll']:.4f} nats/token over {v['tokens']:,} tokens of the held-out files)"
            )
        if base.get("heldout_chat_nll") is not None:
            L.append(
                f"- held-out chat examples: nll {base['heldout_chat_nll']:.4f} "
                f"(ppl {math.exp(base['heldout_chat_nll']):.2f})"
            )
        L += ["", "| step | train loss (EMA) | held-out nll (64 windows) |", "|---|---|---|"]
        for h in base["history"]:
            L.append(f"| {h['step']} | {h['train_loss_ema']:.4f} | {h['heldout_nll_small']:.4f} |")
        L += ["", "### Greedy samples on held-out chat prompts", ""]
        for s in base["samples"]:
            L += [f"USER: {s['prompt']}", "", "```python", s["greedy"].rstrip("\n"), "```", ""]
    dr = rd("drafter_info.json")
    L += ["## Drafter", ""]
    if dr:
        L += ["```json", json.dumps(dr, indent=1), "```", ""]
    else:
        L += [
            "Not built yet: `python -m scripts.build_demo --stages drafter` distils it with "
            "`redrafter_mlx.train.distill` into `drafter/` (3-8 MB fp16 planned).",
            "",
        ]
    (out / "BUILD.md").write_text("\n".join(L))


def _version(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return "?"


# ----------------------------------------------------------------------------------------------
# CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scripts.build_demo",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--stages",
        default=",".join(STAGES),
        help=f"comma-separated subset of {','.join(STAGES)} (default: all)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=(
            "package data dir: base/ drafter/ heldout_prompts.jsonl BUILD.md (default: %(default)s)"
        ),
    )
    p.add_argument(
        "--work",
        type=Path,
        default=DEFAULT_WORK,
        help="scratch dir for corpus dumps and token arrays (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--steps",
        type=int,
        default=TrainConfig.steps,
        help="training steps of the base model (default: %(default)s, the committed build)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="instead of --steps: measure throughput and size the run to this many minutes",
    )
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=BaseConfig.hidden_size)
    p.add_argument("--layers", type=int, default=BaseConfig.num_hidden_layers)
    p.add_argument("--intermediate-size", type=int, default=BaseConfig.intermediate_size)
    p.add_argument("--heads", type=int, default=BaseConfig.num_attention_heads)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument(
        "--drafter-steps",
        type=int,
        default=None,
        help="training steps of the drafter (default: redrafter_mlx.train.distill's default)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    stages = [s.strip() for s in a.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise SystemExit(f"unknown stage(s): {unknown}; choose from {STAGES}")
    out, work = a.out.resolve(), a.work.resolve()
    base_dir = out / "base"
    from rich.console import Console

    console = Console()

    def log(msg):
        console.print(msg, markup=False, highlight=False)

    if "corpus" in stages:
        t0 = time.time()
        man = build_corpus(work, out=out)
        s = man["stats"]
        log(
            f"corpus: Python {man['python_version']}: {man['n_files']} files "
            f"(train {s['train']['files']}, held-out {s['heldout']['files']}), "
            f"chat examples {s['train']['chat']} + {s['heldout']['chat']} ({time.time() - t0:.1f}s)"
        )
    if "tokenizer" in stages:
        t0 = time.time()
        info = build_tokenizer(work, base_dir, vocab_size=a.vocab_size, seed=a.seed)
        log(f"tokenizer: {info} ({time.time() - t0:.1f}s)")
    if "base" in stages:
        cfg = BaseConfig(
            hidden_size=a.hidden_size,
            num_hidden_layers=a.layers,
            intermediate_size=a.intermediate_size,
            num_attention_heads=a.heads,
            num_key_value_heads=a.heads,
        )
        tcfg = TrainConfig(steps=a.steps, seed=a.seed, lr=a.lr)
        info = train_base(work, base_dir, cfg, tcfg, minutes=a.minutes, log=log)
        info["argv"] = argv  # BUILD.md records the command line that produced the shipped weights
        (work / "base_info.json").write_text(json.dumps(info, indent=1) + "\n")
    if any(s in stages for s in ("corpus", "tokenizer", "base")):
        write_build_md(out, work, argv)
    if "drafter" in stages:
        info = build_drafter(work, out, a.seed, steps=a.drafter_steps, log=log)
        info["argv"] = argv
        (work / "drafter_info.json").write_text(json.dumps(info, indent=1, default=str) + "\n")
        write_build_md(out, work, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
