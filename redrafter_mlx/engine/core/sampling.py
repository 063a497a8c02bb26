"""Target-token draws: greedy and temperature / top-k / top-p / min-p sampling, after the
text-reading processors (logit bias; repetition, presence and frequency penalties).

One path for every draw. ``SamplerConfig`` is the one settings type a user gives (CLI flags,
the Python API and the server's requests all become one, checked in ``validate``). Each
row's settings become arrays once, when the row is admitted (``row_settings``: where every
value is checked and made to fit float32 / int32), and every draw, a solo run's as a
server row's, takes a ``RowSampler``: a batch of rows with their own settings and keys (a
solo run is a batch of one row, or of B rows alike). Each filter is one function of
``(logits, per-row values)``, chained by ``draw`` in ``FILTERS`` order (mlx-lm's
``make_sampler`` style); a row with a filter off passes through it unchanged.

ReDrafter and the autoregressive baseline draw through the same function, so their token
distributions are the same by construction. One draw per tree node (Gumbel-max on the
processed logits) is what makes speculative sampling exact (docs/design/exact-acceptance.md,
"One draw per node"); the penalties read each node's own text (``penalties.py``), so they stay
exact too.

Adding a sampling setting touches:

1. ``SamplerConfig``: the field, and its rule in ``validate`` (the range the step holds);
2. ``RowSettings``: its per-row array, named as the field (``row_settings`` fills it);
3. a filter: its function and its ``FILTERS`` entry (a processor of the text: ``process_text``);
4. its CLI flag (a ``SamplingFlags`` field in ``cli/options.py``, read by ``cli/common.py``'s
   ``sampling_fields``) and its request field (``serve/protocol.py``'s ``SENT_FIELDS``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple

import mlx.core as mx

from ..base.errors import ParamError
from .penalties import NodeText, bias_vector, penalize

MAX_SEED = 2**64 - 1
MAX_PENALTY_CONTEXT = 1024  # the window is read per tree node: (B, C, M, M) compares
# The largest magnitude of a float setting (temperature, penalties, a logit bias; and
# 1 / repetition_penalty): far beyond any useful value (OpenAI allows penalties in [-2, 2]
# and biases in [-100, 100]), and small enough that no product of settings, logits and
# counts overflows float32 (3.4e38) in the step.
SETTING_LIMIT = 1e6
# A temperature below this is greedy, in every path. Two float32 logits of magnitude >= 1
# that differ at all differ by >= 2**-23 (1.2e-7); divided by 1e-11 that gap is > 1e4 nats,
# so the runner-up's probability is exp(-1e4) of the top's: 0 in any float format.
GREEDY_TEMPERATURE = 1e-11


@dataclass(frozen=True)
class SamplerConfig:
    """A request's sampling settings: the one type the CLI flags, the Python API and the
    server's requests all become, validated here (``validate``).

    Hashable, a compiled step's key; ``seed`` is not part of the key (``compare=False``): it
    seeds the draws' keys, not the step. ``temperature`` below ``GREEDY_TEMPERATURE`` (0
    included) is greedy. ``repetition_penalty`` (1 = off), ``presence_penalty`` and
    ``frequency_penalty`` (0 = off) read the last ``repetition_context_size`` tokens of
    prompt + output, as mlx-lm's logits processors do; ``logit_bias`` is
    ``((token id, bias), ...)`` added to the logits first. A ``top_k`` of the vocabulary
    size or more keeps every token. ``end_ids``: token ids that end a text (EOS, stop ids),
    never drawn at a text position (prompt and output) below ``min_length`` (transformers'
    ``min_length`` rule; a server's ``min_tokens`` is the prompt length plus it). The draws
    take these settings as per-row arrays (``row_settings``).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_length: int = 0
    end_ids: tuple[int, ...] = ()
    seed: int | None = field(default=None, compare=False)

    @property
    def greedy(self) -> bool:
        """Whether the draw is the argmax (the one rule: ``GREEDY_TEMPERATURE``)."""
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def resolve(
        cls, sent: Mapping, defaults: Mapping | None = None, fallback: Mapping | None = None
    ) -> SamplerConfig:
        """Settings from what a user ``sent`` (a value of None: not sent), else the model's
        ``defaults`` (``model_defaults``), else ``fallback``, else this class's; validated
        (a ParamError names the field)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(sent) - names)
        if unknown:
            raise ValueError(f"unknown sampling settings {unknown}; known: {sorted(names)}")
        values = {**(fallback or {}), **(defaults or {})}
        values.update({k: v for k, v in sent.items() if v is not None})
        values = {k: v for k, v in values.items() if k in names}
        if "logit_bias" in values:
            values["logit_bias"] = tuple((t, b) for t, b in values["logit_bias"])
        if "end_ids" in values:
            values["end_ids"] = tuple(values["end_ids"])
        return cls(**values).validate()

    def with_defaults(self, defaults: Mapping, given: Sequence[str]) -> SamplerConfig:
        """These settings with the fields not in ``given`` taken from ``defaults``."""
        found = {k: v for k, v in defaults.items() if k not in given}
        return replace(self, **found).validate() if found else self

    def to_dict(self) -> dict:
        """JSON-ready settings (``logit_bias`` as ``{"id": bias}``)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["logit_bias"] = {str(t): b for t, b in self.logit_bias}
        return out

    @property
    def bans_ends(self) -> bool:
        """Whether some draw may not end the text (``end_ids`` before ``min_length``)."""
        return self.min_length > 0 and bool(self.end_ids)

    @property
    def reads_text(self) -> bool:
        """Whether a draw depends on the text before it (a penalty is on)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, vocab_size: int | None = None) -> SamplerConfig:
        """Return self, or raise ParamError naming the field and its range. Every value that
        passes fits the step (``row_settings``); ``vocab_size`` also checks the bias ids."""
        _finite(self, "temperature", "top_p", "min_p", "repetition_penalty")
        if not 0 <= self.temperature <= SETTING_LIMIT:
            raise ParamError(
                "temperature",
                f"temperature must be in [0, {SETTING_LIMIT:g}] (0 = greedy, as is any value "
                f"below {GREEDY_TEMPERATURE:g}), got {self.temperature}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            _bounded(name, getattr(self, name))
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ParamError(
                "top_k",
                f"top_k must be an integer >= 0 (0, or the vocabulary size or more, keeps every "
                f"token), got {self.top_k!r}",
            )
        if not 0.0 <= self.min_p < 1.0:
            raise ParamError("min_p", f"min_p must be in [0, 1), got {self.min_p}")
        if not 1 / SETTING_LIMIT <= self.repetition_penalty <= SETTING_LIMIT:
            raise ParamError(
                "repetition_penalty",
                f"repetition_penalty must be in [{1 / SETTING_LIMIT:g}, {SETTING_LIMIT:g}] "
                f"(1 = off), got {self.repetition_penalty}",
            )
        size = self.repetition_context_size
        if (
            isinstance(size, bool)
            or not isinstance(size, int)
            or not 1 <= size <= MAX_PENALTY_CONTEXT
        ):
            raise ParamError(
                "repetition_context_size",
                f"repetition_context_size must be an integer in [1, {MAX_PENALTY_CONTEXT}], "
                f"got {size!r}",
            )
        check_logit_bias(self.logit_bias, vocab_size)
        check_end_ids(self.min_length, self.end_ids, vocab_size)
        check_seed(self.seed)
        return self


def _is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _finite(cfg, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not _is_finite_number(value):
            raise ParamError(name, f"{name} must be a finite number, got {value!r}")


def _bounded(name: str, value, what: str | None = None) -> None:
    """ParamError unless ``value`` is a finite number of magnitude <= ``SETTING_LIMIT``."""
    if not _is_finite_number(value):
        raise ParamError(name, f"{what or name} must be a finite number, got {value!r}")
    if abs(value) > SETTING_LIMIT:
        raise ParamError(
            name,
            f"{what or name} must be a number in [-{SETTING_LIMIT:g}, {SETTING_LIMIT:g}], "
            f"got {value!r}",
        )


def check_logit_bias(bias, vocab_size: int | None = None) -> None:
    """Raise ParamError unless ``bias`` is ``((token id, bias), ...)`` within the vocab, each
    bias of magnitude <= ``SETTING_LIMIT``."""
    for token, value in bias:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ParamError("logit_bias", f"logit_bias keys must be token ids >= 0, got {token!r}")
        if vocab_size is not None and token >= vocab_size:
            raise ParamError(
                "logit_bias",
                f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})",
            )
        _bounded("logit_bias", value, f"logit_bias for token {token}")


def check_end_ids(min_length, end_ids, vocab_size: int | None = None) -> None:
    """Raise ParamError unless ``min_length`` is an integer in [0, 2**31 - 1] and ``end_ids``
    token ids (within the vocabulary when ``vocab_size`` is given)."""
    if (
        isinstance(min_length, bool)
        or not isinstance(min_length, int)
        or not 0 <= min_length < 2**31
    ):
        raise ParamError(
            "min_length", f"min_length must be an integer in [0, 2**31 - 1], got {min_length!r}"
        )
    for token in end_ids:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ParamError("end_ids", f"end_ids must be token ids >= 0, got {token!r}")
        if vocab_size is not None and token >= vocab_size:
            raise ParamError(
                "end_ids", f"end_ids token id {token} is outside the vocabulary [0, {vocab_size})"
            )


def check_seed(seed) -> int | None:
    """``seed`` if it is None or an integer in [0, 2**64 - 1], else ParamError."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ParamError("seed", f"seed must be an integer in [0, 2**64 - 1], got {seed!r}")
    return seed


NEG_INF = -float("inf")


# --------------------------------------------------------------------------- the filters
# Each takes the tempered log-weights x (B, ..., V), float32, and a per-row value
# broadcasting against x[..., :1]; it returns x with the dropped tokens at -inf.
# A row's "off" value leaves it unchanged; none drops a row's most likely token.


def apply_top_k(x: mx.array, top_k: mx.array) -> mx.array:
    """Keep each row's ``top_k`` most likely tokens (ties with the k-th kept): int32, 0 = off."""
    V = x.shape[-1]
    desc = -mx.sort(-x, axis=-1)
    at = mx.clip(top_k - 1, 0, V - 1).astype(mx.int32)
    kth = mx.take_along_axis(desc, mx.broadcast_to(at, (*x.shape[:-1], 1)), axis=-1)
    return mx.where((top_k > 0) & (x < kth), mx.array(NEG_INF, dtype=mx.float32), x)


def apply_top_p(x: mx.array, top_p: mx.array) -> mx.array:
    """Keep the smallest set of most likely tokens holding ``top_p`` of the mass, the most
    likely always (a top_p too small for float32 keeps it alone): float32, 1 = off."""
    probs = mx.softmax(x, axis=-1)
    desc = -mx.sort(-probs, axis=-1)
    before = mx.cumsum(desc, axis=-1) - desc  # mass strictly above each sorted token
    thresh = mx.min(mx.where(before < top_p, desc, 2.0), axis=-1, keepdims=True)
    thresh = mx.minimum(thresh, desc[..., :1])
    kept = mx.where(probs >= thresh, x, mx.array(NEG_INF, dtype=mx.float32))
    return mx.where(top_p < 1.0, kept, x)


def apply_min_p(x: mx.array, min_p: mx.array) -> mx.array:
    """Drop tokens below ``min_p`` times the top probability: float32, 0 = off."""
    probs = mx.softmax(x, axis=-1)
    floor = min_p * mx.max(probs, axis=-1, keepdims=True)
    return mx.where(probs >= floor, x, mx.array(NEG_INF, dtype=mx.float32))


class Filter(NamedTuple):
    """A truncation filter: ``name`` (its ``SamplerConfig`` field and ``RowSettings``
    array), ``on`` (whether a row uses it: its held value, the vocabulary size) and
    ``apply`` (x, per-row values)."""

    name: str
    on: Callable[[object, int], bool]
    apply: Callable[[mx.array, mx.array], mx.array]


# Applied after the temperature, in this order.
FILTERS = (
    Filter("top_k", lambda k, V: 0 < k < V, apply_top_k),
    Filter("top_p", lambda p, V: p < 1.0, apply_top_p),
    Filter("min_p", lambda m, V: m > 0.0, apply_min_p),
)


# --------------------------------------------------------------------------- rows


class StepMode(NamedTuple):
    """Static switches of a batch step's sampling (a compile key): any row samples, the
    ``filters`` some sampling row uses (``FILTERS`` names), any row has a logit bias / a
    penalty, reading ``span`` history tokens; ``split``: the fork and child token ids of a
    batch holding a branching row (``branches.split_logits``), () else; ``ban``: some row
    bans its ``end_ids`` below its ``min_length``; ``logprobs``: the top count of the emitted
    tokens' logprobs some row asks for (``logprobs.logprob_bucket``; 0: none). An all-greedy
    batch pays for an argmax only."""

    sample: bool = False
    filters: tuple[str, ...] = ()
    bias: bool = False
    penalize: bool = False
    span: int = 0
    split: tuple[int, ...] = ()
    ban: bool = False
    logprobs: int = 0


class RowSettings(NamedTuple):
    """B rows' settings as the step holds them (``row_settings``), named as their
    ``SamplerConfig`` fields.

    temperature, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty: (B,)
    float32 (temperature 0 = a greedy row; 1 / 0 = off); top_k (0 = off),
    repetition_context_size: (B,) int32; logit_bias: (B, V) float32 added first, or (B, 1)
    zeros when no row has one; min_length: (B,) int32 (0 = off); end_ids: (B, V) bool, the
    ids a row may not draw below its min_length, or (B, 1) False when no row bans any.
    """

    temperature: mx.array
    top_p: mx.array
    top_k: mx.array
    min_p: mx.array
    repetition_penalty: mx.array
    presence_penalty: mx.array
    frequency_penalty: mx.array
    repetition_context_size: mx.array
    logit_bias: mx.array
    min_length: mx.array
    end_ids: mx.array


class RowSampling(NamedTuple):
    """Rows' sampling: the static ``StepMode`` and the ``RowSettings`` arrays."""

    mode: StepMode
    settings: RowSettings


PENALTY_SPANS = (20, 64, 256, 1024)  # history a batch's penalties read: few compile keys
GREEDY = SamplerConfig()  # a free row's settings
INT_FIELDS = ("top_k", "repetition_context_size", "min_length")  # int32; others float32
VOCAB_FIELDS = ("logit_bias", "end_ids")  # (B, V) when a row uses them, else (B, 1)


def held_values(cfg: SamplerConfig, vocab_size: int) -> dict:
    """``cfg``'s values as the step holds them (the one place they are made to fit): a greedy
    row's temperature 0, a top_k of the vocabulary size or more 0 (off); the others as
    validated (each fits float32 / int32: ``SamplerConfig.validate``)."""
    values = {name: getattr(cfg, name) for name in RowSettings._fields if name not in VOCAB_FIELDS}
    values["temperature"] = 0.0 if cfg.greedy else float(cfg.temperature)
    values["top_k"] = cfg.top_k if cfg.top_k < vocab_size else 0
    values["min_length"] = cfg.min_length if cfg.bans_ends else 0
    return values


def one_row(cfg: SamplerConfig | None, vocab_size: int) -> RowSampling:
    """One row's sampling, checked (``validate`` against the vocabulary): build it when the
    row is admitted, so that a bad value fails that row alone. None: a free row (greedy)."""
    cfg = GREEDY if cfg is None else cfg.validate(vocab_size)
    held = held_values(cfg, vocab_size)
    sampling = not cfg.greedy
    filters = tuple(f.name for f in FILTERS if sampling and f.on(held[f.name], vocab_size))
    span = 0
    if cfg.reads_text:
        span = next(s for s in PENALTY_SPANS if s >= cfg.repetition_context_size)
    mode = StepMode(
        sampling, filters, bool(cfg.logit_bias), cfg.reads_text, span, (), cfg.bans_ends
    )
    columns = {
        name: mx.array([value], mx.int32 if name in INT_FIELDS else mx.float32)
        for name, value in held.items()
    }
    if cfg.logit_bias:
        columns["logit_bias"] = bias_vector(cfg.logit_bias, vocab_size)[None]
    else:
        columns["logit_bias"] = mx.zeros((1, 1), mx.float32)
    columns["end_ids"] = mx.zeros((1, 1), mx.bool_)
    if cfg.bans_ends:
        columns["end_ids"] = (mx.arange(vocab_size) == mx.array(cfg.end_ids)[:, None]).any(0)[None]
    return RowSampling(mode, RowSettings(**columns))


def stack_rows(rows: Sequence[RowSampling | None], vocab_size: int) -> RowSampling:
    """A batch's sampling from its rows' (``one_row``; None: a free row, greedy)."""
    rows = [r if r is not None else one_row(None, vocab_size) for r in rows]
    modes = [r.mode for r in rows]
    used = {name for m in modes for name in m.filters}
    mode = StepMode(
        any(m.sample for m in modes),
        tuple(f.name for f in FILTERS if f.name in used),
        any(m.bias for m in modes),
        any(m.penalize for m in modes),
        max(m.span for m in modes),
        ban=any(m.ban for m in modes),
    )
    columns = {}
    for name in RowSettings._fields:
        parts = [getattr(r.settings, name) for r in rows]
        if name in VOCAB_FIELDS:
            width = vocab_size if (mode.bias if name == "logit_bias" else mode.ban) else 1
            parts = [mx.broadcast_to(p, (1, width)) if p.shape[1] != width else p for p in parts]
        columns[name] = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    return RowSampling(mode, RowSettings(**columns))


def row_settings(configs: Sequence[SamplerConfig | None], vocab_size: int) -> RowSampling:
    """One batch's sampling from its rows' ``SamplerConfig``s (None: a free row, greedy)."""
    return stack_rows([one_row(c, vocab_size) for c in configs], vocab_size)


def row_keys_of(key: mx.array, rows: int) -> mx.array:
    """(rows, 2) keys from one key (2,): ``key`` itself for one row, else ``rows`` keys split
    from it."""
    return key[None] if rows == 1 else mx.random.split(key, rows)


class RowSampler(NamedTuple):
    """A batch whose rows draw with their own settings (``RowSettings``) and PRNG keys
    (``keys`` (B, 2), one per row for this draw; unused when no row samples); ``mode`` is
    static. A row's draw equals the same row's draw alone, with its settings and key.
    ``split``: the rows' branching arrays (``branches.SplitRows``) when ``mode.split``."""

    settings: RowSettings
    keys: mx.array | None
    mode: StepMode
    split: tuple | None = None

    @classmethod
    def of(cls, sampling: RowSampling, keys: mx.array | None) -> RowSampler:
        return cls(sampling.settings, keys, sampling.mode)

    @classmethod
    def from_config(
        cls, cfg: SamplerConfig, vocab_size: int, key: mx.array | None, batch: int = 1
    ) -> RowSampler:
        """``batch`` rows all drawing with ``cfg``, with keys from ``key`` (``row_keys_of``; None
        only when greedy): a solo run as a batch."""
        rows = row_settings([cfg] * batch, vocab_size)
        if rows.mode.sample and key is None:
            raise ValueError("sampling needs a PRNG key (temperature > 0)")
        return cls.of(rows, None if key is None else row_keys_of(key, batch))

    @property
    def reads_text(self) -> bool:
        return self.mode.penalize

    def penalty_window(self):
        """(history tokens read: static, window size per row (B,))."""
        return self.mode.span, self.settings.repetition_context_size


def process_text(
    logits: mx.array, sampler: RowSampler, text: NodeText | None, positions=None
) -> mx.array:
    """Each row's logit bias and penalties, then its banned ends: (B, C, V) -> (B, C, V), raw
    logits. ``text`` is each node's window (``penalties.node_text``), needed when
    ``sampler.reads_text``; ``positions`` (B, C) int32: the text position of the token each
    node draws, needed when ``sampler.mode.ban`` (``ban_ends``)."""
    mode, s = sampler.mode, sampler.settings
    if mode.bias:
        logits = logits.astype(mx.float32) + s.logit_bias[:, None, :]
    if mode.penalize:
        penalties = (s.repetition_penalty, s.presence_penalty, s.frequency_penalty)
        penalized = penalize(logits.astype(mx.float32), text, *penalties)
        logits = unpenalized_splits(logits, penalized, sampler)
    if mode.ban:
        if positions is None:
            raise ValueError("banning end ids (min_length) needs each draw's text position")
        logits = ban_ends(logits, s.end_ids, s.min_length, positions)
    return logits


def ban_ends(logits: mx.array, end_ids: mx.array, min_length: mx.array, positions) -> mx.array:
    """Each row's ``end_ids`` (B, V) bool at -inf where the token drawn lands below its
    ``min_length`` (B,) int32: logits (B, C, V), positions (B, C). A row with none banned, or
    past its min_length, is unchanged: the same rule at every node, whatever the step."""
    early = positions < min_length[:, None]  # (B, C)
    banned = early[..., None] & end_ids[:, None, :]
    return mx.where(banned, mx.array(NEG_INF, dtype=logits.dtype), logits)


def unpenalized_splits(logits: mx.array, penalized: mx.array, sampler: RowSampler) -> mx.array:
    """``penalized`` with a branching row's split tokens at their logits before the
    penalties (bias kept): they are structure, not text (the rebuilt answer holds none), and
    a token's penalty depends only on its own count, so this is as if no penalty counted
    them. A list's forks, a few tokens apart, would otherwise penalize the next fork away."""
    if not sampler.mode.split or sampler.split is None:
        return penalized
    vocab = mx.arange(logits.shape[-1])
    split = (vocab == sampler.mode.split[0]) | (vocab == sampler.mode.split[1])
    on = sampler.split.on.reshape((-1,) + (1,) * (logits.ndim - 1))
    return mx.where(on & split, logits.astype(penalized.dtype), penalized)


def target_log_weights(logits: mx.array, sampler: RowSampler) -> mx.array:
    """Each sampling row's target distribution as log-weights: (B, ..., V) -> (B, ..., V)
    float32, -inf = excluded; ``softmax`` of it is what ``draw`` samples (a greedy row's is
    unused: it draws the argmax).

    Temperature, then ``FILTERS`` in order, each only where the batch's mode says a row
    uses it. No float32 overflow: the settings' bounds keep |logits| below ~1e12 and the
    temperature at or above ``GREEDY_TEMPERATURE`` (1e-11).
    """
    mode, s = sampler.mode, sampler.settings
    per_row = (-1,) + (1,) * (logits.ndim - 1)  # broadcast (B,) over (B, ..., V)
    temperature = s.temperature.reshape(per_row)
    x = logits.astype(mx.float32) / mx.where(temperature > 0, temperature, 1.0)
    for f in FILTERS:
        if f.name in mode.filters:
            x = f.apply(x, getattr(s, f.name).reshape(per_row))
    return x


def draw(logits: mx.array, sampler: RowSampler) -> mx.array:
    """One draw per position with each row's own settings and key: (B, ..., V) ->
    (B, ...) int32. A greedy row's draw is the argmax; a sampling row's, Gumbel-max on
    ``target_log_weights`` with its own key."""
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    if not sampler.mode.sample:
        return greedy
    x = target_log_weights(logits, sampler)
    noise = mx.vmap(lambda key: mx.random.gumbel(x.shape[1:], key=key))(sampler.keys)
    sampled = mx.argmax(x + noise, axis=-1).astype(mx.int32)
    sampling = sampler.settings.temperature.reshape((-1,) + (1,) * (greedy.ndim - 1)) > 0
    return mx.where(sampling, sampled, greedy)


def process_logits(logits: mx.array, cfg: SamplerConfig) -> mx.array:
    """The log-weights ``cfg``'s draws sample from: (..., V) -> (..., V) float32 (every row
    with ``cfg``: ``target_log_weights``; greedy: 0 at the argmax, -inf elsewhere), for
    checking the draws against."""
    if cfg.greedy:
        best = mx.argmax(logits, axis=-1, keepdims=True)
        return mx.where(mx.arange(logits.shape[-1]) == best, 0.0, NEG_INF)
    sampler = RowSampler.from_config(cfg, logits.shape[-1], mx.random.key(0))
    return target_log_weights(logits[None], sampler)[0]


GENERATION_CONFIG = "generation_config.json"
# generation_config.json keys that set a SamplerConfig field (Hugging Face's names): the
# settings a model's file fills where no flag or request gave them (the CLI reads this list).
MODEL_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_defaults(folder) -> dict:
    """The sampling values a model's ``generation_config.json`` recommends, as SamplerConfig
    fields: ``{}`` when there is none, ``do_sample: false`` means greedy (temperature 0, as
    in transformers), and a value out of range is left out (the engine's default holds)."""
    import json
    from pathlib import Path

    file = Path(folder) / GENERATION_CONFIG
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    found = {}
    for key in MODEL_DEFAULT_KEYS:
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            found[key] = int(value) if key == "top_k" else float(value)
    if config.get("do_sample") is False:
        found = {k: v for k, v in found.items() if k == "repetition_penalty"}
        found["temperature"] = 0.0
    good = {}
    for key, value in found.items():
        try:
            SamplerConfig(**{key: value}).validate()
        except ParamError:
            continue
        good[key] = value
    return good
