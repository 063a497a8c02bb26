"""Beam shapes and the (W, L[, C]) grid the tuner searches, with context-lookup variants.

The shape itself is the engine's :class:`~redrafter_mlx.engine.core.shape.BeamShape` (``W`` beams
of ``L`` tokens counting the init token, optional capacity ``C``, ``K`` lookup chains of
``Lk`` tokens); ``BeamShape.autoregressive()`` stands for plain decoding throughout the tuner.
With lookup, :func:`with_lookup` adds to every drafter shape ``W×L`` its variants
``W×L+K×Lk`` and the lookup-only shapes ``K×Lk`` (which need no drafter).
"""

from __future__ import annotations

import re
from dataclasses import replace

from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.loop.plan import (  # noqa: F401 (the drafter's reach: the engine's)
    max_length_for,
    read_predict_tokens,
)


def parse_int_set(text: str, option: str) -> list[int]:
    """Parse ``"1-4"``, ``"2,4,8"`` or ``"1-3,6"`` into a sorted list of distinct positive ints.

    ``option`` names the command-line option in the error message.
    """
    values: set[int] = set()
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not match:
            raise ValueError(
                f"{option}: cannot read {part!r}; use a range like 1-4 or a list like 1,2,4"
            )
        lo = int(match.group(1))
        hi = int(match.group(2) or lo)
        if lo < 1 or hi < lo:
            raise ValueError(f"{option}: {part!r} must be positive and ascending, e.g. 1-4")
        values.update(range(lo, hi + 1))
    if not values:
        raise ValueError(f"{option}: no values given; use a range like 1-4")
    return sorted(values)


def parse_capacities(text: str | None) -> list[int | None]:
    """``None``/``""``/``"none"`` -> ``[None]`` (no cap); ``"8,12"`` -> ``[None, 8, 12]``.

    The uncapped variant is always searched, so a cap only wins when it helps.
    """
    if text is None or str(text).strip().lower() in ("", "none", "off"):
        return [None]
    return [None, *parse_int_set(text, "--capacities")]


def build_grid(
    widths: list[int], lengths: list[int], capacities: list[int | None]
) -> list[BeamShape]:
    """Every speculative shape of the grid, skipping capacities that cannot matter.

    A capacity ``C`` is kept only when ``L <= C < max_packed``: below ``L`` the best beam
    would not fit, at or above ``max_packed`` the cap never binds (same as no cap).
    Lengths of 1 (no drafting) are left out; autoregressive decoding is measured anyway.
    """
    shapes: list[BeamShape] = []
    for length in lengths:
        if length < 2:
            continue
        for width in widths:
            base = BeamShape(width, length, None)
            for capacity in capacities:
                if capacity is None:
                    shapes.append(base)
                elif length <= capacity < base.max_packed:
                    shapes.append(BeamShape(width, length, capacity))
    return shapes


def parse_lookup(text: str | None, default: str) -> list[int]:
    """``--lookup``: chain counts to try (``"1"``, ``"1-2"``); ``"0"``/``"off"`` -> ``[]``.

    ``None`` reads ``default``."""
    text = default if text is None else str(text).strip()
    if text.lower() in ("0", "off", "none"):
        return []
    return parse_int_set(text, "--lookup")


def parse_lookup_lengths(text: str | None, default: str) -> list[int]:
    """``--lookup-length``: chain lengths to try, counting the init token (each >= 2)."""
    lengths = parse_int_set(default if text is None else text, "--lookup-length")
    if lengths[0] < 2:
        raise ValueError(
            f"--lookup-length: {lengths[0]} is too short; a chain counts the init token, so >= 2"
        )
    return lengths


def with_lookup(
    shapes: list[BeamShape], chains: list[int], chain_lengths: list[int]
) -> list[BeamShape]:
    """The lookup-only shapes ``K×Lk``, then every shape of ``shapes`` followed by its
    variants with ``K`` chains of ``Lk`` tokens added, for every ``K`` and ``Lk``.

    A capped variant keeps the drafter's ``C`` slots and adds the chains' own
    (``C + K*(Lk-1)``), as ``chat`` does when it adds chains to a capped shape. No ``chains``:
    ``shapes`` unchanged.
    """
    pairs = [(k, n) for k in chains for n in chain_lengths]
    out = [BeamShape.lookup_only(k, n) for k, n in pairs]
    for shape in shapes:
        out.append(shape)
        for k, n in pairs:
            capacity = None if shape.capacity is None else shape.capacity + k * (n - 1)
            out.append(BeamShape(shape.width, shape.length, capacity, k, n))
    return list(dict.fromkeys(out)) if pairs else list(shapes)


def with_draft_model(shapes: list[BeamShape], lengths: list[int]) -> list[BeamShape]:
    """A draft model's chains in the grid: for each ``Ld`` of ``lengths``, the chain alone
    (``D1×Ld``), then every shape of ``shapes`` followed by its variants with the chain
    added (a capped shape keeps its ``C`` and adds the chain's ``Ld - 1`` slots). No
    ``lengths``: ``shapes`` unchanged."""
    out = [BeamShape(0, 1, None, 0, 0, n) for n in lengths]
    for shape in shapes:
        out.append(shape)
        for n in lengths:
            capacity = None if shape.capacity is None else shape.capacity + n - 1
            out.append(replace(shape, capacity=capacity, model_length=n))
    return list(dict.fromkeys(out))


def shape_sources(
    shape: BeamShape, early_exit: bool = False, slot: tuple[str, ...] = ("draft_model",)
) -> list[str]:
    """The draft sources a shape's step runs (``engine.drafting.sources.SOURCE_NAMES``): the
    drafter's beams (an early-exit adapter's chain when the drafter is one), lookup chains, the
    draft slot's chains (``slot``: what it holds, a draft model's chain, an early-exit adapter's,
    or both); none for plain decoding."""
    names = []
    if shape.drafts and not shape.is_autoregressive:
        names.append("early_exit" if early_exit else "drafter")
    if shape.lookup:
        names.append("lookup")
    if shape.model_length:
        names += slot
    return names


def limit_lengths(
    lengths: list[int], predict_tokens: int | None, force: bool = False
) -> tuple[list[int], list[int]]:
    """Split ``lengths`` into (kept, dropped) by the drafter's trained length.

    With ``force`` or an unknown limit nothing is dropped.
    """
    limit = max_length_for(predict_tokens)
    if force or limit is None:
        return list(lengths), []
    return [n for n in lengths if n <= limit], [n for n in lengths if n > limit]
