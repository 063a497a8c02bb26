"""APAR post-training with mlx-lm's LoRA trainer: the split tokens added to the vocabulary
(embedding and tied head grow by two trainable rows), LoRA on the last layers, checkpoints
every few steps and a resumed run that continues from the newest, and the adapter saved for
the package (``weights_convert.smollm2_apar`` fuses it into a branching model folder: its
config's ``branches`` block and tokenizer name both tokens).

Data are mlx-lm's ``(tokens, loss_from)`` items from :func:`apar_data.branch_sequences`.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..engine.core.branches import CHILD_TOKEN, FORK_TOKEN

SPLIT_TOKENS = (FORK_TOKEN, CHILD_TOKEN)
ADAPTER_FILE = "adapters.safetensors"
CHECKPOINT = re.compile(r"^(\d{7})_adapters\.safetensors$")  # mlx-lm's numbered saves


class GrownEmbedding(nn.Module):
    """A frozen embedding (V, H) and ``extra`` (n, H) trainable rows after it (ids V..V+n-1);
    ``as_linear`` is the tied head over all V + n rows. ``rows``: the new rows' start
    (:func:`split_rows_start`), else the mean row."""

    def __init__(self, base: nn.Embedding, n: int, rows: mx.array | None = None):
        super().__init__()
        self.base = base
        self.base.freeze()
        if rows is None:
            mean = base.weight.astype(mx.float32).mean(axis=0)
            rows = mx.broadcast_to(mean, (n, base.weight.shape[1]))
        if rows.shape != (n, base.weight.shape[1]):
            raise ValueError(f"the new rows' start has shape {rows.shape}, not {n} rows")
        self.extra = rows.astype(base.weight.dtype)

    def table(self) -> mx.array:
        """(V + n, H) the whole embedding."""
        return mx.concatenate([self.base.weight, self.extra])

    def __call__(self, ids: mx.array) -> mx.array:
        return self.table()[ids]

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self.table().T


@dataclass(frozen=True)
class LoraSettings:
    """LoRA and trainer settings (mlx-lm's names)."""

    layers: int = 8  # LoRA on the last this many blocks
    rank: int = 8
    scale: float = 20.0
    lr: float = 1e-4
    rows_lr: float = 5e-3  # the new embedding rows' (a tied head row moves slowly at lr)
    batch_size: int = 4
    iters: int = 100  # total, across resumed runs
    save_every: int = 20
    max_seq_length: int = 1024
    seed: int = 0


def add_split_tokens(tokenizer) -> list[int]:
    """Add the split tokens to mlx-lm's tokenizer (special, never split) -> their ids."""
    hf = tokenizer._tokenizer
    hf.add_special_tokens({"additional_special_tokens": list(SPLIT_TOKENS)})
    return [hf.convert_tokens_to_ids(t) for t in SPLIT_TOKENS]


def split_rows_start(table: mx.array, samples, fork: int, child: int) -> mx.array:
    """(2, H) where the fork and child rows start: the fork row at the mean embedding of the
    tokens that follow a child token in ``samples`` (a child's first text token: where the
    parent forks, the untrained model already expects such a token, so the tied head starts
    scoring the fork there), the child row at the mean of the tokens before a fork (the
    heading's end, ``:`` or `` -``, after which details follow). ``table``: (V, H)."""
    after = [t[i + 1] for t, _ in samples for i, x in enumerate(t[:-1]) if x == child]
    before = [t[i - 1] for t, _ in samples for i, x in enumerate(t) if x == fork and i > 0]
    before = [b for b in before if b not in (fork, child)]
    if not after or not before:
        raise ValueError("the samples hold no fork followed by a child: nothing to start from")
    rows = [table[mx.array(ids)].astype(mx.float32).mean(axis=0) for ids in (after, before)]
    return mx.stack(rows)


def prepare_model(model, settings: LoraSettings, vocab_ids: list[int], rows=None):
    """Freeze ``model`` (an mlx-lm Llama-family model with a tied head), grow its embedding
    by the split tokens' rows (starting at ``rows``, (2, H), else the mean row) and put LoRA
    on its last ``settings.layers`` blocks."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    inner = model.model
    V = inner.embed_tokens.weight.shape[0]
    if vocab_ids != list(range(V, V + len(vocab_ids))):
        raise ValueError(
            f"the split tokens got ids {vocab_ids}, not the next ids after the embedding's "
            f"{V} rows: the tokenizer and the model disagree on the vocabulary size"
        )
    if not getattr(model.args, "tie_word_embeddings", False):
        raise ValueError("growing the vocabulary here needs a tied head (as SmolLM2 has)")
    model.freeze()
    lora = {"rank": settings.rank, "scale": settings.scale, "dropout": 0.0}
    linear_to_lora_layers(model, settings.layers, lora)
    inner.embed_tokens = GrownEmbedding(inner.embed_tokens, len(vocab_ids), rows)
    return model


def done_iters(work: Path) -> int:
    """Iterations the newest numbered checkpoint in ``work`` holds (0 when none); the saves of
    a run that was stopped (``work/run``) are adopted first."""
    _adopt_run(work)
    found = [
        int(m[1]) for p in work.glob("*_adapters.safetensors") if (m := CHECKPOINT.match(p.name))
    ]
    return max(found, default=0)


def _adopt_run(work: Path) -> None:
    """Move ``work/run``'s saves to ``work``, numbered from the run's first step (mlx-lm
    numbers its saves from 1 in each run; ``run/start`` holds the steps done before it)."""
    run = work / "run"
    if not (run / "start").exists():  # none, or stopped before its first step
        shutil.rmtree(run, ignore_errors=True)
        return
    start = int((run / "start").read_text())
    for saved in sorted(run.glob("*_adapters.safetensors")):
        if m := CHECKPOINT.match(saved.name):
            shutil.move(saved, work / f"{start + int(m[1]):07d}_adapters.safetensors")
    shutil.rmtree(run)


def train(model, samples, work: Path, settings: LoraSettings, report=print) -> dict:
    """Train on ``samples`` (``[(tokens, loss_from), ...]``) into ``work``; a run with
    checkpoints there resumes from the newest (its weights; the optimizer starts afresh, as
    mlx-lm's ``--resume-adapter-file``). -> ``{"iters", "tokens_per_s", "train_loss"}``."""
    import mlx.optimizers as optim
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.trainer import TrainingArgs
    from mlx_lm.tuner.trainer import train as lora_train

    work.mkdir(parents=True, exist_ok=True)
    start = done_iters(work)
    if start:
        newest = work / f"{start:07d}_adapters.safetensors"
        model.load_weights(str(newest), strict=False)
        report(f"resumed from {newest.name}")
    left = settings.iters - start
    if left <= 0:
        return {"iters": start, "tokens_per_s": 0.0, "train_loss": None}
    if len(samples) < settings.batch_size:
        raise ValueError(f"{len(samples)} samples, fewer than a batch of {settings.batch_size}")
    np.random.seed(settings.seed + start)  # mlx-lm's batch order draws from numpy's state
    mx.random.seed(settings.seed + start)

    class Reports(TrainingCallback):
        def __init__(self):
            self.reports = []

        def on_train_loss_report(self, info):
            self.reports.append(info)

    args = TrainingArgs(
        batch_size=settings.batch_size,
        iters=left,
        steps_per_report=min(settings.save_every, left),
        steps_per_eval=10**9,
        steps_per_save=settings.save_every,
        max_seq_length=settings.max_seq_length,
        adapter_file=str(work / "run" / ADAPTER_FILE),
    )
    (work / "run").mkdir()
    (work / "run" / "start").write_text(str(start))
    callback = Reports()
    tic = time.perf_counter()
    model.train()
    rows_first = optim.MultiOptimizer(  # the new rows at their own rate, LoRA at lr
        [optim.Adam(learning_rate=settings.rows_lr), optim.Adam(learning_rate=settings.lr)],
        [lambda path, _: path.endswith("embed_tokens.extra")],
    )
    lora_train(
        model,
        rows_first,
        samples,
        None,
        args,
        training_callback=callback,
    )
    seconds = time.perf_counter() - tic
    _adopt_run(work)
    final = work / f"{settings.iters:07d}_adapters.safetensors"
    mx.save_safetensors(str(final), trainable_weights(model))
    last = callback.reports[-1] if callback.reports else {}
    tokens = last.get("trained_tokens", 0)
    return {
        "iters": settings.iters,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "train_loss": last.get("train_loss"),
    }


def trainable_weights(model) -> dict[str, mx.array]:
    """The LoRA matrices and the new embedding rows (what a checkpoint holds)."""
    from mlx.utils import tree_flatten

    return dict(tree_flatten(model.trainable_parameters()))


def save_adapter(model, settings: LoraSettings, out: Path) -> None:
    """The trained adapter into ``out`` (temp folder, renamed at the end):
    ``adapters.safetensors`` (:func:`trainable_weights`: each adapted linear's ``lora_a``
    (in, r) and ``lora_b`` (r, out), and ``model.embed_tokens.extra``, the split tokens' rows)
    and ``adapter_config.json`` (rank, scale, layers, the tokens). ``weights_convert.
    smollm2_apar`` fuses it into the base model's folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the folder from other users
    try:
        mx.save_safetensors(str(tmp / ADAPTER_FILE), trainable_weights(model))
        config = {
            "rank": settings.rank,
            "scale": settings.scale,
            "layers": settings.layers,
            "tokens": list(SPLIT_TOKENS),
        }
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        kept = out.iterdir() if out.exists() else ()
        for f in kept:  # BUILD.md, eval.json stay
            if f.is_file() and f.name not in {ADAPTER_FILE, "adapter_config.json"}:
                shutil.copy2(f, tmp / f.name)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
