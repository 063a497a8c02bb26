"""What the server's scheduler takes in and gives out: a ``Request`` (a prompt, its limit,
its sampling settings and a ``sink``), the ``Event``s a request receives, and the engine
events rank 0 decides and every rank applies under ``mlx.launch`` (one broadcast per loop
iteration, ``share``)."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from redrafter_mlx.engine.base.distributed import broadcast_bytes
from redrafter_mlx.engine.core.logprobs import MAX_TOP_LOGPROBS
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.loop.rows import RowStats


class QueueFull(Exception):
    """The request queue is at ``max_queue``: try again later (HTTP 429)."""


class ShuttingDown(Exception):
    """The server is draining and accepts no new requests (HTTP 503)."""


@dataclass
class Event:
    """What a request receives: new tokens, then one event with ``finish`` or ``error``.

    finish: "stop" (EOS), "length" (max_tokens) or "context" (the model's context is full:
    ``engine.loop.run.make_row``); error: a message, with ``status`` the HTTP code
    (500 engine failure, 503 shutdown); ``logprobs``: per token of ``tokens``,
    ``(logprob, ((id, logprob), ...))`` when the request asked for them (``Request.logprobs``).
    """

    tokens: list[int]
    stats: RowStats
    finish: str | None = None
    error: str | None = None
    status: int = 200
    logprobs: list | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None or self.error is not None


_ids = itertools.count()


@dataclass
class Request:
    """One generation. ``sink`` is called on the engine thread with each ``Event``;
    ``sampler``: its sampling settings and seed (None: rank 0 draws one at admission).
    It ends ("stop") at the model's EOS (not with ``ignore_eos``) and at any of its
    ``stop_ids``, neither of which ends it within its first ``min_tokens`` tokens.
    ``logprobs``: each token's log-probability and its ``logprobs`` most likely tokens'
    (``engine.core.logprobs``) come with its events; None: none."""

    prompt: list[int]
    max_tokens: int
    sink: Callable[[Event], None]
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    stop_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    cached_tokens: int = 0  # of its prompt, taken from the prompt cache (set at admission)
    complete: bool = False  # ended by its client with its answer whole (a stop string)

    def cancel(self) -> None:
        """Ask the engine to free this request's row at the next step boundary."""
        self.cancelled.set()

    def end(self) -> None:
        """Free the row as ``cancel`` does, the answer being complete (a stop string ended
        it): ``/health`` counts it done, not cancelled."""
        self.complete = True
        self.cancelled.set()


@dataclass
class Held:
    """A request holding a batch row (the batch ``Row``'s owner)."""

    request: Request
    ticket: int
    answered: bool = False  # its last event (finish or error) was sent
    ends: frozenset = frozenset()  # the token ids that end its rows (``Scheduler.ends``)


@dataclass
class ServerStats:
    """Whole-server counters (``GET /health``)."""

    steps: int = 0
    max_rows_per_step: int = 0
    row_steps: int = 0
    requests_done: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0
    generated: int = 0
    engine_errors: int = 0  # batch faults (every request in flight failed)
    request_errors: int = 0  # one request's own failure (the others went on)

    def record_step(self, rows: int) -> None:
        self.steps += 1
        self.row_steps += rows
        self.max_rows_per_step = max(self.max_rows_per_step, rows)

    def to_dict(self) -> dict:
        """The counters as ``/health`` shows them."""
        return dict(
            steps=self.steps,
            max_rows_per_step=self.max_rows_per_step,
            row_steps=self.row_steps,
            mean_rows_per_step=round(self.row_steps / max(self.steps, 1), 3),
            requests_done=self.requests_done,
            requests_failed=self.requests_failed,
            requests_cancelled=self.requests_cancelled,
            generated_tokens=self.generated,
            engine_errors=self.engine_errors,
            request_errors=self.request_errors,
        )


def check(request: Request, model) -> None:
    """Raise ValueError for a request the engine cannot run (empty, off-vocab, too long)."""
    if not request.prompt:
        raise ValueError("the prompt has no tokens")
    V = model.vocab_size
    if any(not 0 <= t < V for t in request.prompt):
        raise ValueError(f"prompt token ids must be in [0, {V})")
    if request.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
    if any(not 0 <= t < V for t in request.stop_ids):
        raise ValueError(f"stop token ids must be in [0, {V})")
    if request.logprobs is not None and not 0 <= request.logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {request.logprobs}")
    if not 0 <= request.min_tokens <= request.max_tokens:
        raise ValueError(
            f"min_tokens must be in [0, max_tokens = {request.max_tokens}], "
            f"got {request.min_tokens}"
        )
    context = model.max_context
    if context is not None and len(request.prompt) >= context:
        raise ValueError(
            f"the prompt has {len(request.prompt)} tokens; the model's context is {context} tokens"
        )
    request.sampler.validate(V)


# --- Engine events: what rank 0 decides and every rank applies (``Scheduler._apply``), as
# JSON-ready dicts. ``ticket``: the request's number in admission order, the same on every
# rank.
#   {"op": "admit", "ticket": n, "seed": s, "request": {...}}: a request starts
#       prefilling; ``seed`` is its own or one rank 0 drew, so sampled rows agree
#   {"op": "free", "ticket": n, "error": message or None, "status": code}: its row or
#       prefill leaves (cancelled, or ended by the server with ``error``)
#   {"op": "stop"}: the loop ends (a follower's ``follow`` returns)

STOP = {"op": "stop"}


def admit_event(request: Request, seed: int, ticket: int) -> dict:
    """The event that admits ``request`` (its prompt and settings, not its sink)."""
    fields = dict(prompt=request.prompt, max_tokens=request.max_tokens, id=request.id)
    fields.update(stop_ids=request.stop_ids, ignore_eos=request.ignore_eos)
    fields.update(min_tokens=request.min_tokens, sampler=request.sampler.to_dict())
    fields.update(logprobs=request.logprobs)
    return {"op": "admit", "ticket": ticket, "seed": seed, "request": fields}


def free_event(ticket: int, error: str | None = None, status: int = 500) -> dict:
    return {"op": "free", "ticket": ticket, "error": error, "status": status}


def request_from(event: dict) -> Request:
    """A follower's copy of an admitted request; nobody reads its events."""
    fields = dict(event["request"])
    sent = dict(fields.pop("sampler"))
    sent["logit_bias"] = tuple((int(t), float(b)) for t, b in sent["logit_bias"].items())
    fields["stop_ids"] = tuple(fields["stop_ids"])
    return Request(sink=lambda ev: None, sampler=SamplerConfig.resolve(sent), **fields)


def share(events: list[dict] | None, group, faults: int, nap: float = 0.0) -> list[dict]:
    """Rank 0's ``events`` on every rank of ``group`` (one broadcast between steps; alone:
    ``events``). A rank whose count of batch ``faults`` differs from rank 0's has left its
    schedule: RuntimeError.

    An idle rank 0 tells the others to sleep ``nap`` seconds before the next message, rather
    than wait in the ``all_sum``, whose wait polls (on the ring backend about a third of a
    core); a request reaching an idle server starts up to that much later."""
    if group is None:
        return events
    raw = None
    if group.rank() == 0:
        raw = json.dumps({"events": events, "faults": faults, "nap": nap}).encode()
    message = json.loads(broadcast_bytes(raw, group))
    if message["faults"] != faults:
        raise RuntimeError(
            f"rank {group.rank()} is out of step with rank 0 after an engine "
            f"failure ({faults} batch faults here, {message['faults']} on rank 0)"
        )
    if group.rank() != 0 and message["nap"]:
        time.sleep(message["nap"])
    return message["events"]
