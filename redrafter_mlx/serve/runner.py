"""The server's runner: uvicorn, draining the scheduler on SIGINT/SIGTERM, and closing a
connection whose request is not read within the read timeout."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading

from .app import READ_DEADLINE, RELEASE
from .scheduler import Scheduler

log = logging.getLogger("redrafter_mlx.serve")


def make_server(app, scheduler: Scheduler, host: str, port: int, log_level: str, grace_s: float):
    """A uvicorn server whose SIGINT/SIGTERM drains the scheduler and exits cleanly (code 0)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            scheduler.begin_drain(grace_s)
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            """Like uvicorn's, minus re-raising the signal afterwards: a requested stop is a
            clean exit, not a death by signal."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, handler in original.items():
                    signal.signal(s, handler)

    limits = app.state.serve_config
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level.lower(),
        timeout_graceful_shutdown=grace_s + 2.0,
        access_log=log_level.lower() == "debug",
        http=_timed_http(limits.read_timeout_s),
        limit_concurrency=limits.max_connections,
    )
    return DrainingServer(config)


def _timed_http(seconds: float):
    """uvicorn's h11 protocol, closing a connection whose next request's headers have not all
    arrived within ``seconds`` of it opening (or of the previous response): uvicorn itself
    waits for ever for the first request, and a trickle of bytes outlives its keep-alive
    timeout. The same deadline bounds the body, which the app reads (``_within``): it is
    stamped in the request's scope (``READ_DEADLINE``)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _timer = None
        _deadline = 0.0
        _waiting = None  # the cycle before the request being waited for

        def _arm(self) -> None:
            self._disarm()
            self._waiting = self.cycle
            self._deadline = self.loop.time() + seconds
            self._timer = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _check(self) -> None:
            if self.cycle is not self._waiting:  # the headers arrived: a new cycle runs
                if self._timer is not None:  # its body is due by the same deadline
                    self.cycle.scope[READ_DEADLINE] = self._deadline
                self.cycle.scope[RELEASE] = self._release
                self._disarm()

        def _release(self) -> None:
            """This connection and its request's task no longer count against uvicorn's
            ``limit_concurrency`` (``--max-connections``): a refused one draining its body."""
            self.connections.discard(self)
            self.tasks.discard(asyncio.current_task())

        def _expire(self) -> None:
            self._timer = None
            if self.cycle is self._waiting and not self.transport.is_closing():
                log.info("closing a connection whose request headers took over %g s", seconds)
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._check()

        def on_response_complete(self) -> None:
            self._arm()  # before: a pipelined request may start a cycle right away
            super().on_response_complete()
            self._check()
            if self.transport.is_closing():
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return TimedH11Protocol
