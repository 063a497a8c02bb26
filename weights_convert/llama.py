"""Llama-family base models: which tensors to keep, their expected shapes, the output config.

Hugging Face Llama names are the mlx-lm ``models/llama.py`` names, so tensors keep their
names. Dropped: ``*.rotary_emb.inv_freq`` buffers, and ``lm_head.weight`` when embeddings are
tied (as mlx-lm's ``sanitize`` does). Every other tensor must match the shape the config
implies; unknown tensors are refused (mlx-lm would refuse them at load time).
"""

from __future__ import annotations

from dataclasses import dataclass

from weights_convert.errors import ConversionError
from weights_convert.tensors import TensorRef

DEFAULT_RMS_NORM_EPS = 1e-6  # transformers' LlamaConfig default


@dataclass(frozen=True)
class LlamaPlan:
    """The base model's tensors to write and what was left out.

    Attributes:
        tensors: (output name, source) pairs, in source order.
        dropped: source names intentionally not written (rotary buffers, tied lm_head).
        tied: whether the output ties lm_head to the input embedding.
    """

    tensors: list[tuple[str, TensorRef]]
    dropped: list[str]
    tied: bool


def check_config(config: dict, root) -> None:
    """Refuse configs that are not a (non-quantized) Llama-family model."""
    from redrafter_mlx.engine.config import ConfigError, check_model_config

    try:
        check_model_config(config, f"{root}/config.json")
    except ConfigError as e:
        raise ConversionError(str(e)) from None
    if "quantization_config" in config or "quantization" in config:
        raise ConversionError(
            f"{root} is already quantized (config has a quantization block); convert the "
            "original fp16/bf16/fp32 checkpoint instead"
        )


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama config implies -> its shape (out, in) / (dim,). Includes lm_head."""
    h, v, inter = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    n_heads = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_heads
    head_dim = config.get("head_dim") or h // n_heads
    shapes = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    proj = {
        "self_attn.q_proj": (n_heads * head_dim, h),
        "self_attn.k_proj": (n_kv * head_dim, h),
        "self_attn.v_proj": (n_kv * head_dim, h),
        "self_attn.o_proj": (h, n_heads * head_dim),
        "mlp.gate_proj": (inter, h),
        "mlp.up_proj": (inter, h),
        "mlp.down_proj": (h, inter),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for name, shape in proj.items():
            shapes[f"{p}.{name}.weight"] = shape
            has_bias = (
                config.get("attention_bias")
                if name.startswith("self_attn")
                else config.get("mlp_bias")
            )
            if has_bias:
                shapes[f"{p}.{name}.bias"] = (shape[0],)
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
    return shapes


def _is_rotary_buffer(name: str) -> bool:
    return name.endswith(".rotary_emb.inv_freq") or name == "model.rotary_emb.inv_freq"


def plan_tensors(refs: list[TensorRef], config: dict, root) -> LlamaPlan:
    """Match checkpoint tensors to the config: keep, drop, or refuse with a clear error."""
    shapes = expected_shapes(config)
    names = {r.name for r in refs}
    tied = bool(config.get("tie_word_embeddings", False)) or "lm_head.weight" not in names
    kept, dropped = [], []
    for ref in refs:
        if _is_rotary_buffer(ref.name) or (tied and ref.name == "lm_head.weight"):
            dropped.append(ref.name)
            continue
        if ref.name not in shapes:
            raise ConversionError(
                f"tensor {ref.name} in {ref.path.name} is not a weight of a Llama model as "
                "described by "
                f"{root}/config.json; is --model the right checkpoint?"
            )
        if ref.shape != shapes[ref.name]:
            raise ConversionError(
                f"tensor {ref.name} in {ref.path.name} has shape {list(ref.shape)} but "
                f"{root}/config.json implies {list(shapes[ref.name])}; the config does not match "
                "the weights (check hidden_size, intermediate_size, heads, vocab_size)"
            )
        kept.append((ref.name, ref))
    missing = sorted(set(shapes) - names - ({"lm_head.weight"} if tied else set()))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ConversionError(
            f"checkpoint {root} lacks {', '.join(missing[:5])}{more}, which its config.json "
            "implies; "
            "download all weight shards (or fix num_hidden_layers in config.json)"
        )
    return LlamaPlan(kept, dropped, tied)


def output_config(config: dict, tied: bool, dtype: str, quantization: dict | None) -> dict:
    """The mlx-lm config.json for the converted model (sorted keys, as mlx-lm writes them)."""
    out = dict(config)
    out.pop("_name_or_path", None)
    out["tie_word_embeddings"] = tied  # mlx-lm's Llama defaults to True: always write it
    out.setdefault("rms_norm_eps", DEFAULT_RMS_NORM_EPS)
    out["torch_dtype"] = dtype
    if "dtype" in out:
        out["dtype"] = dtype
    if quantization is not None:
        out["quantization"] = dict(quantization)
        out["quantization_config"] = dict(quantization)
    return dict(sorted(out.items()))
