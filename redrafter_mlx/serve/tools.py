"""Tool calls on the wire: a chat request's ``tools``, ``tool_choice`` and
``parallel_tool_calls``, checked, and what they ask of the prompt and of the answer.

The model's own chat template renders the tools (``Tokenizer.chat_prompt(tools=)``) and
its answer's calls are parsed back by mlx-lm's parser for the template's format
(``serve/channels.py``), so a template mlx-lm knows no tool-call format of cannot take
tools: ``check_support`` refuses them with a 400.

``tool_choice`` is honoured through the prompt, never by masking the model's draws, so the
answer stays the model's own (and lossless under speculation): ``"auto"`` renders every tool
and parses whatever calls the answer makes; ``"none"`` renders them (the model still reads
what the tools are) and parses nothing, the answer's text returned as it is; ``"required"``
ends the prompt with the format's tool-call start (``TemplateMarkers.tool_ids``), so the
answer opens with a call; a named function is rendered alone, the call opened the same way.
``parallel_tool_calls: false`` ends the answer once its first call is complete.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ProtocolError

MAX_TOOLS = 128  # OpenAI's limit on the tools of one request
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class Tools:
    """A request's tools.

    specs:    the ``tools`` as sent, each ``{"type": "function", "function": {"name",
              "description"?, "parameters"?, "strict"?}}``
    choice:   ``"auto"``, ``"none"``, ``"required"`` or the name of the function to call
    parallel: whether one answer may make several calls (``parallel_tool_calls``)
    """

    specs: tuple[dict, ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def named(self) -> bool:
        """Whether ``choice`` names a function."""
        return self.choice not in CHOICES

    @property
    def rendered(self) -> list[dict]:
        """The tools the chat template shows: a named function alone, else all."""
        if self.named:
            return [t for t in self.specs if t["function"]["name"] == self.choice]
        return list(self.specs)

    @property
    def parsed(self) -> bool:
        """Whether the answer's tool calls are parsed (not with ``"none"``)."""
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """Whether the prompt opens a call (``"required"`` or a named function)."""
        return self.choice == "required" or self.named


def parse_tools(body: dict) -> Tools | None:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``; None when it
    sends no tools (``tool_choice`` then may be only ``"auto"`` or ``"none"``)."""
    specs = _specs(body.get("tools"))
    choice = _choice(body.get("tool_choice"), specs)
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise ProtocolError(
            f"'parallel_tool_calls' must be a boolean, got {parallel!r}", "parallel_tool_calls"
        )
    if not specs:
        return None
    return Tools(tuple(specs), choice, parallel)


def _specs(value) -> list[dict]:
    """``tools``: up to ``MAX_TOOLS`` function specs with distinct, valid names."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ProtocolError("'tools' must be a list of function specs", "tools")
    if len(value) > MAX_TOOLS:
        raise ProtocolError(f"'tools' takes at most {MAX_TOOLS} tools, got {len(value)}", "tools")
    names = set()
    for i, tool in enumerate(value):
        name = _spec_name(tool, f"tools[{i}]")
        if name in names:
            raise ProtocolError(f"tools[{i}]: the function name {name!r} is given twice", "tools")
        names.add(name)
    return value


def _spec_name(tool, where: str) -> str:
    """The function name of one ``tools`` entry, its fields checked."""
    shape = (
        f'{where} must be {{"type": "function", "function": {{"name": ..., '
        '"description": ..., "parameters": {...}}}'
    )
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ProtocolError(f"{shape} (only function tools are supported)", "tools")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ProtocolError(shape, "tools")
    if not NAME.match(function["name"]):
        raise ProtocolError(
            f"{where}.function.name must be 1-64 letters, digits, '_' or '-', "
            f"got {function['name'][:80]!r}",
            "tools",
        )
    for field_, kind in (("description", str), ("parameters", dict), ("strict", bool)):
        if function.get(field_) is not None and not isinstance(function[field_], kind):
            raise ProtocolError(
                f"{where}.function.{field_} must be a {kind.__name__}, "
                f"got {type(function[field_]).__name__}",
                "tools",
            )
    return function["name"]


def _choice(value, specs: list[dict]) -> str:
    """``tool_choice``: ``"auto"`` (the default), ``"none"``, ``"required"`` or
    ``{"type": "function", "function": {"name": ...}}`` naming one of ``specs``."""
    if value is None:
        return "auto"
    names = [t["function"]["name"] for t in specs]
    if isinstance(value, str):
        if value not in CHOICES:
            raise ProtocolError(
                f"'tool_choice' must be 'auto', 'none', 'required' or "
                f'{{"type": "function", "function": {{"name": ...}}}}, got {value[:80]!r}',
                "tool_choice",
            )
        if value == "required" and not names:
            raise ProtocolError(
                "'tool_choice' is 'required' but the request sends no 'tools'", "tool_choice"
            )
        return value
    typed = isinstance(value, dict) and value.get("type") == "function"
    function = value.get("function") if typed else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ProtocolError(
            'a named \'tool_choice\' must be {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in names:
        raise ProtocolError(
            f"'tool_choice' names the function {name[:80]!r}, which is not in 'tools' "
            f"({', '.join(names) or 'none sent'})",
            "tool_choice",
        )
    return name


def check_support(tools: Tools | None, messages: list[dict], tokenizer) -> None:
    """ProtocolError (400) for tools, or tool calls and results in the history, sent to a
    model whose chat template has no tool-call format mlx-lm knows (``TemplateMarkers``'s
    ``parse_tool``): its prompt could not show them, nor its answer's calls be read back."""
    if tokenizer.markers.parse_tool is not None:
        return
    where = "tools" if tools is not None else None
    if where is None:
        where = next(
            (
                f"messages[{i}]"
                for i, m in enumerate(messages)
                if "tool_calls" in m or m["role"] == "tool"
            ),
            None,
        )
    if where is not None:
        raise no_tool_support(where, "'tools' and the tool messages")


def no_tool_support(where: str, drop: str) -> ProtocolError:
    """The 400 for tools sent to a model whose template has no tool support: ``where`` the
    request first uses them, ``drop`` what to leave out (each API's own words)."""
    return ProtocolError(
        f"'{where}': this model's chat template has no tool support (no tool-call format "
        "that mlx-lm's tool parsers know, mlx_lm.tool_parsers), so it can neither show tools "
        f"nor have its calls read back; drop {drop}, or serve a model whose template "
        "supports tools",
        where,
    )
