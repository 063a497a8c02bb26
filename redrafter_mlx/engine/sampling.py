"""Target-token draws: greedy and temperature / top-k / top-p / min-p sampling, after the
text-reading processors (logit bias; repetition, presence and frequency penalties).

ReDrafter and the autoregressive baseline draw through the same function, so their token
distributions are the same by construction. One draw per tree node (Gumbel-max on the
processed logits) is what makes speculative sampling exact (docs/design/exact-acceptance.md,
"One draw per node");
the penalties read each node's own text (``penalties.py``), so they stay exact too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple

import mlx.core as mx

from .errors import ParamError
from .penalties import NodeText, bias_vector, penalize

MAX_SEED = 2**64 - 1
MAX_PENALTY_CONTEXT = 1024  # the window is read per tree node: (B, C, M, M) compares


@dataclass(frozen=True)
class SamplerConfig:
    """A request's sampling settings: the one type the CLI flags, the Python API and the
    server's requests all become, validated here (``validate``).

    Hashable, a compiled step's key; ``seed`` is not part of the key (``compare=False``): it
    seeds the draws' keys, not the step. ``repetition_penalty`` (1 = off),
    ``presence_penalty`` and ``frequency_penalty`` (0 = off) read the last
    ``repetition_context_size`` tokens of prompt + output, as mlx-lm's logits processors do;
    ``logit_bias`` is ``((token id, bias), ...)`` added to the logits first. A batch whose
    rows differ draws with the per-row form of these settings (``row_settings``).
    Adding a setting: a field here, its check in ``validate``, its use in ``process_logits``
    and ``draw_rows`` (and a ``RowSettings`` array), and its flag and request field
    (``cli/common.py``'s option, ``serve/protocol.py``'s ``SENT_FIELDS``).
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
    seed: int | None = field(default=None, compare=False)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

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
    def reads_text(self) -> bool:
        """Whether a draw depends on the text before it (a penalty is on)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def penalty_window(self) -> tuple[int, int]:
        """(history tokens read, window size): both ``repetition_context_size``."""
        return self.repetition_context_size, self.repetition_context_size

    def validate(self, vocab_size: int | None = None) -> SamplerConfig:
        """Return self, or raise ParamError naming the field and its range."""
        _finite(self, "temperature", "top_p", "min_p", "repetition_penalty")
        _finite(self, "presence_penalty", "frequency_penalty")
        if self.temperature < 0:
            raise ParamError(
                "temperature", f"temperature must be >= 0 (0 = greedy), got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ParamError(
                "top_k", f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}"
            )
        if not 0.0 <= self.min_p < 1.0:
            raise ParamError("min_p", f"min_p must be in [0, 1), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ParamError(
                "repetition_penalty",
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}",
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
        check_seed(self.seed)
        return self


def _is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _finite(cfg, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not _is_finite_number(value):
            raise ParamError(name, f"{name} must be a finite number, got {value!r}")


def check_logit_bias(bias, vocab_size: int | None = None) -> None:
    """Raise ParamError unless ``bias`` is ``((token id, finite bias), ...)`` within the vocab."""
    for token, value in bias:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ParamError("logit_bias", f"logit_bias keys must be token ids >= 0, got {token!r}")
        if vocab_size is not None and token >= vocab_size:
            raise ParamError(
                "logit_bias",
                f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})",
            )
        if not _is_finite_number(value):
            raise ParamError(
                "logit_bias", f"logit_bias for token {token} must be a finite number, got {value!r}"
            )


def check_seed(seed) -> int | None:
    """``seed`` if it is None or an integer in [0, 2**64 - 1], else ParamError."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ParamError("seed", f"seed must be an integer in [0, 2**64 - 1], got {seed!r}")
    return seed


def process_text(logits: mx.array, cfg, text: NodeText | None) -> mx.array:
    """The logit bias and the penalties of ``cfg`` (a SamplerConfig, or a RowSampler with
    each row's own): (B, C, V) -> (B, C, V), raw logits. ``text`` is each node's window
    (``penalties.node_text``), needed when ``cfg.reads_text``."""
    if isinstance(cfg, RowSampler):
        rows, mode = cfg.settings, cfg.mode
        bias = rows.bias[:, None, :] if mode.bias else None
        penalties = (rows.repetition, rows.presence, rows.frequency)
    else:
        bias = bias_vector(cfg.logit_bias, logits.shape[-1]) if cfg.logit_bias else None
        penalties = (cfg.repetition_penalty, cfg.presence_penalty, cfg.frequency_penalty)
    if bias is not None:
        logits = logits.astype(mx.float32) + bias
    if cfg.reads_text:
        logits = penalize(logits.astype(mx.float32), text, *penalties)
    return logits


NEG_INF = -float("inf")


def process_logits(logits: mx.array, cfg: SamplerConfig) -> mx.array:
    """Log-weights of the target distribution: (..., V) float32 -> (..., V), -inf = excluded.

    Order: temperature, top-k, top-p, min-p. ``softmax`` of the result is the exact
    distribution that ``draw`` samples from.
    """
    x = logits.astype(mx.float32) / cfg.temperature
    if 0 < cfg.top_k < x.shape[-1]:
        kth = mx.min(mx.topk(x, cfg.top_k, axis=-1), axis=-1, keepdims=True)
        x = mx.where(x >= kth, x, mx.array(NEG_INF, dtype=mx.float32))
    if cfg.top_p < 1.0:
        x = nucleus_filter(x, cfg.top_p)
    if cfg.min_p > 0.0:
        x = min_p_filter(x, cfg.min_p)
    return x


def nucleus_filter(x: mx.array, top_p) -> mx.array:
    """Keep the smallest set of tokens holding ``top_p`` of the mass: (..., V) -> (..., V).

    ``top_p`` is a float or an array broadcasting against ``x[..., :1]`` (one value per row).
    """
    neg_inf = mx.array(NEG_INF, dtype=mx.float32)
    probs = mx.softmax(x, axis=-1)
    desc = -mx.sort(-probs, axis=-1)
    before = mx.cumsum(desc, axis=-1) - desc  # mass strictly above each sorted token
    thresh = mx.min(mx.where(before < top_p, desc, 2.0), axis=-1, keepdims=True)
    return mx.where(probs >= thresh, x, neg_inf)


def min_p_filter(x: mx.array, min_p) -> mx.array:
    """Drop tokens below ``min_p`` times the top probability: (..., V) -> (..., V).

    ``min_p`` is a float or an array broadcasting against ``x[..., :1]`` (0 keeps all).
    """
    probs = mx.softmax(x, axis=-1)
    floor = min_p * mx.max(probs, axis=-1, keepdims=True)
    return mx.where(probs >= floor, x, mx.array(NEG_INF, dtype=mx.float32))


def top_k_rows(x: mx.array, top_k: mx.array) -> mx.array:
    """Keep each row's ``top_k`` most likely tokens: (B, ..., V) -> (B, ..., V).

    ``top_k``: an int32 array broadcasting against ``x[..., :1]``, 0 (or >= V) keeps all. The
    k-th largest value is the one ``process_logits`` takes (``topk``'s minimum), so ties
    are kept alike.
    """
    V = x.shape[-1]
    desc = -mx.sort(-x, axis=-1)
    at = mx.clip(top_k - 1, 0, V - 1).astype(mx.int32)
    kth = mx.take_along_axis(desc, mx.broadcast_to(at, (*x.shape[:-1], 1)), axis=-1)
    on = (top_k > 0) & (top_k < V)
    return mx.where(on & (x < kth), mx.array(NEG_INF, dtype=mx.float32), x)


class StepMode(NamedTuple):
    """Static switches of a batch step's sampling (a compile key): any row samples / uses
    top-p / top-k / min-p / has a logit bias / a penalty, reading ``span`` history tokens.
    An all-greedy batch pays for an argmax only."""

    sample: bool = False
    nucleus: bool = False
    top_k: bool = False
    min_p: bool = False
    bias: bool = False
    penalize: bool = False
    span: int = 0


class RowSettings(NamedTuple):
    """The per-row tensor form of B rows' ``SamplerConfig``s (``row_settings``).

    temperature, top_p, min_p, repetition, presence, frequency: (B,) float32 (temperature 0 =
    greedy row; 1 / 0 = off); top_k, context: (B,) int32; bias: (B, V) float32 added first,
    or (B, 1) zeros when no row has one.
    """

    temperature: mx.array
    top_p: mx.array
    top_k: mx.array
    min_p: mx.array
    repetition: mx.array
    presence: mx.array
    frequency: mx.array
    context: mx.array
    bias: mx.array


PENALTY_SPANS = (20, 64, 256, 1024)  # history a batch's penalties read: few compile keys
GREEDY = SamplerConfig()  # a free row's settings


def row_settings(
    configs: Sequence[SamplerConfig | None], vocab_size: int
) -> tuple[StepMode, RowSettings]:
    """One batch's per-row settings from its rows' ``SamplerConfig``s (None: a free row,
    greedy): the static ``StepMode`` and the ``RowSettings`` arrays."""
    rows = [c if c is not None else GREEDY for c in configs]
    used = [c for c in configs if c is not None]
    sampling = [c for c in used if not c.greedy]
    reading = [c.repetition_context_size for c in used if c.reads_text]
    span = next((s for s in PENALTY_SPANS if s >= max(reading)), 0) if reading else 0
    mode = StepMode(
        bool(sampling),
        any(c.top_p < 1.0 for c in sampling),
        any(0 < c.top_k < vocab_size for c in sampling),
        any(c.min_p > 0.0 for c in sampling),
        any(c.logit_bias for c in used),
        bool(reading),
        span,
    )

    def per_row(name, dtype=mx.float32):
        return mx.array([getattr(c, name) for c in rows], dtype)

    if mode.bias:
        bias = mx.stack([bias_vector(c.logit_bias, vocab_size) for c in rows])
    else:
        bias = mx.zeros((len(rows), 1), mx.float32)
    settings = RowSettings(
        per_row("temperature"),
        per_row("top_p"),
        per_row("top_k", mx.int32),
        per_row("min_p"),
        per_row("repetition_penalty"),
        per_row("presence_penalty"),
        per_row("frequency_penalty"),
        per_row("repetition_context_size", mx.int32),
        bias,
    )
    return mode, settings


class RowSampler(NamedTuple):
    """A batch whose rows draw with their own settings (``RowSettings``) and PRNG keys
    (``keys`` (B, 2), one per row for this draw); ``mode`` is static. A row's draw equals
    ``draw`` with that row's ``SamplerConfig`` and key, alone."""

    settings: RowSettings
    keys: mx.array
    mode: StepMode

    @property
    def reads_text(self) -> bool:
        return self.mode.penalize

    def penalty_window(self):
        """(history tokens read: static, window size per row (B,))."""
        return self.mode.span, self.settings.context


def draw_rows(logits: mx.array, rows: RowSampler) -> mx.array:
    """One draw per position with each row's own settings: (B, ..., V) -> (B, ..., ) int32.

    Order as ``process_logits``: temperature, top-k, top-p, min-p, each only where the
    batch's ``mode`` says a row uses it; a row with it off is left as is.
    """
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    mode, s = rows.mode, rows.settings
    if not mode.sample:
        return greedy
    per_row = (-1,) + (1,) * (logits.ndim - 1)  # broadcast (B,) over (B, ..., V)
    temperature = s.temperature.reshape(per_row)
    x = logits.astype(mx.float32) / mx.where(temperature > 0, temperature, 1.0)
    if mode.top_k:
        x = top_k_rows(x, s.top_k.reshape(per_row))
    if mode.nucleus:
        top_p = s.top_p.reshape(per_row)
        x = mx.where(top_p < 1.0, nucleus_filter(x, top_p), x)
    if mode.min_p:
        min_p = s.min_p.reshape(per_row)
        x = mx.where(min_p > 0.0, min_p_filter(x, min_p), x)
    noise = mx.vmap(lambda key: mx.random.gumbel(x.shape[1:], key=key))(rows.keys)
    sampled = mx.argmax(x + noise, axis=-1).astype(mx.int32)
    return mx.where(s.temperature.reshape(per_row[:-1]) > 0, sampled, greedy)


def draw(logits: mx.array, cfg: SamplerConfig, key: mx.array | None) -> mx.array:
    """One independent target draw per row: (..., V) -> (...) int32.

    With a ``RowSampler`` each row draws with its own settings and key (``key`` unused).
    """
    if isinstance(cfg, RowSampler):
        return draw_rows(logits, cfg)
    if cfg.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    x = process_logits(logits, cfg)
    noise = mx.random.gumbel(x.shape, key=key)
    return mx.argmax(x + noise, axis=-1).astype(mx.int32)


GENERATION_CONFIG = "generation_config.json"
# generation_config.json keys that set a SamplerConfig field (Hugging Face's names).
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
