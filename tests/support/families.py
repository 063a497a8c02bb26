"""Tiny configs of the families the verifier reads (Qwen2/3, Gemma 2/3), logits through our
loader, and the same weights written as a GGUF file."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from redrafter_mlx.engine.core.tree import cache_mask, chain_mask
from redrafter_mlx.engine.verifier.lm_model import from_config
from redrafter_mlx.engine.verifier.protocol import Verifier
from tests.support.models import _randomize

BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
)


WINDOW = 4  # smaller than the prompt, so sliding layers drop keys in prefill and in steps


CONFIGS = {
    "qwen2": dict(
        BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"], rope_theta=1e6,
        tie_word_embeddings=False, use_sliding_window=False,
    ),
    "qwen2_tied": dict(
        BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"], rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32,
        rope_theta=1e6, attention_bias=False, tie_word_embeddings=True,
    ),
    "qwen3_untied": dict(
        BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=8,
        rope_theta=1e6, attention_bias=False, tie_word_embeddings=False,
    ),
    "gemma2": dict(
        BASE, model_type="gemma2", architectures=["Gemma2ForCausalLM"], num_hidden_layers=3,
        head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0, sliding_window=WINDOW, rope_theta=10000.0,
        hidden_activation="gelu_pytorch_tanh",
    ),
    "gemma3_text": dict(
        BASE, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
        num_hidden_layers=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=WINDOW, sliding_window_pattern=2, rope_theta=1e6,
        rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
}  # fmt: skip


PROMPT = [1, 17, 50, 42, 3, 29, 88, 21, 5, 64]


STEPS = [7, 91, 33, 12, 60, 2]


def filled(config: dict) -> dict:
    from redrafter_mlx.engine.verifier.config import completed

    return completed(config)


def gemma(model) -> bool:
    return model.model_type.startswith("gemma")


def our_logits(model: Verifier, prompt=PROMPT, steps=STEPS) -> list[np.ndarray]:
    """Our forward: the prompt in one call, then one token per call, against the cache."""
    slots = 256
    cache = model.make_cache(1, slots)
    T = len(prompt)
    idx = mx.arange(T, dtype=mx.int32)[None]
    mask = cache_mask(mx.zeros((1,), mx.int32), chain_mask(T), slots)
    h, cache = model(mx.array([prompt]), idx, mask, cache, idx)
    out = list(np.array(model.logits(h[0])))
    for p, t in enumerate(steps, start=T):
        pos = mx.array([[p]], dtype=mx.int32)
        mask = cache_mask(mx.array([p], dtype=mx.int32), chain_mask(1), slots)
        h, cache = model(mx.array([[t]]), pos, mask, cache, pos)
        out.append(np.array(model.logits(h[0, 0])))
    return out


def _prefill_hidden(model: Verifier) -> mx.array:
    """Hidden states of PROMPT from an empty cache: (T, H)."""
    T = len(PROMPT)
    cache = model.make_cache(1, 256)
    idx = mx.arange(T, dtype=mx.int32)[None]
    mask = cache_mask(mx.zeros((1,), mx.int32), chain_mask(T), 256)
    return model(mx.array([PROMPT]), idx, mask, cache, idx)[0][0]


GGUF_ARCH = {
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}


GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


GGUF_GEMMA_LAYER = {
    **GGUF_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


# What llama.cpp stores for Gemma (no query_pre_attn_scalar: it is head_dim below 27B; no
# sliding pattern for Gemma 3: every 6th layer is global), so the source config says the same.
GGUF_CONFIGS = {
    "qwen2": CONFIGS["qwen2"],
    "qwen3": CONFIGS["qwen3"],
    "gemma2": dict(CONFIGS["gemma2"], query_pre_attn_scalar=16),
    "gemma3_text": {
        **{k: v for k, v in CONFIGS["gemma3_text"].items() if k != "sliding_window_pattern"},
        "num_hidden_layers": 7,
    },
}


def _gguf_name(hf: str, gemma: bool) -> str:
    if hf in GGUF_GLOBAL:
        return GGUF_GLOBAL[hf]
    _, _, layer, *rest = hf.split(".")
    names = GGUF_GEMMA_LAYER if gemma else GGUF_LAYER
    return f"blk.{layer}.{names['.'.join(rest[:-1])]}.{rest[-1]}"


def write_family_gguf(path: Path, name: str, qtype: str) -> Verifier:
    """A GGUF of a random ``GGUF_CONFIGS[name]`` model; returns the model it should convert to
    (2-D weights through ``qtype``'s quantization, norms as llama.cpp rounds ``w + 1``)."""
    import gguf

    from tests.support.gguf_files import CHATML, byte_level_vocab

    tokens, merges, types = byte_level_vocab()
    config = filled(dict(GGUF_CONFIGS[name], vocab_size=len(tokens)))
    model = from_config(config)
    _randomize(model, 5, 2.0)
    arch = GGUF_ARCH[name]
    gemma = config["model_type"].startswith("gemma")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    args = SimpleNamespace(**{"rope_scaling": None, **config, "head_dim": head_dim})
    Q = gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(args.num_hidden_layers)
    writer.add_context_length(args.max_position_embeddings)
    writer.add_embedding_length(args.hidden_size)
    writer.add_feed_forward_length(args.intermediate_size)
    writer.add_head_count(args.num_attention_heads)
    writer.add_head_count_kv(args.num_key_value_heads)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(args.rms_norm_eps)
    if name == "gemma2":
        writer.add_attn_logit_softcapping(args.attn_logit_softcapping)
        writer.add_final_logit_softcapping(args.final_logit_softcapping)
    if gemma:
        writer.add_sliding_window(args.sliding_window)
    if args.rope_scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(args.rope_scaling["factor"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if name.startswith("qwen") else "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_chat_template(CHATML)
    reference = {}
    for hf, w in tree_flatten(model.parameters()):
        x = np.array(w, dtype=np.float32)
        if gemma and hf.endswith("norm.weight"):
            x = x - 1.0  # our model holds HF's zero-centred weight; the file holds w + 1
            stored = x + np.float32(1.0)
            reference[hf] = stored - np.float32(1.0)
            writer.add_tensor(_gguf_name(hf, gemma), stored)
        elif x.ndim == 2 and qtype != "F32":
            q = gguf.quants.quantize(x, Q[qtype])
            reference[hf] = gguf.quants.dequantize(q, Q[qtype]).astype(np.float32)
            writer.add_tensor(_gguf_name(hf, gemma), q, raw_dtype=Q[qtype])
        else:
            reference[hf] = x
            writer.add_tensor(_gguf_name(hf, gemma), x)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_weights([(k, mx.array(v)) for k, v in reference.items()])
    mx.eval(model.parameters())
    return model
