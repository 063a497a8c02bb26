"""Base models (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text): which tensors to keep,
their expected shapes, the output config.

Hugging Face names are the mlx-lm model names, so tensors keep their names. Dropped:
``*.rotary_emb.inv_freq`` buffers, and an ``lm_head.weight`` that copies the embedding of a
tied model (the engine's one rule, ``redrafter_mlx.engine.verifier.config.ties_head``: another head
under a tied config is refused). Every other tensor must match the shape the config
implies; unknown tensors are refused (mlx-lm would refuse them at load time).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

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
    """Refuse configs that are not a (non-quantized) supported model."""
    from redrafter_mlx.engine.verifier.config import ConfigError, check_model_config

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
    """Every tensor a config implies -> its shape (out, in) / (dim,). Includes lm_head.

    Asked of mlx-lm's own class for the family, the verifier that will load the output
    (its arrays are lazy and never computed), with the config as the loader completes it
    (``config.for_mlx_lm``: transformers' defaults), so each family's biases, q/k norms and
    sandwich norms are known in one place.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from redrafter_mlx.engine.verifier.config import completed

    filled = {**completed(config), "tie_word_embeddings": False}
    try:
        cls, args = _get_classes(filled)
        model = cls(args.from_dict(filled))
    except (TypeError, ValueError, KeyError) as e:
        raise ConversionError(f"config.json cannot describe a model we run: {e}") from None
    shapes = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}
    shapes.setdefault("lm_head.weight", (filled["vocab_size"], filled["hidden_size"]))
    return shapes


def _is_rotary_buffer(name: str) -> bool:
    return name.endswith(".rotary_emb.inv_freq") or name == "model.rotary_emb.inv_freq"


def _ties_head(config: dict, refs: list[TensorRef], root) -> bool:
    """The engine's rule (``config.ties_head``): tied or not; a tied config's head must be a
    copy of the embedding (then dropped, and listed as dropped), else ConversionError."""
    from redrafter_mlx.engine.verifier.config import (
        ConfigError,
        different_head,
        head_pairs,
        ties_head,
    )

    by_name = {r.name: r for r in refs}

    @functools.cache
    def is_copy() -> bool:
        pairs = head_pairs(by_name)
        return all(_same_tensor(by_name[head], by_name.get(embedding)) for head, embedding in pairs)

    try:
        tied = ties_head(config, by_name, f"{root}/config.json", is_copy)
        if tied and head_pairs(by_name) and not is_copy():
            raise different_head(f"{root}/config.json")
    except ConfigError as e:
        raise ConversionError(str(e)) from None
    return tied


def _same_tensor(a: TensorRef, b: TensorRef | None) -> bool:
    """Whether two stored tensors hold the same values (read only when dtype and shape agree)."""
    if b is None or (a.dtype, a.shape) != (b.dtype, b.shape):
        return False
    return bool(np.array_equal(a.load(), b.load()))


def plan_tensors(refs: list[TensorRef], config: dict, root) -> LlamaPlan:
    """Match checkpoint tensors to the config: keep, drop, or refuse with a clear error."""
    shapes = expected_shapes(config)
    names = {r.name for r in refs}
    tied = _ties_head(config, refs, root)
    kept, dropped = [], []
    for ref in refs:
        if _is_rotary_buffer(ref.name) or (tied and ref.name.startswith("lm_head.")):
            dropped.append(ref.name)
            continue
        if ref.name not in shapes:
            raise ConversionError(
                f"tensor {ref.name} in {ref.path.name} is not a weight of a "
                f"{config.get('model_type')} model as described by "
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
