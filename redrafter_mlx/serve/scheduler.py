"""The server's engine loop: continuous batching of speculative decoding (requests in, events
out); the batch itself is the engine's (``engine/loop/batch.py``: rows, steps, exact stops).

One thread owns the model and the KV cache (``Scheduler.serve_forever``). HTTP handlers only
``submit`` requests into a bounded queue and receive ``Event``s through each request's
``sink`` (called on the engine thread; the app forwards them to asyncio). Each iteration, at
a step boundary: cancelled rows leave; queued requests are admitted (each a one-row
``Prefill``, prefilled exactly as a solo run prefills it); then one ``BatchGenerator.next``:
about one chunk (``PREFILL_CHUNK`` tokens) of prefill, so a long prompt pauses the other rows
one chunk at a time, complete prompts joining with their first token, and one turn of the
batch's loop (the next step queued and the previous one read, in the order the backend
measured best: the same rule as a solo run's, ``platform.read_first``).

Under ``mlx.launch`` (the model split across ranks, ``engine/base/distributed.py``) every rank
runs this loop over its shard; only rank 0 has the HTTP server, the queue, the clients'
cancellations and the clock. What those decide reaches the engine only as a few events
(``requests.py``: admitted, with its settings and seed; freed; stop), broadcast by rank 0
once per iteration (``_share``) and applied by every rank with one rule (``_apply``); the
rest follows from the events and the tokens, the same on every rank. ``follow`` is the loop
of a rank other than 0: no queue, no HTTP, until rank 0's stop event.

Failures are isolated: an exception in one request's own work (admitting, prefilling, drawing
its first token) ends that request with an error event and the others go on; only an
exception in the batch's work (the step, resizing, placing a row) fails every request in
flight, each with one error event, and the loop starts over with an empty batch. Every row's
output is what the same request alone produces (``redrafter_mlx.generate`` with the same
shape, seed and sampling settings).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from dataclasses import replace

from redrafter_mlx.engine.core.branches import BranchRules, check_branching_model
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.decoding.cache import Session
from redrafter_mlx.engine.loop.adaptive import Adaptive
from redrafter_mlx.engine.loop.batch import BatchGenerator
from redrafter_mlx.engine.loop.batch_choice import BatchChoice
from redrafter_mlx.engine.loop.prefilling import Prefill
from redrafter_mlx.engine.loop.prompt_cache import PromptCache
from redrafter_mlx.engine.loop.rows import Row, RowStats
from redrafter_mlx.engine.loop.run import Run, make_row

from .requests import (
    STOP,
    Event,
    Held,
    QueueFull,
    Request,
    ServerStats,
    ShuttingDown,
    admit_event,
    check,
    free_event,
    request_from,
    share,
)

log = logging.getLogger("redrafter_mlx.serve")

IDLE_NAP = 0.8  # of rank 0's idle wait: how long the other ranks sleep while it idles


class RequestBatch(BatchGenerator):
    """The engine's batch, each row stopping at its own request's end ids (``Held.ends``:
    the model's EOS unless ``ignore_eos``, and the request's ``stop_token_ids``) rather than
    at the batch's one EOS set: ``emit`` runs with the row's set in its place."""

    def emit(self, row: Row, tokens: list[int]) -> tuple[list[int], str | None]:
        shared = self.eos
        self.eos = row.owner.ends if isinstance(row.owner, Held) else shared
        try:
            return super().emit(row, tokens)
        finally:
            self.eos = shared


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
        draft_model=None,
        branches: BranchRules | None = None,
        prompt_cache_bytes: int = 0,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if branches is not None:
            check_branching_model(model)
        self.branches = branches  # APAR branching rules (each request's branches are rows)
        # The slot checked, the shape resolved to its sources' parts, the arrays evaluated
        # (the loop runs on its own thread): ``engine/loop/run.py``, as ``generate_steps`` builds.
        run = Run.of(model, drafter, draft_model, shape, own_thread=True)
        self.model = model
        self.max_batch = max_batch
        self.prompt_cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes > 0 else None
        self.queue: queue.Queue[Request] = queue.Queue(maxsize=max(max_queue, 1))
        self.group = group  # under mlx.launch: the ranks' group; rank 0 decides the events
        self.leader = group is None or group.rank() == 0
        eos = {int(e) for e in eos_token_ids}
        self.speculative = run.speculative
        policy = run.policy(adapt, "requests")  # adaptive: a ``BatchChoice``, else the shape
        # Adaptive shapes (``engine/batch_choice``); None: not adaptive.
        self.choice: BatchChoice | None = policy if isinstance(policy, BatchChoice) else None
        self.eos = frozenset(eos)
        # The rows, their state, the steps and the loop's order (``engine/loop/batch.py``).
        self.batch = run.generator(
            policy, eos, max_batch, compiled=compiled, group=group, kind=RequestBatch
        )
        self.stats = ServerStats()
        self._draining = False
        self._drain_deadline = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: str | None = None  # why the engine loop stopped, if it died
        self.ready = threading.Event()
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
        """Raise ValueError for a request the engine cannot run (``requests.check``)."""
        check(request, self.model)

    @property
    def active_rows(self) -> int:
        return len(self.batch.active)

    @property
    def rows(self) -> list[Row | None]:
        return self.batch.rows

    def health(self) -> dict:
        """Live counters for ``GET /health``."""
        return dict(
            max_batch=self.max_batch,
            batch_rows=len(self.rows),
            active_rows=self.active_rows,
            queued=self.queue.qsize(),
            prefilling=len(self.batch.prefills),
            max_queue=self.queue.maxsize,
            **self.stats.to_dict(),
            resizes=self.batch.resizes,
            speculative=self.speculative,
            sources=[source.describe() for source in self.batch.sources],
            adaptive=self.choice is not None,
            shape_steps=self.choice.steps_run() if self.choice else {},
            step_ms=self.choice.step_ms() if self.choice else {},
            draining=self._draining,
            failure=self.failure,
            prompt_cache=self.prompt_cache.health() if self.prompt_cache else None,
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
        with contextlib.suppress(Exception):
            self.batch.settle()

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
        while self.batch.pending is not None:
            self.run_once()
        self.stats = ServerStats()
        if self.choice is not None:
            self.choice.ran.clear()

    # ------------------------------------------------------------------ the loop

    def run_once(self, idle_wait: float = 0.05) -> None:
        """One iteration: this iteration's events (leaves, joins: rank 0 decides them, every
        rank applies them), prefill, then one turn of the batch's loop (the next step
        queued, the previous one read, in the batch's order)."""
        if self.batch.state is None:
            self._reset()
        events = self._share(self._decide(idle_wait) if self.leader else None, idle_wait)
        try:
            if not self._apply(events):
                return
            turn = self.batch.next()  # prefill, joins, one step (``BatchGenerator.next``)
            for job, error in turn.failed:
                self._fail_one(job.owner.request, error)
            for got in turn.joined:  # once per request
                got.row.stats.ttft_s = time.perf_counter() - got.row.owner.request.submitted
                self._deliver(got.row, got.new, got.finish, got.logprobs)
            for got in turn.stepped:
                self._deliver(got.row, got.new, got.finish, got.logprobs)
            queued = self.batch.pending  # the step this turn queued (each turn queues one)
            if queued is not None:
                self.stats.record_step(sum(r is not None for r in queued.owners))
        except Exception as e:  # an engine failure fails the rows in flight, not the server
            self._fail_all(e)

    def _busy(self) -> bool:
        busy = self.active_rows > 0 or self.batch.pending is not None
        return busy or bool(self.batch.prefills)

    def _reset(self) -> None:
        """Fresh batch state: every row free, empty cache (also after an engine failure)."""
        self.batch.reset()

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
        """Rank 0's ``events`` on every rank (``requests.share``); an idle rank 0 lets the
        others sleep for most of its ``idle_wait``."""
        nap = IDLE_NAP * idle_wait if self.leader and not events and not self._busy() else 0.0
        return share(events, self.group, self._faults, nap)

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
            held = Held(request, ticket, ends=self.ends(request))
            sampler = self.row_sampler(request, held.ends)
            prompt, most = request.prompt, request.max_tokens
            row = make_row(self.model, sampler, len(prompt), most, self.branches, held)
            row.logprobs = request.logprobs
            pc = self.prompt_cache
            job = Prefill([prompt], sampler, event["seed"], session, held, [row], prompt_cache=pc)
            request.cached_tokens = job.cached_tokens
            row.stats.queued_s = job.started - request.submitted
            self.batch.insert(job)
        return True

    def ends(self, request: Request) -> frozenset:
        """The token ids that end ``request``'s rows: the model's EOS (not with
        ``ignore_eos``) and its own ``stop_ids``."""
        return frozenset(request.stop_ids) | (frozenset() if request.ignore_eos else self.eos)

    @staticmethod
    def row_sampler(request: Request, ends: frozenset):
        """``request``'s sampling settings, with its ``ends`` never drawn within its first
        ``min_tokens`` tokens (``SamplerConfig.min_length``: the prompt's length plus them)."""
        if request.min_tokens < 1 or not ends:
            return request.sampler
        min_length = len(request.prompt) + request.min_tokens
        return replace(request.sampler, min_length=min_length, end_ids=tuple(sorted(ends)))

    def _free(self, ticket: int, error: str | None, status: int) -> None:
        """The request with ``ticket`` leaves its prefill or row: cancelled (no ``error``),
        or answered with ``error``."""
        for job in self.batch.prefills:
            if job.owner.ticket == ticket:
                self.batch.prefills.remove(job)
                if error is None:
                    self._count_freed(job.owner.request)
                else:
                    self._reject(job.owner.request, error, status)
                return
        for row in self.batch.active:
            if row.owner.ticket == ticket:
                if error is None:
                    self._count_freed(row.owner.request)
                    log.debug("%s freed after %d tokens", row.owner.request.id, row.out)
                else:
                    self._send(row, [], error=error, status=status)
                self.batch.drop(row)  # every branch's row of the request, waiting ones too
                return

    def _count_freed(self, request: Request) -> None:
        """Count a request its client freed: done when its answer was complete (a stop
        string: ``Request.end``), else cancelled."""
        if request.complete:
            self.stats.requests_done += 1
        else:
            self.stats.requests_cancelled += 1

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
        for row in self.batch.active:
            if not row.finished and id(row.owner.request) not in answered:
                self._send(row, [], error=message)
                answered.add(id(row.owner.request))
        for job in self.batch.prefills:
            if id(job.owner.request) not in answered:
                self._reject(job.owner.request, message, 500)
        for request in self._incoming.values():  # admitted as the failure struck
            self._reject(request, message, 500)
        self.batch.prefills, self._incoming = [], {}

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
        # rows children waiting for one and forks of the step in flight will take
        # (``BatchGenerator.fork``, ``reserved``)
        batch = self.batch
        held = self.active_rows + len(batch.prefills) + len(batch.waiting) + batch.reserved
        held -= leaving
        while held + len(events) < self.max_batch:
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
            seed = request.sampler.seed
            seed = seed if seed is not None else time.time_ns() % (1 << 31)
            ticket = next(self._tickets)
            self._incoming[ticket] = request
            events.append(admit_event(request, seed, ticket))
        return events

    def _deliver(self, row: Row, new: list[int], finish: str | None, logprobs=None) -> None:
        """Send a row's emitted tokens (the batch stopped it exactly) and their ``logprobs``
        (``RowStep.logprobs``); count a finish. A branch's row sends its request's rebuilt
        text as it becomes final (``BranchTree.take_final``; no logprobs), finishing once
        every branch has (once)."""
        self.stats.generated += len(new)
        if row.tree is not None:
            root = row.family[0]
            if root.owner.answered:
                return
            new, finish = row.tree.take_final(), root.request_finish
            if not new and finish is None:
                return
            row, logprobs = root, None
        self._send(row, new, finish=finish, logprobs=logprobs)
        if finish is not None:
            self.stats.requests_done += 1

    def _send(
        self, row: Row, tokens: list[int], finish=None, error=None, status=500, logprobs=None
    ) -> None:
        if error is not None:
            for branch in row.family:
                branch.finished = True  # answered: no other event reaches it
            self.stats.requests_failed += 1
        if finish is not None or error is not None:
            row.owner.answered = True
        stats = row.request_stats()
        event = Event(tokens, stats, finish, error, status if error else 200, logprobs)
        with contextlib.suppress(Exception):  # a broken sink must not stop the engine
            row.owner.request.sink(event)

    def _reject(self, request: Request, message: str, status: int) -> None:
        with contextlib.suppress(Exception):
            request.sink(Event([], RowStats(len(request.prompt)), error=message, status=status))
        self.stats.requests_failed += 1

    # ------------------------------------------------------------------ rows leaving

    def _cancelled(self) -> list[int]:
        """Tickets of the cancelled requests that are prefilling or hold a row."""
        held = [*(j.owner for j in self.batch.prefills), *(r.owner for r in self.batch.active)]
        return [x.ticket for x in held if x.request.cancelled.is_set()]

    def _drain_step(self) -> list[dict]:
        """While draining: refuse queued requests; past the grace period, free events that
        stop every prefill and active row."""
        if not self._draining:
            return []
        self._reject_queued("the server is shutting down", 503)
        if time.perf_counter() < self._drain_deadline:
            return []
        held = [*(j.owner for j in self.batch.prefills), *(r.owner for r in self.batch.active)]
        return [free_event(x.ticket, "the server is shutting down", 503) for x in held]
