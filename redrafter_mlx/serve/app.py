"""The ASGI app (Starlette); its runner (uvicorn) is ``runner.py``.

Handlers never touch the model: they validate, tokenize, ``submit`` to the scheduler and read
the request's events from an ``asyncio.Queue`` that the engine thread fills through
``loop.call_soon_threadsafe``; a chat answer's text is split into content, reasoning and
tool calls (``channels.py``) as it arrives. A streaming response is Server-Sent Events
(``data: {...}`` then ``data: [DONE]``); a client that goes away cancels its request, which
frees its row at the next step. ``POST /v1/messages`` is the Anthropic Messages API on the
same path (``anthropic.py`` reads the request into the chat ``Params``,
``anthropic_reply.py`` shapes the answer, its events and its errors).

Status codes: 400 bad request (OpenAI error body), 404 unknown model, 408 request not read
within ``read_timeout_s`` (headers and body together), 413 body over ``max_body_bytes``
(answered as soon as it is known), 429 queue full, 500 engine failure (of this request, or
of the batched step: then of every request in it), 503 shutting down or over
``max_connections``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import anthropic_reply as areply
from .anthropic import parse_request as parse_anthropic
from .channels import Channels, Part, shown_specials
from .errors import error_body
from .logprobs import Trail
from .protocol import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_TIMEOUT_S,
    ProtocolError,
    Reply,
    check_bias_ids,
    check_context,
    check_ids,
    check_model,
    new_id,
    parse_body,
    parse_chat,
    parse_completion,
    prompt_ids,
    usage,
)
from .scheduler import Event, QueueFull, Request, Scheduler, ShuttingDown
from .text import TextStream
from .tools import check_support

log = logging.getLogger("redrafter_mlx.serve")

DISCARD_LIMIT = 64 << 20  # the most of a refused body read (and dropped) so the 413 arrives
LINGER_S = 1.0  # after a 413: how long a client sending nothing more is waited for
READ_DEADLINE = "redrafter_mlx.read_deadline"  # scope key: when the request must be read by
RELEASE = "redrafter_mlx.release"  # scope key: stop counting this connection (a 413 answered)


class EngineFailure(Exception):
    """An error event from the engine (status 500 or 503)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass
class ServeConfig:
    """What the app needs besides the scheduler."""

    tokenizer: object
    model_id: str
    max_tokens_limit: int
    context: int | None
    vocab_size: int
    beam: dict  # {"beam_width", "beam_length", "capacity", "lookup", "lookup_length",
    # "adaptive"}: the asked shape (adaptive: each step's shape is chosen); {}: AR
    aliases: tuple[str, ...] = ()  # other names a request's ``model`` may use
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    sampling_defaults: dict = field(default_factory=dict)  # the model's generation_config
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S  # a whole request: beyond, closed / 408
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    @property
    def names(self) -> tuple[str, ...]:
        """The id first, then the aliases (no repeats): what ``/v1/models`` lists."""
        return tuple(dict.fromkeys((self.model_id, *self.aliases)))


def error_response(
    message: str, status: int, type: str, param=None, code=None, anthropic=False
) -> JSONResponse:
    """An error in the endpoint's API's shape: OpenAI's, or (``anthropic``) Anthropic's."""
    if anthropic:
        return JSONResponse(areply.error_body(message, status), status_code=status)
    return JSONResponse(error_body(message, type, param, code), status_code=status)


def _refusal_body(e: ProtocolError, anthropic: bool) -> dict:
    return areply.error_body(e.message, e.status) if anthropic else e.body()


ERROR_TYPES = {429: "rate_limit_error", 500: "server_error", 503: "server_error"}


def create_app(scheduler: Scheduler, config: ServeConfig, start_engine: bool = True) -> Starlette:
    """The OpenAI-compatible app over one scheduler (started and stopped with the app)."""
    started = int(time.time())

    async def chat_completions(request: HTTPRequest) -> Response:
        return await _complete(request, parse_chat)

    async def completions(request: HTTPRequest) -> Response:
        return await _complete(request, parse_completion)

    async def messages(request: HTTPRequest) -> Response:
        """The Anthropic Messages API (``anthropic.py``), on the same scheduler."""
        parse = functools.partial(parse_anthropic, tokenizer=config.tokenizer)
        return await _complete(request, parse, anthropic=True)

    async def _complete(request: HTTPRequest, parse, anthropic: bool = False) -> Response:
        deadline = _read_deadline(request, config.read_timeout_s)
        try:
            raw = _read_body(request, config.max_body_bytes)
            body = parse_body(await _within(raw, deadline, config.read_timeout_s))
            params = parse(body, config.max_tokens_limit)
            check_model(params.model, config.names)
            if params.kind == "chat":
                check_support(params.tools, params.messages, config.tokenizer)
            ids = prompt_ids(params, config.tokenizer)
            param = "messages" if params.kind == "chat" else "prompt"
            check_context(ids, config.context, config.vocab_size, param)
            check_bias_ids(params.sent.get("logit_bias", ()), config.vocab_size)
            check_ids(params.stop_ids, config.vocab_size, "stop_token_ids")
            if scheduler.branches is not None:
                _check_unbranched(params)
        except ProtocolError as e:
            body = _refusal_body(e, anthropic)
            if e.status == 413:  # answered now; the connection closes by the read deadline
                return _Refusal(body, e.status, deadline)
            if e.status == 408:
                return JSONResponse(body, e.status, headers={"Connection": "close"})
            return JSONResponse(body, status_code=e.status)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            return Response(status_code=499)
        return await _generate(request, params, ids, anthropic)

    async def _generate(http: HTTPRequest, params, ids: list[int], anthropic: bool) -> Response:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        room = (config.context or 1 << 30) - len(ids)
        request = Request(
            ids,
            params.max_tokens or min(config.max_tokens_limit, room),
            sink=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
            sampler=params.sampling(config.sampling_defaults),
            id=areply.new_id() if anthropic else new_id(params.kind),
            stop_ids=params.stop_ids,
            ignore_eos=params.ignore_eos,
            min_tokens=params.min_tokens,
            logprobs=params.logprobs,
        )
        try:
            scheduler.submit(request)
        except QueueFull as e:
            return error_response(str(e), 429, "rate_limit_error", None, "queue_full", anthropic)
        except ShuttingDown as e:
            return error_response(str(e), 503, "server_error", anthropic=anthropic)
        except ValueError as e:
            return error_response(str(e), 400, "invalid_request_error", anthropic=anthropic)
        tok, keep, channels = config.tokenizer, frozenset(), Channels.plain()
        if params.kind == "chat":
            keep = shown_specials(tok, params.tools)
            channels = Channels.of_answer(tok, params.tools, ids, params.stream)
        text = TextStream(tok, params.stop, params.min_tokens, keep)
        trail = Trail(params.kind, params.logprobs, tok)
        run = _Run(request, events, text, params, channels, anthropic, trail)
        if params.stream:
            return await _stream(http, run)
        return await _collect(http, run)

    async def _stream(http: HTTPRequest, run: _Run) -> Response:
        """SSE; the first event is awaited first so that early failures keep their status."""
        try:
            first = await _until_disconnect(http, run.events.get(), run)
        except asyncio.CancelledError:
            run.request.cancel()
            raise
        if first is None:
            return Response(status_code=499)
        if first.error is not None:
            return _failure(first.error, first.status, run.anthropic)
        sse = _anthropic_sse(run, first) if run.anthropic else _sse(run, first)
        return StreamingResponse(sse, media_type="text/event-stream")

    async def _sse(run: _Run, first: Event):
        reply = Reply(run.params.kind, run.request.id, config.model_id)
        try:
            yield _data(reply.chunk(None, first=True))
            async for part, finish in run.parts(first):
                if part:
                    yield _data(reply.chunk(part, logprobs=run.logprobs()))
                if finish is not None:
                    yield _data(reply.chunk(None, finish=finish, logprobs=run.logprobs()))
            if run.params.include_usage:
                yield _data(reply.usage_chunk(run.usage(), run.speculation(config.beam)))
            yield "data: [DONE]\n\n"
            run.log()
        except EngineFailure as e:
            run.finish = "error"
            yield _data(error_body(str(e), ERROR_TYPES.get(e.status, "server_error")))
        finally:
            _after_stream(run)

    async def _anthropic_sse(run: _Run, first: Event):
        """The Messages API's events: ``message_start``, each block's start, deltas and
        stop (``anthropic_reply.Blocks``), ``message_delta`` (stop reason, usage),
        ``message_stop``; an engine failure mid-stream is an ``error`` event."""
        request, blocks = run.request, areply.Blocks()
        start = areply.message_start(request.id, config.model_id, len(request.prompt))
        try:
            yield areply.event("message_start", start)
            yield areply.event("ping", {"type": "ping"})
            finish = None
            async for part, fin in run.parts(first):
                for name, data in blocks.add(part):
                    yield areply.event(name, data)
                finish = fin or finish
            for name, data in blocks.close():
                yield areply.event(name, data)
            spec = run.speculation(config.beam)
            end = areply.message_delta(finish, run.text.matched, run.usage(), spec)
            yield areply.event("message_delta", end)
            yield areply.event("message_stop", {"type": "message_stop"})
            run.log()
        except EngineFailure as e:
            run.finish = "error"
            yield areply.event("error", areply.error_body(str(e), e.status))
        finally:
            _after_stream(run)

    async def _collect(http: HTTPRequest, run: _Run) -> Response:
        async def gather():
            whole, finish = Part(), None
            async for part, fin in run.parts(None):
                whole += part
                finish = fin or finish
            return whole, finish

        async def blocks():  # the Messages API's content blocks, in the answer's order
            whole, finish = areply.Blocks(), None
            async for part, fin in run.parts(None):
                whole.add(part)
                finish = fin or finish
            return whole, finish

        try:
            result = await _until_disconnect(http, blocks() if run.anthropic else gather(), run)
        except EngineFailure as e:
            return _failure(str(e), e.status, run.anthropic)
        if result is None:
            return Response(status_code=499)
        answer, finish = result
        run.log()
        usage_, spec = run.usage(), run.speculation(config.beam)
        if run.anthropic:
            matched = run.text.matched
            body = areply.message(
                run.request.id, config.model_id, answer, finish, matched, usage_, spec
            )
            return JSONResponse(body)
        reply = Reply(run.params.kind, run.request.id, config.model_id)
        return JSONResponse(reply.full(answer, finish, usage_, spec, run.logprobs()))

    def card(name: str) -> dict:
        return dict(id=name, object="model", created=started, owned_by="redrafter-mlx")

    async def models(request: HTTPRequest) -> Response:
        """The loaded model under each name a request may use (its id first)."""
        return JSONResponse({"object": "list", "data": [card(n) for n in config.names]})

    async def model(request: HTTPRequest) -> Response:
        """``GET /v1/models/{id}``: the model under that name (an id may hold slashes), as
        ``models.retrieve`` reads it; 404 ``model_not_found`` for a name not served."""
        name = request.path_params["model_id"]
        try:
            check_model(name, config.names)
        except ProtocolError as e:
            return JSONResponse(e.body(), status_code=e.status)
        served = {n.casefold(): n for n in config.names}
        return JSONResponse(card(served[name.casefold()]))

    async def health(request: HTTPRequest) -> Response:
        """200 ``ok`` or ``draining``; 503 ``failed`` once the engine loop has died."""
        stats = scheduler.health()
        status = "failed" if stats["failure"] else "draining" if stats["draining"] else "ok"
        body = {"status": status, "model": config.model_id, **stats}
        return JSONResponse(body, status_code=503 if stats["failure"] else 200)

    async def http_error(request: HTTPRequest, exc: HTTPException) -> Response:
        kind, anthropic = "invalid_request_error", _is_anthropic(request)
        return error_response(exc.detail, exc.status_code, kind, anthropic=anthropic)

    async def server_error(request: HTTPRequest, exc: Exception) -> Response:
        log.exception("unhandled error in a handler")
        message, anthropic = f"internal error: {type(exc).__name__}", _is_anthropic(request)
        return error_response(message, 500, "server_error", anthropic=anthropic)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if start_engine:
            scheduler.start()
        yield
        scheduler.begin_drain(0.0)
        await asyncio.to_thread(scheduler.stop)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    handlers = {HTTPException: http_error, Exception: server_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.serve_config = config  # make_server reads the connection limits from it
    return app


def wire_finish(finish: str) -> str:
    """The ``finish_reason`` a client reads for the engine's ``finish``: OpenAI's values
    (``"stop"``, ``"length"``), so a cut by the model's context (``"context"``) is
    ``"length"``, as OpenAI and vLLM report it."""
    return "length" if finish == "context" else finish


def _is_anthropic(request: HTTPRequest) -> bool:
    """Whether the request was sent to the Messages API (its errors take its shape)."""
    return request.url.path.rstrip("/").startswith("/v1/messages")


def _after_stream(run: _Run) -> None:
    """A stream's end, however it ended: a client gone mid-answer logged, its row freed."""
    if run.finish is None and not run.request.cancelled.is_set():
        log.info("%s: client disconnected after %d tokens", run.request.id, run.tokens)
    run.request.cancel()  # a no-op once finished; frees the row after a disconnect


class _Run:
    """One request in flight on the HTTP side: its events, text (``TextStream``), the
    text's channels (a chat's: ``Channels.of_answer``; else all content), counters,
    whether it speaks the Messages API (``anthropic``) and its tokens' logprobs (``trail``)."""

    def __init__(
        self,
        request: Request,
        events: asyncio.Queue,
        text: TextStream,
        params,
        channels: Channels | None = None,
        anthropic: bool = False,
        trail: Trail | None = None,
    ):
        self.request, self.events, self.text, self.params = request, events, text, params
        self.channels = channels or Channels.plain()
        self.anthropic = anthropic
        self.tokens = 0
        self.finish: str | None = None
        self.stats = None
        self.trail = trail or Trail("chat", None, None)  # its tokens' logprobs (none asked)

    def logprobs(self) -> dict | None:
        """The logprobs of the tokens not yet sent (None: not asked for, or none new)."""
        return self.trail.take(self.text.decoder.tokens)

    async def pieces(self, first: Event | None):
        """Yield (text delta, finish reason or None: ``wire_finish``) until the request ends.

        A stop string ends it early (the engine row is cancelled); an engine error raises.
        """
        event = first if first is not None else await self.events.get()
        while True:
            self.stats = event.stats
            if event.error is not None:
                raise EngineFailure(event.error, event.status)
            delta, stopped = self.text.add(event.tokens)
            self.tokens = self.text.tokens
            self.trail.add(event.logprobs, self.tokens)
            if stopped:
                self.request.end()
                self.finish = "stop"
                yield delta, "stop"
                return
            if event.finish is not None:
                self.finish = event.finish  # the engine's reason (logged)
                yield delta + self.text.finish(), wire_finish(event.finish)
                return
            yield delta, None
            event = await self.events.get()

    async def parts(self, first: Event | None):
        """Yield (``Part``: the new text by channel, finish reason or None) until the
        request ends: ``pieces`` split by the answer's ``Channels``. An answer that made tool
        calls and stopped finishes ``"tool_calls"``; one that may make only one call ends
        (its row freed) once it has."""
        channels = self.channels
        async for delta, finish in self.pieces(first):
            part = channels.add(delta)
            if finish is None and channels.done:
                self.request.end()
                finish = self.finish = "stop"
            elif finish is not None:
                part += channels.finish()
            if finish == "stop" and channels.called:
                finish = self.finish = "tool_calls"
            yield part, finish
            if finish is not None:
                return

    def usage(self) -> dict:
        """Prompt and completion tokens; with branches, every branch's tokens (the text
        holds the rebuilt text, less the split tokens)."""
        branched = self.stats is not None and self.stats.branches
        made = self.stats.generated if branched else self.tokens
        return usage(len(self.request.prompt), made, self.request.cached_tokens)

    def speculation(self, beam: dict) -> dict:
        stats = self.stats.to_dict() if self.stats is not None else {}
        return {"enabled": bool(beam), **beam, **stats}

    def log(self) -> None:
        s = self.stats
        if s is None:
            return
        log.info(
            "%s: prompt %d tok, generated %d tok, %.1f tok/s, %.2f tok/step, "
            "ttft %.3f s, queued %.3f s, finish %s",
            self.request.id,
            len(self.request.prompt),
            self.tokens,
            s.generated / max(s.decode_s, 1e-9),
            s.tokens_per_step,
            s.ttft_s,
            s.queued_s,
            self.finish,
        )


async def _read_body(request: HTTPRequest, limit: int) -> bytes:
    """The body, or ProtocolError 413 once it is over ``limit`` bytes: by its Content-Length
    up front, else (chunked) as soon as the bytes received pass it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared)} bytes", limit)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"over {limit} bytes", limit)
        parts.append(chunk)
    return b"".join(parts)


def _check_unbranched(params) -> None:
    """ProtocolError for the fields a server running APAR branches does not honour (each
    branch is a row that ends on its own)."""
    for name, value in (
        ("stop_token_ids", params.stop_ids),
        ("ignore_eos", params.ignore_eos),
        ("min_tokens", params.min_tokens),
        ("logprobs", params.logprobs is not None),
    ):
        if value:
            raise ProtocolError(
                f"'{name}' is not supported while this server runs APAR branches "
                "(serve --branches); drop it, or start the server with --branches off",
                name,
            )


def _read_deadline(request: HTTPRequest, seconds: float) -> float:
    """When this request must be read by (event loop time): ``seconds`` after the server began
    waiting for it (the connection opened, or the previous response ended: stamped in the
    scope by ``runner._timed_http``), else (another server) ``seconds`` from now."""
    deadline = request.scope.get(READ_DEADLINE)
    return deadline if deadline is not None else asyncio.get_running_loop().time() + seconds


async def _within(read, deadline: float, seconds: float):
    """Await ``read`` (the body), or ProtocolError 408 once the request's read ``deadline``
    passes (``seconds``: the read timeout, for the message): a client that sends slowly (or
    never) holds its connection no longer than the read timeout, however it sends."""
    left = deadline - asyncio.get_running_loop().time()
    try:
        return await asyncio.wait_for(read, max(left, 0.0))
    except TimeoutError:
        raise ProtocolError(
            f"the request was not received within {seconds:g} s (serve --read-timeout)",
            status=408,
            code="request_timeout",
        ) from None


def _too_large(size: str, limit: int) -> ProtocolError:
    return ProtocolError(
        f"the request body is {size}; this server takes at most {limit} bytes "
        "(raise it with serve --max-body-bytes)",
        status=413,
        code="request_too_large",
    )


class _Refusal(JSONResponse):
    """An error answered while the client may still be sending its body (a 413): the whole
    answer is sent at once, then the rest of the body is read and dropped, so that a client
    still sending reads the answer instead of a reset connection, until the body ends, the
    client sends nothing for ``LINGER_S``, ``DISCARD_LIMIT`` bytes or the request's read
    ``deadline``, whichever comes first; then the connection closes."""

    def __init__(self, content: dict, status: int, deadline: float):
        super().__init__(content, status, headers={"Connection": "close"})
        self.deadline = deadline

    async def __call__(self, scope, receive, send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": True})
        if (release := scope.get(RELEASE)) is not None:  # answered: no longer a client's
            release()  # connection under --max-connections while its body is dropped
        await _discard_body(receive, self.deadline)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _discard_body(receive, deadline: float) -> None:
    """Read and drop the rest of a refused body (``_Refusal``)."""
    loop, seen = asyncio.get_running_loop(), 0
    while seen <= DISCARD_LIMIT:
        wait = min(LINGER_S, deadline - loop.time())
        if wait <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), wait)
        except TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return  # the body ended, or the client left
        seen += len(message.get("body", b""))


async def _until_disconnect(http: HTTPRequest, work, run: _Run):
    """Await ``work``; if the client disconnects first, cancel the request and return None."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    run.request.cancel()
    log.info("%s: client disconnected", run.request.id)
    return None


async def _disconnected(http: HTTPRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _failure(message: str, status: int, anthropic: bool = False) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "server_error")
    return error_response(message, status, kind, anthropic=anthropic)
