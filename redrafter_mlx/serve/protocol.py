"""The OpenAI wire format: request parsing and validation, and response bodies.

Parsing never touches the engine: a request either becomes ``Params`` or raises
``ProtocolError`` (HTTP 400 with an OpenAI-style error body naming the bad parameter).
Supported: ``max_tokens`` (``max_completion_tokens``), ``stop``, ``n=1``, ``stream`` with
``stream_options.include_usage``, and every sampling setting the CLI has (``SENT_FIELDS``):
``temperature`` (0 = greedy), ``top_p``, ``top_k``, ``min_p``, ``seed``, ``logit_bias``,
``presence_penalty`` and ``frequency_penalty`` (over the last ``repetition_context_size``
tokens, as mlx-lm's server), and mlx-lm's ``repetition_penalty`` and
``repetition_context_size``; the common extensions of vLLM and other servers,
``stop_token_ids``, ``ignore_eos`` and ``min_tokens`` (``EXTENSIONS``); and OpenAI's
``user``, ``metadata``, ``prompt_cache_key`` and ``safety_identifier``, which change no
answer; and a chat's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (``serve/tools.py``;
its messages: ``serve/messages.py``); ``logprobs`` and ``top_logprobs``
(``serve/logprobs.py``). Sampling fields a request leaves out take the model's
``generation_config.json`` values, else OpenAI's defaults (``Params.sampling``). What it does
not implement (``response_format``, ``echo`` ...) is refused, a server flag sent as a field
(``draft_model``, ``beam_width`` ...) is refused, and so is any other field
(``check_fields``): none is ever ignored.

Every field is checked here, before anything reaches the engine: the sampling settings by
the engine's own rules (``SamplerConfig.validate``) within OpenAI's ranges, and a value the
engine would choke on (text with a lone surrogate) is a 400 naming it.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from redrafter_mlx.engine.base.errors import ParamError
from redrafter_mlx.engine.core.sampling import SamplerConfig

from .channels import Part
from .errors import ProtocolError
from .logprobs import parse_logprobs
from .messages import chat_ids, parse_messages
from .tools import Tools, parse_tools

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send 0 for greedy decoding
DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: ~1M prompt tokens as JSON ids, far past any context
DEFAULT_READ_TIMEOUT_S = 30.0  # a client's time to send a request's headers, then its body
DEFAULT_MAX_CONNECTIONS = 1024  # open connections (beyond: 503), slow clients included
MAX_STOP = 4
MAX_STOP_IDS = 256  # stop_token_ids a request may send
# Parameters that would change the output in ways this server does not implement.
UNSUPPORTED = {
    "functions": None,
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "response_format": (None, {"type": "text"}),
    "function_call": (None, "none"),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "audio": None,
    "prediction": None,
    "reasoning_effort": None,
    "verbosity": None,
    "web_search_options": None,
}
# OpenAI fields that change no answer (who asks, labels, a cache hint): accepted, checked
METADATA = {"user": str, "metadata": dict, "prompt_cache_key": str, "safety_identifier": str}
# Extensions other OpenAI-compatible servers (vLLM, ...) honour, and so does this one.
EXTENSIONS = ("stop_token_ids", "ignore_eos", "min_tokens")

# request fields that name a server setting (a flag of ``serve``): refused, never ignored
SERVER_SETTINGS = {
    "branches": "--branches",
    "max_branches": "--max-branches",
    "branch_depth": "--branch-depth",
    "draft_model": "--draft-model",
    "drafter": "--drafter",
    "beam_width": "--beam-width",
    "beam_length": "--beam-length",
    "capacity": "--capacity",
    "no_draft": "--no-draft",
    "lookup": "--lookup",
    "lookup_length": "--lookup-length",
    "no_lookup": "--no-lookup",
    "adapt": "--no-adapt",
    "no_adapt": "--no-adapt",
    "dtype": "--dtype",
    "max_kv_size": "--max-kv-size",
    "max_batch": "--max-batch",
    "max_queue": "--max-queue",
    "max_tokens_limit": "--max-tokens-limit",
}


@dataclass
class Params:
    """A validated request. ``messages`` for chat, ``prompt`` (text or ids) for completions;
    ``sent``: the sampling settings it sent (``SamplerConfig`` fields, checked)."""

    kind: str  # "chat" | "completion"
    model: str | None
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    sent: dict = field(default_factory=dict)
    stop_ids: tuple[int, ...] = ()  # stop_token_ids
    ignore_eos: bool = False
    min_tokens: int = 0
    tools: Tools | None = None  # chat: tools, tool_choice, parallel_tool_calls
    logprobs: int | None = None  # the top count of its tokens' logprobs; None: none

    def sampling(self, defaults: dict | None = None) -> SamplerConfig:
        """The request's sampling settings: what it sent, else the model's ``defaults``
        (``engine.core.sampling.model_defaults``), else OpenAI's."""
        fallback = {"temperature": DEFAULT_TEMPERATURE}
        return SamplerConfig.resolve(self.sent, defaults, fallback)


# --------------------------------------------------------------------------- the body


def parse_body(raw: bytes):
    """The body's JSON value, or ProtocolError (400): not JSON, not UTF-8, nested too deep,
    or text holding a lone UTF-16 surrogate (``"\\ud800"``: valid JSON, but no text)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ProtocolError("the request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, over-long integers
        raise ProtocolError(f"the request body is not valid JSON: {e}") from None
    where = _lone_surrogate(body)
    if where is not None:
        raise ProtocolError(
            f"'{where}' holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
            "which is not text; send valid Unicode (pair the surrogates or drop them)",
            where,
        )
    return body


def _lone_surrogate(value) -> str | None:
    """The path (``messages[0].content``) of the first string holding a lone surrogate.

    Iterative: the depth is whatever ``json.loads`` accepted.
    """
    stack = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not _is_text(v):
                return path or "body"
        elif isinstance(v, dict):
            for k, item in v.items():
                if not _is_text(k):
                    return path or "body"
                stack.append((f"{path}.{k}" if path else k, item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
    return None


def _is_text(s: str) -> bool:
    """Whether ``s`` encodes to UTF-8 (a lone surrogate does not)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_model(requested: str | None, names: tuple[str, ...]) -> None:
    """``model`` must name the loaded model (its id or an alias; absent: the loaded one),
    else ProtocolError 404 ``model_not_found`` as OpenAI answers."""
    if requested is None or requested.casefold() in {n.casefold() for n in names}:
        return
    raise ProtocolError(
        f"the model {shown(requested)} is not served here; this server runs "
        f"{', '.join(repr(n) for n in names)} (see GET /v1/models)",
        "model",
        status=404,
        code="model_not_found",
    )


SHOWN_CHARS = 80  # the most of a client's text an error message repeats


def shown(text: str, most: int = SHOWN_CHARS) -> str:
    """``text`` quoted for an error message, cut to its first ``most`` characters (the
    length given) when longer: a client's 5,000-character name is not echoed whole."""
    if len(text) <= most:
        return repr(text)
    return f"{text[:most]!r}... ({len(text)} characters)"


# --------------------------------------------------------------------------- field checks


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _get(body: dict, name: str, check, expected: str, default=None):
    """``body[name]`` (None/missing -> default) if ``check`` accepts it, else ProtocolError."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise ProtocolError(f"'{name}' must be {expected}, got {value!r}", name)
    return value


# Each sampling setting a request may send: its JSON type, and OpenAI's range where it is
# narrower than the engine's (the engine's own rules, ``SamplerConfig.validate``, apply to all).
SENT_FIELDS = {
    "temperature": (float, (0.0, 2.0)),
    "top_p": (float, None),
    "top_k": (int, None),
    "min_p": (float, None),
    "seed": (int, None),
    "repetition_penalty": (float, (0.0, 10.0)),
    "repetition_context_size": (int, None),
    "presence_penalty": (float, (-2.0, 2.0)),
    "frequency_penalty": (float, (-2.0, 2.0)),
}


# The fields a request may send besides its kind's own (``KIND_FIELDS``): each is honoured,
# or refused when set to what this server does not do (``UNSUPPORTED``).
COMMON_FIELDS = (
    "model",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "n",
    "stream",
    "stream_options",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    *SENT_FIELDS,
    *EXTENSIONS,
    *METADATA,
    *UNSUPPORTED,
)
KIND_FIELDS = {
    "chat": ("messages", "tools", "tool_choice", "parallel_tool_calls"),
    "completion": ("prompt",),
}
# refused with their own reason: OpenAI's deprecated forms of ``tools`` and ``tool_choice``
LEGACY = {"functions": "tools", "function_call": "tool_choice"}


def check_fields(body: dict, kind: str) -> None:
    """Every field of ``body`` must be one this server reads, else ProtocolError naming it:
    one it does not implement (``UNSUPPORTED``) or a server setting (``SERVER_SETTINGS``,
    also spelt with dashes) with its own reason, any other as unknown."""
    known = {*COMMON_FIELDS, *KIND_FIELDS[kind]}
    for name, value in body.items():
        allowed = UNSUPPORTED.get(name, ())
        if name in LEGACY and (allowed is None or value not in allowed):
            raise ProtocolError(
                f"'{name}' is OpenAI's deprecated form of '{LEGACY[name]}', which this server "
                f"takes: send '{LEGACY[name]}' instead",
                name,
            )
        if name in UNSUPPORTED and (allowed is None or value not in allowed):
            raise ProtocolError(f"'{name}' is not supported by this server", name)
        if name in KIND_FIELDS["chat"] and name not in known:
            raise ProtocolError(
                f"'{name}' is a field of chat requests (POST /v1/chat/completions); "
                "a completion takes a prompt only: drop it",
                name,
            )
        setting = name.replace("-", "_").casefold()
        if setting in SERVER_SETTINGS:
            raise ProtocolError(
                f"'{name}' is a setting of the whole server, not of a request: start the "
                f"server with {SERVER_SETTINGS[setting]} (see GET /health for what it runs); "
                f"drop '{name}'",
                name,
            )
        if name not in known:
            honoured = sorted(n for n in known if n not in UNSUPPORTED)
            raise ProtocolError(
                f"unknown field {shown(name)}: this server takes {', '.join(honoured)} "
                "(docs/serving.md, 'Endpoints and fields'); drop it",
                name[:SHOWN_CHARS],
            )


def _common(body: dict, kind: str, max_tokens_limit: int) -> Params:
    """The fields chat and completions share."""
    check_fields(body, kind)
    for name, kind_ in METADATA.items():
        _get(body, name, lambda v, k=kind_: isinstance(v, k), f"a {kind_.__name__}")
    n = _get(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise ProtocolError(f"only n=1 is supported, got n={n}", "n")
    name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    max_tokens = _get(body, name, _is_int, "an integer")
    if max_tokens is not None and not 1 <= max_tokens <= max_tokens_limit:
        raise ProtocolError(
            f"'{name}' must be in [1, {max_tokens_limit}] (the server's limit), got {max_tokens}",
            name,
        )
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ProtocolError("'stream_options.include_usage' must be a boolean", "stream_options")
    model = _get(body, "model", lambda v: isinstance(v, str), "a string")
    ignore_eos = _get(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean", False)
    min_tokens = _get(body, "min_tokens", _is_int, "an integer", 0)
    most = max_tokens or max_tokens_limit
    if not 0 <= min_tokens <= most:
        raise ProtocolError(
            f"'min_tokens' must be in [0, {most}] (at most max_tokens), got {min_tokens}",
            "min_tokens",
        )
    return Params(
        kind,
        model,
        max_tokens=max_tokens,
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=include_usage,
        sent=sent_sampling(body),
        stop_ids=_stop_ids(body.get("stop_token_ids")),
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        logprobs=parse_logprobs(body, kind),
    )


def _stop_ids(value) -> tuple[int, ...]:
    """``stop_token_ids``: up to ``MAX_STOP_IDS`` token ids (the vocabulary: ``check_ids``)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value):
        raise ProtocolError("'stop_token_ids' must be a list of token ids", "stop_token_ids")
    if len(value) > MAX_STOP_IDS:
        raise ProtocolError(
            f"'stop_token_ids' takes at most {MAX_STOP_IDS} ids, got {len(value)}",
            "stop_token_ids",
        )
    return tuple(dict.fromkeys(value))


def sent_sampling(body: dict) -> dict:
    """The sampling settings sent (``SamplerConfig`` fields), each checked: its type, OpenAI's
    range, then the engine's rules; a ProtocolError names the first bad one."""
    sent = {}
    for name, (kind, bounds) in SENT_FIELDS.items():
        check, expected = (_is_int, "an integer") if kind is int else (_is_number, "a number")
        value = _get(body, name, check, expected)
        if value is None:
            continue
        if bounds is not None and not bounds[0] <= value <= bounds[1]:
            raise ProtocolError(
                f"'{name}' must be in [{bounds[0]:g}, {bounds[1]:g}], got {value}", name
            )
        sent[name] = kind(value)
    bias = _logit_bias(body.get("logit_bias"))
    if bias:
        sent["logit_bias"] = bias
    try:
        SamplerConfig.resolve(sent)
    except ParamError as e:
        shown = e.message if len(e.message) <= 160 else e.message[:160] + "..."
        raise ProtocolError(shown, e.param) from None
    return sent


def check_bias_ids(bias: tuple[tuple[int, float], ...], vocab_size: int) -> None:
    """Every ``logit_bias`` token id must be in the vocabulary, else ProtocolError."""
    check_ids([t for t, _ in bias], vocab_size, "logit_bias")


def check_ids(ids, vocab_size: int, param: str) -> None:
    """Every token id of ``param`` must be in the vocabulary, else ProtocolError."""
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise ProtocolError(
            f"'{param}' token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", param
        )


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: an object of token id (a string of digits) -> bias in [-100, 100]."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ProtocolError("'logit_bias' must be an object of token id -> bias", "logit_bias")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9):
            raise ProtocolError(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
        if not _is_number(bias) or not -100.0 <= bias <= 100.0:
            raise ProtocolError(
                f"'logit_bias' values must be numbers in [-100, 100], got {bias!r}", "logit_bias"
            )
        out.append((int(key), float(bias)))
    return tuple(out)


def _stop(value) -> list[str]:
    """``stop``: a string or up to 4 non-empty strings."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ProtocolError("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP:
        raise ProtocolError(f"'stop' takes at most {MAX_STOP} strings", "stop")
    return stops


def _prompt(value) -> str | list[int]:
    """A completion prompt: a string or token ids (or a list holding exactly one of those)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        return value
    raise ProtocolError(
        "'prompt' must be a non-empty string or token id list (one prompt per request)",
        "prompt",
    )


def parse_chat(body, max_tokens_limit: int) -> Params:
    """Validate a ``POST /v1/chat/completions`` body."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    params = _common(body, "chat", max_tokens_limit)
    params.messages = parse_messages(body.get("messages"))
    params.tools = parse_tools(body)
    return params


def parse_completion(body, max_tokens_limit: int) -> Params:
    """Validate a ``POST /v1/completions`` body."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    params = _common(body, "completion", max_tokens_limit)
    params.prompt = _prompt(body.get("prompt"))
    return params


# --------------------------------------------------------------------------- prompts


def prompt_ids(params: Params, tokenizer) -> list[int]:
    """Token ids: chat through the tokenizer's chat format (``messages.chat_ids``), text
    with BOS, ids as given."""
    if params.kind == "chat":
        return chat_ids(params.messages, params.tools, tokenizer)
    if isinstance(params.prompt, str):
        return tokenizer.encode(params.prompt)
    return list(params.prompt)


def check_context(ids: list[int], context: int | None, vocab_size: int, param: str) -> None:
    """The prompt must leave room for one generated token and use known token ids."""
    if context is not None and len(ids) >= context:
        raise ProtocolError(
            f"the prompt is {len(ids)} tokens; this model's context is {context} tokens",
            param,
            code="context_length_exceeded",
        )
    if any(not 0 <= t < vocab_size for t in ids):
        raise ProtocolError(f"prompt token ids must be in [0, {vocab_size})", param)


# --------------------------------------------------------------------------- responses


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """Token counts; ``prompt_tokens_details.cached_tokens`` when the prompt cache gave some."""
    own = dict(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
    if not cached_tokens:
        return own
    return {**own, "prompt_tokens_details": dict(cached_tokens=cached_tokens)}


@dataclass
class Reply:
    """The fixed fields of one response (id, created, model) and its body shapes."""

    kind: str
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, obj: str) -> dict:
        return dict(id=self.id, object=obj, created=self.created, model=self.model)

    def full(self, part: Part, finish: str, usage_: dict, speculation: dict, logprobs=None) -> dict:
        """The non-streaming body: a chat's message (``message_of``) or a completion's text;
        ``logprobs``: its tokens' (``logprobs.Trail``), None when not asked for."""
        if self.kind == "chat":
            message = message_of(part)
            choice = dict(index=0, message=message, finish_reason=finish, logprobs=logprobs)
            head = self._head("chat.completion")
        else:
            choice = dict(index=0, text=part.content, finish_reason=finish, logprobs=logprobs)
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": usage_, "speculation": speculation}

    def chunk(
        self, part: Part | None, finish: str | None = None, first: bool = False, logprobs=None
    ) -> dict:
        """One streamed chunk (``first`` carries the chat role): a chat's delta holds what
        ``part`` has of ``content``, ``reasoning_content`` and ``tool_calls``; ``logprobs``:
        the tokens' since the last chunk (``logprobs.Trail``)."""
        part = part or Part()
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else {}
            if part.content:
                delta["content"] = part.content
            if part.reasoning:
                delta["reasoning_content"] = part.reasoning
            if part.calls:
                delta["tool_calls"] = part.calls
            choice = dict(index=0, delta=delta, finish_reason=finish, logprobs=logprobs)
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = dict(index=0, text=part.content, finish_reason=finish, logprobs=logprobs)
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage_: dict, speculation: dict) -> dict:
        """The final chunk of ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage_, "speculation": speculation}


def message_of(part: Part) -> dict:
    """A chat answer's message: its ``content`` (null when it only calls tools, as OpenAI
    answers), its ``reasoning_content`` where it reasoned, its ``tool_calls`` where it
    made any."""
    content = None if part.calls and not part.content else part.content
    message = {"role": "assistant", "content": content}
    if part.reasoning:
        message["reasoning_content"] = part.reasoning
    if part.calls:
        message["tool_calls"] = part.calls
    return message
