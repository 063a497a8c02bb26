"""The early-exit self-drafter (Kangaroo, arXiv 2404.18911; DESIGN.md section 3c).

The target drafts for itself: its first ``exit_layer`` layers, then a small adapter (per
adapter layer: RMSNorm -> attention with a residual; no MLP; then a final RMSNorm) and the
target's own LM head, frozen. The shallow layers write the drafted tokens' K/V into the
target's cache at the slots the verify overwrites; the adapter keeps a K/V cache of its own
(same slot count as the target's, committed positions at slots ``[0, len)``).

Weight names follow the public Kangaroo adapter (a Llama decoder layer without its MLP):

    layers.{i}.input_layernorm.weight
    layers.{i}.self_attn.{q,k,v,o}_proj.weight
    norm.weight

A folder holds ``config.json`` (``"kind": "early-exit"``, ``EarlyExitArgs``) and
``model.safetensors``.

Adapter cache invariant: slots ``[0, len)`` hold the adapter K/V of the committed tokens.
``adapter_write`` fills it from exit-layer hidden states (the prompt's after prefill, or an
accepted path that another draft source proposed); ``draft_chain`` writes the slots of the
init token and of every drafted token, so after a step that accepted this chain's first n
drafts, ``[len, len + n + 1)`` is already right.

Shapes: B rows, S cache slots, A attended slots (the window), H hidden, V vocabulary,
G = gamma drafted tokens.
"""

from __future__ import annotations

import json
import math
import weakref
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..core.footprint import StepMemory, head_bytes, module_bytes, own_cache_bytes
from ..verifier.entries import Slots
from ..verifier.lm_rope import rope_at, rope_tables
from ..verifier.protocol import Verifier
from ..verifier.slots import attention, write_slots
from .early_exit_chain import ETA, draft_chain, prefill, refresh_committed
from .kinds import kind_of
from .sources import DraftContext, Proposal, Source, catch_up_positions, register_source

KIND = "early-exit"


@dataclass
class EarlyExitArgs:
    """The adapter's configuration (its ``config.json``, with ``kind``)."""

    exit_layer: int  # the adapter reads the residual after the target's layers [:exit_layer]
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's (the head is the target's)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    rope_scaling: dict[str, Any] | None = None
    num_layers: int = 1  # adapter attention layers (Kangaroo: 1)
    draft_vocab: list[int] | None = None  # shortlist: the head rows drafting reads (None: all)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_target(cls, target, exit_layer: int) -> EarlyExitArgs:
        """An adapter for a model of ``target`` args (``Verifier.args``) exiting after
        ``exit_layer`` layers (its attention shape, rope and eps copied)."""
        check_exit_layer(exit_layer, target.num_hidden_layers)
        return cls(
            exit_layer=exit_layer,
            hidden_size=target.hidden_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_traditional=target.rope_traditional,
            rope_scaling=target.rope_scaling,
        )

    @property
    def head_size(self) -> int:
        """Rows of the head drafting reads: K with a shortlist, else vocab_size."""
        return len(self.draft_vocab) if self.draft_vocab else self.vocab_size

    @classmethod
    def from_config(cls, config: dict) -> EarlyExitArgs:
        """From a ``config.json`` dict; a missing key is a ValueError naming it."""
        if config.get("kind") != KIND:
            raise ValueError(
                f"config.json says kind {config.get('kind')!r}, not {KIND!r}: this folder is "
                "not an early-exit adapter"
            )
        names = set(cls.__dataclass_fields__) - {"extra"}
        required = [
            n
            for n, f in cls.__dataclass_fields__.items()
            if f.default is MISSING and f.default_factory is MISSING
        ]
        missing = [n for n in required if n not in config]
        if missing:
            raise ValueError(f"early-exit config.json lacks {missing}")
        known = {k: v for k, v in config.items() if k in names}
        extra = {k: v for k, v in config.items() if k not in names and k != "kind"}
        check_config(config)
        return cls(**known, extra=extra)

    def to_config(self) -> dict:
        cfg = dict(self.extra)
        cfg.update({k: v for k, v in asdict(self).items() if k != "extra"})
        if self.draft_vocab is None:
            cfg.pop("draft_vocab")
        else:
            cfg["draft_vocab"] = [int(i) for i in self.draft_vocab]
        cfg["kind"] = KIND
        return cfg


POSITIVE = ("exit_layer", "hidden_size", "num_attention_heads", "num_key_value_heads")
POSITIVE += ("head_dim", "vocab_size", "num_layers")


# The real-valued keys and the range each accepts, as (key, lowest, highest, whether the
# lowest itself is accepted).
NUMBERS = (
    ("rms_norm_eps", 0.0, float("inf"), False),
    ("rope_theta", 0.0, float("inf"), False),
    ("eta", 0.0, 1.0, True),  # the confidence exit (``ETA``): a probability
)


def check_config(config: dict) -> None:
    """ValueError naming the key and its accepted range unless an adapter config's sizes are
    whole numbers >= 1, its ``NUMBERS`` finite numbers in their ranges and its
    ``draft_vocab`` (when present) a non-empty list of distinct ids in ``[0, vocab_size)``:
    a damaged config.json, caught before any tensor is built."""
    fix = "its config.json is damaged; train or convert the adapter again"
    for key in POSITIVE:
        value = config.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"config.json gives {key} {value!r}, not a whole number >= 1: {fix}")
    for key, low, high, closed in NUMBERS:
        if key in config and not _in_range(config[key], low, high, closed):
            bound = f"in [{low:g}, {high:g}]" if high < float("inf") else f"> {low:g}"
            raise ValueError(
                f"config.json gives {key} {config[key]!r}, not a finite number {bound}: {fix}"
            )
    ids = config.get("draft_vocab")
    if ids is None:
        return
    if not isinstance(ids, list) or not ids:
        raise ValueError(
            f"config.json's draft_vocab is {type(ids).__name__ if ids else 'empty'}, not a "
            f"non-empty list of token ids (leave the key out to draft from the whole "
            f"vocabulary): {fix}"
        )
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool)]
    if bad:
        raise ValueError(f"config.json's draft_vocab holds {bad[0]!r}, not a token id: {fix}")
    vocab = config["vocab_size"]
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(
            f"config.json's draft_vocab holds ids outside the vocabulary [0, {vocab}) (e.g. "
            f"{bad[0]}): {fix}"
        )
    if len(set(ids)) != len(ids):
        seen: set = set()
        twice = next(i for i in ids if i in seen or seen.add(i))
        raise ValueError(f"config.json's draft_vocab lists id {twice} more than once: {fix}")


def _in_range(value, low: float, high: float, closed: bool) -> bool:
    """Whether ``value`` is a finite number (not a bool) in ``[low, high]`` (``(low, high]``
    unless ``closed``)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return False
    return (low <= value if closed else low < value) and value <= high


def check_exit_layer(exit_layer: int, layers: int) -> None:
    """ValueError unless 1 <= exit_layer < layers (at least one layer drafts, one verifies)."""
    if not isinstance(exit_layer, int) or not 1 <= exit_layer < layers:
        raise ValueError(
            f"exit layer {exit_layer!r} is outside [1, {layers}) for this {layers}-layer "
            f"model: pass --exit-layer between 1 and {layers - 1}"
        )


class AdapterAttention(nn.Module):
    """Self-attention at per-token positions over the adapter's slot cache: Llama's q/k/v/o
    projections (no biases) and the target's rope (mlx-lm's ``initialize_rope``)."""

    def __init__(self, args: EarlyExitArgs):
        super().__init__()
        dim, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        from mlx_lm.models.rope_utils import initialize_rope

        self.rope = initialize_rope(hd, args.rope_theta, args.rope_traditional, args.rope_scaling)

    def __call__(self, x, positions, mask, entry: Slots, write_idx, tables=None):
        """x: (B, T, H); positions, write_idx: (B, T); mask: (B, 1, T, A) bool over the first
        A slots after this call's writes; entry: its K/V, (B, n_kv, S, D) each; ``tables``:
        ``lm_rope.rope_tables`` of ``positions`` (shared by the layers). Returns (out (B, T,
        H), the entry after the call's writes)."""
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, T, self.n_kv_heads, -1)
        q, k = rope_at(self.rope, q, positions, tables), rope_at(self.rope, k, positions, tables)
        keys = write_slots(entry.keys, write_idx, k.transpose(0, 2, 1, 3))
        values = write_slots(entry.values, write_idx, v)
        A = mask.shape[-1]
        out = attention(q, keys[:, :, :A], values[:, :, :A], self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1)), Slots(keys, values)


class AdapterLayer(nn.Module):
    """x + attention(RMSNorm(x)): a Llama decoder layer without its MLP."""

    def __init__(self, args: EarlyExitArgs):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.self_attn = AdapterAttention(args)

    def __call__(self, x, positions, mask, entry: Slots, write_idx, tables=None):
        r, entry = self.self_attn(
            self.input_layernorm(x), positions, mask, entry, write_idx, tables
        )
        return x + r, entry


class EarlyExitAdapter(nn.Module):
    """The adapter: exit-layer hidden states -> states the target's LM head reads.

    With a shortlist (``args.draft_vocab``, K ids) drafting reads only those K rows of the
    target's head (``draft_top1``): gathered once per target (``bind_head``), as the
    recurrent drafter's shortlist head does (FR-Spec). The verify still reads the whole
    head, so the output is unchanged; a draft outside the shortlist is never proposed."""

    def __init__(self, args: EarlyExitArgs):
        super().__init__()
        self.args = args
        self.layers = [AdapterLayer(args) for _ in range(args.num_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.set_shortlist(args.draft_vocab)

    def set_shortlist(self, ids: list[int] | None) -> None:
        """Draft from the head rows of ``ids`` (None: the whole head); unbinds the rows."""
        self.args.draft_vocab = [int(i) for i in ids] if ids else None
        # not parameters (underscore): constants of the adapter
        self._draft_ids = mx.array(self.args.draft_vocab, mx.int32) if ids else None
        self._head = None  # (K, H) rows of the bound target's head (``bind_head``)
        self._head_of = None  # a weak reference to that target

    def __call__(self, x, positions, mask, cache: tuple, write_idx):
        """x: (B, T, H) exit-layer states; positions, write_idx: (B, T); mask: (B, 1, T, A);
        cache: one ``Slots`` per adapter layer, (B, n_kv, S, D) keys and values.
        Returns (normed states (B, T, H), the cache)."""
        tables = rope_tables(self.layers[0].self_attn.rope, positions)  # one per call
        new = []
        for layer, entry in zip(self.layers, cache):
            x, entry = layer(x, positions, mask, entry, write_idx, tables)
            new.append(entry)
        return self.norm(x), tuple(new)

    def as_source(self, part: str) -> EarlyExitSource:
        """This adapter as a draft source of the shape's ``part`` (``"beams"``: as the
        drafter, its chain the W1×L; ``"chain"``: in the draft slot, one D1×L chain)."""
        return EarlyExitSource(self, part=part)

    def make_cache(self, batch: int, slots: int, dtype=None) -> tuple:
        """A zeroed adapter cache: one ``Slots`` per layer, (batch, n_kv, slots, D) each."""
        dtype = dtype or self.norm.weight.dtype
        a = self.args
        shape = (batch, a.num_key_value_heads, slots, a.head_dim)
        return tuple(Slots(mx.zeros(shape, dtype), mx.zeros(shape, dtype)) for _ in self.layers)


def check_pair(model: Verifier, adapter: EarlyExitAdapter) -> None:
    """ValueError unless ``adapter`` was made for a model shaped like ``model`` whose first
    layers can run alone (``Verifier.check_early_exit``)."""
    check_args(model.args, adapter.args)
    if model.shards != 1:
        raise ValueError("the early-exit drafter does not run under tensor parallelism yet")
    model.check_early_exit()


def check_args(t, a: EarlyExitArgs) -> None:
    """ValueError unless an adapter of config ``a`` was made for a model of args ``t``
    (``Verifier.args``; checked before its weights are read: ``load_adapter``'s ``target``)."""
    layers = t.num_hidden_layers
    try:
        check_exit_layer(a.exit_layer, layers)
    except ValueError:  # the rule's own message names a training flag; this is a file
        raise ValueError(
            f"this early-exit adapter exits after layer {a.exit_layer}, but the model has "
            f"{layers} layers (an adapter needs an exit layer in [1, {layers})): it was made "
            "for a deeper model; use the adapter trained for this model"
        ) from None
    if (a.hidden_size, a.vocab_size) != (t.hidden_size, t.vocab_size):
        raise ValueError(
            f"this early-exit adapter was made for hidden size {a.hidden_size} and vocabulary "
            f"{a.vocab_size}, the model has {t.hidden_size} and {t.vocab_size}: use the "
            "adapter trained for this model"
        )
    ids = a.draft_vocab or []
    if ids and not all(0 <= i < t.vocab_size for i in ids):
        raise ValueError(
            f"this early-exit adapter's draft_vocab holds ids outside the vocabulary "
            f"[0, {t.vocab_size}): its config.json is damaged; train or convert it again"
        )


def pair(model: Verifier, adapter: EarlyExitAdapter) -> EarlyExitAdapter:
    """``check_pair``, then ``bind_head``: what every place that pairs an adapter with its
    target calls once, before a step is compiled. Returns the adapter."""
    check_pair(model, adapter)
    bind_head(model, adapter)
    return adapter


def bind_head(model: Verifier, adapter: EarlyExitAdapter) -> None:
    """Gather the shortlist's head rows for ``model`` once, evaluated (no-op without a
    shortlist): a step compiled after this reads them as a constant. A model whose logits
    are more than its head's rows binds none (``draft_top1`` reads its whole head)."""
    if adapter._draft_ids is None or (adapter._head_of and adapter._head_of() is model):
        return
    rows = model.head_rows(adapter._draft_ids)
    if rows is not None:
        mx.eval(rows)
    adapter._head, adapter._head_of = rows, weakref.ref(model)


class EarlyExitSource(Source):
    """The early-exit chain as a draft source (``sources.py``): one greedy chain of
    ``length`` tokens (init token first, ``length - 1`` drafts, ``ABSENT`` past the
    confidence cut ``eta``) per row: the shape's W1×L as the drafter (``part`` ``"beams"``),
    or one ``D1×L`` chain in the draft slot (``"chain"``). Its state (``DecodeState.sources``)
    is the adapter's cache (``Slots`` per adapter layer, (B, n_kv, S, D)), prefilled with
    the prompt (``prefill``). ``refresh``: the most tokens another source's accepted path can
    commit (0 when the chain is the only source: its own accepted drafts are already in the
    adapter cache); each draft first rewrites the adapter K/V of that many last committed
    tokens (``draft_chain``), so it needs ``DraftContext.history`` then. A run holds one
    adapter state (``one_per_run``)."""

    source_id = register_source("early_exit")
    stateful = True
    one_per_run = True
    order = 10  # before a draft model in the draft slot

    def __init__(
        self,
        adapter: EarlyExitAdapter,
        length: int = 0,
        refresh: int = 0,
        eta=None,
        part: str = "beams",
    ):
        self.adapter, self.length, self.refresh, self.part = adapter, length, refresh, part
        self.eta = adapter_eta(adapter) if eta is None else eta

    @property
    def modules(self) -> tuple:
        return (self.adapter,)

    def describe(self) -> str:
        return f"early_exit (exit layer {self.adapter.args.exit_layer})"

    def once_message(self) -> str:
        return both_slots_message()

    def check(self, model) -> None:
        check_pair(model, self.adapter)

    def bind(self, model) -> None:
        bind_head(model, self.adapter)  # its shortlist's head rows, before any compile

    def length_in(self, shape) -> int:
        if self.part == "beams" and shape.drafts:
            check_width(shape.width)
        return super().length_in(shape)

    def for_step(self, shape, length: int, other: int) -> EarlyExitSource:
        if length < 2:
            raise ValueError(f"an early-exit chain needs >= 2 tokens, got {length}")
        return EarlyExitSource(self.adapter, length, other, self.eta, self.part)

    def empty_state(self, model, batch: int, slots: int) -> tuple:
        return self.adapter.make_cache(batch, slots)

    def profile_counts(self) -> dict:
        """As the drafter its draft steps are the shape's; a refresh of another source's path
        reads the layers and the adapter once more. In the draft slot: its chain's steps."""
        if self.part == "beams":
            return {"drafter_refreshes": 1} if self.refresh else {}
        return {"chain_steps": self.length - 1, "chain_refreshes": 1 if self.refresh else 0}

    def price(self, pricer):
        return pricer.early_exit(self.adapter, self.part)

    def memory(self, model, shape, batch: int, window: int):
        """Its weights (and bound head rows), its K/V cache over the window, and one draft
        step's logits over its head (``head_bytes``) when ``shape`` runs it."""
        runs = super().length_in(shape) > 0
        step = head_bytes(batch, 1, self.adapter.args.head_size) if runs else 0
        cache = own_cache_bytes(self.adapter) * batch * window
        return StepMemory(module_bytes(self.adapter), cache, step)

    def prefill(self, model, session, rows: slice) -> tuple:
        return prefill(model, self.adapter, session.cached[rows], session.slots)

    @property
    def covers(self) -> int:
        """Committed tokens its draft re-runs itself (``refresh``): the most a step of this
        source may leave behind for the next one (alone: 0, its path is in its cache)."""
        return self.refresh

    def catch_up(self, ctx: DraftContext, count: int) -> tuple:
        """Its state after re-running each row's last ``count`` committed tokens through the
        target's first layers and the adapter (``refresh_committed``, chunk by chunk,
        ``sources.catch_up_positions``), and the target's cache with those layers' junk
        K/V written only above each row's length. Returns (state, the target's cache)."""
        cache, own = ctx.cache, ctx.own
        for pos in catch_up_positions(ctx.lengths, count):
            cache, own = refresh_committed(
                ctx.model, self.adapter, ctx.history, ctx.lengths, cache, own,
                ctx.window, pos.shape[1], start=pos[:, 0],
            )  # fmt: skip
        return own, cache

    def propose(self, ctx: DraftContext) -> Proposal:
        chain = draft_chain(
            ctx.model,
            self.adapter,
            ctx.init_token,
            ctx.lengths,
            ctx.cache,
            ctx.own,
            ctx.window,
            gamma=self.length - 1,
            eta=self.eta,
            history=ctx.history,
            refresh=self.refresh,
        )
        return Proposal(
            chain.tokens[:, None], chain.present[:, None], 1, chain.own, cache=chain.cache
        )


def adapter_eta(adapter: EarlyExitAdapter) -> float:
    """The confidence exit: ``eta`` from the adapter folder's config.json, else ``ETA``."""
    return float(adapter.args.extra.get("eta", ETA))


def both_slots_message() -> str:
    return (
        "an early-exit adapter was given both as the drafter and as the draft model: a run "
        "holds one adapter; pass it once (--drafter <recurrent drafter> --draft-model "
        "<early-exit folder> runs it beside the recurrent drafter)"
    )


def check_width(width: int) -> None:
    """ValueError unless the shape drafts one beam: the early-exit drafter makes one chain."""
    if width != 1:
        raise ValueError(
            f"the early-exit drafter drafts one chain, the shape asks for {width} beams: "
            "use one beam (--beam-width 1; as a config: W1xL7, lookup chains may join: "
            "W1xL7+K1xL8)"
        )


def save_adapter(path: str | Path, adapter: EarlyExitAdapter) -> None:
    """Write ``config.json`` (with ``"kind": "early-exit"``) and ``model.safetensors``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(adapter.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(adapter.args.to_config(), indent=2) + "\n")


def is_early_exit(path: str | Path) -> bool:
    """Whether ``path`` holds a ``config.json`` of kind early-exit (``kinds.kind_of``)."""
    return kind_of(path) == KIND


def kind_problem(path: str | Path) -> str | None:
    """Why a folder whose ``config.json`` reads as an adapter's (it has ``exit_layer``, a key
    only an adapter's config has) is not taken for one: its ``kind`` is not "early-exit"
    (misspelt or missing); None otherwise."""
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or "exit_layer" not in config or config.get("kind") == KIND:
        return None
    return (
        f"{file} has an early-exit adapter's exit_layer but kind {config.get('kind')!r}, not "
        f'{KIND!r}: set "kind": "{KIND}" in it (or train or convert the adapter again)'
    )


def check_finite(weights: dict, file: Path) -> None:
    """ValueError naming the tensors of ``file`` that hold a NaN or an infinity
    (``loading.non_finite``: what a diverged training run leaves), as for a drafter."""
    from ..verifier.weight_files import non_finite

    bad = non_finite(weights)
    if bad:
        raise ValueError(
            f"{file} holds non-finite weights (NaN or infinity in {', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}), as a diverged training run leaves them; such "
            "an adapter never gets a draft accepted. Train it again (distill --kind early-exit "
            "with a lower --lr) or use another adapter"
        )


def load_adapter(path: str | Path, dtype=None, target=None) -> EarlyExitAdapter:
    """The adapter saved in ``path`` (``save_adapter``'s layout); ValueError naming a missing
    or unexpected tensor, a damaged or truncated file, or a config that is not of kind
    early-exit. ``target``: the model's args, checked against the config (``check_args``)
    before the weights are read."""
    from ..base.safetensors_check import check_file

    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}/config.json cannot be read ({e}): not an adapter") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}/config.json is not a JSON object: not an adapter")
    args = EarlyExitArgs.from_config(config)
    if target is not None:
        check_args(target, args)
    adapter = EarlyExitAdapter(args)
    file = path / "model.safetensors"
    if not file.exists():
        raise ValueError(f"{path} has no model.safetensors: convert or train the adapter first")
    check_file(file)  # truncated or corrupt: one message naming the file and the fix
    weights = mx.load(str(file))
    expected = set(dict(tree_flatten(adapter.parameters())))
    missing, unexpected = expected - set(weights), set(weights) - expected
    if missing or unexpected:
        raise ValueError(
            f"{file} does not match its config.json: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    shapes = dict(tree_flatten(adapter.parameters()))
    for name, value in weights.items():
        if value.shape != shapes[name].shape:
            raise ValueError(
                f"{file} does not match its config.json: {name} has shape "
                f"{list(value.shape)}, the config implies {list(shapes[name].shape)}; train or "
                "convert the adapter again"
            )
    check_finite(weights, file)
    if dtype is not None:
        weights = {k: v.astype(dtype) for k, v in weights.items()}
    adapter.load_weights(list(weights.items()))
    mx.eval(adapter.parameters())
    return adapter
