"""EAGLE-3 heads: one (or a few) Llama layers over the target's fused features.

Two published layouts load to the same module (``Eagle3Head``):

* the speculators format (``speculators_model_type: "eagle3"``): the layer's settings in
  ``transformer_layer_config``, ``draft_vocab_size``, ``target_hidden_size``,
  ``norm_before_residual``, ``eagle_aux_hidden_state_layer_ids``; weights ``layers.0.*``;
* the original EAGLE repository's (``architectures: ["LlamaForCausalLMEagle3"]``): a flat
  Llama config, the layer named ``midlayer.*``.

Weights: ``embed_tokens`` (optional: the target's is used when absent), ``fc`` (3H_t -> H),
``layers.0.{input_layernorm, hidden_norm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
mlp.*}`` (q/k/v read 2H: the normed token embedding and the normed feature), ``norm``,
``lm_head`` (H -> draft vocabulary), ``d2t`` (draft id -> target id offset), ``t2d`` (unused).

The head's entry for text position p pairs the token at p + 1 with the feature at p (the
target's three tapped layers at p, fused by ``fc``; for a drafted token, the head's own
output hidden state at p): it sits in slot p, rotated at position p + 1 (mlx-vlm 0.7.10's
``Eagle3DraftModel``, whose first entry is at position 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.llama import MLP as LlamaMLP

from ...core.tree import arange, cache_mask, chain_mask
from .common import HeadMismatch, Target, empty_state, heads_first, slot_attend

KIND = "eagle3"
ORIGINAL_ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class Eagle3Config:
    """An EAGLE-3 head's settings, from either layout's config.json (``from_config``)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    num_hidden_layers: int = 1
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    target_hidden_size: int | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    tie_word_embeddings: bool = False
    aux_layer_ids: tuple[int, ...] | None = None  # HF hidden-state indexing (0: embeddings)
    speculative_tokens: int | None = None
    layout: str = "speculators"

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.target_hidden_size = self.target_hidden_size or self.hidden_size

    @classmethod
    def from_config(cls, config: dict) -> Eagle3Config:
        """Either layout's config.json as read (a dict)."""
        if config.get("speculators_model_type") == KIND:
            text = dict(config.get("transformer_layer_config") or {})
            top = config
            layout = "speculators"
        else:
            text, top, layout = dict(config), config, "original"
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
        methods = (top.get("speculators_config") or {}).get("proposal_methods") or []
        aux = top.get("eagle_aux_hidden_state_layer_ids")
        try:
            return cls(
                hidden_size=int(text["hidden_size"]),
                intermediate_size=int(text["intermediate_size"]),
                num_attention_heads=int(text["num_attention_heads"]),
                num_key_value_heads=int(
                    text.get("num_key_value_heads") or text["num_attention_heads"]
                ),
                vocab_size=int(text.get("vocab_size") or top["vocab_size"]),
                draft_vocab_size=int(top.get("draft_vocab_size") or text["vocab_size"]),
                num_hidden_layers=int(text.get("num_hidden_layers", 1)),
                head_dim=text.get("head_dim"),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_traditional=bool(text.get("rope_traditional", False)),
                attention_bias=bool(text.get("attention_bias", False)),
                mlp_bias=bool(text.get("mlp_bias", False)),
                target_hidden_size=top.get("target_hidden_size"),
                norm_before_residual=bool(top.get("norm_before_residual", False)),
                norm_before_fc=bool(top.get("norm_before_fc", False)),
                tie_word_embeddings=bool(top.get("tie_word_embeddings", False)),
                aux_layer_ids=tuple(int(i) for i in aux) if aux else None,
                speculative_tokens=(methods[0].get("speculative_tokens") if methods else None),
                layout=layout,
            )
        except KeyError as e:
            raise HeadMismatch(
                f"the EAGLE-3 config ({layout} layout) lacks {e.args[0]!r}: "
                "the folder's config.json is incomplete; re-download the head"
            ) from None

    def feature_layers(self, target_layers: int) -> tuple[int, ...]:
        """The target's decoder layers (0-based) whose outputs are fused, in order: the aux
        ids less one (HF index 0 is the embeddings), default [2, n/2, n-3] of the target's
        n layers. (mlx-vlm defaults n to the head's own layer count.)"""
        n = target_layers
        ids = self.aux_layer_ids or (2, n // 2, max(n - 3, 0))
        return tuple(max(i - 1, 0) for i in ids)


class _Attention(nn.Module):
    """Llama attention whose q/k/v read ``in_dim`` features (2H in the first layer)."""

    def __init__(self, c: Eagle3Config, in_dim: int):
        super().__init__()
        D, bias = c.head_dim, c.attention_bias
        self.n_heads, self.n_kv_heads, self.scale = (
            c.num_attention_heads,
            c.num_key_value_heads,
            D**-0.5,
        )
        self.q_proj = nn.Linear(in_dim, self.n_heads * D, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.n_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.n_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * D, c.hidden_size, bias=bias)
        self.rope = nn.RoPE(D, traditional=c.rope_traditional, base=c.rope_theta)

    def __call__(self, x, positions, mask, keys, values, write_idx):
        q = heads_first(self.q_proj(x), self.n_heads)
        k = heads_first(self.k_proj(x), self.n_kv_heads)
        v = heads_first(self.v_proj(x), self.n_kv_heads)
        out, keys, values = slot_attend(self, q, k, v, positions, mask, keys, values, write_idx)
        return self.o_proj(out), keys, values


class _MlpArgs:
    def __init__(self, c: Eagle3Config):
        self.hidden_size, self.intermediate_size = c.hidden_size, c.intermediate_size
        self.mlp_bias = c.mlp_bias


class _Layer(nn.Module):
    """A Llama decoder layer; the first one (``first``) reads concat(norm(embedding),
    hidden_norm(feature)) and its residual is the feature (normed or not)."""

    def __init__(self, c: Eagle3Config, first: bool):
        super().__init__()
        H, eps = c.hidden_size, c.rms_norm_eps
        self.first, self.norm_before_residual = first, c.norm_before_residual
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        if first:
            self.hidden_norm = nn.RMSNorm(H, eps=eps)
        self.self_attn = _Attention(c, 2 * H if first else H)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.mlp = LlamaMLP(_MlpArgs(c))

    def __call__(self, h, embeds, positions, mask, keys, values, write_idx):
        if self.first:
            normed = self.hidden_norm(h)
            residual = normed if self.norm_before_residual else h
            x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        else:
            residual, x = h, self.input_layernorm(h)
        a, keys, values = self.self_attn(x, positions, mask, keys, values, write_idx)
        h = residual + a
        return h + self.mlp(self.post_attention_layernorm(h)), keys, values


class Eagle3Head(nn.Module):
    """An EAGLE-3 head (either layout). ``embed_tokens`` is None where the checkpoint has
    none. Its tokens are embedded by the target's embedding wherever that has the head's
    shape (as mlx-vlm's ``bind`` does: published heads ship a frozen copy of it), by its
    own only where the head is narrower than the target (``shares_embedding``)."""

    kind = KIND

    def __init__(self, config: Eagle3Config, own_embedding: bool = True):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if own_embedding else None
        if c.norm_before_fc:
            self.input_norm = nn.RMSNorm(3 * c.target_hidden_size, eps=c.rms_norm_eps)
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.layers = [_Layer(c, i == 0) for i in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.d2t = mx.zeros((c.draft_vocab_size,), mx.int32)

    @property
    def shares_embedding(self) -> bool:
        """Whether the target's embedding embeds the head's tokens (same hidden size, or
        the head ships none)."""
        c = self.config
        return self.embed_tokens is None or c.hidden_size == c.target_hidden_size

    @staticmethod
    def sanitize(weights: dict) -> dict:
        """Checkpoint names -> module names: ``midlayer.`` is ``layers.0.``; ``t2d`` and
        rotary caches dropped; ``d2t`` as int32."""
        out = {}
        for key, value in weights.items():
            if key.startswith("model."):
                key = key[len("model.") :]
            if key.startswith("midlayer."):
                key = "layers.0." + key[len("midlayer.") :]
            if key == "t2d" or "rotary_emb" in key or key.startswith("verifier_"):
                continue
            out[key] = value.astype(mx.int32) if key == "d2t" else value
        return out

    def make_state(self, batch: int, slots: int, dtype=mx.float32) -> tuple:
        """Zeroed (keys, values): per layer (batch, n_kv, slots, D)."""
        c = self.config
        return empty_state(len(self.layers), batch, slots, c.num_key_value_heads, c.head_dim, dtype)

    def fuse(self, features: mx.array) -> mx.array:
        """(B, T, 3H_t) target features -> (B, T, H) (``fc``, after ``input_norm`` if any)."""
        if self.config.norm_before_fc:
            features = self.input_norm(features)
        return self.fc(features)

    def __call__(self, embeds, hidden, positions, mask, keys, values, write_idx):
        """embeds: (B, T, H) token embeddings; hidden: (B, T, H) fused features or the head's
        own output states; positions, write_idx: (B, T); mask: (B, 1, T, A); keys/values: per
        layer (B, n_kv, S, D). Returns (output states (B, T, H), before ``norm``; keys,
        values)."""
        new_keys, new_values = [], []
        h = hidden
        for layer, k, v in zip(self.layers, keys, values):
            h, k, v = layer(h, embeds, positions, mask, k, v, write_idx)
            new_keys.append(k)
            new_values.append(v)
        return h, new_keys, new_values

    def logits(self, hidden: mx.array) -> mx.array:
        """(B, T, H) output states -> (B, T, V_draft) float32 draft-vocabulary logits."""
        return self.lm_head(self.norm(hidden)).astype(mx.float32)

    def to_target(self, ids: mx.array) -> mx.array:
        """Draft-vocabulary ids (any shape) -> the target's ids (``d2t`` offsets), int32."""
        ids = ids.astype(mx.int32)
        if self.config.draft_vocab_size == self.config.vocab_size:
            return ids
        return ids + self.d2t[ids]

    def target_logits(self, logits: mx.array) -> mx.array:
        """(..., V_draft) -> (..., V) logits over the target's vocabulary, -inf at ids the
        draft vocabulary lacks."""
        c = self.config
        if c.draft_vocab_size == c.vocab_size:
            return logits
        ids = self.to_target(arange(c.draft_vocab_size))
        full = mx.full((*logits.shape[:-1], c.vocab_size), -mx.inf, logits.dtype)
        return _scatter(full, ids, logits)


def _scatter(full: mx.array, ids: mx.array, logits: mx.array) -> mx.array:
    flat = full.reshape(-1, full.shape[-1])
    rows = logits.reshape(-1, logits.shape[-1])
    idx = mx.broadcast_to(ids[None], rows.shape)
    return mx.put_along_axis(flat, idx, rows, axis=1).reshape(full.shape)


def propose(head: Eagle3Head, target: Target, state: tuple, tokens, features, start, depth: int):
    """One greedy chain of ``depth`` drafts after committing T entries.

    tokens: (B, T) target ids at text positions [start + 1, start + T] (the last one the
    init token); features: (B, T, 3H_t) the target's tapped features at [start, start + T);
    start: (B,) int32; state: (keys, values) holding entries [0, start). The entries go to
    slots [start, start + T); then each draft's entry (its own output state as the feature)
    to the next slot. Returns (drafts (B, depth) target ids, logits (B, depth, V_draft)
    float32, state). The state after it holds [0, start + T) (later slots: junk).
    """
    keys, values = state
    T = tokens.shape[1]
    S = keys[0].shape[2]
    embed = target.embed if head.shares_embedding else head.embed_tokens
    slots = start[:, None] + arange(T)[None, :]
    mask = cache_mask(start, chain_mask(T), S)
    h, keys, values = head(embed(tokens), head.fuse(features), slots + 1, mask, keys, values, slots)
    h = h[:, -1:]
    drafts, logits = [], []
    one = chain_mask(1)
    for k in range(depth):
        step = head.logits(h)  # (B, 1, V_draft)
        token = head.to_target(mx.argmax(step, axis=-1))  # (B, 1)
        drafts.append(token)
        logits.append(step)
        if k + 1 == depth:
            break
        at = (start + T + k)[:, None]
        mask = cache_mask(start + T + k, one, S)
        h, keys, values = head(embed(token), h, at + 1, mask, keys, values, at)
    return mx.concatenate(drafts, axis=1), mx.concatenate(logits, axis=1), (keys, values)
