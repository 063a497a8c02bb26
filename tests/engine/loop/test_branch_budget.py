"""``--max-tokens`` with APAR branches bounds the answer, the rebuilt text: the answer is the
first N tokens of the rebuilt text an unbounded run writes (greedy), branches stop once all
they could still write lies past N, and a fork there makes no child (engine/core/branches.py,
"The answer's length")."""

import pytest

from redrafter_mlx.engine.base.errors import ParamError
from redrafter_mlx.engine.core.branches import BranchRules, BranchTree
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.loop.generation import generate_steps
from tests.support.branching import EOS, FORK, PROMPT, RULES, model_and_drafter, run_batch

F, C = 6, 7  # toy fork and child ids, as in tests/engine/core/test_branches.py
TOY = BranchRules(fork_id=F, child_id=C)
OTHER = [9, 8, 7, 6, 5]
SOME_FORKS = SamplerConfig(logit_bias=((FORK, 1.0),))  # forks, under the branch limit


def test_ends_are_where_each_branch_writes_next():
    tree = BranchTree(TOY)
    tree.extend(0, [1, 2, F])  # child 1's text lands after [1, 2]
    tree.extend(0, [3])
    tree.extend(1, [4, 5])
    assert tree.linear() == [1, 2, 4, 5, 3]
    assert tree.ends() == [5, 4]  # the root writes after its detail's text; the detail at 4


def test_a_budget_cuts_the_text_and_names_the_branches_past_it():
    tree = BranchTree(TOY, budget=4)
    tree.extend(0, [1, 2, F])
    tree.extend(0, [3, 3])
    tree.extend(1, [4])
    assert tree.past_budget() == [0]  # its next token lands at 5 at least
    tree.extend(1, [5])
    assert tree.past_budget() == [0, 1]
    tree.finish(0), tree.finish(1)
    assert tree.linear() == [1, 2, 4, 5] and tree.take_final() == [1, 2, 4, 5]


def test_a_fork_whose_text_lies_past_the_budget_makes_no_child():
    tree = BranchTree(TOY, budget=3)
    step = tree.extend(0, [1, 2, 3, F, 4])
    assert step.fork is None and step.keep == 5 and len(tree.branches) == 1
    assert tree.linear() == [1, 2, 3]
    tree = BranchTree(TOY, budget=3)
    assert tree.extend(0, [1, 2, F]).fork is not None  # its child's text starts at 2 < 3


def test_the_budget_must_be_positive():
    with pytest.raises(ParamError, match="budget must be >= 1"):
        BranchTree(TOY, budget=0)


def reference_text(model, drafter, shape, prompt):
    """The rebuilt text of an answer whose rows each stop at 30 tokens (or EOS), and how
    much of it no such cut changed: the text before the first place a cut branch would
    have written next (``BranchTree.ends``). Checked to stay under the branch limit, so
    forks are masked by position alone."""
    request = [(prompt, SOME_FORKS, 0, 30, True)]
    roots, _, _ = run_batch(model, drafter, shape, request, budget=False)
    tree = roots[0].tree
    assert 2 < len(tree.branches) < RULES.max_branches
    ends = tree.ends()
    cut = [ends[r.branch] for r in roots[0].family if r.finish != "stop"]
    return tree.linear(), min(cut, default=len(tree.linear()))


@pytest.mark.parametrize("shape", [AR, BeamShape(2, 3)], ids=["ar", "drafter"])
def test_greedy_answer_is_the_longer_answers_first_n_tokens(shape):
    model, drafter = model_and_drafter()
    for prompt in (PROMPT, OTHER):
        full, exact = reference_text(model, drafter, shape, prompt)
        assert exact >= 20, "the test needs a long uncut text"
        for n in (1, 5, 12, exact):
            events = list(
                generate_steps(
                    model,
                    drafter if shape.drafts else None,
                    [prompt],
                    max_tokens=n,
                    shape=shape,
                    sampler=SOME_FORKS,
                    eos_token_ids=[EOS],
                    branches=RULES,
                )
            )
            text = [t for ev in events for t in ev.tokens[0]]
            assert text == full[:n], (prompt, n)
            assert events[-1].finish[0] == "length"
        assert events[-1].stats.branches > 1  # the longest answer forked
