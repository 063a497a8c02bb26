"""The model's own MTP layers (Qwen3.5 / Qwen3-Next ``mtp.*``), chained to a depth.

Read from the target's checkpoint beside mlx-lm's model (mlx-lm's ``sanitize`` drops them),
or from a sidecar folder (mlx-vlm's ``model_type: "qwen3_5_mtp"``, the same tensors without
the ``mtp.`` prefix, norms already shifted). Weights: ``fc`` (2H -> H),
``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``layers.i.*`` (full-attention Qwen3.5
layers: gated queries, q/k norms, partial rope; MoE on MoE models), ``norm``; the HF
checkpoint stores those RMSNorm weights zero-centred (1.0 added here). The depth count is
the text config's ``mtp_num_hidden_layers``.

The entry for text position p pairs the token at p + 1 with the target's final (normed)
hidden state at p, ``fc(concat(norm_e(embed(x[p + 1])), norm_h(h[p])))``, in slot p, rotated
at p; its normed output gives the token at p + 2 through the target's head and is the next
draft's hidden state (mlx-vlm 0.7.10's ``qwen3_5_mtp``).
"""

from __future__ import annotations

import re
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5

from ...core.tree import arange, cache_mask, chain_mask
from .common import HeadMismatch, Target, empty_state, heads_first, slot_attend

KIND = "mtp"
SIDECAR_MODEL_TYPE = "qwen3_5_mtp"
TARGET_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)


def text_config(config: dict) -> dict:
    """The text settings of a target's (or a sidecar's) config.json."""
    return dict(config.get("text_config") or config)


def mtp_layers(config: dict) -> int:
    """How many MTP layers a config declares (0: none)."""
    text = text_config(config)
    return int(text.get("mtp_num_hidden_layers") or text.get("num_nextn_predict_layers") or 0)


def layer_args(config: dict) -> qwen3_5.TextModelArgs:
    """mlx-lm's Qwen3.5 text arguments for the MTP layers (all full attention)."""
    text = text_config(config)
    args = qwen3_5.TextModelArgs.from_dict(text)
    return replace(args, num_hidden_layers=mtp_layers(config), full_attention_interval=1)


class _Layer(nn.Module):
    """mlx-lm's Qwen3.5 full-attention layer (its attention and MLP modules), over a slot
    cache."""

    def __init__(self, args: qwen3_5.TextModelArgs):
        super().__init__()
        self.self_attn = qwen3_5.Attention(args)
        if args.num_experts > 0:
            self.mlp = qwen3_5.SparseMoeBlock(args)
        else:
            self.mlp = qwen3_5.MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, positions, mask, keys, values, write_idx):
        a = self.self_attn
        h = self.input_layernorm(x)
        B, T, _ = h.shape
        q, gate = mx.split(a.q_proj(h).reshape(B, T, a.num_attention_heads, -1), 2, axis=-1)
        q = a.q_norm(q).transpose(0, 2, 1, 3)
        k = a.k_norm(heads_first(a.k_proj(h), a.num_key_value_heads))
        v = heads_first(a.v_proj(h), a.num_key_value_heads)
        out, keys, values = slot_attend(a, q, k, v, positions, mask, keys, values, write_idx)
        x = x + a.o_proj(out * mx.sigmoid(gate.reshape(B, T, -1)))
        return x + self.mlp(self.post_attention_layernorm(x)), keys, values


class MtpHead(nn.Module):
    """A Qwen3.5 / Qwen3-Next MTP head."""

    kind = KIND

    def __init__(self, config: dict):
        super().__init__()
        args = self.args = layer_args(config)
        if args.num_hidden_layers < 1:
            raise HeadMismatch(
                "the config declares no MTP layers (mtp_num_hidden_layers is 0 or absent): "
                "this checkpoint has no MTP head; pick a draft model or lookup instead"
            )
        H, eps = args.hidden_size, args.rms_norm_eps
        self.config = config
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        self.layers = [_Layer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=eps)

    @staticmethod
    def sanitize(weights: dict) -> dict:
        """Checkpoint names -> module names: the ``mtp.`` part of a target checkpoint's keys
        dropped (keys without it are not MTP tensors there, and are dropped too, unless none
        has it: a sidecar), zero-centred norms of the checkpoint shifted by 1.0, per-expert
        MoE tensors stacked as mlx-lm's ``switch_mlp``."""
        hf = any(mtp_key(k) is not None for k in weights)
        out = {}
        for key, value in weights.items():
            if hf:
                key = mtp_key(key)
                if key is None:
                    continue
                if key.endswith(_NORMS) and value.ndim == 1:
                    value = value + 1.0
            out[key] = value
        return _stack_experts(out)

    def make_state(self, batch: int, slots: int, dtype=mx.float32) -> tuple:
        """Zeroed (keys, values): per layer (batch, n_kv, slots, D)."""
        a = self.args
        return empty_state(len(self.layers), batch, slots, a.num_key_value_heads, a.head_dim, dtype)

    def __call__(self, embeds, hidden, positions, mask, keys, values, write_idx):
        """embeds: (B, T, H) token embeddings; hidden: (B, T, H) the target's final normed
        states (or the head's own outputs); positions, write_idx: (B, T); mask: (B, 1, T, A).
        Returns (normed output states (B, T, H), keys, values)."""
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        h, new_keys, new_values = self.fc(x), [], []
        for layer, k, v in zip(self.layers, keys, values):
            h, k, v = layer(h, positions, mask, k, v, write_idx)
            new_keys.append(k)
            new_values.append(v)
        return self.norm(h), new_keys, new_values


def mtp_key(key: str) -> str | None:
    at = key.find("mtp.")
    if at < 0 or (at > 0 and key[at - 1] != "."):
        return None
    return key[at + len("mtp.") :]


_EXPERT = re.compile(
    r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$"
)


def _stack_experts(weights: dict) -> dict:
    groups: dict = {}
    for key in list(weights):
        if m := _EXPERT.fullmatch(key):
            prefix, expert, proj, suffix = m.groups()
            groups.setdefault((prefix[: -len(".experts")], proj, suffix), {})[int(expert)] = key
    for (base, proj, suffix), keys in groups.items():
        stacked = [weights.pop(keys[i]) for i in sorted(keys)]
        weights[f"{base}.switch_mlp.{proj}.{suffix}"] = mx.stack(stacked)
    return weights


def propose(head: MtpHead, target: Target, state: tuple, tokens, hidden, start, depth: int):
    """One greedy chain of ``depth`` drafts after committing T entries.

    tokens: (B, T) target ids at text positions [start + 1, start + T] (the last one the
    init token); hidden: (B, T, H) the target's final normed hidden states at [start,
    start + T); start: (B,) int32. Returns (drafts (B, depth) int32, logits (B, depth, V)
    float32, state holding [0, start + T); later slots: junk).
    """
    keys, values = state
    T = tokens.shape[1]
    S = keys[0].shape[2]
    slots = start[:, None] + arange(T)[None, :]
    mask = cache_mask(start, chain_mask(T), S)
    h, keys, values = head(target.embed(tokens), hidden, slots, mask, keys, values, slots)
    h = h[:, -1:]
    drafts, logits = [], []
    one = chain_mask(1)
    for k in range(depth):
        step = target.head(h).astype(mx.float32)  # (B, 1, V)
        token = mx.argmax(step, axis=-1).astype(mx.int32)
        drafts.append(token)
        logits.append(step)
        if k + 1 == depth:
            break
        at = (start + T + k)[:, None]
        mask = cache_mask(start + T + k, one, S)
        h, keys, values = head(target.embed(token), h, at, mask, keys, values, at)
    return mx.concatenate(drafts, axis=1), mx.concatenate(logits, axis=1), (keys, values)
