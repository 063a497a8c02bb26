"""Target-token draws: greedy and temperature / top-k / top-p / min-p sampling, after the
text-reading processors (logit bias; repetition, presence and frequency penalties).

ReDrafter and the autoregressive baseline draw through the same function, so their token
distributions are the same by construction. One draw per tree node (Gumbel-max on the
processed logits) is what makes speculative sampling exact (docs/design.md, "Exact acceptance");
the penalties read each node's own text (``penalties.py``), so they stay exact too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx

from .errors import ParamError
from .penalties import NodeText, bias_vector, penalize

MAX_SEED = 2**64 - 1
MAX_PENALTY_CONTEXT = 1024  # the window is read per tree node: (B, C, M, M) compares


@dataclass(frozen=True)
class SamplerConfig:
    """How the target's next token is drawn (hashable: a compiled step's key).

    ``repetition_penalty`` (1 = off), ``presence_penalty`` and ``frequency_penalty`` (0 = off)
    read the last ``repetition_context_size`` tokens of prompt + output, as mlx-lm's logits
    processors do; ``logit_bias`` is ``((token id, bias), ...)`` added to the logits first.
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

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

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
        if self.top_k < 0:
            raise ParamError("top_k", f"top_k must be >= 0 (0 disables it), got {self.top_k}")
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
        pen = cfg.penalties
        if pen is None:
            return logits
        bias = pen.bias[:, None, :] if pen.biased else None
        penalties = (pen.repetition, pen.presence, pen.frequency)
    else:
        bias = bias_vector(cfg.logit_bias, logits.shape[-1]) if cfg.logit_bias else None
        penalties = (cfg.repetition_penalty, cfg.presence_penalty, cfg.frequency_penalty)
    if bias is not None:
        logits = logits.astype(mx.float32) + bias
    if cfg.reads_text:
        logits = penalize(logits.astype(mx.float32), text, *penalties)
    return logits


def process_logits(logits: mx.array, cfg: SamplerConfig) -> mx.array:
    """Log-weights of the target distribution: (..., V) float32 -> (..., V), -inf = excluded.

    Order: temperature, top-k, top-p, min-p. ``softmax`` of the result is the exact
    distribution that ``draw`` samples from.
    """
    x = logits.astype(mx.float32) / cfg.temperature
    neg_inf = mx.array(-float("inf"), dtype=mx.float32)
    V = x.shape[-1]
    if 0 < cfg.top_k < V:
        kth = mx.min(mx.topk(x, cfg.top_k, axis=-1), axis=-1, keepdims=True)
        x = mx.where(x >= kth, x, neg_inf)
    if cfg.top_p < 1.0:
        x = nucleus_filter(x, cfg.top_p)
    if cfg.min_p > 0.0:
        probs = mx.softmax(x, axis=-1)
        floor = cfg.min_p * mx.max(probs, axis=-1, keepdims=True)
        x = mx.where(probs >= floor, x, neg_inf)
    return x


def nucleus_filter(x: mx.array, top_p) -> mx.array:
    """Keep the smallest set of tokens holding ``top_p`` of the mass: (..., V) -> (..., V).

    ``top_p`` is a float or an array broadcasting against ``x[..., :1]`` (one value per row).
    """
    neg_inf = mx.array(-float("inf"), dtype=mx.float32)
    probs = mx.softmax(x, axis=-1)
    desc = -mx.sort(-probs, axis=-1)
    before = mx.cumsum(desc, axis=-1) - desc  # mass strictly above each sorted token
    thresh = mx.min(mx.where(before < top_p, desc, 2.0), axis=-1, keepdims=True)
    return mx.where(probs >= thresh, x, neg_inf)


class RowSampler(NamedTuple):
    """Per-row sampling settings for a batch whose rows differ (the server's batch).

    temperature, top_p: (B,) float32, temperature 0 = greedy row; keys: (B, 2) one PRNG key
    per row for this draw. ``sample`` / ``nucleus`` are static switches (any row samples /
    any sampling row has top_p < 1) so an all-greedy batch pays for an argmax only.
    A row's draw equals ``draw`` with that row's ``SamplerConfig`` and key, alone.
    """

    temperature: mx.array
    top_p: mx.array
    keys: mx.array
    sample: bool
    nucleus: bool
    penalties: RowPenalties | None = None

    @property
    def reads_text(self) -> bool:
        return self.penalties is not None and self.penalties.reads_text

    def penalty_window(self):
        """(history tokens read: static, window size per row (B,))."""
        return self.penalties.span, self.penalties.context


class RowPenalties(NamedTuple):
    """Per-row logit bias and penalties (``SamplerConfig``'s, one row each).

    repetition, presence, frequency: (B,) float32 (1 / 0 / 0 = off); context: (B,) int32
    window sizes; bias: (B, V) float32 added first. ``span`` (static) is at least every
    row's window; ``reads_text`` / ``biased`` (static) say whether any row uses them.
    """

    repetition: mx.array
    presence: mx.array
    frequency: mx.array
    context: mx.array
    bias: mx.array
    span: int
    reads_text: bool
    biased: bool


def draw_rows(logits: mx.array, rows: RowSampler) -> mx.array:
    """One draw per position with each row's own settings: (B, ..., V) -> (B, ...) int32."""
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    if not rows.sample:
        return greedy
    per_row = (-1,) + (1,) * (logits.ndim - 1)  # broadcast (B,) over (B, ..., V)
    temperature = rows.temperature.reshape(per_row)
    x = logits.astype(mx.float32) / mx.where(temperature > 0, temperature, 1.0)
    if rows.nucleus:
        top_p = rows.top_p.reshape(per_row)
        x = mx.where(top_p < 1.0, nucleus_filter(x, top_p), x)
    noise = mx.vmap(lambda key: mx.random.gumbel(x.shape[1:], key=key))(rows.keys)
    sampled = mx.argmax(x + noise, axis=-1).astype(mx.int32)
    return mx.where(rows.temperature.reshape(per_row[:-1]) > 0, sampled, greedy)


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
