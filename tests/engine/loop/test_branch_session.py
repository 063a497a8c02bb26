"""A chat session across APAR answers: the cache a branching answer leaves holds its
prompt (every branch's row starts with it), so the next turn prefills only what follows it,
after a whole answer or one interrupted, and answers as from a fresh session."""

import pytest

from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.decoding.cache import Session
from redrafter_mlx.engine.loop.generation import generate_steps
from tests.support.branching import EOS, PROMPT, RULES, forking_sampler, model_and_drafter


def answer(model, drafter, prompt, session, shape, stop_after=None):
    """One turn: (its text, its prefilled tokens); ``stop_after`` events: interrupted there
    (the generator closed, as chat's Ctrl-C closes it)."""
    kw = dict(max_tokens=12, shape=shape, sampler=forking_sampler(), eos_token_ids=[EOS])
    stream = generate_steps(model, drafter, [prompt], session=session, branches=RULES, **kw)
    text, prefilled = [], None
    for i, event in enumerate(stream):
        text += event.tokens[0]
        prefilled = event.stats.prefilled_tokens
        if stop_after is not None and i + 1 >= stop_after:
            stream.close()
            break
    return text, prefilled


@pytest.mark.parametrize("stop_after", [None, 3], ids=["whole", "interrupted"])
@pytest.mark.parametrize("shape", [AR, BeamShape(2, 3)], ids=["ar", "drafter"])
def test_the_next_turn_prefills_only_what_follows_the_last_prompt(shape, stop_after, read_order):
    model, drafter = model_and_drafter()
    session = Session(model, 1)
    first, prefilled = answer(model, drafter, PROMPT, session, shape, stop_after)
    assert prefilled == len(PROMPT) and first
    turn2 = PROMPT + first + [9, 8, 7]
    second, prefilled = answer(model, drafter, turn2, session, shape)
    assert prefilled == len(turn2) - len(PROMPT)
    fresh, _ = answer(model, drafter, turn2, Session(model, 1), shape)
    assert second == fresh
