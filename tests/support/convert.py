"""Checkpoints in miniature for the converter's tests: an APAR checkpoint (a grown vocabulary,
Medusa heads) and a Kangaroo adapter (``pytorch_model.bin``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from redrafter_mlx.engine.core.branches import CHILD_TOKEN, FORK_TOKEN
from tests.support.paths import CONVERT as FIXTURES
from tests.support.torch_pickles import _int, _state_dict, _storage, _tensor, _torch_zip

GROWN = ("model.embed_tokens.weight", "lm_head.weight")


NOT_WEIGHTS = ("prompt", "logits", "logits_tied")


def apar_checkpoint(folder: Path, added: str = "added_tokens.json") -> dict[str, np.ndarray]:
    """The fixture Llama (vocab 128) with two rows more in its embedding and head, the split
    tokens at ids 128 and 129 (in ``added_tokens.json`` or ``tokenizer.json``), and Medusa
    head files beside it -> the weights written."""
    rng = np.random.default_rng(0)
    weights = {
        k: v for k, v in np.load(FIXTURES / "llama_expected.npz").items() if k not in NOT_WEIGHTS
    }
    for name in GROWN:
        extra = rng.standard_normal((2, weights[name].shape[1])).astype(np.float32)
        weights[name] = np.concatenate([weights[name], extra])
    folder.mkdir(parents=True)
    mx.save_safetensors(
        str(folder / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()}
    )
    config = json.loads((FIXTURES / "llama_st_bf16" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 130}))
    for f in (FIXTURES / "tokenizer").iterdir():
        shutil.copyfile(f, folder / f.name)
    if added == "added_tokens.json":
        (folder / added).write_text(json.dumps({FORK_TOKEN: 128, CHILD_TOKEN: 129}))
    else:
        from tokenizers import AddedToken, Tokenizer

        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok.add_special_tokens([AddedToken(FORK_TOKEN), AddedToken(CHILD_TOKEN)])
        tok.save(str(folder / "tokenizer.json"))
    (folder / "medusa_lm_head.safetensors").write_bytes(b"not read")
    (folder / "medusa").mkdir()
    return weights


BASE = FIXTURES / "llama_bin"  # hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 128


H, HEADS, KV, D = 64, 4, 2, 16


def write_torch_bin(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A ``torch.save`` zip of fp32 tensors, one storage each (the format, without torch)."""
    items, storages = {}, {}
    for i, (name, x) in enumerate(tensors.items()):
        x = np.ascontiguousarray(x, dtype=np.float32)
        stride = tuple(s // 4 for s in x.strides)
        items[name] = _tensor(_storage(str(i), x.size), _int(0), x.shape, stride)
        storages[str(i)] = x.tobytes()
    _torch_zip(path, _state_dict(items), storages)


def adapter_weights(seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    return {
        "layers.0.input_layernorm.weight": (1 + 0.1 * rng.standard_normal(H)).astype(np.float32),
        "layers.0.self_attn.q_proj.weight": mat(HEADS * D, H),
        "layers.0.self_attn.k_proj.weight": mat(KV * D, H),
        "layers.0.self_attn.v_proj.weight": mat(KV * D, H),
        "layers.0.self_attn.o_proj.weight": mat(H, HEADS * D),
        "norm.weight": (1 + 0.1 * rng.standard_normal(H)).astype(np.float32),
    }


def make_adapter(folder: Path, weights=None, extra=True, **config) -> Path:
    """A Kangaroo adapter folder: the base's LlamaConfig with one layer, a torch zip .bin
    (with the rotary buffer and an unused post-attention norm, as strict=False allows)."""
    folder.mkdir(parents=True)
    cfg = json.loads((BASE / "config.json").read_text())
    cfg.update(num_hidden_layers=1, **config)
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = dict(weights or adapter_weights())
    if extra:
        tensors["layers.0.self_attn.rotary_emb.inv_freq"] = 1.0 / (
            10000 ** (np.arange(0, D, 2, dtype=np.float32) / D)
        )
        tensors["layers.0.post_attention_layernorm.weight"] = np.ones(H, np.float32)
    write_torch_bin(folder / "pytorch_model.bin", tensors)
    return folder
