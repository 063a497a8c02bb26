"""DFlash block drafters (``architectures: ["DFlashDraftModel"]``): one forward proposes a
whole block.

config.json: ``block_size`` (16), ``dflash_config.{mask_token_id, target_layer_ids}``,
``num_target_layers``, the Qwen3 layer settings; weights ``fc`` (len(taps)*H -> H),
``hidden_norm``, ``layers.i.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.*}``, ``norm``; no embedding and no head (the target's).

The context: the target's tapped features of every committed position but the newest (the
init token, whose features the target has not computed yet), fused by ``fc`` and
``hidden_norm``, become K/V in every layer (slot p: text position p, rotated at p; K/V
projected from the fused features themselves, not from the layer's input). The queries:
``[init token, mask x (block_size - 1)]`` at the positions after the context, embedded by
the target, attending to the context and to each other (non-causal); their K/V are not
kept. The target's head gives every block position's logits at once; the drafts are the
argmax of positions 1.. (mlx-vlm 0.7.10's ``qwen3_dflash``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3

from ...core.tree import arange
from ...verifier.lm_rope import rope_at, rope_tables
from ...verifier.slots import attention, write_heads
from .common import HeadMismatch, Target, empty_state, heads_first

KIND = "block"
ARCHITECTURE = "DFlashDraftModel"


@dataclass
class BlockConfig:
    """A DFlash head's settings (``from_config`` reads the published config.json)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 262144
    layer_types: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict) -> BlockConfig:
        c = dict(config)
        dflash = c.get("dflash_config") or {}
        for key in ("mask_token_id", "target_layer_ids", "num_target_layers"):
            if key in dflash:
                c[key] = dflash[key]
        unsupported = [
            f"{key}={dflash[key]!r}"
            for key in ("causal", "attention_sink_bias", "draft_window_size")
            if dflash.get(key)
        ] + [t for t in c.get("layer_types") or [] if t != "full_attention"][:1]
        if unsupported:
            raise HeadMismatch(
                f"the DFlash head uses {unsupported[0]}, which this engine does not run yet "
                "(full, non-causal attention only): pick a Qwen3 DFlash head"
            )
        if "num_target_layers" not in c and c.get("target_layer_ids"):
            c["num_target_layers"] = max(c["target_layer_ids"]) + 1
        rope = dict(c.get("rope_parameters") or {})
        if "rope_theta" in rope:
            c["rope_theta"] = rope.pop("rope_theta")
        if rope:
            c["rope_scaling"] = rope
        names = cls.__dataclass_fields__
        try:
            return cls(**{k: v for k, v in c.items() if k in names})
        except TypeError as e:
            raise HeadMismatch(
                f"the DFlash config.json is incomplete ({e}): re-download the head"
            ) from None

    def feature_layers(self, target_layers: int) -> tuple[int, ...]:
        """The target's decoder layers (0-based) whose outputs are fused, in order."""
        del target_layers
        return tuple(int(i) for i in self.target_layer_ids)

    def qwen3_args(self) -> qwen3.ModelArgs:
        return qwen3.ModelArgs(
            model_type="qwen3",
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.vocab_size,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            head_dim=self.head_dim,
            tie_word_embeddings=True,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
        )


class _Layer(nn.Module):
    """mlx-lm's Qwen3 attention and MLP, run over [context K/V; block K/V]."""

    def __init__(self, args: qwen3.ModelArgs):
        super().__init__()
        self.self_attn = qwen3.Attention(args)
        self.mlp = qwen3.MLP(args.hidden_size, args.intermediate_size)
        eps = args.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=eps)

    def write_context(self, ctx, ctx_pos, keys, values, table):
        """ctx: (B, T, H) fused context -> its K/V written at slots ``ctx_pos`` (B, T),
        rotated at them (``table``: their rope table). Returns (keys, values)."""
        a = self.self_attn
        m = a.n_kv_heads
        k_ctx = a.k_norm(heads_first(a.k_proj(ctx), m))
        v_ctx = heads_first(a.v_proj(ctx), m)
        keys = write_heads(keys, ctx_pos, rope_at(a.rope, k_ctx, ctx_pos, table))
        return keys, write_heads(values, ctx_pos, v_ctx)

    def __call__(self, x, ctx, ctx_pos, ctx_mask, block_pos, keys, values, tables):
        """x: (B, L, H) block states; ctx: (B, T, H) fused context written at slots
        ``ctx_pos`` (B, T); ctx_mask: (B, 1, 1, A) the slots the block sees (after the
        writes); block_pos: (B, L). Returns (x, keys, values)."""
        a = self.self_attn
        n, m = a.n_heads, a.n_kv_heads
        keys, values = self.write_context(ctx, ctx_pos, keys, values, tables[0])
        h = self.input_layernorm(x)
        B, L, _ = h.shape
        q = a.q_norm(a.q_proj(h).reshape(B, L, n, -1)).transpose(0, 2, 1, 3)
        k = a.k_norm(a.k_proj(h).reshape(B, L, m, -1)).transpose(0, 2, 1, 3)
        v = heads_first(a.v_proj(h), m)
        q = rope_at(a.rope, q, block_pos, tables[1])
        k = rope_at(a.rope, k, block_pos, tables[1])
        A = ctx_mask.shape[-1]
        all_k = mx.concatenate([keys[:, :, :A], k], axis=2)
        all_v = mx.concatenate([values[:, :, :A], v], axis=2)
        mask = mx.concatenate(
            [mx.broadcast_to(ctx_mask, (B, 1, L, A)), mx.ones((B, 1, L, L), mx.bool_)], axis=-1
        )
        out = attention(q, all_k, all_v, a.scale, mask)
        x = x + a.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
        return x + self.mlp(self.post_attention_layernorm(x)), keys, values


class BlockHead(nn.Module):
    """A DFlash block drafter."""

    kind = KIND

    def __init__(self, config: BlockConfig):
        super().__init__()
        c = self.config = config
        args = c.qwen3_args()
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = [_Layer(args) for _ in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    @staticmethod
    def sanitize(weights: dict) -> dict:
        """Checkpoint names -> module names (a ``model.`` prefix dropped)."""
        return {
            (k[len("model.") :] if k.startswith("model.") else k): v for k, v in weights.items()
        }

    def make_state(self, batch: int, slots: int, dtype=mx.float32) -> tuple:
        """Zeroed (keys, values) of the context: per layer (batch, n_kv, slots, D)."""
        c = self.config
        return empty_state(len(self.layers), batch, slots, c.num_key_value_heads, c.head_dim, dtype)

    def context(self, features, ctx_pos, keys, values):
        """The context entries alone: features (B, T, k*H) fused and their K/V written at
        slots ``ctx_pos`` (B, T) in every layer. Returns (fused (B, T, H), keys, values)."""
        ctx = self.hidden_norm(self.fc(features))
        table = rope_tables(self.layers[0].self_attn.rope, ctx_pos)
        new_keys, new_values = [], []
        for layer, k, v in zip(self.layers, keys, values):
            k, v = layer.write_context(ctx, ctx_pos, k, v, table)
            new_keys.append(k)
            new_values.append(v)
        return ctx, new_keys, new_values

    def __call__(self, embeds, features, ctx_pos, lengths, keys, values):
        """embeds: (B, L, H) the block's embeddings; features: (B, T, k*H) the new context
        positions' tapped features, written at ``ctx_pos`` (B, T); lengths: (B,) context
        positions after them (the block sits at [len, len + L)). Returns (normed block
        states (B, L, H), keys, values)."""
        L = embeds.shape[1]
        ctx = self.hidden_norm(self.fc(features))
        block_pos = lengths[:, None] + arange(L)[None, :]
        A = int(keys[0].shape[2])
        ctx_mask = (arange(A)[None, :] < lengths[:, None])[:, None, None]
        rope = self.layers[0].self_attn.rope
        tables = (rope_tables(rope, ctx_pos), rope_tables(rope, block_pos))
        h, new_keys, new_values = embeds, [], []
        for layer, k, v in zip(self.layers, keys, values):
            h, k, v = layer(h, ctx, ctx_pos, ctx_mask, block_pos, k, v, tables)
            new_keys.append(k)
            new_values.append(v)
        return self.norm(h), new_keys, new_values


def propose(head: BlockHead, target: Target, state: tuple, features, start, init_token, size=None):
    """One block: ``size`` (default ``block_size``) - 1 greedy drafts.

    features: (B, T, k*H) the target's tapped features at text positions [start, start + T)
    (each committed position but the init token's); start: (B,) int32, the context
    positions ``state`` holds; init_token: (B,) the token at start + T. Returns (drafts
    (B, size - 1) int32, logits (B, size - 1, V) float32, state holding [0, start + T)).
    """
    keys, values = state
    size = size or head.config.block_size
    B, T = features.shape[:2]
    mask_id = head.config.mask_token_id
    block = mx.concatenate(
        [init_token[:, None].astype(mx.int32), mx.full((B, size - 1), mask_id, mx.int32)], axis=1
    )
    ctx_pos = start[:, None] + arange(T)[None, :]
    h, keys, values = head(target.embed(block), features, ctx_pos, start + T, keys, values)
    logits = target.head(h[:, 1:]).astype(mx.float32)
    return mx.argmax(logits, axis=-1).astype(mx.int32), logits, (keys, values)
