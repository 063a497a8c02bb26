"""OpenAI's ``logprobs``: the request fields (``parse_logprobs``) and the answer's objects
(``Trail``: a chat's ``choices[].logprobs.content[]``, a completion's ``tokens`` /
``token_logprobs`` / ``top_logprobs`` / ``text_offset``), streamed or whole.

The values are the engine's (``engine.core.logprobs``): each emitted token's log-probability
under the distribution it was drawn from, exact under speculation. A token the sampling
filters dropped has probability 0; JSON has no -inf, so it reads ``MIN_LOGPROB`` (OpenAI's
own floor).
"""

from __future__ import annotations

import functools

from redrafter_mlx.engine.core.logprobs import MAX_TOP_LOGPROBS

from .errors import ProtocolError

MIN_LOGPROB = -9999.0  # a probability of 0 (a filtered-out token), as OpenAI writes it


def parse_logprobs(body: dict, kind: str) -> int | None:
    """The top count a request asks for with its tokens' logprobs, None: no logprobs.

    Chat: ``logprobs`` (a boolean) and ``top_logprobs`` (an integer in [0, 20], only with
    ``logprobs: true``). Completions: ``logprobs``, the integer top count in [0, 20] (OpenAI
    allows 5). ProtocolError (400) names the bad field and the limit."""
    value = body.get("logprobs")
    top = body.get("top_logprobs")
    if kind == "completion":
        if top is not None:
            raise ProtocolError(
                "'top_logprobs' is a field of chat requests; a completion asks with "
                f"'logprobs': an integer in [0, {MAX_TOP_LOGPROBS}] (the top tokens per token)",
                "top_logprobs",
            )
        if value is None:
            return None
        return _top_count(value, "logprobs")
    if value is not None and not isinstance(value, bool):
        raise ProtocolError(f"'logprobs' must be a boolean, got {value!r}", "logprobs")
    if top is not None and not value:
        raise ProtocolError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if not value:
        return None
    return 0 if top is None else _top_count(top, "top_logprobs")


def _top_count(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"'{name}' must be an integer, got {value!r}", name)
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ProtocolError(
            f"'{name}' must be in [0, {MAX_TOP_LOGPROBS}] (the most top tokens this server "
            f"gives per token), got {value}",
            name,
        )
    return value


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (``bytes_to_unicode`` inverted)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = list(kept), 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(kept, chars)}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for in a text (OpenAI's ``bytes``): a byte piece (``<0xE2>``)
    its byte, a byte-level BPE token its bytes, a word piece with its space for ``▁``; a
    special token its own spelling."""
    piece = tokenizer.piece(token_id)
    if piece is None:
        return b""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    decoder = _byte_decoder()
    special = token_id in tokenizer.special_ids
    if tokenizer.byte_level and not special and all(c in decoder for c in piece):
        return bytes(decoder[c] for c in piece)
    return piece.replace("\u2581", " ").encode("utf-8")


def _finite(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB  # -inf (and nan) -> the floor


class Trail:
    """A request's token logprobs as they arrive (``add``), rendered in OpenAI's shape for
    the tokens not yet sent (``take``); ``top``: the top count asked (None: none)."""

    def __init__(self, kind: str, top: int | None, tokenizer):
        self.kind, self.top, self.tokenizer = kind, top, tokenizer
        self.entries: list = []
        self.sent = 0
        self.offset = 0  # characters of the completion's text before the next token

    def add(self, entries: list | None, tokens: int) -> None:
        """Append an event's ``(logprob, top)`` per token, keeping those of the text's first
        ``tokens`` tokens (a stop string ends the text: ``TextStream.tokens``)."""
        if self.top is None or not entries:
            return
        self.entries += entries
        del self.entries[max(tokens, self.sent) :]

    def take(self, tokens: list[int]) -> dict | None:
        """The logprobs object of the entries not yet sent (None when logprobs are off or
        nothing is new); ``tokens``: the answer's token ids so far (the entries' order)."""
        if self.top is None or self.sent >= len(self.entries):
            return None
        new = range(self.sent, len(self.entries))
        self.sent = len(self.entries)
        if self.kind == "chat":
            return {
                "content": [self._chat(tokens[k], *self.entries[k]) for k in new],
                "refusal": None,
            }
        out = dict(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for k in new:
            text = self._text(tokens[k])
            own, top = self.entries[k]
            out["tokens"].append(text)
            out["token_logprobs"].append(_finite(own))
            out["top_logprobs"].append({self._text(i): _finite(lp) for i, lp in top})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def _text(self, token_id: int) -> str:
        return token_bytes(self.tokenizer, token_id).decode("utf-8", errors="replace")

    def _entry(self, token_id: int, logprob: float) -> dict:
        raw = token_bytes(self.tokenizer, token_id)
        text = raw.decode("utf-8", errors="replace")
        return {"token": text, "logprob": _finite(logprob), "bytes": list(raw)}

    def _chat(self, token_id: int, own: float, top) -> dict:
        entry = self._entry(token_id, own)
        entry["top_logprobs"] = [self._entry(i, lp) for i, lp in top]
        return entry
