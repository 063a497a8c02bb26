"""The verifier: a Llama-family transformer with explicit per-token positions and masks.

Weight names are mlx-lm's (``model.embed_tokens``, ``model.layers.{i}.self_attn.q_proj``,
..., ``lm_head``) so mlx-lm model directories load unchanged, quantized ones included.

Unlike mlx-lm's forward, ours is a pure function of arrays that suits tree verification:

* every token carries its own position (``len + depth`` in a draft tree);
* K/V are written into a preallocated cache at explicit slots (``write_idx``) with a scatter
  (in place under ``mx.compile``), and attention uses an explicit boolean mask over all
  cache slots, so prefill, autoregressive steps, tree verification and the trainer's
  branch rollouts are one code path.

Shapes: B batch rows, T new tokens, S cache slots, H hidden size, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .rope import RoPE

# Fused kernels (mx.fast rope with per-row offsets, scaled_dot_product_attention) on Metal and
# CUDA; composed ops on the CPU backend, where they measured several times faster. None picks
# by device; tests set True/False to run both paths on any backend.
FUSED_KERNELS: bool | None = None


def fused_kernels() -> bool:
    """Whether this forward uses the fused kernels (see ``FUSED_KERNELS``)."""
    return mx.default_device() != mx.cpu if FUSED_KERNELS is None else FUSED_KERNELS


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int | None = None
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict) -> ModelArgs:
        """Build from a HF / mlx-lm ``config.json`` dict; unknown keys go to ``extra``."""
        names = set(cls.__dataclass_fields__) - {"extra"}
        known = {k: v for k, v in config.items() if k in names}
        extra = {k: v for k, v in config.items() if k not in names}
        known.setdefault("tie_word_embeddings", False)
        return cls(**known, extra=extra)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        dim, hd, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=bias)
        self.rope = RoPE(hd, args.rope_theta, args.rope_traditional, args.rope_scaling)

    def _rotate(self, x: mx.array, positions) -> mx.array:
        """RoPE at per-token positions. x: (B, T, heads, D) -> (B, T, heads, D).

        ``positions`` is either (B, T) int positions (fused kernel: fold tokens into rows,
        one offset per row) or precomputed ``(cos, sin)`` tables from ``rope_tables``.
        """
        if isinstance(positions, tuple):
            return apply_rope(x, *positions, self.rope.traditional)
        B, T, heads, D = x.shape
        rows = x.reshape(B * T, heads, 1, D)
        return self.rope(rows, offset=positions.reshape(-1)).reshape(B, T, heads, D)

    def __call__(self, x, positions, mask, keys, values, write_idx):
        """x: (B, T, H); positions, write_idx: (B, T); mask: (B, 1, T, A) bool over the
        first A cache slots (the attention window, A <= S); keys/values: (B, n_kv, S, D).
        Returns (out (B, T, H), keys, values)."""
        B, T, _ = x.shape
        A = mask.shape[-1]
        q = self._rotate(self.q_proj(x).reshape(B, T, self.n_heads, -1), positions)
        k = self._rotate(self.k_proj(x).reshape(B, T, self.n_kv_heads, -1), positions)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, -1)
        keys = write_slots(keys, write_idx, k)
        values = write_slots(values, write_idx, v)
        out = attention(q.transpose(0, 2, 1, 3), keys[:, :, :A], values[:, :, :A], self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1)), keys, values


def write_slots(cache: mx.array, slots: mx.array, new: mx.array) -> mx.array:
    """cache (B, n_kv, S, D) with ``new`` (B, T, n_kv, D) written at ``slots`` (B, T).

    One ScatterAxis (in place under ``mx.compile``); advanced indexing would add an arange
    and broadcasts per call, ~10-20 us each on the CPU backend.
    """
    B, T, n_kv, D = new.shape
    idx = mx.broadcast_to(slots[:, None, :, None], (B, n_kv, T, D))
    return mx.put_along_axis(cache, idx, new.transpose(0, 2, 1, 3).astype(cache.dtype), axis=2)


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array, traditional: bool) -> mx.array:
    """Rotate (B, T, heads, D) by tables (B, T, 1, dims/2); dims beyond 2*half pass through."""
    half = cos.shape[-1]
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    rest = x[..., 2 * half :]
    if traditional:
        pairs = x[..., : 2 * half].reshape(*x.shape[:-1], half, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        rotated = mx.stack([a * cos - b * sin, b * cos + a * sin], axis=-1)
        rotated = rotated.reshape(*x.shape[:-1], 2 * half)
    else:
        a, b = x[..., :half], x[..., half : 2 * half]
        rotated = mx.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return mx.concatenate([rotated, rest], axis=-1) if rest.shape[-1] else rotated


def attention(q, k, v, scale: float, mask):
    """Masked attention with grouped K/V heads.

    q: (B, n_heads, T, D); k, v: (B, n_kv, A, D); mask: (B, 1, T, A) bool -> (B, n_heads, T, D).
    On Metal/CUDA the fused kernel; on the CPU backend two matmuls, which are several times
    faster there for multi-token (tree) queries.
    """
    if fused_kernels():
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    B, n_heads, T, D = q.shape
    n_kv = k.shape[1]
    q = (q * scale).reshape(B, n_kv, (n_heads // n_kv) * T, D)
    scores = (q @ k.transpose(0, 1, 3, 2)).reshape(B, n_kv, n_heads // n_kv, T, -1)
    scores = mx.where(mask[:, :, None], scores.astype(mx.float32), -mx.inf)
    probs = mx.softmax(scores, axis=-1).astype(v.dtype).reshape(B, n_kv, -1, k.shape[2])
    return (probs @ v).reshape(B, n_heads, T, D)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, positions, mask, keys, values, write_idx):
        r, keys, values = self.self_attn(
            self.input_layernorm(x), positions, mask, keys, values, write_idx
        )
        h = x + r
        return h + self.mlp(self.post_attention_layernorm(h)), keys, values


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(nn.Module):
    """Llama-family causal LM. ``__call__`` returns final normed hidden states and the cache."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_context(self) -> int | None:
        return self.args.max_position_embeddings

    def embed(self, tokens: mx.array) -> mx.array:
        """The LLM's input embedding table lookup, (...) -> (..., H). The drafter reads it too."""
        return self.model.embed_tokens(tokens)

    def __call__(self, tokens, positions, mask, keys, values, write_idx):
        """One forward over T new tokens per row against the cache.

        tokens, positions, write_idx: (B, T) int32; mask: (B, 1, T, A) bool (True = attend)
        over the first A cache slots *after* this call's writes; keys/values: lists (one per
        layer) of (B, n_kv, S, D), A <= S. Returns (hidden (B, T, H) after the final norm,
        keys, values).
        """
        x = self.embed(tokens)
        if not fused_kernels():
            # One cos/sin table for all layers: on the CPU backend the fused rope kernel with
            # per-row offsets costs ~7x more than this.
            positions = self.model.layers[0].self_attn.rope.tables(positions)
        new_keys, new_values = [], []
        for layer, k, v in zip(self.model.layers, keys, values):
            x, k, v = layer(x, positions, mask, k, v, write_idx)
            new_keys.append(k)
            new_values.append(v)
        return self.model.norm(x), new_keys, new_values

    def logits(self, hidden: mx.array) -> mx.array:
        """(..., H) -> (..., V) float32 logits."""
        if self.args.tie_word_embeddings:
            out = self.model.embed_tokens.as_linear(hidden)
        else:
            out = self.lm_head(hidden)
        return out.astype(mx.float32)

    def make_cache(self, batch: int, slots: int, dtype=None):
        """Zeroed K/V lists, each (batch, n_kv, slots, D)."""
        dtype = dtype or self.model.norm.weight.dtype
        shape = (batch, self.args.num_key_value_heads, slots, self.args.head_dim)
        keys = [mx.zeros(shape, dtype) for _ in self.model.layers]
        values = [mx.zeros(shape, dtype) for _ in self.model.layers]
        return keys, values

    def sanitize(self, weights: dict) -> dict:
        """Drop rotary buffers, and ``lm_head`` when embeddings are tied."""
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights
