"""A chat request's ``messages``, checked, and its prompt: the conversation through the
model's chat template, with its tools.

A message is ``{"role", "content"}`` (a string or text parts; ``developer`` reads as
``system``); an assistant's may carry ``tool_calls`` (OpenAI's ``{"id", "type": "function",
"function": {"name", "arguments": a JSON string}}``, the arguments given to the template as
the object they encode, as mlx-lm's server gives them) and a ``tool`` message carries a
call's result (``tool_call_id``). The conversation ends with a user message or a tool result.
"""

from __future__ import annotations

import json

from jinja2 import TemplateError

from .errors import ProtocolError
from .tools import Tools

ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(value) -> list[dict]:
    """``messages`` as the chat template takes them, or ProtocolError naming the bad one."""
    if not isinstance(value, list) or not value:
        raise ProtocolError("'messages' must be a non-empty list of messages", "messages")
    out = [_message(m, i) for i, m in enumerate(value)]
    if out[-1]["role"] not in ("user", "tool"):
        raise ProtocolError(
            "the last message must come from the user (or be a tool's result)", "messages"
        )
    return out


def _message(m, i: int) -> dict:
    """One message, checked: its role, content, and tool calls or the call it answers."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise ProtocolError(
            f"messages[{i}] must be an object with a role in {', '.join(ROLES)}",
            f"messages[{i}]",
        )
    role = "system" if m["role"] == "developer" else m["role"]
    calls = m.get("tool_calls")
    if calls is not None and role != "assistant":
        raise ProtocolError(
            f"messages[{i}]: only an assistant message may carry 'tool_calls'", f"messages[{i}]"
        )
    out = {"role": role, "content": _text_content(m.get("content"), i, role == "assistant")}
    if calls:
        out["tool_calls"] = _calls(calls, i)
    if role == "tool":
        out.update(_result_of(m, i))
    return out


def _text_content(content, i: int, nullable: bool) -> str:
    """A message's content: a string or a list of ``{"type": "text", "text": ...}`` parts; an
    assistant's may be null (the OpenAI API allows it): an empty reply."""
    if content is None and nullable:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ProtocolError(
        f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}]"
    )


def _calls(calls, i: int) -> list[dict]:
    """An assistant's ``tool_calls``, each function's arguments decoded to an object."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ProtocolError(f"{where} must be a list of tool calls", f"messages[{i}]")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ProtocolError(
                f'{where}[{j}] must be {{"id": ..., "type": "function", "function": '
                '{"name": ..., "arguments": "<a JSON object as a string>"}}',
                f"messages[{i}]",
            )
        args = _arguments(function.get("arguments"), f"{where}[{j}].function.arguments", i)
        entry = {"type": "function", "function": {"name": function["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _arguments(value, where: str, i: int) -> dict:
    """A call's arguments: a JSON object, sent encoded as a string (OpenAI) or as is."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = None
    if not isinstance(value, dict):
        raise ProtocolError(
            f'{where} must be a JSON object encoded as a string, e.g. \'{{"city": "Paris"}}\'',
            f"messages[{i}]",
        )
    return value


def _result_of(m: dict, i: int) -> dict:
    """A tool message's ``tool_call_id`` (and ``name``, where sent), checked."""
    out = {}
    for field_ in ("tool_call_id", "name"):
        value = m.get(field_)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ProtocolError(f"messages[{i}].{field_} must be a string", f"messages[{i}]")
        out[field_] = value
    return out


def chat_ids(messages: list[dict], tools: Tools | None, tokenizer) -> list[int]:
    """The prompt's token ids: the system messages joined into one, the conversation through
    the tokenizer's chat format with the tools it shows (``Tools.rendered``), and the
    format's tool-call start after it where the request forces a call (``Tools.forced``)."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    turns = [m for m in messages if m["role"] != "system"]
    shown = tools.rendered if tools is not None else None
    try:
        ids = tokenizer.chat_prompt(turns, "\n".join(system) if system else None, tools=shown)
    except TemplateError as e:  # the template's own refusal (raise_exception) or its error
        raise ProtocolError(
            f"the model's chat template cannot render these messages: {e}", "messages"
        ) from None
    if tools is not None and tools.forced:
        ids = ids + list(tokenizer.markers.tool_ids)
    return ids
