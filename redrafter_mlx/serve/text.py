"""An answer's text as it streams: token ids to text deltas, cut at the first stop string."""

from __future__ import annotations

from redrafter_mlx.engine.base.tokenizer import StreamDecoder


class TextStream:
    """Token ids -> text deltas, cut at the first stop string.

    Text that could still become the start of a stop string is held back until it cannot.
    ``tokens`` counts the generated tokens the text is made of: after a stop string, those up
    to and including the one that completed it (the usage's ``completion_tokens``, the same
    however the engine's steps split the tokens). With ``min_tokens``, only a stop string
    completed by the ``min_tokens``-th token or a later one ends the text (vLLM's rule): one
    that ends within the text of the tokens before (``floor`` characters) is text.
    ``keep``: the special tokens the text shows (a chat template's markers:
    ``StreamDecoder``). ``matched``: the stop string that ended the text, once one has.
    """

    def __init__(
        self, tokenizer, stop: list[str], min_tokens: int = 0, keep: frozenset[int] = frozenset()
    ):
        self.decoder = StreamDecoder(tokenizer, keep)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.tokens = 0
        self.before = max(min_tokens - 1, 0)  # tokens that complete no stop string
        self.floor = 0  # characters of their text
        self.matched: str | None = None

    def add(self, tokens: list[int]) -> tuple[str, bool]:
        """New text safe to send, and whether a stop string ended the text."""
        early = self.before - len(self.decoder.tokens)
        if early > 0:
            self.text += self.decoder.add(tokens[:early])
            self.floor = len(self.text)
        self.text += self.decoder.add(tokens[max(early, 0) :])
        delta, stopped = self._release(final=False)
        self.tokens = len(self.decoder.tokens)
        if stopped:
            self.tokens -= len(tokens) - self._stop_token(tokens)
        return delta, stopped

    def _stop_token(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (the last added) it took for a stop string to appear."""
        done = self.decoder.tokens[: len(self.decoder.tokens) - len(tokens)]
        for k in range(1, len(tokens)):  # once per request, over one step's tokens
            text = self.decoder.text_of(done + tokens[:k])
            if self._first_stop(text) is not None:
                return k
        return len(tokens)

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """(where it starts, the string) of the first stop string in ``text`` that ends past
        ``floor`` (of two starting there, the shorter: the one completed first), or None."""
        hits = [(text.find(s, max(self.floor - len(s) + 1, 0)), len(s), s) for s in self.stop]
        first = min((h for h in hits if h[0] >= 0), default=None)
        return None if first is None else (first[0], first[2])

    def finish(self) -> str:
        """The rest of the text once generation ended."""
        self.text += self.decoder.flush()
        return self._release(final=True)[0]

    def _release(self, final: bool) -> tuple[str, bool]:
        hit = self._first_stop(self.text)
        stopped = hit is not None
        if stopped:
            self.text, self.matched = self.text[: hit[0]], hit[1]
        end = len(self.text) if (final or stopped) else max(len(self.text) - self.hold, 0)
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta, stopped
