"""The Anthropic Messages API (``POST /v1/messages``) over the OpenAI endpoints' machinery.

A request becomes the chat ``Params`` the OpenAI chat endpoint makes: its turns, in the
OpenAI form, checked by ``messages.parse_messages`` and rendered by the model's chat
template (an assistant's ``tool_use`` blocks as its ``tool_calls``, each ``tool_result``
as a ``tool`` message), its ``tools`` and ``tool_choice`` a ``tools.Tools``; the answer's
``channels.Part``s (text, thinking, complete tool calls) become Anthropic's content blocks,
whole in the message object or as the stream's events (``anthropic_reply.py``). Every field is
honoured, accepted (it changes no answer) or refused with its reason; a field the API does
not have is refused, never ignored (docs/serving.md, "The Anthropic Messages API").
Errors carry Anthropic's body: ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json

from .errors import ProtocolError
from .messages import parse_messages
from .protocol import (
    COMMON_FIELDS,
    KIND_FIELDS,
    SERVER_SETTINGS,
    Params,
    sent_sampling,
    shown,
)
from .tools import NAME, Tools, no_tool_support, parse_tools

MAX_STOP_SEQUENCES = 16  # the stop strings one request may send
HONOURED = (
    "model",
    "messages",
    "max_tokens",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "metadata",
    "service_tier",
)
# the API's fields this server does not do: refused, with the reason
REFUSED = {
    "thinking": "whether the model thinks is its chat template's own default, which a "
    "request cannot set here; its thinking comes back in 'thinking' blocks",
    "container": "containers belong to Anthropic's code execution tool",
    "mcp_servers": "this server connects to no MCP servers",
    "context_management": "this server does not edit the context",
}
# OpenAI fields with a Messages API counterpart
OPENAI_NAMES = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}
SERVICE_TIERS = ("auto", "standard_only")
# a content block's keys (required, optional) by its type
BLOCK_KEYS = {
    "text": (("text",), ("cache_control", "citations")),
    "tool_use": (("id", "name", "input"), ("cache_control",)),
    "tool_result": (("tool_use_id",), ("content", "is_error", "cache_control")),
    "thinking": (("thinking",), ("signature",)),
    "redacted_thinking": (("data",), ()),
}
BLOCK_ROLES = {"tool_use": "assistant", "thinking": "assistant", "redacted_thinking": "assistant"}
BLOCK_ROLES["tool_result"] = "user"


# --------------------------------------------------------------------------- the request


def parse_request(body, max_tokens_limit: int, tokenizer) -> Params:
    """Validate a ``POST /v1/messages`` body into the chat ``Params``, or ProtocolError
    naming the field (a template without tool support refuses tools, as for OpenAI)."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    _check_fields(body)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise ProtocolError(
            "'max_tokens' is required (the Messages API's schema): send the most tokens the "
            f"answer may have, at most {max_tokens_limit}",
            "max_tokens",
        )
    if not _is_int(max_tokens) or not 1 <= max_tokens <= max_tokens_limit:
        raise ProtocolError(
            f"'max_tokens' must be an integer in [1, {max_tokens_limit}] (the server's limit: "
            f"serve --max-tokens-limit), got {max_tokens!r}",
            "max_tokens",
        )
    model = _typed(body, "model", str, "a string")
    stream = _typed(body, "stream", bool, "a boolean") or False
    temperature = body.get("temperature")
    if temperature is not None and _is_number(temperature) and not 0 <= temperature <= 1:
        raise ProtocolError(
            f"'temperature' must be in [0, 1] (the Messages API's range), got {temperature}",
            "temperature",
        )
    sent = sent_sampling({k: body[k] for k in ("temperature", "top_p", "top_k") if k in body})
    _metadata(body.get("metadata"))
    tier = body.get("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise ProtocolError(
            f"'service_tier' must be 'auto' or 'standard_only' (one tier), got {tier!r}",
            "service_tier",
        )
    turns, first_tool = _conversation(body.get("system"), body.get("messages"))
    tools = _tools(body.get("tools"), body.get("tool_choice"))
    where = "tools" if tools is not None else first_tool
    if where is not None and tokenizer.markers.parse_tool is None:
        raise no_tool_support(where, "'tools' and the tool_use / tool_result blocks")
    return Params(
        "chat",
        model,
        messages=parse_messages(turns),
        max_tokens=max_tokens,
        stop=_stop_sequences(body.get("stop_sequences")),
        stream=stream,
        sent=sent,
        tools=tools,
    )


def _check_fields(body: dict) -> None:
    """Every field must be one of ``HONOURED``, else ProtocolError with its reason."""
    openai = {*COMMON_FIELDS, *KIND_FIELDS["chat"]}
    for name in body:
        if name in HONOURED:
            continue
        if name in REFUSED:
            raise ProtocolError(f"'{name}' is not supported: {REFUSED[name]}; drop it", name)
        setting = name.replace("-", "_").casefold()
        if setting in SERVER_SETTINGS:
            raise ProtocolError(
                f"'{name}' is a setting of the whole server, not of a request: start the "
                f"server with {SERVER_SETTINGS[setting]}; drop '{name}'",
                name,
            )
        if name in OPENAI_NAMES:
            raise ProtocolError(
                f"'{name}' is the OpenAI API's field; the Messages API's is "
                f"'{OPENAI_NAMES[name]}': send that instead",
                name,
            )
        if name in openai:
            raise ProtocolError(
                f"'{name}' is a field of the OpenAI endpoints (POST /v1/chat/completions, "
                "also served here), not of the Messages API: drop it, or send the request "
                "there",
                name,
            )
        raise ProtocolError(
            f"unknown field {shown(name)}: POST /v1/messages takes {', '.join(HONOURED)} "
            "(docs/serving.md, 'The Anthropic Messages API'); drop it",
            name[:80],
        )


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _typed(body: dict, name: str, kind: type, expected: str):
    """``body[name]`` (None when absent) if it is a ``kind``, else ProtocolError."""
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise ProtocolError(f"'{name}' must be {expected}, got {value!r}", name)
    return value


def _metadata(value) -> None:
    """``metadata``: ``{"user_id": a string}`` at most; it changes no answer."""
    if value is None:
        return
    if not isinstance(value, dict) or set(value) - {"user_id"}:
        raise ProtocolError("'metadata' must be an object holding only 'user_id'", "metadata")
    if value.get("user_id") is not None and not isinstance(value["user_id"], str):
        raise ProtocolError("'metadata.user_id' must be a string", "metadata")


def _stop_sequences(value) -> list[str]:
    """``stop_sequences``: up to ``MAX_STOP_SEQUENCES`` non-empty strings."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise ProtocolError(
            "'stop_sequences' must be a list of non-empty strings", "stop_sequences"
        )
    if len(value) > MAX_STOP_SEQUENCES:
        raise ProtocolError(
            f"'stop_sequences' takes at most {MAX_STOP_SEQUENCES} strings, got {len(value)}",
            "stop_sequences",
        )
    return list(dict.fromkeys(value))


# --------------------------------------------------------------------------- the turns


def _conversation(system, messages) -> tuple[list[dict], str | None]:
    """The system prompt and the turns as OpenAI messages (what ``parse_messages`` takes),
    and where the first ``tool_use`` or ``tool_result`` block is (None: there is none)."""
    out = []
    text = _system(system)
    if text is not None:
        out.append({"role": "system", "content": text})
    if not isinstance(messages, list) or not messages:
        raise ProtocolError(
            '\'messages\' must be a non-empty list of {"role", "content"} turns', "messages"
        )
    names: dict[str, str] = {}  # each tool_use id -> its tool's name
    first_tool = None
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ProtocolError(
                f"{where} must be an object with a role 'user' or 'assistant' (the system "
                "prompt goes in the top-level 'system')",
                where,
            )
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise ProtocolError(
                f"{where} has the unknown key {shown(extra[0])}: a turn is "
                '{"role", "content"}; drop it',
                where,
            )
        blocks = _blocks(m.get("content"), f"{where}.content", m["role"])
        if first_tool is None:
            first_tool = next(
                (p for p, b in blocks if b["type"] in ("tool_use", "tool_result")), None
            )
        if m["role"] == "assistant":
            out.append(_assistant(blocks, names))
        else:
            out += _user(blocks, names)
    if messages[-1]["role"] != "user":
        raise ProtocolError(
            "the last message must be the user's: an assistant turn for the answer to "
            "continue (a prefill) is not supported; end the conversation with a user turn",
            f"messages[{len(messages) - 1}]",
        )
    return out, first_tool


def _system(value) -> str | None:
    """``system``: a string or a list of text blocks (joined, as written)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        blocks = _blocks(value, "system", "system")
        if all(b["type"] == "text" for _, b in blocks):
            return "".join(b["text"] for _, b in blocks)
    raise ProtocolError("'system' must be a string or a list of text blocks", "system")


def _blocks(content, where: str, role: str) -> list[tuple[str, dict]]:
    """A turn's content as (where, block) pairs, each block checked: its type is one this
    server reads, it belongs to ``role``'s turns, its keys are its type's."""
    if isinstance(content, str):
        return [(where, {"type": "text", "text": content})]
    if not isinstance(content, list):
        raise ProtocolError(f"{where} must be a string or a list of content blocks", where)
    out = []
    for j, block in enumerate(content):
        path = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            raise ProtocolError(f'{path} must be a content block, {{"type": ..., ...}}', path)
        if kind not in BLOCK_KEYS:
            why = (
                "this server runs text models"
                if kind in ("image", "document")
                else "this server takes text, tool_use, tool_result and thinking blocks"
            )
            raise ProtocolError(f"{path} is a {shown(kind)} block: {why}", path)
        owner = BLOCK_ROLES.get(kind)
        if owner is not None and owner != role:
            raise ProtocolError(f"{path}: a {kind} block belongs to a turn of the {owner}", path)
        _block_keys(block, kind, path)
        out.append((path, block))
    return out


def _block_keys(block: dict, kind: str, path: str) -> None:
    """A block's keys, each of its type's and of the JSON type it takes."""
    required, optional = BLOCK_KEYS[kind]
    for key in block:
        if key not in (*required, *optional, "type"):
            raise ProtocolError(
                f"{path} has the unknown key {shown(key)}: a {kind} block takes "
                f"{', '.join((*required, *optional))}; drop it",
                path,
            )
    types = {"input": dict, "is_error": bool, "cache_control": dict, "citations": list}
    for key in (*required, *optional):
        value = block.get(key)
        if value is None and key in optional:
            continue
        if key == "content":  # a tool_result's: a string or text blocks
            continue
        kind_ = types.get(key, str)
        if not isinstance(value, kind_):
            name = {dict: "an object", bool: "a boolean", list: "a list"}.get(kind_, "a string")
            raise ProtocolError(f"{path}.{key} must be {name}", path)


def _assistant(blocks: list[tuple[str, dict]], names: dict[str, str]) -> dict:
    """An assistant turn: its text (thinking is not shown to the template, as an OpenAI
    message's reasoning is not) and its ``tool_use`` blocks as ``tool_calls``."""
    text = [{"type": "text", "text": b["text"]} for _, b in blocks if b["type"] == "text"]
    calls = []
    for _, b in blocks:
        if b["type"] == "tool_use":
            names[b["id"]] = b["name"]
            function = {"name": b["name"], "arguments": b["input"]}
            calls.append({"id": b["id"], "type": "function", "function": function})
    turn = {"role": "assistant", "content": text}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _user(blocks: list[tuple[str, dict]], names: dict[str, str]) -> list[dict]:
    """A user turn: its text blocks as user messages, each ``tool_result`` as a ``tool``
    message (with the call's name), in the order sent."""
    out: list[dict] = []
    for path, b in blocks:
        if b["type"] == "text":
            if out and out[-1]["role"] == "user":
                out[-1]["content"].append({"type": "text", "text": b["text"]})
            else:
                out.append({"role": "user", "content": [{"type": "text", "text": b["text"]}]})
            continue
        call = b["tool_use_id"]
        if call not in names:
            raise ProtocolError(
                f"{path}.tool_use_id {shown(call)} answers no tool_use block of an earlier "
                "assistant turn: send each result after the turn that made its call, with "
                "the call's id",
                path,
            )
        result = {"role": "tool", "tool_call_id": call, "name": names[call]}
        out.append({**result, "content": _result_text(b.get("content"), f"{path}.content")})
    return out or [{"role": "user", "content": ""}]


def _result_text(content, where: str) -> str:
    """A ``tool_result``'s content: absent, a string or text blocks (joined, as written)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        blocks = _blocks(content, where, "user")
        if all(b["type"] == "text" for _, b in blocks):
            return "".join(b["text"] for _, b in blocks)
    raise ProtocolError(f"{where} must be a string or a list of text blocks", where)


# --------------------------------------------------------------------------- the tools


def _tools(value, choice) -> Tools | None:
    """``tools`` (custom tools: ``name``, ``description``, ``input_schema``) and
    ``tool_choice`` as ``tools.parse_tools`` takes them in the OpenAI form."""
    specs = []
    if value is not None:
        if not isinstance(value, list):
            raise ProtocolError(
                '\'tools\' must be a list of tools, each {"name", "description", "input_schema"}',
                "tools",
            )
        specs = [_tool(t, f"tools[{i}]") for i, t in enumerate(value)]
    openai_choice, parallel = _tool_choice(choice, specs)
    return parse_tools(
        {"tools": specs or None, "tool_choice": openai_choice, "parallel_tool_calls": parallel}
    )


def _tool(tool, where: str) -> dict:
    """One custom tool, checked, as an OpenAI function spec."""
    if not isinstance(tool, dict):
        raise ProtocolError(f'{where} must be {{"name", "description", "input_schema"}}', "tools")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise ProtocolError(
            f"{where} is the tool type {shown(str(kind))}, one of Anthropic's own tools, which "
            'its API runs; this server takes custom tools ({"name", "description", '
            '"input_schema"}): define it as one, or drop it',
            "tools",
        )
    extra = sorted(set(tool) - {"type", "name", "description", "input_schema", "cache_control"})
    if extra:
        raise ProtocolError(
            f"{where} has the unknown key {shown(extra[0])}: a tool takes name, description, "
            "input_schema (and type 'custom', cache_control); drop it",
            "tools",
        )
    name = tool.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ProtocolError(
            f"{where}.name must be 1-64 letters, digits, '_' or '-', got {name!r:.80}", "tools"
        )
    if tool.get("description") is not None and not isinstance(tool["description"], str):
        raise ProtocolError(f"{where}.description must be a string", "tools")
    if not isinstance(tool.get("input_schema"), dict):
        raise ProtocolError(
            f"{where}.input_schema must be the JSON schema (an object) of the tool's input, "
            'e.g. {"type": "object", "properties": {...}}',
            "tools",
        )
    function = {"name": name}  # OpenAI's order of keys, which a template's tojson keeps
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": {**function, "parameters": tool["input_schema"]}}


CHOICE_KEYS = {"auto": (), "any": (), "tool": ("name",), "none": ()}


def _tool_choice(value, specs: list[dict]) -> tuple:
    """``tool_choice`` (``auto``, ``any``, ``tool`` with a ``name``, ``none``; the first
    three with ``disable_parallel_tool_use``) as OpenAI's, and whether calls may be several."""
    if value is None:
        return None, True
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in CHOICE_KEYS:
        raise ProtocolError(
            '\'tool_choice\' must be {"type": "auto"}, {"type": "any"}, {"type": '
            f'"tool", "name": ...}} or {{"type": "none"}}, got {shown(json.dumps(value))}',
            "tool_choice",
        )
    keys = ("type", *CHOICE_KEYS[kind], *(() if kind == "none" else ("disable_parallel_tool_use",)))
    extra = sorted(set(value) - set(keys))
    if extra:
        raise ProtocolError(
            f"'tool_choice' of type '{kind}' takes {', '.join(keys)}; drop {shown(extra[0])}",
            "tool_choice",
        )
    disable = value.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise ProtocolError(
            "'tool_choice.disable_parallel_tool_use' must be a boolean", "tool_choice"
        )
    if kind in ("any", "tool") and not specs:
        raise ProtocolError(
            f"'tool_choice' is '{kind}' but the request sends no 'tools'", "tool_choice"
        )
    if kind == "tool":
        if not isinstance(value.get("name"), str):
            raise ProtocolError("'tool_choice.name' must name one of 'tools'", "tool_choice")
        return {"type": "function", "function": {"name": value["name"]}}, not disable
    return {"auto": "auto", "any": "required", "none": "none"}[kind], not disable
