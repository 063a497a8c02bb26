"""Driving ``ChatLoop`` directly: a loop printing into a string buffer, its output, a Ctrl-C
mid-answer."""

from __future__ import annotations

import io

from rich.console import Console

from redrafter_mlx.cli.chat_ui import ChatLoop
from redrafter_mlx.cli.common import BeamFlags, plan_from_flags
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape

MAX_TOKENS = 6


def make_loop(engine, max_tokens=MAX_TOKENS, show_accepted=False, terminal=False):
    """A ChatLoop printing into a string buffer (``loop.console.file.getvalue()``)."""
    plan = plan_from_flags(engine.paths, None, BeamFlags(1, 3))
    console = Console(
        file=io.StringIO(),
        width=200,
        highlight=False,
        soft_wrap=True,
        force_terminal=terminal,
        color_system="standard" if terminal else None,
    )
    return ChatLoop(
        engine, plan, SamplerConfig(), max_tokens, show_accepted=show_accepted, console=console
    )


def output(loop) -> str:
    return loop.console.file.getvalue()


def interrupt_after(n_chunks: int, lose_cache: bool = False):
    """A stream_generate double that yields ``n_chunks`` real chunks, then Ctrl-C."""
    from redrafter_mlx.engine.loop.generation import stream_generate

    def stream(*args, session=None, **kwargs):
        inner = stream_generate(*args, session=session, **kwargs)
        for i, response in enumerate(inner):
            if i == n_chunks:
                inner.close()
                if lose_cache:
                    session.cache = None  # as if Ctrl-C landed before the engine's hand-back
                raise KeyboardInterrupt
            yield response

    return stream


def make_short_loop(engine):
    from redrafter_mlx.cli.chat_ui import ChatLoop
    from redrafter_mlx.engine.core.sampling import SamplerConfig
    from tuning import ShapeChoice

    console = Console(file=io.StringIO(), width=300, highlight=False, soft_wrap=True)
    return ChatLoop(
        engine, ShapeChoice(BeamShape(1, 3), "test"), SamplerConfig(), 4, console=console
    )
