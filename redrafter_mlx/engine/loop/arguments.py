"""The Python API's arguments, normalised once at its entry (``stream_generate``,
``batch_generate``; ``generate`` passes its keywords to ``stream_generate``).

What is unambiguous is accepted: a shape label (``"W1xL4"``, :meth:`BeamShape.parse`) or a
dict of :class:`BeamShape` fields, a dict of :class:`SamplerConfig` fields, ``logit_bias`` as a
``{token id: bias}`` mapping (ids as ints or digit strings, as ``SamplerConfig.to_dict``
writes them), integer-like numbers (NumPy's) and token ids in any sequence or array. Anything
else is a ``TypeError`` (or, for a bad value, a ``ValueError``) naming the argument and what it
takes, instead of an error from deep inside the engine.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace

from ..core.sampling import SamplerConfig
from ..core.shape import BeamShape
from ..decoding.cache import Session

Prompt = str | list[int]


def api_arguments(
    tokenizer, prompts, max_tokens, shape, sampler, seed, session, *, batch: bool = False
) -> tuple[Prompt | list[Prompt], int, BeamShape | None, SamplerConfig, int | None, Session | None]:
    """(prompt(s), max_tokens, shape, sampler, seed, session), each in the one form the engine
    takes. ``batch``: ``prompts`` is a list of prompts (``batch_generate``), else one prompt.
    A prompt stays a string (encoded by the caller) or becomes a list of token ids.
    """
    if batch:
        if isinstance(prompts, str | bytes | bytearray) or not _is_sequence(prompts):
            raise TypeError(
                f"prompts must be a list of prompts (strings or token id lists), got "
                f"{type(prompts).__name__}; for one prompt call generate or stream_generate"
            )
        prompts = [_prompt(p, tokenizer, f"prompts[{i}]") for i, p in enumerate(prompts)]
    else:
        prompts = _prompt(prompts, tokenizer, "prompt")
    # Types here; the ranges are checked where the engine uses them (decode).
    max_tokens = _integer(max_tokens, "max_tokens", "a positive integer (256 if left out)")
    if seed is not None:
        seed = _integer(seed, "seed", "an integer in [0, 2**64 - 1] or None")
    if session is not None and not isinstance(session, Session):
        raise TypeError(
            f"session must be a redrafter_mlx.Session or None, got {type(session).__name__}"
        )
    return prompts, max_tokens, _shape(shape), _sampler(sampler), seed, session


def _is_sequence(value) -> bool:
    return isinstance(value, Sequence) or hasattr(value, "tolist")


def _integer(value, name: str, takes: str) -> int:
    """``value`` as an int: an int or an integer-like number (NumPy's), never a bool, float
    or string."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be {takes}, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be {takes}, got {type(value).__name__} {value!r}") from None


def _prompt(value, tokenizer, name: str) -> Prompt:
    """A string, or token ids from any sequence or array of integers."""
    if isinstance(value, str):
        if tokenizer is None:
            raise TypeError(
                f"{name} is a string but tokenizer is None; pass the tokenizer, or token ids"
            )
        return value
    if isinstance(value, bytes | bytearray):
        raise TypeError(
            f"{name} is {type(value).__name__}, which is neither text nor token ids; pass a str "
            f"({name}.decode('utf-8')) or a list of token ids"
        )
    if hasattr(value, "tolist"):  # NumPy or MLX array, once, before any decoding
        value = value.tolist()
    if not isinstance(value, Sequence) or isinstance(value, Mapping):
        raise TypeError(
            f"{name} must be a string or a list of token ids, got {type(value).__name__}"
        )
    ids = []
    for t in value:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise TypeError(
                f"{name} must be a string or a list of integer token ids; it holds "
                f"{type(t).__name__} {t!r}"
            )
        ids.append(operator.index(t))
    return ids


def _shape(value) -> BeamShape | None:
    if value is None or isinstance(value, BeamShape):
        return value
    if isinstance(value, str):
        return BeamShape.parse(value)
    if isinstance(value, Mapping):
        return BeamShape(**_fields(BeamShape, value, "shape"))
    raise TypeError(
        f"shape must be a BeamShape, a label such as 'W1xL4' or 'AR', a dict of BeamShape "
        f"fields, or None, got {type(value).__name__}"
    )


def _sampler(value) -> SamplerConfig:
    if isinstance(value, Mapping):
        value = SamplerConfig(**_fields(SamplerConfig, value, "sampler"))
    elif not isinstance(value, SamplerConfig):
        raise TypeError(
            f"sampler must be a SamplerConfig or a dict of its fields (temperature, top_p, ...), "
            f"got {type(value).__name__}"
        )
    return replace(value, logit_bias=_logit_bias(value.logit_bias))


def _fields(cls, values: Mapping, name: str) -> dict:
    known = {f.name for f in fields(cls)}
    unknown = sorted(str(k) for k in values if k not in known)
    if unknown:
        raise TypeError(
            f"{name} has unknown fields {unknown}; {cls.__name__} takes {sorted(known)}"
        )
    return dict(values)


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """``((token id, bias), ...)`` from that form or a ``{token id: bias}`` mapping."""
    if isinstance(value, Mapping):
        pairs = []
        for token, bias in value.items():
            pairs.append((_token(token), bias))
        return tuple(pairs)
    if isinstance(value, str) or not _is_sequence(value):
        raise TypeError(
            f"logit_bias must be a {{token id: bias}} dict or (token id, bias) pairs, got "
            f"{type(value).__name__}"
        )
    pairs = tuple(value)
    if not all(isinstance(p, Sequence) and not isinstance(p, str) and len(p) == 2 for p in pairs):
        raise TypeError("logit_bias must be a {token id: bias} dict or (token id, bias) pairs")
    return tuple((_token(t), b) for t, b in pairs)


def _token(token):
    """A logit_bias key as an int where it is one (NumPy's, or digits as JSON keys are);
    anything else is left for ``check_logit_bias`` to refuse by name."""
    if isinstance(token, str) and token.isdigit():
        return int(token)
    if not isinstance(token, bool) and hasattr(token, "__index__"):
        return operator.index(token)
    return token
