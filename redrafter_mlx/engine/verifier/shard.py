"""Tensor parallelism for the verifier: one model split across N processes (or Macs).

Each rank holds 1/N of every layer's attention heads (q/k/v split by output rows, o by input
columns; K/V heads split too, so GQA groups stay whole) and of its MLP (gate/up by output,
down by input); one ``all_sum`` after each attention and each MLP makes the hidden state
whole again on every rank (mlx's ``shard_linear``). Embeddings, norms and the LM head are
replicated, so the hidden states, logits and everything the decode step computes from them
are the same on every rank without another message.

The family's own ``shard`` (mlx-lm's) does the split where mlx-lm has one; ``llama_like``
does the same for a family without one whose layers are Llama-shaped (Gemma 2 and 3).
"""

from __future__ import annotations

import math

import mlx.nn as nn

from ..base.errors import RedrafterError

BY_OUTPUT = ("q_proj", "k_proj", "v_proj")
MLP_BY_OUTPUT = ("gate_proj", "up_proj")


class ShardError(RedrafterError, ValueError):
    """A model that cannot be split across this many ranks; the message names what would work."""


def check_split(config: dict, n: int) -> None:
    """ShardError unless ``n`` ranks can each take whole heads, MLP rows and quant groups
    (sizes from ``config``, or its ``text_config``); the message lists the counts that work."""
    text = {**(config.get("text_config") or {}), **config}
    heads = text.get("num_attention_heads")
    kv = text.get("num_key_value_heads") or heads
    mlp = text.get("intermediate_size")
    if not all(isinstance(v, int) and v > 0 for v in (heads, kv, mlp)):
        return  # not a Llama-shaped config: the family's own shard decides
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    quant = config.get("quantization") or config.get("quantization_config")
    counts = [heads, kv, mlp]
    if quant:
        group = quant["group_size"]
        counts += [heads * head_dim // group, mlp // group]  # o_proj's, down_proj's groups
    common = math.gcd(*counts)
    if common % n == 0:
        return
    works = [d for d in range(2, min(common, 64) + 1) if common % d == 0]
    what = f"{heads} attention heads, {kv} K/V heads and an MLP of {mlp}" + (
        f" in quantization groups of {quant['group_size']}" if quant else ""
    )
    fix = f"launch {_or(works)} processes instead" if works else "run it in one process"
    raise ShardError(f"cannot split a model with {what} across {n} processes: {fix}")


def _or(values: list[int]) -> str:
    text = ", ".join(str(v) for v in values[:-1])
    return f"{text} or {values[-1]}" if len(values) > 1 else str(values[0])


def llama_like(lm: nn.Module, config: dict, group) -> None:
    """Split ``lm`` in place across ``group`` as mlx-lm's Llama ``shard`` does, for a family
    without a ``shard`` of its own whose layers have ``self_attn.{q,k,v,o}_proj`` (with
    ``n_heads`` / ``n_kv_heads``) and ``mlp.{gate,up,down}_proj``; ShardError otherwise."""
    from mlx.nn.layers.distributed import shard_linear

    model_type = config.get("model_type")
    layers = getattr(getattr(lm, "model", None), "layers", None)
    if not layers or not all(_llama_shaped(layer) for layer in layers):
        raise ShardError(
            f"mlx-lm has no shard for {model_type} models and its layers are not Llama-shaped: "
            "run it in one process"
        )
    check_split(config, group.size())
    n = group.size()
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in BY_OUTPUT:
            setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
        attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
        attn.n_heads //= n
        attn.n_kv_heads //= n
        for name in MLP_BY_OUTPUT:
            setattr(mlp, name, shard_linear(getattr(mlp, name), "all-to-sharded", group=group))
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


def _llama_shaped(layer) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "n_heads", "n_kv_heads")
    return all(hasattr(attn, p) for p in projections) and all(
        hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")
    )
