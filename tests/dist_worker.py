"""One rank of the tensor-parallel tests: run under ``mlx.launch -n N`` by
tests/test_distributed.py.

``python tests/dist_worker.py CASES.json OUT_DIR``: loads each case's model split across the
launched ranks (and its drafter whole), decodes the case, and writes
``OUT_DIR/rank{r}.json`` with, per case, the tokens of every row, the bytes this rank's model
holds, MLX's peak memory while loading, and a hash of one verify forward's logits (to check
that the logits are bitwise the same on every rank).
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from redrafter_mlx.engine import model as model_module
from redrafter_mlx.engine.distributed import world
from redrafter_mlx.engine.generation import decode
from redrafter_mlx.engine.loading import load_drafter, load_model
from redrafter_mlx.engine.sampling import SamplerConfig
from redrafter_mlx.engine.shape import BeamShape


def param_bytes(model) -> int:
    """Bytes of every parameter the model holds on this rank."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def fresh_memory() -> int:
    """Free what earlier cases left, reset MLX's peak; the bytes still held (the baseline)."""
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    return mx.get_active_memory()


def logits_hash(model, prompt: list[int]) -> str:
    """sha256 of the float32 logits of one prefill forward over ``prompt``."""
    T = len(prompt)
    keys, values = model.make_cache(1, T)
    pos = mx.arange(T, dtype=mx.int32)[None]
    mask = (mx.arange(T)[None, :] <= mx.arange(T)[:, None])[None, None]
    hidden, _, _ = model(mx.array([prompt], mx.int32), pos, mask, keys, values, pos)
    logits = np.array(model.logits(hidden).astype(mx.float32))
    return hashlib.sha256(logits.tobytes()).hexdigest()


def run_case(case: dict, group) -> dict:
    model_module.FUSED_KERNELS = case.get("fused")  # None: by device (composed on the CPU)
    base = fresh_memory()
    model, _ = load_model(case["model"], mx.float32, group)
    load_peak = mx.get_peak_memory() - base
    drafter = load_drafter(case["drafter"], mx.float32) if case.get("drafter") else None
    tokens = [[] for _ in case["prompts"]]
    for ev in decode(
        model,
        drafter,
        case["prompts"],
        max_tokens=case["max_tokens"],
        shape=BeamShape.parse(case["shape"]),
        sampler=SamplerConfig(temperature=case.get("temperature", 0.0)),
        seed=case.get("seed"),
        adapt=True,  # a sharded model pins the shape itself
    ):
        for row, new in zip(tokens, ev.tokens):
            row.extend(new)
    return {
        "tokens": tokens,
        "param_bytes": param_bytes(model),
        "load_peak": load_peak,
        "logits_sha": logits_hash(model, case["prompts"][0]),
        "kv_heads": model.make_cache(1, 1)[0][0].shape[1],
    }


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    group = world()
    if group is None:
        raise SystemExit("run me under mlx.launch -n N (N > 1)")
    out = {"size": group.size(), "cases": {name: run_case(c, group) for name, c in cases.items()}}
    Path(sys.argv[2], f"rank{group.rank()}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
