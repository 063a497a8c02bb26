"""``redrafter-mlx serve``: an OpenAI-compatible server with continuous batching.

Loads the model (and drafter) once, compiles the batched step, and serves
``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` and ``/health`` on localhost
(see :mod:`redrafter_mlx.serve`).

Under ``mlx.launch`` the model is split across the ranks: rank 0 runs the HTTP server and
the scheduler, and every other rank runs the scheduler's follower loop (``follow``), which
applies the events rank 0 broadcasts each iteration and so runs the same steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated

import typer

from redrafter_mlx.cli.common import BeamFlags, branch_flags, check_memory, prepare_engine
from redrafter_mlx.cli.consoles import err_console
from redrafter_mlx.cli.errors import FlagError, cli_errors
from redrafter_mlx.cli.options import (
    BranchFlags,
    DtypeOpt,
    MaxKvSizeOpt,
    ModelFlags,
    NoAdaptOpt,
    ShapeFlags,
    VerboseOpt,
    flag_groups,
)
from redrafter_mlx.serve.protocol import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_TIMEOUT_S,
)

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def check_serve_flags(
    port: int,
    max_batch: int,
    max_queue: int,
    limit: int,
    log_level: str,
    grace: float = 0.0,
    max_body: int = 1,
    read_timeout: float = 1.0,
    max_connections: int = 1,
):
    """FlagError naming the first bad server flag."""
    if not 0 <= port <= 65535:
        raise FlagError(f"--port must be in [0, 65535], got {port}")
    if max_batch < 1:
        raise FlagError(f"--max-batch must be >= 1, got {max_batch}")
    if max_queue < 1:
        raise FlagError(f"--max-queue must be >= 1, got {max_queue}")
    if limit < 1:
        raise FlagError(f"--max-tokens-limit must be >= 1, got {limit}")
    if log_level.lower() not in LOG_LEVELS:
        raise FlagError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
    if not (math.isfinite(grace) and grace >= 0):
        raise FlagError(f"--shutdown-grace must be a finite number of seconds >= 0, got {grace}")
    if max_body < 1:
        raise FlagError(f"--max-body-bytes must be >= 1, got {max_body}")
    if not (math.isfinite(read_timeout) and read_timeout > 0):
        raise FlagError(
            f"--read-timeout must be a finite number of seconds > 0, got {read_timeout}"
        )
    if max_connections < 1:
        raise FlagError(f"--max-connections must be >= 1, got {max_connections}")


def check_port_free(host: str, port: int) -> None:
    """FlagError naming ``--port`` (or ``--host``) unless the server could listen there now:
    a socket is bound as uvicorn binds it (SO_REUSEADDR) and closed again. Port 0 (any free
    port) always can."""
    import errno
    import socket

    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise FlagError(f"--host {host!r} is not an address or a known host name ({e})") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise FlagError(
                    f"--port {port}: {host}:{port} is already in use (another server?); choose "
                    f"another --port (0 picks a free one) or stop what listens there"
                ) from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise FlagError(f"--host {host}: not an address of this machine") from None
            raise FlagError(
                f"--port {port}: cannot listen on {host}:{port} ({e.strerror})"
            ) from None


def model_id(paths) -> str:
    """The name clients see in ``/v1/models``: ``demo`` or the model directory / repo id."""
    from pathlib import Path

    if paths.demo:
        return "redrafter-mlx-demo"
    path = Path(paths.model).expanduser()
    return path.name if path.exists() else paths.model


def model_aliases(model: str | None, paths) -> tuple[str, ...]:
    """Other names a request's ``model`` may use for the loaded model: ``--model`` as given,
    the bundled name (``demo``, ``smollm2``), the folder's name (a repo id's last part), and
    ``default`` (whatever is loaded)."""
    from pathlib import Path

    from redrafter_mlx.engine.base.bundled import NAMES, bundled

    path = Path(paths.model).expanduser()
    names = [model] if model else []
    names += [n for n in NAMES if path == bundled(n).base.expanduser()]
    if not paths.demo:  # the demo's folder is called "base"
        names.append(path.name)
    names.append("default")
    return tuple(dict.fromkeys(n for n in names if n and n != model_id(paths)))


@dataclass(frozen=True)
class ServeFlags:
    """``serve``'s options, in the order ``--help`` lists them."""

    models: ModelFlags = field(default_factory=ModelFlags)
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1"
    port: Annotated[int, typer.Option("--port", help="TCP port (0 = any free port).")] = 8080
    max_batch: Annotated[
        int, typer.Option("--max-batch", help="Most requests decoded together (batch rows).")
    ] = 8
    max_queue: Annotated[
        int, typer.Option("--max-queue", help="Requests waiting for a row; beyond it: 429.")
    ] = 64
    prompt_cache_bytes: Annotated[
        int,
        typer.Option(
            "--prompt-cache-bytes",
            help="Bytes of earlier prompts' K/V kept to reuse their shared prefixes (0: off).",
        ),
    ] = 1 << 30
    max_tokens_limit: Annotated[
        int,
        typer.Option("--max-tokens-limit", help="Largest max_tokens a request may ask for."),
    ] = 4096
    shape: ShapeFlags = field(default_factory=ShapeFlags)
    no_adapt: NoAdaptOpt = False
    branching: BranchFlags = field(default_factory=BranchFlags)
    dtype: DtypeOpt = None
    max_kv_size: MaxKvSizeOpt = None
    shutdown_grace: Annotated[
        float,
        typer.Option(
            "--shutdown-grace", help="Seconds in-flight requests get to finish on SIGINT/SIGTERM."
        ),
    ] = 3.0
    max_body_bytes: Annotated[
        int,
        typer.Option("--max-body-bytes", help="Largest request body; beyond it: 413."),
    ] = DEFAULT_MAX_BODY_BYTES
    read_timeout: Annotated[
        float,
        typer.Option(
            "--read-timeout",
            help="Seconds a client has to send a whole request (headers and body); beyond: "
            "closed (headers) or 408 (body).",
        ),
    ] = DEFAULT_READ_TIMEOUT_S
    max_connections: Annotated[
        int,
        typer.Option("--max-connections", help="Most open connections; beyond it: 503."),
    ] = DEFAULT_MAX_CONNECTIONS
    log_level: Annotated[
        str, typer.Option("--log-level", help="critical, error, warning, info or debug.")
    ] = "info"
    verbose: VerboseOpt = False


@flag_groups
def serve(flags: ServeFlags) -> None:
    """Serve the model over an OpenAI-compatible HTTP API with continuous batching."""
    with cli_errors(flags.verbose):
        check_serve_flags(
            flags.port,
            flags.max_batch,
            flags.max_queue,
            flags.max_tokens_limit,
            flags.log_level,
            flags.shutdown_grace,
            flags.max_body_bytes,
            flags.read_timeout,
            flags.max_connections,
        )
        check_port_free(flags.host, flags.port)  # before the model loads: a busy port fails fast
        ready = prepare_engine(
            flags.models.model,
            flags.models.drafter,
            flags.dtype,
            BeamFlags.of(flags.shape),
            max_tokens=flags.max_tokens_limit,
            max_kv_size=flags.max_kv_size,
            batch=flags.max_batch,
            split_ok=True,
            draft_model=flags.models.draft_model,
        )
        adapt = not flags.no_adapt and ready.plan.speculative
        plan = ready.plan if adapt else serving_plan(ready.plan)
        engine = ready.engine
        group = getattr(engine.model, "group", None)
        rules = branch_flags(engine, flags.branching)  # checked here
        if rules is not None and hasattr(plan, "shape"):  # a branch row holds a few more
            tokens = rules.row_tokens(flags.max_tokens_limit)
            check_memory(engine, plan.shape, tokens, True, flags.max_batch)
        if group is not None and group.rank() != 0:
            follow(engine, plan, flags.max_batch, group, adapt, rules)
            exit_now()
        server = build(engine, plan, flags, adapt, rules)
        announce(engine, plan, flags, adapt, rules)
        server(flags.host, flags.port, flags.shutdown_grace)
    exit_now()


def announce(engine, plan, flags: ServeFlags, adapt: bool, rules) -> None:
    """The start-up lines: the model, the beam and where the API listens; then the model's
    sampling defaults that requests leaving them out get."""
    group = getattr(engine.model, "group", None)
    split = f" · split across {group.size()} ranks" if group is not None else ""
    adaptive = ", adaptive" if adapt else ""
    adaptive += ", APAR branches" if rules else ""
    err_console().print(
        f"[bold]redrafter-mlx serve[/] · {model_id(engine.paths)} ({engine.dtype}) · "
        f"beam {plan.label} ({plan.source}{adaptive}) · {flags.max_batch} rows{split} · "
        f"http://{flags.host}:{flags.port}/v1",
    )
    defaults = serving_defaults(engine.folder)
    if defaults:
        shown = ", ".join(f"{k} {v:g}" for k, v in defaults.items())
        err_console().print(
            f"[dim]requests that leave them out get {shown} (the model's generation_config.json)[/]"
        )


def exit_now() -> None:
    """End the process with code 0 once the server has stopped (every answer sent, the
    engine thread joined), skipping the interpreter's teardown: there MLX's native threads
    could abort the process ("terminate called without an active exception", exit -6)
    after a clean stop, seen after adaptive serving on Ctrl-C / SIGTERM."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serving_plan(plan):
    """With ``--no-adapt`` serve runs one shape for every row: one drafter beam with one
    lookup chain and no --capacity gets room for one of them, so each row verifies its beam
    or its chain (the chain when its match is strong) and rows whose text does not repeat pay
    no more than the drafter alone. ``--capacity`` gives the tree more room. (Adaptive, the
    default, chooses each step among that shape, its parts and plain decoding.)"""
    from dataclasses import replace

    from tuning import ShapeChoice

    shape = plan.shape
    one_each = shape.drafts and shape.width == 1 and shape.lookup == 1 and not shape.model_length
    if not (one_each and shape.capacity is None):  # a draft model's chain keeps its own slots
        return plan
    room = replace(shape, capacity=min(shape.length, shape.chain_length))
    return ShapeChoice(room, f"{plan.source}; room for the beam or the chain per row")


def follow(engine, plan, max_batch: int, group, adapt: bool = False, branches=None) -> None:
    """A rank other than 0 under ``mlx.launch``: no HTTP; the scheduler's follower loop runs
    the same engine work as rank 0's, event by event, and returns at rank 0's stop event
    (rank 0 stopping on SIGINT/SIGTERM, or failing). Ctrl-C reaches every local rank: rank
    0 decides, so it is ignored here."""
    import signal

    from redrafter_mlx.serve.scheduler import Scheduler

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    shape = plan.shape if plan.speculative else None
    eos = engine.tokenizer.eos_token_ids
    sched = Scheduler(
        engine.model,
        engine.drafter,
        shape,
        eos,
        max_batch,
        group=group,
        adapt=adapt,
        draft_model=engine.draft_model,
        branches=branches,
    )
    sched.follow()


def serve_config(engine, shape, flags: ServeFlags, adapt: bool):
    """What the app needs besides the scheduler (``serve.app.ServeConfig``): the tokenizer,
    the model's names (its id, then the aliases a request may use), the limits, the beam
    ``/v1/models`` shows (``shape``: None for plain decoding) and the model's defaults."""
    from redrafter_mlx.serve.app import ServeConfig

    names = (model_id(engine.paths), *model_aliases(flags.models.model, engine.paths))
    beam = {}
    if shape is not None:
        beam = dict(beam_width=shape.width, beam_length=shape.length, capacity=shape.slots)
        beam.update(lookup=shape.lookup, lookup_length=shape.chain_length, adaptive=adapt)
    model = engine.model
    return ServeConfig(
        engine.tokenizer,
        names[0],
        flags.max_tokens_limit,
        model.max_context,
        model.vocab_size,
        beam,
        names[1:],
        flags.max_body_bytes,
        serving_defaults(engine.folder),
        flags.read_timeout,
        flags.max_connections,
    )


def serving_defaults(folder) -> dict:
    """The model's generation_config.json values a request may leave out (every sampling
    setting they name: temperature, top_p, top_k, min_p, repetition_penalty)."""
    from redrafter_mlx.engine.core.sampling import model_defaults

    return model_defaults(folder) if folder else {}


def build(engine, plan, flags: ServeFlags, adapt: bool = False, branches=None):
    """Scheduler + app, warmed up; returns ``run(host, port, grace)``. ``adapt``: choose each
    step's shape (``engine/loop/batch_choice.py``); ``branches``: the ``--branches`` rules."""
    import logging

    from redrafter_mlx.serve.app import create_app
    from redrafter_mlx.serve.runner import make_server
    from redrafter_mlx.serve.scheduler import Scheduler

    log_level = flags.log_level
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    shape = plan.shape if plan.speculative else None
    tok = engine.tokenizer
    scheduler = Scheduler(
        engine.model,
        engine.drafter,
        shape,
        tok.eos_token_ids,
        flags.max_batch,
        flags.max_queue,
        group=getattr(engine.model, "group", None),
        adapt=adapt,
        draft_model=engine.draft_model,
        branches=branches,
        # one rank alone (the ranks' prefills must match, and followers keep no cache)
        prompt_cache_bytes=0 if getattr(engine.model, "group", None) else flags.prompt_cache_bytes,
    )
    scheduler.start(warmup_prompt=tok.chat_prompt([{"role": "user", "content": "Hello"}]))
    config = serve_config(engine, shape, flags, adapt)
    app = create_app(scheduler, config)

    def run(host: str, port: int, grace: float) -> None:
        try:
            make_server(app, scheduler, host, port, log_level, grace).run()
        finally:  # the loop ends (under mlx.launch: the other ranks' loops with it)
            scheduler.begin_drain(0.0)
            scheduler.stop()

    return run
