"""An answer's text split as its chat template marks it: reasoning, content and tool calls.

mlx-lm's ``TextStateMachine`` (``mlx_lm.generate``) follows the template's markers through
the text as it streams (a thinking block ``<think>`` ... ``</think>``; a tool call between
its format's start and end, Mistral's running to the end of the answer), holding back text
that may still be the start of one, and strips them; each call's text is read by mlx-lm's
own parser for the format (``TemplateMarkers.parse_tool``). This is what mlx-lm's server
does (``mlx_lm.server``, ``handle_completion``); the transitions are those of mlx-lm's
``make_text_state_machine`` less the tool ones when the request parses no calls (no tools,
or ``tool_choice: "none"``: the text is then the answer's as written, markers included),
and less the response formats of mlx-lm's own chat templates, which no checkpoint's
template has. A call whose text the parser refuses (cut short by ``max_tokens``, or not a
call) stays in the content as the model wrote it, markers included.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field

from mlx_lm.generate import TextStateMachine

from redrafter_mlx.engine.base.tokenizer import TemplateMarkers

from .tools import Tools

log = logging.getLogger("redrafter_mlx.serve")


@dataclass
class Part:
    """New answer text by channel: ``content``, ``reasoning`` and complete ``calls``
    (OpenAI tool calls: ``{"id", "type": "function", "function": {"name", "arguments"}}``,
    the arguments a JSON string; with ``index`` when streamed); ``order``: the same pieces
    in the order the answer wrote them, ("reasoning" | "content", text) or ("call", call)
    (an API whose answer is a list of blocks reads them so: ``anthropic_reply.Blocks``)."""

    content: str = ""
    reasoning: str = ""
    calls: list[dict] = field(default_factory=list)
    order: list[tuple[str, object]] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.order:
            texts = (("reasoning", self.reasoning), ("content", self.content))
            self.order = [(k, v) for k, v in texts if v] + [("call", c) for c in self.calls]

    def __iadd__(self, other: Part) -> Part:
        self.content += other.content
        self.reasoning += other.reasoning
        self.calls += other.calls
        self.order += other.order
        return self

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)


def shown_specials(tokenizer, tools: Tools | None) -> frozenset[int]:
    """The special tokens a chat answer's text shows: every one where its tool calls are
    parsed (mlx-lm's parsers read the text mlx-lm's detokenizer gives, all tokens' text:
    Mistral's calls hold the special ``[ARGS]``), else only the template's markers (so a
    thinking block marked by special tokens still splits)."""
    markers = tokenizer.markers
    if tools is not None and tools.parsed and markers.parse_tool is not None:
        return tokenizer.special_ids | markers.ids
    return markers.ids


def transitions(markers, parse_calls: bool) -> dict | None:
    """The state machine's edges (state -> [(marker, next state)]) for ``markers``
    (``TemplateMarkers``); tool edges only where calls are parsed."""
    edges: dict[str, list] = {}
    if markers.think is not None:
        start, end = markers.think
        edges["normal"] = [(start, "reasoning")]
        edges["reasoning"] = [(end, "normal")]
    if parse_calls and markers.tool is not None:
        start, end = markers.tool
        edges.setdefault("normal", []).append((start, "tool"))
        if "reasoning" in edges:
            edges["reasoning"].append((start, "tool"))
        edges["tool"] = [(end, "normal")] if end else []
    return edges or None


class Channels:
    """Text deltas -> ``Part``s, for one answer.

    markers:  the template's (``Tokenizer.markers``)
    tools:    the request's, or None (no calls parsed)
    initial:  the state the answer starts in: "normal", "reasoning" (the prompt opened a
              thinking block: ``Tokenizer.thinking_open``) or "tool" (it opened a call:
              ``Tools.forced``)
    stream:   number each call (``index``), as streamed deltas carry it

    ``done`` turns true once the answer has made its one call where
    ``parallel_tool_calls`` is false: the rest of the answer is dropped, and the request
    should end. ``called`` counts the calls made.
    """

    def __init__(self, markers, tools: Tools | None, initial: str = "normal", stream=False):
        self.markers, self.tools, self.stream = markers, tools, stream
        parse = tools is not None and tools.parsed and markers.parse_tool is not None
        self.state = TextStateMachine(transitions(markers, parse)).make_state(initial)
        self.current = initial
        self.tool_text = ""
        self.called = 0
        self.done = False

    @classmethod
    def plain(cls) -> Channels:
        """All text is content (a completion: no template)."""
        return cls(TemplateMarkers(), None)

    @classmethod
    def of_answer(cls, tokenizer, tools: Tools | None, prompt: list[int], stream: bool):
        """The channels of a chat answer to ``prompt``: it starts in a call where the
        prompt opened one (``Tools.forced``), in reasoning where it opened a thinking block."""
        if tools is not None and tools.forced:
            initial = "tool"
        else:
            initial = "reasoning" if tokenizer.thinking_open(prompt) else "normal"
        return cls(tokenizer.markers, tools, initial, stream)

    def add(self, text: str) -> Part:
        """The parts ``text`` (the next delta of the answer) completes."""
        if self.done or not text:
            return Part()
        self.state, segments = TextStateMachine.split(self.state, text)
        return self._take(segments)

    def finish(self) -> Part:
        """The rest once the answer ended: text held back as a possible marker, and a call
        still open (a format without an end marker, or cut short) parsed."""
        if self.done:
            return Part()
        self.state, rest, state = TextStateMachine.flush(self.state)
        part = self._take([(state, rest)])
        if self.current == "tool" and not self.done:
            part += self._close_call()
        return part

    def _take(self, segments: list[tuple[str, str]]) -> Part:
        """Each (state, text) segment to its channel; a call closes when its state ends."""
        part = Part()
        for state, text in segments:
            if self.done:
                break
            if state == "reasoning":
                part += Part(reasoning=text)
            elif state == "tool":
                self.tool_text += text
            else:
                if self.current == "tool":
                    part += self._close_call()
                    if self.done:
                        break
                part += Part(content=text)
            self.current = state
        return part

    def _close_call(self) -> Part:
        """The call just ended, parsed (its text back into the content if it cannot be)."""
        text, self.tool_text = self.tool_text, ""
        try:
            parsed = self.markers.parse_tool(text, list(self.tools.specs))
            calls = [self._openai(c) for c in (parsed if isinstance(parsed, list) else [parsed])]
        except Exception as e:  # mlx-lm's parsers raise whatever their reading hits
            log.info("a tool call did not parse (%s: %s); kept as text", type(e).__name__, e)
            start, end = self.markers.tool
            return Part(content=start + text + end)
        if not self.tools.parallel:
            calls, self.done = calls[:1], True
        for call in calls:
            if self.stream:
                call["index"] = self.called
            self.called += 1
        return Part(calls=calls)

    @staticmethod
    def _openai(call: dict) -> dict:
        """One parsed call (``{"name", "arguments", "id"?}``) as an OpenAI tool call: the
        model's id where its format writes one (as mlx-lm's server keeps it), else a new
        one; the arguments JSON-encoded."""
        args = call.get("arguments", {})
        encoded = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        call_id = call.get("id") or f"call_{uuid.uuid4().hex[:24]}"
        function = {"name": call["name"], "arguments": encoded}
        return {"id": call_id, "type": "function", "function": function}
