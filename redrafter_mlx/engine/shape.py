"""The beam shape: one type from the command line through the tuner to the decode step.

``W`` beams of ``L`` tokens each (``L`` counts the init token, the token the LLM itself
produced), verified in at most ``C`` packed tree slots. ``L == 1`` drafts nothing: that is
plain autoregressive decoding, :meth:`BeamShape.autoregressive`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ParamError


class ShapeError(ParamError):
    """An invalid beam shape; ``param`` names the field (width, length or capacity)."""


@dataclass(frozen=True, order=True)
class BeamShape:
    """W beams of L tokens, verified in ``capacity`` packed slots (None: the worst case)."""

    width: int
    length: int
    capacity: int | None = None

    @classmethod
    def autoregressive(cls) -> BeamShape:
        """The shape that drafts nothing: plain autoregressive decoding."""
        return cls(1, 1, None)

    @property
    def is_autoregressive(self) -> bool:
        """True for the plain-decoding shape (W1, L1): no draft tokens are proposed."""
        return self.width == 1 and self.length == 1

    @property
    def max_packed(self) -> int:
        """Packed tokens of the worst-case tree: the shared init token plus L-1 per beam."""
        return 1 + self.width * (self.length - 1)

    @property
    def slots(self) -> int:
        """Packed slots the verifier scores per step: ``capacity``, else ``max_packed``."""
        return self.max_packed if self.capacity is None else self.capacity

    @property
    def label(self) -> str:
        """``AR``, ``W2×L5`` or ``W4×L5 C12``."""
        if self.is_autoregressive:
            return "AR"
        text = f"W{self.width}×L{self.length}"
        return text if self.capacity is None else f"{text} C{self.capacity}"

    def validate(self, vocab_size: int | None = None) -> BeamShape:
        """Return self, or raise :class:`ShapeError` naming the field and its valid range."""
        if self.is_autoregressive:
            return self
        if self.width < 1:
            raise ShapeError("width", f"beam width must be >= 1, got {self.width}")
        if self.length < 2:
            raise ShapeError(
                "length", f"beam length must be >= 2 (it counts the init token), got {self.length}"
            )
        if vocab_size is not None and self.width > vocab_size:
            raise ShapeError(
                "width", f"beam width {self.width} exceeds the vocabulary ({vocab_size})"
            )
        upper = self.width * self.length
        allowed = f"use a capacity in [{self.length}, {upper}]"
        if self.capacity is not None and self.capacity < self.length:
            raise ShapeError(
                "capacity",
                f"capacity {self.capacity} < beam length {self.length}: the best beam must fit; "
                f"{allowed}",
            )
        if self.capacity is not None and self.capacity > upper:
            raise ShapeError(
                "capacity",
                f"capacity {self.capacity} > width*length {upper}: no tree needs more; {allowed}",
            )
        return self

    def to_dict(self) -> dict:
        """``{"width": .., "length": .., "capacity": ..}``."""
        return {"width": self.width, "length": self.length, "capacity": self.capacity}


AR = BeamShape.autoregressive()
