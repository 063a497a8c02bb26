"""The context cap (``--max-kv-size``, the model's context) with APAR branches: it bounds
each branch's row (the prompt, the text before its fork, its own text), not the rebuilt
answer, and a request whose answer a branch's cut shortened finishes ``"context"``, as a
plain run the cap stops does (``Row.request_finish``)."""

from redrafter_mlx.engine.core.branches import request_rows
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import AR
from redrafter_mlx.engine.decoding.cache import Session, token_limit
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.loop.batch import BatchGenerator
from redrafter_mlx.engine.loop.batch_choice import FixedShape
from redrafter_mlx.engine.loop.generation import generate_steps
from redrafter_mlx.engine.loop.prefilling import Prefill
from redrafter_mlx.engine.loop.rows import Row, RowStats
from tests.support.branching import EOS, PROMPT, RULES, model_and_drafter

SOME_FORKS = SamplerConfig(logit_bias=((30, 3.0),))  # forks, under the branch limit
CAP = len(PROMPT) + 20  # each row: the prompt and 20 tokens
N = 25  # the answer's budget: more than a row holds


def decode(max_tokens: int, cap: int | None = CAP) -> Row:
    """One branching request under a context cap, its rows' limits set as ``generate`` and
    the server set them (``token_limit``); its root row once every branch finished."""
    model, _ = model_and_drafter()
    model.cap_context(cap)
    row_tokens, tree = request_rows(RULES, max_tokens)
    limit, at_limit = token_limit(model, len(PROMPT), row_tokens)
    root = Row(SOME_FORKS, limit, len(PROMPT), RowStats(len(PROMPT)), at_limit=at_limit)
    root.tree = tree
    batch = BatchGenerator(model, held_sources(), FixedShape(AR), (EOS,), 64)
    batch.reset()
    batch.insert(Prefill([PROMPT], SOME_FORKS, 0, Session(model, 1), rows=[root]))
    for _ in range(200):
        if root.request_done:
            return root
        batch.next()
    raise AssertionError("the request did not finish")


def test_each_branch_fits_the_cap_and_a_cut_inside_the_answer_finishes_context():
    """The answer reaches its budget (its root stops there, ``"length"``) but a detail the
    cap cut lies inside it: the request finishes ``"context"``."""
    root = decode(max_tokens=N)
    tree = root.tree
    assert len(tree.branches) > 2, "the test needs forks"
    for b in range(len(tree.branches)):  # every branch's sequence fits the cap
        assert len(PROMPT) + len(tree.row(b)) <= CAP, b
    ends = tree.ends()
    cut = [r.branch for r in root.family if r.finish == "context" and ends[r.branch] < N]
    assert cut, "the test needs a branch the cap cut inside the answer"
    assert root.family[0].finish == "length"  # the root stopped at the budget
    assert root.request_finish == "context"
    assert len(tree.linear()) == N > CAP - len(PROMPT)  # the cap bounds rows, not the answer
    uncapped = decode(max_tokens=N, cap=None)
    assert uncapped.request_finish == "length"
    assert uncapped.tree.linear() != tree.linear()  # the cut changed the answer


def test_a_cut_at_the_answers_end_is_its_length():
    """A branch the cap cut where the answer ends anyway (its next token would land at the
    budget): the cap changed nothing in the answer, ``"length"``, and the text is the
    uncapped answer's."""
    root = decode(max_tokens=16)
    ends = root.tree.ends()
    assert any(r.finish == "context" and ends[r.branch] == 16 for r in root.family)
    assert root.request_finish == "length"
    uncapped = decode(max_tokens=16, cap=None)
    assert root.tree.linear() == uncapped.tree.linear()


def test_generate_reports_the_context_cut():
    model, _ = model_and_drafter()
    model.cap_context(CAP)
    events = list(
        generate_steps(
            model, None, [PROMPT], max_tokens=N, shape=AR, sampler=SOME_FORKS,
            eos_token_ids=[EOS], branches=RULES,
        )
    )  # fmt: skip
    assert events[-1].finish[0] == "context" and events[-1].stats.branches > 2
