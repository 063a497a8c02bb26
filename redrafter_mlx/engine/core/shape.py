"""The beam shape: one type from the command line through the tuner to the decode step.

``W`` drafter beams of ``L`` tokens each (``L`` counts the init token, the token the LLM
itself produced) and ``K`` context-lookup chains of ``Lk`` tokens (continuations of the
latest earlier matches of the text's suffix, ``engine/drafting/lookup.py``), verified together
in at most ``C`` packed tree slots, with a draft model's chain of ``Ld`` tokens (``D1×Ld``,
``engine/drafting/draft_model.py``) when one is given. ``W1×L1`` with no lookup drafts
nothing: that is plain autoregressive decoding, :meth:`BeamShape.autoregressive`. ``W0`` with
``K >= 1`` speculates from the context alone (models without a drafter).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..base.errors import ParamError

_LABEL = re.compile(
    r"^(?:W(?P<w>\d+)[x×]L(?P<l>\d+))?(?:\+?K(?P<k>\d+)[x×]L(?P<lk>\d+))?"
    r"(?:\+?D1[x×]L(?P<dl>\d+))?(?:[\s/]*C(?P<c>\d+))?$",
    re.IGNORECASE,
)


DEFAULT_MODEL_LENGTH = 4  # a draft model's chain, the init token included (D1×L4)


class ShapeError(ParamError):
    """An invalid beam shape; ``param`` names the field (width, length or capacity)."""


@dataclass(frozen=True, order=True)
class BeamShape:
    """W drafter beams of L tokens, K lookup chains of ``lookup_length`` tokens (0: L) and
    a draft model's chain of ``model_length`` tokens (0: none), verified in ``capacity``
    packed slots (None: the worst case)."""

    width: int
    length: int
    capacity: int | None = None
    lookup: int = 0
    lookup_length: int = 0
    model_length: int = 0

    @classmethod
    def autoregressive(cls) -> BeamShape:
        """The shape that drafts nothing: plain autoregressive decoding."""
        return cls(1, 1, None)

    @classmethod
    def lookup_only(cls, chains: int, length: int, capacity: int | None = None) -> BeamShape:
        """``chains`` lookup chains of ``length`` tokens and no drafter beam."""
        return cls(0, 1, capacity, chains, length)

    @classmethod
    def parse(cls, label: str) -> BeamShape:
        """The shape of a ``label``: ``AR``, ``W2xL5``, ``W4xL5 C12``, ``W1xL4+K1xL8``,
        ``K2xL6``, ``D1xL4`` (a draft model's chain) or ``W1xL4+K1xL8+D1xL4`` (``x`` or
        ``×``; the capacity after a space or ``/``). Not validated, except that a
        written chain length must count the init token (``K1xL0`` is refused)."""
        text = label.strip()
        if text.upper() == "AR":
            return AR
        m = _LABEL.match(text)
        if not m or not (m["w"] or m["k"] or m["dl"]):
            raise ShapeError(
                "label",
                f"{label!r} is not a beam shape; write AR, W2xL5, W4xL5/C12, W1xL4+K1xL8, K1xL8"
                " or D1xL4",
            )
        capacity = int(m["c"]) if m["c"] else None
        chains, chain_length = (int(m["k"]), int(m["lk"])) if m["k"] else (0, 0)
        if chains and chain_length < 2:  # 0 would silently mean "the drafter's length"
            raise ShapeError("lookup_length", _chain_length_message(chain_length))
        model_length = int(m["dl"]) if m["dl"] else 0
        if m["dl"] and model_length < 2:
            raise ShapeError("model_length", _model_length_message(model_length))
        if not m["w"]:
            return cls(0, 1, capacity, chains, chain_length, model_length)
        return cls(int(m["w"]), int(m["l"]), capacity, chains, chain_length, model_length)

    def as_chain(self) -> BeamShape:
        """The nearest shape whose step verifies one chain: one drafter beam, one lookup
        chain, and with more than one candidate room for one of them (each row verifies the
        candidate its ranking puts first). What a model with recurrent layers runs: their
        state follows a chain, not a tree's branches (docs/design/any-model.md)."""
        one = replace(self, width=1 if self.drafts else self.width, lookup=min(self.lookup, 1))
        lengths = [one.length if one.drafts else 0, one.chain_length, one.model_length]
        lengths = [n for n in lengths if n]
        if len(lengths) > 1:
            one = replace(one, capacity=min([*lengths, one.capacity or min(lengths)]))
        return one

    @property
    def verifies_chain(self) -> bool:
        """Whether every step of this shape verifies a single chain (``as_chain``)."""
        return self.as_chain() == self

    @property
    def is_autoregressive(self) -> bool:
        """True for the plain-decoding shape (W1, L1, no lookup): no draft is proposed."""
        return self.width == 1 and self.length == 1 and self.lookup == 0 and not self.model_length

    @property
    def drafts(self) -> bool:
        """Whether the drafter proposes beams (W >= 1 and L >= 2)."""
        return self.width >= 1 and self.length >= 2

    @property
    def chain_length(self) -> int:
        """Tokens of each lookup chain, the init token included (0 without lookup)."""
        if not self.lookup:
            return 0
        return self.lookup_length or self.length

    @property
    def beams(self) -> int:
        """Candidates in the tree: drafter beams plus lookup chains."""
        return (self.width if self.drafts else 0) + self.lookup + (1 if self.model_length else 0)

    @property
    def longest(self) -> int:
        """Tokens of the longest candidate (init token included): most a step emits."""
        return max(self.length if self.drafts else 1, self.chain_length, self.model_length)

    @property
    def max_packed(self) -> int:
        """Packed tokens of the worst-case tree: the shared init token plus the rest of
        every beam and chain."""
        drafted = self.width * (self.length - 1) if self.drafts else 0
        chained = self.lookup * max(self.chain_length - 1, 0)
        return 1 + drafted + chained + max(self.model_length - 1, 0)

    @property
    def tree_tokens(self) -> int:
        """Tokens a step places in the cache after the text: the packed slots, and never
        fewer than the worst-case tree (its beams and chains exist before packing)."""
        return max(self.slots, self.max_packed)

    @property
    def largest_part(self) -> str:
        """The field that makes the tree big (``width``, ``length``, ``lookup`` or
        ``lookup_length``): of the drafter's W·(L-1) tokens and the chains' K·(Lk-1), the
        larger part, and of that part its larger factor. The one to shrink, or to blame."""
        drafted = self.width * (self.length - 1) if self.drafts else 0
        chained = self.lookup * max(self.chain_length - 1, 0)
        if chained > drafted:
            return "lookup" if self.lookup >= self.chain_length - 1 else "lookup_length"
        return "width" if self.width >= self.length - 1 else "length"

    @property
    def slots(self) -> int:
        """Packed slots the verifier scores per step: ``capacity``, else ``max_packed``."""
        return self.max_packed if self.capacity is None else self.capacity

    @property
    def label(self) -> str:
        """``AR``, ``W2×L5``, ``W4×L5 C12``, ``W1×L4+K1×L8`` or ``K2×L6`` (lookup only)."""
        if self.is_autoregressive:
            return "AR"
        parts = [f"W{self.width}×L{self.length}"] if self.drafts else []
        if self.lookup:
            parts.append(f"K{self.lookup}×L{self.chain_length}")
        if self.model_length:
            parts.append(f"D1×L{self.model_length}")
        text = "+".join(parts)
        return text if self.capacity is None else f"{text} C{self.capacity}"

    def without_lookup(self) -> BeamShape:
        """The drafter's part alone (plain decoding when there is none)."""
        if not self.drafts:
            return AR
        return BeamShape(self.width, self.length)

    def runnable(self, has_drafter: bool, has_draft_model: bool = False) -> BeamShape:
        """The shape a run can use: without a drafter, only the lookup chains (or AR); a
        draft model's chain only with a draft model (``D1×L`` when one is given and the
        shape has none: its length is the drafter's L, else ``DEFAULT_MODEL_LENGTH``).
        Plain decoding stays plain."""
        if self.is_autoregressive:
            return self
        shape = self
        if has_draft_model and not shape.model_length:
            length = shape.length if shape.drafts else DEFAULT_MODEL_LENGTH
            shape = replace(shape, model_length=length)
        if not has_draft_model and shape.model_length:
            shape = replace(shape, model_length=0)
            if shape.is_autoregressive or not (shape.drafts or shape.lookup):
                return AR
        if has_drafter or shape.is_autoregressive:
            return shape
        if shape.lookup or shape.model_length:
            return BeamShape(0, 1, None, shape.lookup, shape.lookup_length, shape.model_length)
        return AR

    def validate(self, vocab_size: int | None = None) -> BeamShape:
        """Return self, or raise :class:`ShapeError` naming the field and its valid range."""
        if self.is_autoregressive:
            return self
        if self.lookup < 0:
            raise ShapeError("lookup", f"lookup chains must be >= 0, got {self.lookup}")
        if self.lookup and self.chain_length < 2:
            raise ShapeError("lookup_length", _chain_length_message(self.chain_length))
        if self.model_length and self.model_length < 2:
            raise ShapeError("model_length", _model_length_message(self.model_length))
        if self.width < (0 if self.lookup or self.model_length else 1):
            raise ShapeError("width", f"beam width must be >= 1, got {self.width}")
        if self.width >= 1 and self.length < 2:
            raise ShapeError(
                "length", f"beam length must be >= 2 (it counts the init token), got {self.length}"
            )
        if vocab_size is not None and self.width > vocab_size:
            raise ShapeError(
                "width", f"beam width {self.width} exceeds the vocabulary ({vocab_size})"
            )
        lower = self.length if self.drafts else 2
        several = self.lookup or self.model_length
        upper = self.max_packed if several else self.width * self.length
        most = "the tree's tokens" if several else "width*length"
        allowed = f"use a capacity in [{lower}, {upper}]"
        if self.capacity is not None and self.capacity < lower:
            what = f"beam length {self.length}: the best beam must fit" if self.drafts else "2"
            raise ShapeError("capacity", f"capacity {self.capacity} < {what}; {allowed}")
        if self.capacity is not None and self.capacity > upper:
            raise ShapeError(
                "capacity",
                f"capacity {self.capacity} > {most} {upper}: no tree needs more; {allowed}",
            )
        return self

    def to_dict(self) -> dict:
        """``{"width": .., "length": .., "capacity": ..}`` (+ ``lookup``, ``lookup_length``)."""
        out = {"width": self.width, "length": self.length, "capacity": self.capacity}
        if self.lookup:
            out.update(lookup=self.lookup, lookup_length=self.chain_length)
        if self.model_length:
            out.update(model_length=self.model_length)
        return out


def _model_length_message(length: int) -> str:
    return f"draft-model chain length must be >= 2 (it counts the init token), got {length}"


def _chain_length_message(length: int) -> str:
    return f"lookup chain length must be >= 2 (it counts the init token), got {length}"


AR = BeamShape.autoregressive()
