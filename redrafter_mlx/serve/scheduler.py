"""The engine loop: continuous batching of speculative decoding over fixed batch rows.

One thread owns the model and the KV cache (``Scheduler.serve_forever``). HTTP handlers only
``submit`` requests into a bounded queue and receive ``Event``s through each request's
``sink`` (called on the engine thread; the app forwards them to asyncio).

Each loop iteration, at a step boundary:

1. cancelled rows leave (their slot is free again);
2. queued requests take free rows: each prompt is prefilled alone in a one-row cache (exactly
   as a solo run prefills it), about one chunk (``PREFILL_CHUNK`` tokens) per iteration so a
   long prompt pauses the other rows one chunk at a time; once prefilled, its first token is
   drawn with the request's own key, and the row's K/V, hidden state, init token, length and
   key are written into the batch;
3. the next step is queued (``mx.async_eval``) for all rows, with the ``active`` mask;
4. the previous step, already computed, is read: each row owned by the same request when
   the step was queued gets its tokens, stops exactly at EOS or its limit, and leaves.

Batch size: the step is compiled for a few row counts (1, 2, 4, ... up to ``max_batch``),
so a lone request does not pay for seven idle rows. The batch grows when a request finds no
free row and shrinks once at most a quarter of its rows are busy; both re-lay the cache
(a copy, at a step boundary, rare) and never recompile per join or leave.

Under ``mlx.launch`` (the model split across ranks, ``engine/distributed.py``) every rank
runs this loop over its shard; only rank 0 has the HTTP server, the queue, the clients'
cancellations and the clock. What those decide reaches the engine only as a few events
(a request admitted, with its settings and seed; a row or prefill freed; stop), and each
iteration rank 0 sends that iteration's list to every rank in one broadcast, between steps
(``_share``); every rank, rank 0 included, applies it with the one rule, ``_apply``.
The rest of an iteration (prefilling, joining, the step, reading it, rows stopping at EOS
or their limit, the batch resizing) follows from the events and the tokens, which are the
same on every rank, so the ranks run the same steps in the same order. ``follow`` is the
loop of a rank other than 0: no queue, no HTTP, until rank 0's stop event.

Failures are isolated: an exception in one request's own work (admitting, prefilling, drawing
its first token) ends that request with an error event and the others go on; only an
exception in the batch's work (the batched step, resizing, placing a row) fails every
request in flight, each with an error event, and the loop starts over with an empty batch.

Every row's output is what the same request alone produces (``redrafter_mlx.generate`` with
the same beam shape, seed and sampling settings): rows never read each other's cache, free
rows never advance, and each row's draws use its own key sequence.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from redrafter_mlx.engine.adaptive import Adaptive, rank0_shape
from redrafter_mlx.engine.cache import (
    PREFILL_CHUNK,
    SLOT_QUANTUM,
    Session,
    ensure_slots,
    prefill_session,
    step_window,
    stop_at,
    text_history,
    token_limit,
)
from redrafter_mlx.engine.decode import DecodeState, StepOutput, first_draw
from redrafter_mlx.engine.distributed import broadcast_bytes
from redrafter_mlx.engine.loading import materialize
from redrafter_mlx.engine.lookup import LookupShadow
from redrafter_mlx.engine.penalties import bias_vector
from redrafter_mlx.engine.sampling import SamplerConfig, check_seed
from redrafter_mlx.engine.shape import AR, BeamShape

from .batch_step import RowParams, StepMode, make_batch_step
from .choice import BatchChoice

log = logging.getLogger("redrafter_mlx.serve")

PENALTY_SPANS = (20, 64, 256, 1024)  # history a batch's penalties read: few compile keys
IDLE_NAP = 0.8  # of rank 0's idle wait: how long the other ranks sleep while it idles


class QueueFull(Exception):
    """The request queue is at ``max_queue``: try again later (HTTP 429)."""


class ShuttingDown(Exception):
    """The server is draining and accepts no new requests (HTTP 503)."""


@dataclass
class RowStats:
    """One request's counters; ``tokens_per_step`` counts tokens each step emitted."""

    prompt_tokens: int
    generated: int = 0
    steps: int = 0
    emitted_by_steps: int = 0
    accepted_drafts: int = 0
    lookup_drafts: int = 0  # accepted drafts that came from a context-lookup chain
    drafted: int = 0  # draft tokens its steps could accept (a shape's longest candidate, less 1)
    queued_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted_by_steps / max(self.steps, 1)

    def to_dict(self) -> dict:
        """JSON-ready speculation stats; ``acceptance_rate`` = accepted / drafted tokens."""
        drafted = self.drafted
        return dict(
            steps=self.steps,
            tokens_per_step=round(self.tokens_per_step, 4),
            accepted_draft_tokens=self.accepted_drafts,
            accepted_from_drafter=self.accepted_drafts - self.lookup_drafts,
            accepted_from_lookup=self.lookup_drafts,
            acceptance_rate=round(self.accepted_drafts / drafted, 4) if drafted else 0.0,
            generation_tps=round(self.generated / max(self.decode_s, 1e-9), 2),
            time_to_first_token=round(self.ttft_s, 4),
            queue_s=round(self.queued_s, 4),
        )


@dataclass
class Event:
    """What a request receives: new tokens, then one event with ``finish`` or ``error``.

    finish: "stop" (EOS) or "length"; error: a message, with ``status`` the HTTP code
    (500 engine failure, 503 shutdown).
    """

    tokens: list[int]
    stats: RowStats
    finish: str | None = None
    error: str | None = None
    status: int = 200

    @property
    def done(self) -> bool:
        return self.finish is not None or self.error is not None


_ids = itertools.count()


@dataclass
class Request:
    """One generation. ``sink`` is called on the engine thread with each ``Event``."""

    prompt: list[int]
    max_tokens: int
    sink: Callable[[Event], None]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        """Ask the engine to free this request's row at the next step boundary."""
        self.cancelled.set()

    @property
    def sampler(self) -> SamplerConfig:
        return SamplerConfig(
            self.temperature,
            self.top_p,
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
        )


FREE_ROW = Request([], 1, sink=lambda event: None)  # a free row's settings: greedy, no penalty

# --- Engine events: what rank 0 decides and every rank applies (``Scheduler._apply``), as
# JSON-ready dicts. ``ticket``: the request's number in admission order, the same on every
# rank.
#   {"op": "admit", "ticket": n, "seed": s, "request": {field: value}}: a request starts
#       prefilling; ``seed`` is its own or one rank 0 drew, so sampled rows agree
#   {"op": "free", "ticket": n, "error": message or None, "status": code}: its row or
#       prefill leaves (cancelled, or ended by the server with ``error``)
#   {"op": "stop"}: the loop ends (a follower's ``follow`` returns)

REQUEST_FIELDS = (
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "id",
)
STOP = {"op": "stop"}


def admit_event(request: Request, seed: int, ticket: int) -> dict:
    """The event that admits ``request`` (its prompt and settings, not its sink)."""
    fields = {name: getattr(request, name) for name in REQUEST_FIELDS}
    fields["logit_bias"] = [list(pair) for pair in request.logit_bias]
    return {"op": "admit", "ticket": ticket, "seed": seed, "request": fields}


def free_event(ticket: int, error: str | None = None, status: int = 500) -> dict:
    return {"op": "free", "ticket": ticket, "error": error, "status": status}


def request_from(event: dict) -> Request:
    """A follower's copy of an admitted request; nobody reads its events."""
    fields = dict(event["request"])
    fields["logit_bias"] = tuple((int(t), float(b)) for t, b in fields["logit_bias"])
    return Request(sink=lambda ev: None, **fields)


@dataclass
class Row:
    """A request occupying a batch row; ``length`` is its exact cache length as last read."""

    request: Request
    limit: int
    stats: RowStats
    length: int
    joined: float
    slot: int
    ticket: int
    out: int = 0
    finished: bool = False
    shadow: LookupShadow | None = None  # what lookup would have given it (adaptive shapes)


@dataclass
class Prefill:
    """A request being prefilled alone, one chunk at a time, before it takes a row."""

    request: Request
    session: Session
    started: float
    seed: int  # its draws' seed: the request's, else one rank 0 chose (the same everywhere)
    ticket: int  # its number in admission order (the same on every rank)
    done: int = 0  # prompt tokens prefilled so far
    hidden: mx.array | None = None  # (1, H) at the last prefilled token

    def advance(self) -> int:
        """Prefill the next chunk; returns its token count.

        Chunk by chunk through the engine's own prefill, with the session's cached tokens
        kept current, this computes exactly what one solo prefill of the prompt computes.
        """
        prompt = self.request.prompt
        chunk = prompt[self.done : self.done + PREFILL_CHUNK]
        self.hidden = prefill_session(self.session, [chunk])
        self.done += len(chunk)
        self.session.cached = [prompt[: self.done]]
        return len(chunk)

    @property
    def complete(self) -> bool:
        return self.done == len(self.request.prompt)


@dataclass
class Queued:
    """A queued step: its output, the rows it ran (by index when queued: as many as the
    batch had), its shape (None: plain decoding, the fixed-shape batch's only step), and
    when it was queued (None: not a step time, e.g. it compiled)."""

    out: StepOutput
    owners: tuple[Row | None, ...]
    shape: BeamShape | None
    started: float | None


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
    resizes: int = 0

    def record_step(self, rows: int) -> None:
        self.steps += 1
        self.row_steps += rows
        self.max_rows_per_step = max(self.max_rows_per_step, rows)


def row_buckets(max_batch: int) -> list[int]:
    """Batch sizes the step is compiled for: 1, 2, 4, ... below ``max_batch``, then it."""
    sizes = [1]
    while sizes[-1] * 2 < max_batch:
        sizes.append(sizes[-1] * 2)
    return sizes + ([max_batch] if max_batch > 1 else [])


class Scheduler:
    """Continuous batching over ``max_batch`` rows; drive with ``run_once`` or a thread."""

    def __init__(
        self,
        model,
        drafter,
        shape: BeamShape | None,
        eos_token_ids=(),
        max_batch: int = 8,
        max_queue: int = 64,
        compiled: bool = True,
        group=None,
        adapt: Adaptive | bool = False,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.drafter = model, drafter
        if drafter is not None and shape is None:
            raise ValueError("a drafter needs a beam shape")
        shape = (shape or AR).runnable(drafter is not None)
        self.shape = None if shape.is_autoregressive else shape
        materialize(model, drafter)
        self.max_batch = max_batch
        self.buckets = row_buckets(max_batch)
        self.eos = {int(e) for e in eos_token_ids}
        self.compiled = compiled
        self.queue: queue.Queue[Request] = queue.Queue(maxsize=max(max_queue, 1))
        self.per_step = 1 if self.shape is None else self.shape.longest  # most tokens per step
        self.width = 1 if self.shape is None else self.shape.slots  # slots written per step
        # Adaptive: each step's shape chosen among the candidates of ``shape`` (serve/choice.py).
        self.choice: BatchChoice | None = None
        if adapt and self.shape is not None:
            settings = adapt if isinstance(adapt, Adaptive) else Adaptive()
            self.choice = BatchChoice(self.shape, settings)
            self.per_step, self.width = self.choice.per_step, self.choice.slots
        self.stats = ServerStats()
        self._steps: dict[tuple[BeamShape | None, StepMode], Callable] = {}
        self._traced: set = set()  # (shape, mode, rows, window, slots) of steps already run
        self._draining = False
        self._drain_deadline = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: str | None = None  # why the engine loop stopped, if it died
        self.ready = threading.Event()
        self.state = None  # built by the first run_once, on the thread that runs the loop
        self.rows: list[Row | None] = [None]
        self._pending = None
        self._prefills: list[Prefill] = []
        # Under mlx.launch: the ranks' group; rank 0 (``leader``) decides the events.
        self.group = group
        self.leader = group is None or group.rank() == 0
        self._tickets = itertools.count()
        self._incoming: dict[int, Request] = {}  # admitted, not yet applied (rank 0)
        self._faults = 0  # batch faults since the start (never reset: the ranks compare it)
        self._released = False

    # ------------------------------------------------------------------ public API

    def submit(self, request: Request) -> None:
        """Enqueue a request; raises QueueFull (queue at capacity) or ShuttingDown."""
        if self._draining:
            raise ShuttingDown(self.failure or "the server is shutting down")
        self.check(request)
        try:
            self.queue.put_nowait(request)
        except queue.Full:
            raise QueueFull(f"the request queue is full ({self.queue.maxsize} waiting)") from None
        if self.failure is not None:  # the loop died while this request went in
            self._reject_queued(self.failure, 500)

    def check(self, request: Request) -> None:
        """Raise ValueError for a request the engine cannot run (empty, off-vocab, too long)."""
        if not request.prompt:
            raise ValueError("the prompt has no tokens")
        V = self.model.vocab_size
        if any(not 0 <= t < V for t in request.prompt):
            raise ValueError(f"prompt token ids must be in [0, {V})")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
        context = self.model.max_context
        if context is not None and len(request.prompt) >= context:
            raise ValueError(
                f"the prompt has {len(request.prompt)} tokens; the model's context is "
                f"{context} tokens"
            )
        check_seed(request.seed)
        request.sampler.validate(V)

    @property
    def active_rows(self) -> int:
        return sum(r is not None for r in self.rows)

    def health(self) -> dict:
        """Live counters for ``GET /health``."""
        s = self.stats
        return dict(
            max_batch=self.max_batch,
            batch_rows=len(self.rows),
            active_rows=self.active_rows,
            queued=self.queue.qsize(),
            prefilling=len(self._prefills),
            max_queue=self.queue.maxsize,
            steps=s.steps,
            max_rows_per_step=s.max_rows_per_step,
            row_steps=s.row_steps,
            mean_rows_per_step=round(s.row_steps / max(s.steps, 1), 3),
            requests_done=s.requests_done,
            requests_failed=s.requests_failed,
            requests_cancelled=s.requests_cancelled,
            generated_tokens=s.generated,
            engine_errors=s.engine_errors,
            request_errors=s.request_errors,
            resizes=s.resizes,
            speculative=self.shape is not None,
            adaptive=self.choice is not None,
            shape_steps=self.choice.steps_run() if self.choice else {},
            step_ms=self.choice.step_ms() if self.choice else {},
            draining=self._draining,
            failure=self.failure,
        )

    def start(self, warmup_prompt: list[int] | None = None, wait: bool = True) -> None:
        """Run the loop on its own thread, the only one that touches the model.

        MLX streams belong to threads, so the batch state is built (and the step compiled by
        ``warmup_prompt``) on that thread; ``wait`` blocks until it is ready.
        """
        if self._thread is None:
            self._thread = threading.Thread(
                target=self.serve_forever, args=(warmup_prompt,), name="redrafter-engine"
            )
            self._thread.daemon = True
            self._thread.start()
        if wait:
            self.ready.wait()
            if self.failure is not None:
                raise RuntimeError(self.failure)

    def serve_forever(self, warmup_prompt: list[int] | None = None) -> None:
        """The engine loop (returns after ``stop``, or once drained).

        Should the loop itself die (a failure while recovering from a failure), every request
        waiting is answered with an error and new ones are refused (503), so none waits
        forever; ``failure`` says why and ``/health`` reports it.
        """
        try:
            self._reset()
            if warmup_prompt is not None:
                self.warmup(warmup_prompt)
            self.ready.set()
            while not self._stop.is_set():
                self.run_once()
                if self._draining and not self._busy() and self.queue.empty():
                    break
        except Exception as e:  # logged, answered and kept in ``failure``
            self._die(e)
        finally:
            self.ready.set()
            self.release()
            self._settle()

    def _settle(self) -> None:
        """Wait for a step still in flight (queued, never read: the loop was stopped), so
        that no MLX work outlives the loop's thread (the process may exit next)."""
        if self._pending is not None:
            with contextlib.suppress(Exception):
                mx.eval(self._pending.out, self.state, self.row_keys)

    def follow(self) -> None:
        """The loop of a rank other than 0 under ``mlx.launch``: apply rank 0's events and
        run the same steps, until rank 0's stop event. RuntimeError if the loop died."""
        self.serve_forever()
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def release(self) -> None:
        """On rank 0 under ``mlx.launch``: send the stop event (once) so that the followers'
        loops end; ``serve_forever`` does it as it returns. Alone, or elsewhere: nothing."""
        if self.group is None or not self.leader or self._released:
            return
        self._released = True
        try:
            self._share([STOP])
        except Exception:
            log.exception("could not tell the other ranks to stop")

    def begin_drain(self, grace_s: float) -> None:
        """Stop accepting; queued requests fail (503); active rows get ``grace_s`` to finish."""
        self._drain_deadline = time.perf_counter() + grace_s
        self._draining = True

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop thread (after ``begin_drain`` it ends by itself once rows are done)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def warmup(self, prompt: list[int], max_tokens: int = 8) -> None:
        """Compile the greedy step once (a short request run to completion on this thread);
        with adaptive shapes, long enough for each shape to run (each one compiles on its
        first step and is timed on its second) unless the answer ends first."""
        if self.choice is not None:
            max_tokens = max(max_tokens, 4 * len(self.choice.shapes))
        done = threading.Event()
        self.submit(Request(prompt, max_tokens, lambda ev: ev.done and done.set()))
        while not done.is_set():
            self.run_once()
        while self._pending is not None:
            self.run_once()
        self.stats = ServerStats()
        if self.choice is not None:
            self.choice.ran.clear()

    # ------------------------------------------------------------------ the loop

    def run_once(self, idle_wait: float = 0.05) -> None:
        """One iteration: this iteration's events (leaves, joins: rank 0 decides them, every
        rank applies them), prefill, queue the next step, read the previous one.

        With adaptive shapes the previous step is read first, before the events: the next
        step's shape is chosen from the text so far (each row's lookup match state)."""
        if self.state is None:
            self._reset()
        if self.choice is not None and self._pending is not None:
            try:
                self._read(self._pending)
                self._pending = None
            except Exception as e:
                self._fail_all(e)
        events = self._share(self._decide(idle_wait) if self.leader else None, idle_wait)
        try:
            if not self._apply(events):
                return
            self._prefill_some()
            self._fit()
            nxt = self._queue_step() if self.active_rows else None
            if self._pending is not None:
                self._read(self._pending)
            self._pending = nxt
        except Exception as e:  # an engine failure fails the rows in flight, not the server
            self._fail_all(e)

    def _busy(self) -> bool:
        return self.active_rows > 0 or self._pending is not None or bool(self._prefills)

    def _reset(self) -> None:
        """Fresh batch state: every row free, empty cache (also after an engine failure)."""
        B, model = self.buckets[0], self.model
        keys, values = model.make_cache(B, SLOT_QUANTUM)
        dtype = keys[0].dtype
        self.state = DecodeState(
            mx.zeros((B,), mx.int32),
            mx.zeros((B, model.state_width), dtype),
            mx.zeros((B,), mx.int32),
            keys,
            values,
            mx.random.key(0),  # unused: rows draw with row_keys
            mx.zeros((B, SLOT_QUANTUM), mx.int32),  # the text: lookup and penalties read it
        )
        self.row_keys = mx.zeros((B, 2), mx.uint32)
        self.rows: list[Row | None] = [None] * B
        self._pending: Queued | None = None
        if self.choice is not None:
            self.choice.reset()
        self._inflight = 0
        self._params: RowParams | None = None
        self._prefills = []

    # ------------------------------------------------------------------ events

    def _decide(self, idle_wait: float) -> list[dict]:
        """This iteration's events, from what only rank 0 sees: the drain clock, the
        clients' cancellations and the queue (waiting up to ``idle_wait`` when idle)."""
        events = self._drain_step()
        leaving = {e["ticket"] for e in events}
        events += [free_event(t) for t in self._cancelled() if t not in leaving]
        leaving |= {e["ticket"] for e in events}
        return events + self._admit(not self._busy(), idle_wait, len(leaving))

    def _share(self, events: list[dict] | None, idle_wait: float = 0.0) -> list[dict]:
        """Rank 0's ``events`` on every rank (one broadcast; alone: ``events``). A rank whose
        count of batch faults differs from rank 0's has left its schedule: RuntimeError.

        An idle rank 0 (no events, nothing in flight: its next iteration waits on the queue)
        tells the others to sleep for most of its ``idle_wait`` before the next message,
        rather than wait in the ``all_sum``, whose wait polls (on the ring backend about a
        third of a core); a request reaching an idle server starts up to that much later."""
        if self.group is None:
            return events
        raw = None
        if self.leader:
            nap = IDLE_NAP * idle_wait if not events and not self._busy() else 0.0
            raw = json.dumps({"events": events, "faults": self._faults, "nap": nap}).encode()
        message = json.loads(broadcast_bytes(raw, self.group))
        if message["faults"] != self._faults:
            raise RuntimeError(
                f"rank {self.group.rank()} is out of step with rank 0 after an engine "
                f"failure ({self._faults} batch faults here, {message['faults']} on rank 0)"
            )
        if not self.leader and message["nap"]:
            time.sleep(message["nap"])
        return message["events"]

    def _apply(self, events: list[dict]) -> bool:
        """Apply one iteration's events, in order; every rank runs this on the same list.
        False: the stop event (the loop ends)."""
        for event in events:
            if event["op"] == "stop":
                self._stop.set()
                return False
            if event["op"] == "free":
                self._free(event["ticket"], event["error"], event["status"])
                continue
            ticket = event["ticket"]
            request = self._incoming.pop(ticket, None) or request_from(event)
            try:
                session = Session(self.model, 1)
            except Exception as e:  # this request's own cache
                self._fail_one(request, e)
                continue
            job = Prefill(request, session, time.perf_counter(), event["seed"], ticket)
            self._prefills.append(job)
        return True

    def _free(self, ticket: int, error: str | None, status: int) -> None:
        """The request with ``ticket`` leaves its prefill or row: cancelled (no ``error``),
        or answered with ``error``."""
        for job in self._prefills:
            if job.ticket == ticket:
                self._prefills.remove(job)
                if error is None:
                    self.stats.requests_cancelled += 1
                else:
                    self._reject(job.request, error, status)
                return
        for r, row in enumerate(self.rows):
            if row is not None and row.ticket == ticket:
                if error is None:
                    row.finished = True
                    self.stats.requests_cancelled += 1
                    log.debug("%s cancelled after %d tokens", row.request.id, row.out)
                else:
                    self._send(row, [], error=error, status=status)
                self._leave(r)
                return

    def _fail_all(self, error: Exception) -> None:
        """Fail every request in flight with a 500 and start over with an empty batch.

        Each request gets exactly one error event: a row's, else its prefill's (a request
        that failed while joining is in both).
        """
        log.exception("engine failure; failing %d request(s) in flight", self.active_rows)
        self.stats.engine_errors += 1
        self._faults += 1
        self._answer_all(f"engine error: {type(error).__name__}: {error}")
        self._reset()

    def _answer_all(self, message: str) -> None:
        """An error event (500) for each request in a row or prefilling, once each."""
        answered = set()
        for row in self.rows:
            if row is not None and not row.finished:
                self._send(row, [], error=message)
                answered.add(id(row.request))
        for job in self._prefills:
            if id(job.request) not in answered:
                self._reject(job.request, message, 500)
        for request in self._incoming.values():  # admitted as the failure struck
            self._reject(request, message, 500)
        self._prefills, self._incoming = [], {}

    def _die(self, error: BaseException) -> None:
        """The loop is ending on an exception: answer every request and refuse new ones."""
        log.critical("the engine loop stopped; refusing requests from now on", exc_info=True)
        self.failure = f"the engine stopped: {type(error).__name__}: {error}"
        self._draining = True
        with contextlib.suppress(Exception):
            self._answer_all(self.failure)
        self._reject_queued(self.failure, 500)

    def _reject_queued(self, message: str, status: int) -> None:
        """Answer and drop every queued request."""
        while True:
            try:
                self._reject(self.queue.get_nowait(), message, status)
            except queue.Empty:
                return

    def _fail_one(self, request: Request, error: Exception) -> None:
        """End one request whose own work raised (a 500 for it alone); the batch goes on."""
        log.exception("%s failed in the engine; the other requests go on", request.id)
        self.stats.request_errors += 1
        self._reject(request, f"engine error: {type(error).__name__}: {error}", 500)

    # ------------------------------------------------------------------ rows joining

    def _admit(self, block: bool, timeout: float, leaving: int = 0) -> list[dict]:
        """Admit events for queued requests while rows are left for them (``leaving``: rows
        and prefills this iteration frees), waiting up to ``timeout`` when ``block``. An
        unseeded request gets its seed here."""
        events = []
        while self.active_rows + len(self._prefills) - leaving + len(events) < self.max_batch:
            try:
                request = self.queue.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                break
            block = False
            if request.cancelled.is_set():
                continue
            if self._draining:
                self._reject(request, "the server is shutting down", 503)
                continue
            seed = request.seed if request.seed is not None else time.time_ns() % (1 << 31)
            ticket = next(self._tickets)
            self._incoming[ticket] = request
            events.append(admit_event(request, seed, ticket))
        return events

    def _prefill_some(self) -> None:
        """Up to ``PREFILL_CHUNK`` prompt tokens (at least one chunk) per loop iteration, so a
        long prompt pauses the other rows for one chunk at a time, not for all of it.

        A prefill or first draw that raises fails its request alone; the join that follows
        touches the batch, so a failure there is the batch's (``_fail_all``)."""
        budget = PREFILL_CHUNK
        while self._prefills and budget > 0:
            job = self._prefills[0]
            try:
                budget -= job.advance()
                start = self._first_token(job) if job.complete else None
            except Exception as e:
                self._prefills.pop(0)
                self._fail_one(job.request, e)
                continue
            if start is not None:
                self._join(job, *start)
                self._prefills.pop(0)  # after the join: a failing join still answers it

    def _first_token(self, job: Prefill) -> tuple[int, mx.array]:
        """A prefilled request's first token, computed now (so that an error in its own
        prefill or draw surfaces here, not in the batched step), and its next key (2,)."""
        request = job.request
        rng, first_key = mx.random.split(mx.random.key(job.seed))
        prompt = request.prompt
        history = text_history([prompt], len(prompt)) if request.sampler.reads_text else None
        lengths = mx.array([len(prompt)], mx.int32)
        first = first_draw(self.model, job.hidden, request.sampler, first_key, history, lengths)
        return first.item(), rng

    def _join(self, job: Prefill, first: int, rng: mx.array) -> None:
        """Move a prefilled request, its first token drawn, into a free row."""
        if None not in self.rows:
            self._resize(self._bucket_for(len(self.rows) + 1))
        r = self.rows.index(None)
        request = job.request
        joined = time.perf_counter()
        limit, _ = token_limit(self.model, len(request.prompt), request.max_tokens)
        stats = RowStats(len(request.prompt), queued_s=job.started - request.submitted)
        row = Row(request, limit, stats, len(request.prompt), joined, r, job.ticket)
        if self.choice is not None:
            row.shadow = self.choice.shadow([*request.prompt, first])
        self._place(r, job.session, job.hidden, mx.array([first], mx.int32), rng)
        self.rows[r] = row
        self._params = None
        stats.ttft_s = time.perf_counter() - request.submitted
        self._deliver(r, row, [first])  # once per request, at its join

    def _place(self, r: int, session: Session, hidden, first, rng) -> None:
        """Write a prefilled one-row session into batch row ``r`` (lazy array updates)."""
        self._ensure_slots(session.slots)
        at = mx.arange(len(self.rows)) == r  # (B,)
        keys, values = self.state.keys, self.state.values
        for cache, row_cache in ((keys, session.keys), (values, session.values)):
            for layer, src in enumerate(row_cache):
                cache[layer][r : r + 1, :, : src.shape[2]] = src
        s = self.state
        history = s.history
        if history is not None:  # the row's text so far: its prompt, all in the cache
            text = text_history(session.cached, history.shape[1])
            history = mx.where(at[:, None], text, history)
        self.state = s._replace(
            init_token=mx.where(at, first, s.init_token),
            hidden=mx.where(at[:, None], hidden, s.hidden),
            lengths=mx.where(at, session.lengths, s.lengths),
            history=history,
        )
        self.row_keys = mx.where(at[:, None], rng[None], self.row_keys)

    def _ensure_slots(self, slots: int) -> None:
        """Grow the batch cache by whole quanta (a rare copy and a new compile key)."""
        self.state = ensure_slots(self.state, slots)

    # ------------------------------------------------------------------ stepping

    def _row_params(self) -> RowParams:
        """Per-row arrays (rebuilt only after rows join or leave)."""
        if self._params is None:
            reqs = [r.request if r is not None else FREE_ROW for r in self.rows]

            def per_row(name, dtype=mx.float32):
                return mx.array([getattr(q, name) for q in reqs], dtype)

            if any(q.logit_bias for q in reqs):
                V = self.model.vocab_size
                bias = mx.stack([bias_vector(q.logit_bias, V) for q in reqs])
            else:
                bias = mx.zeros((len(reqs), 1), mx.float32)
            self._params = RowParams(
                mx.array([r is not None for r in self.rows]),
                per_row("temperature"),
                per_row("top_p"),
                per_row("repetition_penalty"),
                per_row("presence_penalty"),
                per_row("frequency_penalty"),
                per_row("repetition_context_size", mx.int32),
                bias,
            )
        return self._params

    def _mode(self) -> StepMode:
        requests = [r.request for r in self.rows if r is not None]
        sampling = [q for q in requests if q.temperature > 0]
        reading = [q.repetition_context_size for q in requests if q.sampler.reads_text]
        span = next((s for s in PENALTY_SPANS if s >= max(reading)), 0) if reading else 0
        return StepMode(
            bool(sampling),
            any(q.top_p < 1.0 for q in sampling),
            any(q.logit_bias for q in requests),
            bool(reading),
            span,
        )

    def _step_fn(self, shape: BeamShape | None, mode: StepMode):
        if (shape, mode) not in self._steps:
            self._steps[shape, mode] = make_batch_step(
                self.model, self.drafter if shape else None, shape, mode, self.compiled
            )
        return self._steps[shape, mode]

    def _next_shape(self) -> BeamShape | None:
        """The shape of the step queued now: the fixed one; with adaptive shapes, the
        choice for this batch's size and its rows' match states, or the asked shape while
        a row samples with its own seed (its draws follow the shape of every step, so it
        runs what ``generate --seed`` runs). Split across ranks, rank 0's choice."""
        if self.choice is None:
            return self.shape
        shape = None
        if self.leader:
            active = [row for row in self.rows if row is not None]
            pinned = any(r.request.seed is not None and r.request.temperature > 0 for r in active)
            matches = [row.shadow.match(0) if row.shadow else 0 for row in active]
            shape = self.shape if pinned else self.choice.next(len(self.rows), matches)
        if self.group is not None:
            shape = rank0_shape(shape, self.choice.shapes, self.group)
        return None if shape.is_autoregressive else shape

    def _queue_step(self) -> Queued:
        """Queue one step for all rows; attention covers every active row's possible length."""
        longest = max(row.length for row in self.rows if row is not None)
        window = step_window(longest, self._inflight, self.per_step, self.width)
        self._ensure_slots(window)
        shape, mode = self._next_shape(), self._mode()
        key = (shape, mode, len(self.rows), window, self.state.keys[0].shape[2])
        started = time.perf_counter() if key in self._traced else None  # else: it compiles
        self._traced.add(key)
        step = self._step_fn(shape, mode)
        self.state, self.row_keys, out = step(self.state, self.row_keys, self._row_params(), window)
        mx.async_eval(out, self.state, self.row_keys)
        self._inflight += 1
        owners = tuple(self.rows)
        self.stats.record_step(sum(r is not None for r in owners))
        return Queued(out, owners, shape, started)

    def _read(self, step: Queued) -> None:
        """Deliver a computed step's tokens to the rows still owned by the same request."""
        out = step.out
        tokens, counts = out.tokens.tolist(), out.count.tolist()  # this step is computed
        looked = out.looked_up.tolist() if out.looked_up is not None else [0] * len(counts)
        self._inflight -= 1
        seconds = None if step.started is None else time.perf_counter() - step.started
        ran, resolved = [], []
        for r, row in enumerate(step.owners):  # r: the row's index when the step was queued
            if row is None or row.finished:
                continue
            ran.append(counts[r])
            row.length += counts[r]
            row.stats.steps += 1
            row.stats.emitted_by_steps += counts[r]
            row.stats.accepted_drafts += counts[r] - 1
            row.stats.lookup_drafts += looked[r]
            row.stats.drafted += step.shape.longest - 1 if step.shape else 0
            if row.shadow is not None:  # what a lookup chain would have given this step
                resolved += row.shadow.step(0, tokens[r][: counts[r]])
            self._deliver(row.slot, row, tokens[r][: counts[r]])
            if row.finished and row.shadow is not None:
                resolved += row.shadow.finish(0)
        if self.choice is not None:
            self.choice.finished(len(step.owners), step.shape or AR, ran, seconds)
            self.choice.lookup_seen(resolved)

    def _deliver(self, r: int, row: Row, tokens: list[int]) -> None:
        """Send tokens up to EOS / the row's limit; a finished row leaves."""
        new, finish = stop_at(tokens, self.eos, row.limit - row.out)  # a full context: "length"
        row.out += len(new)
        row.stats.generated += len(new)
        self.stats.generated += len(new)
        row.stats.decode_s = time.perf_counter() - row.joined
        self._send(row, new, finish=finish)
        if finish is not None:
            self.stats.requests_done += 1
            self._leave(r)

    def _send(self, row: Row, tokens: list[int], finish=None, error=None, status=500) -> None:
        if finish is not None or error is not None:
            row.finished = True
            if error is not None:
                self.stats.requests_failed += 1
        event = Event(tokens, row.stats, finish, error, status if error else 200)
        with contextlib.suppress(Exception):  # a broken sink must not stop the engine
            row.request.sink(event)

    def _reject(self, request: Request, message: str, status: int) -> None:
        with contextlib.suppress(Exception):
            request.sink(Event([], RowStats(len(request.prompt)), error=message, status=status))
        self.stats.requests_failed += 1

    # ------------------------------------------------------------------ batch size

    def _bucket_for(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def _fit(self) -> None:
        """Shrink the batch once at most a quarter of its rows are in use (hysteresis)."""
        n, active = len(self.rows), self.active_rows
        if n > 1 and active <= n // 4:
            self._resize(self._bucket_for(max(active, 1)))

    def _resize(self, n: int) -> None:
        """Re-lay the batch over ``n`` rows, active rows first (a copy of the cache; rare).

        Growing appends free rows; shrinking keeps the active rows in order. Rows are
        independent, so moving one changes none of its values.
        """
        rows = self.rows
        self.stats.resizes += 1
        if n > len(rows):
            order, extra = list(range(len(rows))), n - len(rows)
        else:
            used = [i for i, row in enumerate(rows) if row is not None]
            order = (used + [i for i, row in enumerate(rows) if row is None])[:n]
            extra = 0
        idx = mx.array(order, dtype=mx.int32)

        def pick(a):  # (len(rows), ...) -> (n, ...)
            if extra:
                return mx.concatenate([a, mx.zeros((extra, *a.shape[1:]), a.dtype)])
            return a[idx]

        s = self.state
        self.state = s._replace(
            init_token=pick(s.init_token),
            hidden=pick(s.hidden),
            lengths=pick(s.lengths),
            keys=[pick(k) for k in s.keys],
            values=[pick(v) for v in s.values],
            history=None if s.history is None else pick(s.history),
        )
        self.row_keys = pick(self.row_keys)
        self.rows = [rows[i] for i in order] + [None] * extra
        for i, row in enumerate(self.rows):
            if row is not None:
                row.slot = i
        self._params = None

    # ------------------------------------------------------------------ rows leaving

    def _leave(self, r: int) -> None:
        """Free row ``r``: it stops emitting now and its cache length returns to 0."""
        self.rows[r] = None
        self._params = None
        at = mx.arange(len(self.rows)) == r
        self.state = self.state._replace(lengths=mx.where(at, 0, self.state.lengths))

    def _cancelled(self) -> list[int]:
        """Tickets of the cancelled requests that are prefilling or hold a row."""
        held = [*self._prefills, *(row for row in self.rows if row is not None)]
        return [x.ticket for x in held if x.request.cancelled.is_set()]

    def _drain_step(self) -> list[dict]:
        """While draining: refuse queued requests; past the grace period, free events that
        stop every prefill and active row."""
        if not self._draining:
            return []
        self._reject_queued("the server is shutting down", 503)
        if time.perf_counter() < self._drain_deadline:
            return []
        held = [*self._prefills, *(row for row in self.rows if row is not None)]
        return [free_event(x.ticket, "the server is shutting down", 503) for x in held]
