"""Which shapes ``redrafter-mlx tune`` measures: the W×L[ C] grid of ``--widths``,
``--lengths`` and ``--capacities`` (lengths the drafter was not trained for left out), each
shape with the ``--lookup`` chains beside it and the chains alone, and a draft slot's chains
of ``--draft-length`` tokens alone and beside every shape."""

from __future__ import annotations

from redrafter_mlx.cli.errors import FlagError
from redrafter_mlx.engine.core.shape import BeamShape
from tuning.grid import (
    build_grid,
    limit_lengths,
    parse_capacities,
    parse_int_set,
    parse_lookup,
    parse_lookup_lengths,
    read_predict_tokens,
    with_draft_model,
    with_lookup,
)

# Lookup chains tried by default: the commands' default chain (engine.lookup's DEFAULT_CHAINS
# and DEFAULT_CHAIN_LENGTH) beside a drafter; a few more shapes without one (cheap to measure).
LOOKUP_DEFAULTS = {True: ("1", "8"), False: ("1-2", "4,8")}  # has a drafter -> (K, Lk)


def lookup_on(lookup: str | None, no_lookup: bool) -> bool:
    """Whether the grid tries context lookup (not --no-lookup, not --lookup 0)."""
    asked = parse_lookup(lookup, "1")
    if no_lookup and lookup is not None and asked:
        raise FlagError(f"--no-lookup contradicts --lookup {lookup}; give one of them")
    return bool(asked) and not no_lookup


def lookup_grid(
    lookup: str | None, lookup_length: str | None, no_lookup: bool, has_drafter: bool
) -> tuple[list[int], list[int]]:
    """(chain counts, chain lengths) to try; ``([], [])`` with --no-lookup or --lookup 0."""
    if not lookup_on(lookup, no_lookup):
        return [], []
    chains_default, lengths_default = LOOKUP_DEFAULTS[has_drafter]
    return (
        parse_lookup(lookup, chains_default),
        parse_lookup_lengths(lookup_length, lengths_default),
    )


def grid_for(
    widths: str,
    lengths: str,
    capacities: str | None,
    drafter: str | None,
    force_lengths: bool,
    first: BeamShape | None,
    chains: list[int] = (),
    chain_lengths: list[int] = (),
    draft_lengths: list[int] = (),
    early_exit: bool = False,
) -> tuple[list[BeamShape], str]:
    """The shapes to search and a note about dropped lengths: the W×L[ C] grid, each with
    its lookup variants (``chains`` × ``chain_lengths``) and the lookup-only shapes first;
    ``first`` (the chip's preset) and its lookup variants moved to the very front. Without
    a drafter: the lookup-only shapes alone. ``draft_lengths``: a draft model's chains
    alone first, then beside every shape (``with_draft_model``). ``early_exit``: the
    drafter is an early-exit adapter (one chain: W = 1 only)."""
    chains, chain_lengths = list(chains), list(chain_lengths)
    if drafter is None:
        return with_draft_model(with_lookup([], chains, chain_lengths), list(draft_lengths)), ""
    width_list = parse_int_set(widths, "--widths")
    length_list = parse_int_set(lengths, "--lengths")
    predict = read_predict_tokens(drafter)
    kept, dropped = limit_lengths(length_list, predict, force_lengths)
    note = ""
    if early_exit and width_list != [1]:
        width_list = [1]
        note = "the early-exit drafter drafts one chain: widths 1 only; "
    if dropped:
        note += (
            f"lengths {dropped} skipped: the drafter predicts {predict} tokens "
            f"(max length {predict + 1}); pass --force-lengths to try them anyway"
        )
    if not kept:
        raise ValueError(f"--lengths {lengths}: nothing left to try; {note}")
    shapes = with_lookup(
        build_grid(width_list, kept, parse_capacities(capacities)), chains, chain_lengths
    )
    if first in shapes:
        front = with_lookup([first], chains, chain_lengths)[len(chains) * len(chain_lengths) :]
        shapes = front + [s for s in shapes if s not in front]
    return with_draft_model(shapes, list(draft_lengths)), note.rstrip("; ")


def parse_draft_lengths(text: str) -> list[int]:
    """``--draft-length``: chain lengths >= 2 (they count the init token)."""
    try:
        lengths = parse_int_set(text, "--draft-length")
    except ValueError as e:
        raise FlagError(str(e)) from None
    if min(lengths) < 2:
        raise FlagError(f"--draft-length {text}: a chain counts the init token, use >= 2")
    return lengths
