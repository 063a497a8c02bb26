"""The verifier: one decoder-only transformer with explicit per-token positions and masks.

One definition serves Llama / Mistral, Qwen2 / Qwen2.5, Qwen3, Gemma 2 and Gemma 3 (text):
where the families differ, :class:`Family` (derived from ``model_type`` in one place,
:func:`family_of`) names the option: q/k/v and o biases, per-head q/k RMSNorm, Gemma's
``(1 + w)`` norms and sandwich norms, the GELU-tanh MLP, scaled embeddings, attention and
final logit soft-capping, and sliding-window layers (with Gemma 3's local rope base).

Weight names are mlx-lm's (``model.embed_tokens``, ``model.layers.{i}.self_attn.q_proj``,
..., ``lm_head``) so mlx-lm model directories load unchanged, quantized ones included.

Unlike mlx-lm's forward, ours is a pure function of arrays that suits tree verification:

* every token carries its own position (``len + depth`` in a draft tree);
* K/V are written into a preallocated cache at explicit slots (``write_idx``) with a scatter
  (in place under ``mx.compile``), and attention uses an explicit boolean mask over all
  cache slots, so prefill, autoregressive steps, tree verification and the trainer's
  branch rollouts are one code path.

Sliding-window layers attend to keys whose position is within ``sliding_window`` of the
query's. A key's position is known exactly without being stored: a slot this call writes
holds the token at the ``positions`` entry written there, and every other slot of the cache
holds the token at position == slot (committed tokens sit at ``[0, len)``;
docs/design/model-families.md, "Sliding windows"). The trainer's branch rollouts keep earlier
branch tokens at slots above their positions; those are ancestors less than ``depth``
positions back, inside any window larger than the rollout depth, so they are attended
exactly as before.

Shapes: B batch rows, T new tokens, S cache slots, H hidden size, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .config import different_head, head_pairs, with_family_defaults
from .rope import RoPE

# Fused kernels (mx.fast rope with per-row offsets, scaled_dot_product_attention) on Metal and
# CUDA; composed ops on the CPU backend, where they measured several times faster. None picks
# by device; tests set True/False to run both paths on any backend.
FUSED_KERNELS: bool | None = None


def fused_kernels() -> bool:
    """Whether this forward uses the fused kernels (see ``FUSED_KERNELS``)."""
    return mx.default_device() != mx.cpu if FUSED_KERNELS is None else FUSED_KERNELS


GEMMA_TYPES = ("gemma2", "gemma3_text")


@dataclass(frozen=True)
class Family:
    """How a model type departs from Llama (all False: Llama / Mistral).

    Attributes:
        qkv_bias, o_bias: biases on the q/k/v and on the output projection.
        qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
        gemma_norm: RMSNorm weights are zero-centred, the scale is ``1 + w``.
        sandwich_norms: norms after attention and the MLP too (``pre_``/``post_feedforward``).
        gelu: GELU (tanh approximation) gate instead of SiLU.
        scale_embed: embeddings times sqrt(H), rounded to the model's dtype.
    """

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    gemma_norm: bool = False
    sandwich_norms: bool = False
    gelu: bool = False
    scale_embed: bool = False


def family_of(args: ModelArgs) -> Family:
    """The options of ``args.model_type`` (config keys such as ``attention_bias`` still count)."""
    t = args.model_type
    gemma = t in GEMMA_TYPES
    return Family(
        qkv_bias=args.attention_bias or t == "qwen2",
        o_bias=args.attention_bias,
        qk_norm=t in ("qwen3", "gemma3_text"),
        gemma_norm=gemma,
        sandwich_norms=gemma,
        gelu=gemma,
        scale_embed=gemma,
    )


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
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is its -1/2 power
    attn_logit_softcapping: float | None = None  # cap * tanh(score / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the logits (Gemma 2)
    sliding_window: int | None = None  # Gemma: keys within this many positions
    sliding_window_pattern: int | None = None  # Gemma 3: every n-th layer is global
    layer_types: list[str] | None = None  # "sliding_attention" / "full_attention" per layer
    rope_local_base_freq: float | None = None  # Gemma 3: rope base of sliding layers
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.family = family_of(self)  # not a field: config.json never holds it

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends only within ``sliding_window`` positions."""
        if self.model_type not in GEMMA_TYPES or not self.sliding_window:
            return False
        if self.layer_types is not None:
            return self.layer_types[layer] == "sliding_attention"
        if self.model_type == "gemma2":
            return layer % 2 == 0
        return (layer + 1) % (self.sliding_window_pattern or 6) != 0

    def rope_for(self, layer: int) -> tuple[float, dict | None]:
        """(base, scaling) of ``layer``'s RoPE: Gemma 3's sliding layers use the local base."""
        if self.model_type == "gemma3_text" and self.is_sliding(layer):
            return self.rope_local_base_freq or 10000.0, None
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_config(cls, config: dict) -> ModelArgs:
        """Build from a HF / mlx-lm ``config.json`` dict; unknown keys go to ``extra``."""
        names = set(cls.__dataclass_fields__) - {"extra"}
        # An absent key takes the family's reference default (config.FAMILY_DEFAULTS); the
        # output layer's tie is decided from the checkpoint's tensors too (config.ties_head).
        config = with_family_defaults({**rope_parameters(config), **config})
        known = {k: v for k, v in config.items() if k in names}
        extra = {k: v for k, v in config.items() if k not in names}
        return cls(**known, extra=extra)


def rope_parameters(config: dict) -> dict:
    """``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq`` read from the
    ``rope_parameters`` block newer transformers write instead (per layer type for Gemma 3)."""
    params = config.get("rope_parameters")
    if not isinstance(params, dict):
        return {}
    if "full_attention" in params or "sliding_attention" in params:
        out = _rope_settings(params.get("full_attention") or {})
        local = params.get("sliding_attention") or {}
        if "rope_theta" in local:
            out["rope_local_base_freq"] = local["rope_theta"]
        return out
    return _rope_settings(params)


def _rope_settings(params: dict) -> dict:
    """One ``rope_parameters`` entry -> ``rope_theta`` and, unless default, ``rope_scaling``."""
    out = {"rope_theta": params["rope_theta"]} if "rope_theta" in params else {}
    if params.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    return out


class GemmaRMSNorm(nn.Module):
    """RMSNorm with a zero-centred weight: the scale is ``1 + weight`` (Gemma's checkpoints)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x):
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


def rms_norm(args: ModelArgs, dims: int) -> nn.Module:
    """The family's RMSNorm over the last ``dims`` values."""
    cls = GemmaRMSNorm if args.family.gemma_norm else nn.RMSNorm
    return cls(dims, eps=args.rms_norm_eps)


class Attention(nn.Module):
    """Self-attention over this rank's heads: all of them alone, 1/N of the q and of the K/V
    heads under tensor parallelism (``group``), summed over ranks after ``o_proj``."""

    def __init__(self, args: ModelArgs, layer: int, group=None):
        super().__init__()
        family = args.family
        shards = 1 if group is None else group.size()
        self.group = group
        self.n_heads = args.num_attention_heads // shards
        self.n_kv_heads = args.num_key_value_heads // shards
        self.head_dim = args.head_dim
        self.scale = args.attention_scale
        self.softcap = args.attn_logit_softcapping
        dim, hd, bias = args.hidden_size, args.head_dim, family.qkv_bias
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=family.o_bias)
        if family.qk_norm:
            self.q_norm = rms_norm(args, hd)
            self.k_norm = rms_norm(args, hd)
        base, scaling = args.rope_for(layer)
        self.rope = RoPE(hd, base, args.rope_traditional, scaling)
        self.rope_key = (base, repr(scaling))  # layers with equal keys share one cos/sin table

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

    def __call__(self, x, positions, mask, keys, values, write_idx, fresh=None):
        """x: (B, T, H); positions, write_idx: (B, T); mask: (B, 1, T, A) bool over the
        first A cache slots (the attention window, A <= S); keys/values: (B, n_kv, S, D).
        Returns (out (B, T, H), keys, values). ``fresh``: a list to which this call's own
        K/V, (B, T, n_kv, D) each, are appended (a tree commit reads them instead of the
        cache, so the cache is written in place)."""
        B, T, _ = x.shape
        A = mask.shape[-1]
        q = self.q_proj(x).reshape(B, T, self.n_heads, -1)
        k = self.k_proj(x).reshape(B, T, self.n_kv_heads, -1)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotate(q, positions), self._rotate(k, positions)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, -1)
        if fresh is not None:
            fresh.append((k, v))
        keys = write_slots(keys, write_idx, k)
        values = write_slots(values, write_idx, v)
        out = attention(
            q.transpose(0, 2, 1, 3),
            keys[:, :, :A],
            values[:, :, :A],
            self.scale,
            mask,
            self.softcap,
        )
        out = self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))
        return all_ranks(out, self.group), keys, values


def all_ranks(x: mx.array, group) -> mx.array:
    """The sum of every rank's partial ``x`` (B, T, H) under tensor parallelism; ``x`` alone."""
    return x if group is None else mx.distributed.all_sum(x, group=group)


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


def attention(q, k, v, scale: float, mask, softcap: float | None = None):
    """Masked attention with grouped K/V heads, scores optionally soft-capped
    (``softcap * tanh(score / softcap)``, Gemma 2).

    q: (B, n_heads, T, D); k, v: (B, n_kv, A, D); mask: (B, 1, T, A) bool -> (B, n_heads, T, D).
    On Metal/CUDA the fused kernel (which cannot soft-cap); on the CPU backend two matmuls,
    which are several times faster there for multi-token (tree) queries.
    """
    if fused_kernels() and softcap is None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    B, n_heads, T, D = q.shape
    n_kv = k.shape[1]
    q = (q * scale).reshape(B, n_kv, (n_heads // n_kv) * T, D)
    scores = (q @ k.transpose(0, 1, 3, 2)).reshape(B, n_kv, n_heads // n_kv, T, -1)
    scores = scores.astype(mx.float32)
    if softcap is not None:
        scores = mx.tanh(scores / softcap) * softcap
    scores = mx.where(mask[:, :, None], scores, -mx.inf)
    probs = mx.softmax(scores, axis=-1).astype(v.dtype).reshape(B, n_kv, -1, k.shape[2])
    return (probs @ v).reshape(B, n_heads, T, D)


class MLP(nn.Module):
    """The gated MLP; under tensor parallelism (``group``) this rank's 1/N of its rows,
    summed over ranks after ``down_proj``."""

    def __init__(self, args: ModelArgs, group=None):
        super().__init__()
        shards = 1 if group is None else group.size()
        self.group = group
        dim, hidden, bias = args.hidden_size, args.intermediate_size // shards, args.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.act = nn.gelu_approx if args.family.gelu else nn.silu

    def __call__(self, x):
        return all_ranks(self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x)), self.group)


class TransformerBlock(nn.Module):
    """Pre-norm block; with ``sandwich_norms`` (Gemma) each branch's output is normed too.

    Names follow the checkpoints: Llama's ``post_attention_layernorm`` is the norm before the
    MLP, Gemma's normalizes the attention output and ``pre_feedforward_layernorm`` precedes
    the MLP.
    """

    def __init__(self, args: ModelArgs, layer: int, group=None):
        super().__init__()
        self.sliding = args.is_sliding(layer)
        self.self_attn = Attention(args, layer, group)
        self.mlp = MLP(args, group)
        self.input_layernorm = rms_norm(args, args.hidden_size)
        self.post_attention_layernorm = rms_norm(args, args.hidden_size)
        if args.family.sandwich_norms:
            self.pre_feedforward_layernorm = rms_norm(args, args.hidden_size)
            self.post_feedforward_layernorm = rms_norm(args, args.hidden_size)

    def __call__(self, x, positions, mask, keys, values, write_idx, fresh=None):
        r, keys, values = self.self_attn(
            self.input_layernorm(x), positions, mask, keys, values, write_idx, fresh
        )
        if "pre_feedforward_layernorm" not in self:
            h = x + r
            return h + self.mlp(self.post_attention_layernorm(h)), keys, values
        h = x + self.post_attention_layernorm(r)
        r = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(r), keys, values


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, group=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, i, group) for i in range(args.num_hidden_layers)]
        self.norm = rms_norm(args, args.hidden_size)


def window_mask(mask: mx.array, positions: mx.array, write_idx: mx.array, window: int):
    """``mask`` narrowed to keys less than ``window`` positions before each query.

    mask: (B or 1, 1, T, A) bool; positions, write_idx: (B, T) -> (B, 1, T, A) bool. The key
    at a slot this call writes is at the position written there, any other at its slot's
    index (see the module docstring).
    """
    B = positions.shape[0]
    A = mask.shape[-1]
    key_pos = mx.broadcast_to(mx.arange(A, dtype=mx.int32)[None], (B, A))
    key_pos = mx.put_along_axis(key_pos, write_idx, positions.astype(mx.int32), axis=1)
    near = key_pos[:, None, :] > positions[:, :, None] - window  # (B, T, A)
    return mask & near[:, None]


class Verifier(nn.Module):
    """What every verifier keeps beside its forward (this module's ``Model``, and
    ``lm_model.LmModel``): the feature layers a drafter reads and the context cap. A
    subclass sets ``args`` (``num_hidden_layers``, ``max_position_embeddings``) and
    ``hidden_size``, and starts ``feature_layers`` empty."""

    def capture_features(self, layers) -> None:
        """Make every forward also return the residual stream entering each of ``layers``
        (a drafter's ``feature_layers``; empty: the final normed hidden state alone).

        The forward's hidden output becomes (..., (1 + k) * H): the final normed hidden
        state (what ``logits`` reads) followed by the k captured residuals, in ``layers``
        order, so every path that keeps a hidden state for the drafter (prefill, the AR
        step, the tree verify's accepted node, batch rows) keeps the features with it, from
        the same forward. Compiled steps traced for another width are dropped.
        """
        layers = tuple(int(i) for i in layers or ())
        n = self.args.num_hidden_layers
        bad = [i for i in layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"feature layers {bad} are outside this model's layers [0, {n})")
        if layers != self.feature_layers:
            self.__dict__.pop("_batch_steps", None)
        self.feature_layers = layers

    @property
    def state_width(self) -> int:
        """Width of the hidden output of ``__call__``: H, or (1 + k) * H with k captured
        feature layers (``capture_features``)."""
        return self.args.hidden_size * (1 + len(self.feature_layers))

    @property
    def max_context(self) -> int | None:
        """Most tokens a row may hold: the model's trained context, or less after
        ``cap_context`` (every loop, chat and the server stop or trim at this one figure)."""
        trained = self.args.max_position_embeddings
        cap = getattr(self, "context_cap", None)
        if cap is None:
            return trained
        return cap if trained is None else min(trained, cap)

    def cap_context(self, tokens: int | None) -> None:
        """Hold at most ``tokens`` per row in the KV cache (``--max-kv-size``); None lifts it."""
        if tokens is not None and tokens < 1:
            raise ValueError(f"a context cap must be >= 1 token, got {tokens}")
        self.context_cap = tokens


class Model(Verifier):
    """The causal LM. ``__call__`` returns final normed hidden states and the cache.

    ``group``: an ``mx.distributed`` group of N > 1 ranks to split the layers across (tensor
    parallelism, ``engine/base/distributed.py``): this rank holds 1/N of each layer's heads and MLP
    rows and of the K/V cache, and each attention and MLP ends with one ``all_sum``. None
    (the default): the whole model in this process.
    """

    def __init__(self, args: ModelArgs, group=None):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.group = group
        self.shards = 1 if group is None else group.size()
        self.model = LlamaModel(args, group)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.feature_layers: tuple[int, ...] = ()  # see ``capture_features``
        # An APAR model's split token ids (fork, child; ``branches.split_token_ids``, set at
        # load): a row decoding one sequence (branching off) never draws them.
        self.split_ids: tuple[int, ...] = ()

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def dtype(self):
        """The float dtype the model computes in (its final norm's)."""
        return self.model.norm.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def embed(self, tokens: mx.array) -> mx.array:
        """The LLM's input embedding table lookup, (...) -> (..., H). The drafter reads it too
        (unscaled: Gemma's sqrt(H) factor is applied in ``__call__`` only)."""
        return self.model.embed_tokens(tokens)

    def __call__(self, tokens, positions, mask, keys, values, write_idx, fresh=None, counts=None):
        """One forward over T new tokens per row against the cache (``counts``, the real
        tokens per row of a right-padded call, matters only to recurrent layers: none here).

        tokens, positions, write_idx: (B, T) int32; mask: (B, 1, T, A) bool (True = attend)
        over the first A cache slots *after* this call's writes; keys/values: lists (one per
        layer) of (B, n_kv, S, D), A <= S. Returns (hidden (B, T, H) after the final norm,
        keys, values). ``fresh``: a list that receives each layer's new (K, V), (B, T, n_kv,
        D) each.
        """
        x = self.embed(tokens)
        if self.args.family.scale_embed:
            x = x * mx.array(self.args.hidden_size**0.5, dtype=x.dtype)
        layers = self.model.layers
        rotations = {layer.self_attn.rope_key: positions for layer in layers}
        if not fused_kernels():
            # One cos/sin table per rope (not per layer): on the CPU backend the fused rope
            # kernel with per-row offsets costs ~7x more than this.
            for layer in layers:
                if rotations[layer.self_attn.rope_key] is positions:
                    rotations[layer.self_attn.rope_key] = layer.self_attn.rope.tables(positions)
        masks = {False: mask}
        if any(layer.sliding for layer in layers):
            masks[True] = window_mask(mask, positions, write_idx, self.args.sliding_window)
        new_keys, new_values = [], []
        capture = self.feature_layers
        features = {}
        for i, (layer, k, v) in enumerate(zip(layers, keys, values)):
            if i in capture:
                features[i] = x
            rotation = rotations[layer.self_attn.rope_key]
            x, k, v = layer(x, rotation, masks[layer.sliding], k, v, write_idx, fresh)
            new_keys.append(k)
            new_values.append(v)
        hidden = self.model.norm(x)
        if capture:
            hidden = mx.concatenate([hidden, *(features[i] for i in capture)], axis=-1)
        return hidden, new_keys, new_values

    def logits(self, hidden: mx.array) -> mx.array:
        """(..., H) -> (..., V) float32 logits (soft-capped for Gemma 2). A wider hidden
        output (feature layers captured) is read at its first H values, the final normed
        state."""
        H = self.args.hidden_size
        if hidden.shape[-1] != H:
            hidden = hidden[..., :H]
        if self.args.tie_word_embeddings:
            out = self.model.embed_tokens.as_linear(hidden)
        else:
            out = self.lm_head(hidden)
        return self.soft_capped(out.astype(mx.float32))

    def head_logits(self, hidden: mx.array, ids) -> mx.array:
        """(..., H) -> (..., K) float32 logits of token ``ids`` alone (a shortlist head):
        the head's rows at ``ids``, through the final soft cap."""
        rows = output_rows(self, ids)
        return self.soft_capped((hidden[..., : self.hidden_size] @ rows.T).astype(mx.float32))

    def soft_capped(self, logits: mx.array) -> mx.array:
        """Logits through the final soft cap (Gemma 2; others unchanged): the one rule for
        ``logits`` and every head read in part (a shortlist's rows: ``output_rows``)."""
        cap = self.args.final_logit_softcapping
        return mx.tanh(logits / cap) * cap if cap else logits

    def make_cache(self, batch: int, slots: int, dtype=None):
        """Zeroed K/V lists, each (batch, n_kv, slots, D); n_kv counts this rank's heads."""
        dtype = dtype or self.model.norm.weight.dtype
        shape = (batch, self.args.num_key_value_heads // self.shards, slots, self.args.head_dim)
        keys = [mx.zeros(shape, dtype) for _ in self.model.layers]
        values = [mx.zeros(shape, dtype) for _ in self.model.layers]
        return keys, values

    def sanitize(self, weights: dict, file="config.json") -> dict:
        """Drop rotary buffers, and a tied model's ``lm_head`` tensors when they copy the
        embedding; another head is a ``ConfigError`` naming ``file`` (``config.ties_head``)."""
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings and head_pairs(weights):
            if not copies_embedding(weights):
                raise different_head(file)
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights


def copies_embedding(weights: dict) -> bool:
    """Whether every ``lm_head.*`` tensor of ``weights`` equals its ``model.embed_tokens.*``
    counterpart (reads both; ``weights`` may be lazily loaded)."""
    return all(
        embedding in weights and bool(mx.array_equal(weights[head], weights[embedding]))
        for head, embedding in head_pairs(weights)
    )


def output_rows(model: Model, ids=None) -> mx.array:
    """The model's output embedding (its head's weight, or the tied input embedding) at
    ``ids`` (token ids, a list or an array; None: every id): (K or V, H), dequantized when
    quantized. A shortlist head's rows (a drafter's teacher, an early-exit adapter's)."""
    layer = model.model.embed_tokens if model.args.tie_word_embeddings else model.lm_head
    index = None if ids is None else mx.array(ids, dtype=mx.int32)
    weight = layer.weight if index is None else layer.weight[index]
    if "scales" not in layer:
        return weight
    scales = layer.scales if index is None else layer.scales[index]
    biases = layer.get("biases")
    if biases is not None and index is not None:
        biases = biases[index]
    return mx.dequantize(
        weight, scales, biases, layer.group_size, layer.bits, getattr(layer, "mode", "affine")
    )
