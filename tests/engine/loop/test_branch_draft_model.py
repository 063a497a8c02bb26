"""Parallel branches (APAR) with a draft model: a fork copies the parent's draft-model cache
row into the child's row (as it copies the target's K/V), and greedy branches with the
draft model's chain in the tree equal plain decoding of their own rows."""

import mlx.core as mx
import pytest

from redrafter_mlx.engine.base.platform import READ_FIRST_ENV
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.drafting.sources import DRAFT_MODEL
from redrafter_mlx.engine.loop.branch_rows import Branches
from redrafter_mlx.engine.loop.generation import generate_steps
from tests.support.branching import (
    EOS,
    PROMPT,
    RULES,
    check_branches,
    forking_sampler,
    model_and_drafter,
    run_batch,
)
from tests.support.models import tiny_model


def draft_rows_equal(state, a: int, b: int) -> bool:
    """Whether rows ``a`` and ``b`` of every draft-source cache array are equal."""
    arrays = [x for s in state.sources if s is not None for part in s for x in part]
    assert arrays, "the batch holds no draft-model cache"
    return all(mx.array_equal(x[a], x[b]).item() for x in arrays)


@pytest.mark.parametrize("itself", [False, True], ids=["small-draft", "self-draft"])
@pytest.mark.parametrize("label", ["D1xL4", "K1xL4+D1xL3"])
@pytest.mark.parametrize("first", ["1", "0"], ids=["read-first", "queue-ahead"])
def test_a_fork_copies_the_draft_cache_and_branches_equal_plain_decoding(
    monkeypatch, itself, label, first
):
    model, drafter = model_and_drafter()
    draft = model if itself else tiny_model(9, vocab=32, layers=1, hidden=16, heads=2, kv_heads=1)
    copied = []
    fork = Branches.fork

    def checked(self, parent, at, read=None):
        child = fork(self, parent, at, read)
        copied.append(draft_rows_equal(self.batch.state, child.slot, parent.slot))
        return child

    monkeypatch.setattr(Branches, "fork", checked)
    monkeypatch.setenv(READ_FIRST_ENV, first)  # both read orders of branching steps
    sampler = forking_sampler()
    shape = BeamShape.parse(label)
    roots, _, _ = run_batch(model, None, shape, [(PROMPT, sampler, 0, 10, True)], draft_model=draft)
    assert copied and all(copied)  # every child starts from its parent's draft cache
    check_branches(model, drafter, None, roots[0], PROMPT, sampler, 0, 10)
    stats = roots[0].request_stats()
    assert stats.branches == len(roots[0].tree.branches)
    if itself:  # the model as its own draft: drafts get accepted in every branch's row
        assert stats.by_source[DRAFT_MODEL] > 0
        assert all(r.stats.accepted_drafts > 0 for r in roots[0].family)


def test_generate_steps_with_branches_and_a_draft_model_streams_the_rebuilt_text():
    model, _ = model_and_drafter()
    kw = dict(max_tokens=10, sampler=forking_sampler(), seed=0, eos_token_ids=[EOS])
    kw["branches"] = RULES

    def streamed(**more):
        events = list(generate_steps(model, None, [PROMPT], **kw, **more))
        return [t for ev in events for t in ev.tokens[0]], events

    want, _ = streamed(shape=AR)
    got, events = streamed(shape=BeamShape.parse("D1xL4"), draft_model=model)
    assert got == want  # greedy: the rebuilt text of plain decoding
    stats = events[-1].stats
    assert stats.branches > 2 and stats.source_tokens["draft_model"] > 0
    per_event = sum(ev.by_source[0][DRAFT_MODEL] for ev in events)
    assert per_event == stats.source_tokens["draft_model"] == stats.accepted_tokens
