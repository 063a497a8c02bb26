"""The Anthropic Messages API's answer: an answer's ``channels.Part``s as Anthropic's
content blocks (``Blocks``), whole in the message object (``message``) or as the stream's
events (``message_start``, the blocks' events, ``message_delta``, ``message_stop``), and
Anthropic's error body. The request: ``anthropic.py``.
"""

from __future__ import annotations

import json
import uuid

from .channels import Part

ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def new_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def error_body(message: str, status: int) -> dict:
    """Anthropic's error body for an HTTP ``status`` (its type: Anthropic's for the status;
    another 4xx is an ``invalid_request_error``, another 5xx an ``api_error``)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def stop_reason(finish: str, matched: str | None) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) for the answer's ``finish`` (OpenAI's:
    ``stop``, ``length``, ``tool_calls``) and the stop string that ended it, if one did."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if matched is not None:
        return "stop_sequence", matched
    return "end_turn", None


def usage(counts: dict) -> dict:
    """The OpenAI usage (``protocol.usage``) in Anthropic's words."""
    cached = counts.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    own = {"input_tokens": counts["prompt_tokens"], "output_tokens": counts["completion_tokens"]}
    return {**own, "cache_read_input_tokens": cached} if cached else own


def message(
    id_: str, model: str, blocks: Blocks, finish: str, matched, usage_: dict, speculation: dict
) -> dict:
    """The non-streaming body: Anthropic's message object (and the server's ``speculation``)."""
    reason, sequence = stop_reason(finish, matched)
    return {
        **_head(id_, model, blocks.content, reason, sequence, usage(usage_)),
        "speculation": speculation,
    }


def _head(id_, model, content, reason, sequence, usage_) -> dict:
    return {
        "id": id_,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_,
    }


def message_start(id_: str, model: str, input_tokens: int) -> dict:
    empty = {"input_tokens": input_tokens, "output_tokens": 0}
    return {"type": "message_start", "message": _head(id_, model, [], None, None, empty)}


def message_delta(finish: str, matched, usage_: dict, speculation: dict) -> dict:
    reason, sequence = stop_reason(finish, matched)
    return {
        "type": "message_delta",
        "delta": {"stop_reason": reason, "stop_sequence": sequence},
        "usage": {"output_tokens": usage_["completion_tokens"]},
        "speculation": speculation,
    }


def event(name: str, data: dict) -> str:
    """One server-sent event as the Messages API streams it."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class Blocks:
    """An answer's ``Part``s -> Anthropic content blocks, in the order they come: whole
    (``content``) and as stream events (``add`` and ``close`` return (name, data) pairs).

    Thinking is a ``thinking`` block (its ``signature`` empty: nothing signs it), text a
    ``text`` block, each complete call a ``tool_use`` block (its ``input`` the call's
    arguments, streamed as one ``input_json_delta``), in the order the answer wrote them
    (``Part.order``). A block opens at its first non-whitespace text (the whitespace before
    it included): whitespace alone between blocks (the newline between two calls) is no
    block of its own.
    """

    def __init__(self):
        self.content: list[dict] = []
        self.open: str | None = None  # the kind of the last block while text may extend it
        self.held = ("", "")  # (kind, whitespace) not yet in a block

    def add(self, part: Part) -> list[tuple[str, dict]]:
        events = []
        for channel, piece in part.order:
            if channel == "call":
                events += self._tool_use(piece)
            else:
                events += self._text("thinking" if channel == "reasoning" else "text", piece)
        return events

    def close(self) -> list[tuple[str, dict]]:
        """The events that end the last block, once the answer has ended."""
        return self._stop()

    def _text(self, kind: str, text: str) -> list[tuple[str, dict]]:
        if not text:
            return []
        if self.held[0] != kind:
            self.held = ("", "")
        if self.open == kind:
            self.content[-1][kind] += text
            return [self._delta(kind, text)]
        text = self.held[1] + text
        if not text.strip():
            self.held = (kind, text)
            return []
        self.held = ("", "")
        block = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
        events = [*self._stop(), self._start(block)]
        self.open = kind
        self.content[-1][kind] = text
        return [*events, self._delta(kind, text)]

    def _tool_use(self, call: dict) -> list[tuple[str, dict]]:
        arguments = call["function"]["arguments"]
        try:
            args = json.loads(arguments)
        except ValueError:
            args = arguments  # a parser's text that is no JSON: as it is
        self.held = ("", "")
        block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"]}
        events = [*self._stop(), self._start({**block, "input": {}})]
        self.content[-1]["input"] = args
        delta = {"type": "input_json_delta", "partial_json": json.dumps(args, ensure_ascii=False)}
        events.append(_block_event("content_block_delta", len(self.content) - 1, delta=delta))
        self.open = "tool_use"
        return [*events, *self._stop()]

    def _start(self, block: dict) -> tuple[str, dict]:
        self.content.append(dict(block))
        return _block_event("content_block_start", len(self.content) - 1, content_block=block)

    def _delta(self, kind: str, text: str) -> tuple[str, dict]:
        delta = {"type": f"{kind}_delta", kind: text}
        return _block_event("content_block_delta", len(self.content) - 1, delta=delta)

    def _stop(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [_block_event("content_block_stop", len(self.content) - 1)]


def _block_event(name: str, index: int, **fields) -> tuple[str, dict]:
    return name, {"type": name, "index": index, **fields}
