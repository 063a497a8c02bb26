"""A prompt cache shared across requests: the verifier's entries after earlier prompts, kept
in a bounded LRU by token prefix, so that a prompt sharing a prefix with an earlier one
prefills only the rest (``Prefill``: its session starts from them, ``Session.reuse``).

Exact: an attention entry's first n slots are what a cold prefill of those n tokens writes;
a recurrent state is kept only at the whole prompt it was taken after (it cannot be rewound),
so a model with recurrent layers reuses an entry only when its whole text starts the prompt.
Draft sources prefill from the whole prompt text themselves (``Source.prefill``), so they need
nothing from here. Bounded: the entries' bytes never exceed ``capacity`` (least recently used
go first; one larger than the whole capacity is not kept).
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx

DEFAULT_BYTES = 1 << 30  # ``serve --prompt-cache-bytes``'s default


def shared(a: tuple, b: list[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class PromptCache:
    """Token prefix -> the verifier's cache entries after it (one row), LRU by bytes."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.entries: OrderedDict[tuple, tuple] = OrderedDict()
        self.bytes = 0

    @staticmethod
    def size(cache: tuple) -> int:
        return sum(entry.nbytes for entry in cache)

    def lookup(self, prompt: list[int]) -> tuple[int, tuple | None]:
        """The longest cached prefix of ``prompt`` that leaves at least one token to prefill:
        (its length, a copy of its entries holding that many slots); (0, None) when none."""
        best, key = 0, None
        for k in self.entries:
            n = shared(k, prompt)
            n = min(n, len(prompt) - 1)
            if n < len(k) and not all(entry.rewinds for entry in self.entries[k]):
                continue
            if n > best:
                best, key = n, k
        if key is None:
            return 0, None
        self.entries.move_to_end(key)
        return best, tuple(entry.kept(best) for entry in self.entries[key])

    def store(self, tokens: list[int], cache: tuple) -> None:
        """Keep a copy of ``cache``'s first ``len(tokens)`` slots (row 0) under ``tokens``."""
        if self.capacity <= 0 or not tokens:
            return
        key = tuple(tokens)
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        kept = tuple(entry.kept(len(key)) for entry in cache)
        size = self.size(kept)
        if size > self.capacity:
            return
        mx.eval(kept)  # once per prompt, at the end of its prefill (not in a decode step)
        self.entries[key] = kept
        self.bytes += size
        while self.bytes > self.capacity:
            _, old = self.entries.popitem(last=False)
            self.bytes -= self.size(old)

    def health(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.bytes, "capacity": self.capacity}
