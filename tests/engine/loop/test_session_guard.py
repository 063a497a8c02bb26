"""A Session is used by its own thread and one generation at a time. Before,
a session made on one thread and used on another failed inside MLX (``There is no
Stream(cpu, N) in current thread``, sometimes a segfault) and two interleaved generators failed
with a ``TypeError`` in the cache; now both are a clear :class:`SessionInUse` that leaves the
session usable."""

from __future__ import annotations

import threading

import pytest

from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.decoding.cache import Session, SessionInUse
from redrafter_mlx.engine.loop.generation import batch_generate, generate_steps
from tests.support.models import tiny_drafter, tiny_model

PROMPT = [1, 5, 9, 2, 7]
AR = BeamShape.autoregressive()


def tokens(events) -> list[int]:
    return [t for ev in events for t in ev.tokens[0]]


def on_thread(fn):
    """``fn()`` run on a new thread: its result or the exception it raised."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except Exception as e:  # handed back to the test's thread
            box["value"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return box["value"]


def test_a_session_used_from_another_thread_is_refused_and_stays_usable():
    model = tiny_model()
    want = tokens(generate_steps(model, None, [PROMPT], max_tokens=8, shape=AR))
    session = Session(model, 1)
    got = on_thread(lambda: batch_generate(model, None, None, [PROMPT], max_tokens=8, shape=AR,
                                           session=session))  # fmt: skip
    assert isinstance(got, SessionInUse)
    assert "create the Session on the thread that generates with it" in str(got)
    assert (
        tokens(generate_steps(model, None, [PROMPT], max_tokens=8, shape=AR, session=session))
        == want
    )


def test_a_session_made_on_another_thread_is_refused_here():
    model = tiny_model()
    session = on_thread(lambda: Session(model, 1))
    with pytest.raises(SessionInUse, match="created on thread"):
        list(generate_steps(model, None, [PROMPT], max_tokens=4, shape=AR, session=session))


def test_a_second_generation_on_a_busy_session_is_refused_and_the_first_goes_on():
    model = tiny_model()
    drafter = tiny_drafter(model)
    shape = BeamShape(2, 3)
    want = tokens(generate_steps(model, drafter, [PROMPT], max_tokens=12, shape=shape))
    session = Session(model, 1)
    first = generate_steps(model, drafter, [PROMPT], max_tokens=12, shape=shape, session=session)
    second = generate_steps(
        model, drafter, [[1, 5, 9, 3]], max_tokens=12, shape=shape, session=session
    )
    got = list(next(first).tokens[0])
    with pytest.raises(SessionInUse, match="held by a generation that has not finished"):
        next(second)
    got += tokens(first)
    assert got == want
    # Once the first generation has ended, the session serves the next one (prefix reused).
    events = list(generate_steps(model, drafter, [PROMPT + got], max_tokens=4, shape=shape,
                         session=session))  # fmt: skip
    assert events[-1].stats.prefilled_tokens == 1
    # A generator closed early hands the cache back too.
    open_one = generate_steps(model, drafter, [PROMPT], max_tokens=12, shape=shape, session=session)
    next(open_one)
    open_one.close()
    assert tokens(generate_steps(model, drafter, [PROMPT], max_tokens=12, shape=shape,
                         session=session)) == want  # fmt: skip
