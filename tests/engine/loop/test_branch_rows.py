"""Rows that fork (APAR parallel branches) in the engine's one loop: each branch a row of its
own, copied from its parent at the fork (no prefill) and forced to the child token next,
equals plain decoding of its own linear sequence under the same masks."""

import pytest

from redrafter_mlx.engine.base.platform import READ_FIRST_ENV
from redrafter_mlx.engine.core.branches import BranchRules
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.loop.branch_rows import Branches
from redrafter_mlx.engine.loop.rows import Row
from redrafter_mlx.engine.loop.stepping import Stepping
from tests.support.branching import (
    CHILD,
    FORK,
    PROMPT,
    RULES,
    check_branches,
    fork_points,
    forking_sampler,
    model_and_drafter,
    run_batch,
)


@pytest.mark.parametrize("shape", [AR, BeamShape(2, 3)], ids=["ar", "drafter"])
def test_greedy_branches_equal_plain_decoding_of_their_own_rows(shape, read_order):
    model, drafter = model_and_drafter()
    sampler = forking_sampler()
    roots, _, batch = run_batch(model, drafter, shape, [(PROMPT, sampler, 0, 10, True)])
    root = roots[0]
    check_branches(model, drafter, None, root, PROMPT, sampler, 0, 10)
    assert all(r.finished for r in root.family) and root.tree.done
    assert not batch.active  # every branch freed its row


@pytest.mark.parametrize("shape", [AR, BeamShape(2, 3)], ids=["ar", "drafter"])
def test_seeded_sampling_branches_equal_their_rows_decoded_alone(shape, read_order):
    """Each branch draws with its own key, the parent's at the fork (copied), split per step
    as a solo run's: its tokens equal its row decoded alone with the same seed and shape."""
    model, drafter = model_and_drafter()
    sampler = forking_sampler(temperature=0.8)
    roots, _, _ = run_batch(model, drafter, shape, [(PROMPT, sampler, 7, 10, True)])
    reference_shape = shape if shape.drafts else None
    check_branches(model, drafter, reference_shape, roots[0], PROMPT, sampler, 7, 10)


@pytest.mark.parametrize(
    "shape", [BeamShape.lookup_only(1, 4), BeamShape(1, 3, None, 1, 4)], ids=["lookup", "hybrid"]
)
def test_lookup_and_hybrid_steps_fork_like_plain_decoding(shape, read_order):
    """Lookup chains (and the beam-and-chain step) speculate for every branch row too; a
    drafted fork token is never accepted, so the fork is the step's last token."""
    model, drafter = model_and_drafter()
    prompt = [3, 30, 24, 14, 3, 30, 24, 14, 3]  # text the chains can look up
    sampler = forking_sampler()
    roots, _, _ = run_batch(model, drafter, shape, [(prompt, sampler, 0, 10, True)])
    check_branches(model, drafter, None, roots[0], prompt, sampler, 0, 10)


def test_branching_and_plain_requests_share_a_batch():
    """Two branching requests and one with branching off decode together: each branch equals
    its row alone, and the plain request is untouched by the split masks (its child token
    is an ordinary token, biased up here)."""
    model, drafter = model_and_drafter()
    shape = BeamShape(2, 3)
    other = [9, 8, 7, 6, 5]
    greedy, sampled = forking_sampler(), forking_sampler(temperature=0.8)
    plain = SamplerConfig(logit_bias=((CHILD, 6.0),))
    requests = [
        (PROMPT, greedy, 0, 10, True),
        (other, plain, 0, 10, False),
        (other, sampled, 5, 10, True),
    ]
    roots, outs, _ = run_batch(model, drafter, shape, requests)
    check_branches(model, drafter, None, roots[0], PROMPT, greedy, 0, 10)
    check_branches(model, drafter, shape, roots[2], other, sampled, 5, 10)
    _, alone_out, _ = run_batch(model, drafter, shape, [(other, plain, 0, 10, False)])
    assert outs[1] == alone_out[0] and CHILD in outs[1]
    assert roots[1].family == [roots[1]]


def test_a_linear_request_of_an_apar_model_never_draws_split_tokens_in_a_branching_batch():
    """The same batch on a model whose split tokens are its own (``Model.split_ids``): the
    request with branching off draws neither split token (however biased up) and equals
    its own run alone, in which the batch's other rows play no part."""
    model, drafter = model_and_drafter()
    model.split_ids = (FORK, CHILD)
    shape = BeamShape(2, 3)
    other = [9, 8, 7, 6, 5]
    plain = SamplerConfig(logit_bias=((CHILD, 6.0), (FORK, 6.0)))
    requests = [
        (PROMPT, forking_sampler(), 0, 10, True),
        (other, plain, 0, 10, False),
        (other, forking_sampler(temperature=0.8), 5, 10, True),
    ]
    roots, outs, _ = run_batch(model, drafter, shape, requests)
    _, alone_out, _ = run_batch(model, drafter, shape, [(other, plain, 0, 10, False)])
    assert outs[1] == alone_out[0] and not {FORK, CHILD} & set(outs[1])
    assert len(roots[0].family) > 1  # the branching request did fork beside it


def test_limits_hold_when_the_batch_or_the_request_runs_out_of_room():
    """Forks are granted only where the branch limit leaves room for the child: a tree never
    passes ``max_branches``; the batch never grows past ``max_batch`` (a child with no free
    row waits for one, its tree as it is alone); a child token biased up is still never
    drawn freely (masked)."""
    model, drafter = model_and_drafter()
    sampler = SamplerConfig(logit_bias=((FORK, 3.0), (CHILD, 8.0)))
    request = [(PROMPT, sampler, 0, 10, True)]
    for rules, max_batch in [(BranchRules(FORK, CHILD, max_branches=3), 8), (RULES, 2)]:
        roots, _, batch = run_batch(model, drafter, AR, request, rules, max_batch)
        tree = roots[0].tree
        assert 1 < len(tree.branches) <= rules.max_branches
        assert len(batch.rows) <= max_batch and tree.done and not batch.waiting
        for b in tree.branches:
            assert CHILD not in b.tokens[1:]
        alone, _, _ = run_batch(model, drafter, AR, request, rules, 64)
        assert tree.linear() == alone[0].tree.linear()
    assert len(tree.branches) > max_batch  # the children waited for rows


def test_batches_without_a_branching_row_keep_their_step(monkeypatch):
    """The split masks are a static switch: a batch with no branching row runs the step it
    always had (``StepMode.split`` empty); one with a branching row, the masked step."""
    model, drafter = model_and_drafter()
    seen = []
    make = Stepping._step_fn

    def recording(self, shape, mode):
        seen.append(mode.split)
        return make(self, shape, mode)

    monkeypatch.setattr(Stepping, "_step_fn", recording)
    run_batch(model, drafter, AR, [(PROMPT, forking_sampler(), 0, 4, False)])
    assert seen and set(seen) == {()}
    seen.clear()
    run_batch(model, drafter, AR, [(PROMPT, forking_sampler(), 0, 4, True)])
    assert set(seen) == {(FORK, CHILD)}


def test_split_tokens_are_structure_not_text_for_penalties():
    """A branching row's split tokens are neither counted by a penalty nor penalized (the
    rebuilt answer holds none; a list's forks a few tokens apart would penalize the next
    fork away); a row with branching off, in the same batch, keeps them as text."""
    import mlx.core as mx

    from redrafter_mlx.engine.core.branches import split_rows
    from redrafter_mlx.engine.core.penalties import node_text
    from redrafter_mlx.engine.core.sampling import RowSampler, process_text

    cfg = SamplerConfig(repetition_penalty=2.0, repetition_context_size=4)
    plain = RowSampler.from_config(cfg, 32, None, batch=2)
    sampler = plain._replace(
        mode=plain.mode._replace(split=RULES.split_ids),
        split=split_rows([True, False], [True, True], [-1, -1]),
    )
    history = mx.array([[5, FORK, 6, CHILD], [5, FORK, 6, CHILD]], mx.int32)
    text = node_text(history, mx.array([4, 4]), 4, 4)
    logits = mx.ones((2, 1, 32))
    out = process_text(logits, sampler, text)
    assert out[0, 0, FORK].item() == out[0, 0, CHILD].item() == 1.0  # branching row: kept
    assert out[1, 0, FORK].item() == out[1, 0, CHILD].item() == 0.5  # branching off: text
    assert out[0, 0, 5].item() == out[1, 0, 5].item() == 0.5  # other tokens as before


@pytest.mark.parametrize("shape", [AR, BeamShape(2, 3)], ids=["ar", "drafter"])
def test_branches_with_a_repetition_penalty_equal_their_rows(shape):
    model, drafter = model_and_drafter()
    sampler = forking_sampler(repetition_penalty=1.5, repetition_context_size=6)
    roots, _, _ = run_batch(model, drafter, shape, [(PROMPT, sampler, 0, 10, True)])
    check_branches(model, drafter, None, roots[0], PROMPT, sampler, 0, 10)


@pytest.mark.parametrize(
    "shape",
    [AR, BeamShape(2, 3), BeamShape(1, 3, None, 1, 4)],
    ids=["ar", "drafter", "hybrid"],
)
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_steps_queue_ahead_of_a_branching_step_and_change_no_token(monkeypatch, shape, temperature):
    """With the limits far off, the next step is queued before a branching row's step is
    read (``queue_ahead``): a fork then copies that step's end state while the parent's
    next step is already in flight. Every branch of every request equals the loop that
    reads each branching step first: same tokens, same forks, same steps per row."""
    model, drafter = model_and_drafter()
    sampler = forking_sampler(temperature=temperature)
    prompt = [3, 30, 24, 14, 3, 30, 24, 14, 3]  # text lookup chains can find
    requests = [(PROMPT, sampler, 7, 12, True), (prompt, sampler, 3, 12, True)]
    monkeypatch.setenv(READ_FIRST_ENV, "0")  # a GPU's default (the CPU's reads first)
    roots, outs, batch = run_batch(model, drafter, shape, requests)
    assert batch.branches.ahead > 5  # steps queued with a branching step in flight
    assert sum(len(r.tree.branches) for r in roots) > 4
    monkeypatch.setenv(READ_FIRST_ENV, "1")
    want_roots, want_outs, first = run_batch(model, drafter, shape, requests)
    assert first.branches.ahead == 0
    assert outs == want_outs
    for root, want in zip(roots, want_roots):  # branch ids are in fork order: compare as sets
        assert root.tree.linear() == want.tree.linear()
        assert sorted(branch_rows(root)) == sorted(branch_rows(want))


def branch_rows(root: Row) -> list[tuple]:
    """Each branch of ``root``'s request as (fork point, tokens, steps its row took)."""
    tree = root.tree
    return [
        (tuple(fork_points(tree, row.branch)), tuple(tree.branches[row.branch].tokens),
         row.stats.steps)
        for row in root.family
    ]  # fmt: skip


def test_near_the_limits_a_branching_step_is_read_first(monkeypatch):
    """Where a fork of the step in flight could take the room another fork needs (the
    request's branch limit here), the step is read before the next is queued, and the
    limits hold."""
    model, drafter = model_and_drafter()
    answers = []
    decide = Branches.queue_ahead

    def recording(self, pending):
        answers.append(decide(self, pending))
        return answers[-1]

    monkeypatch.setattr(Branches, "queue_ahead", recording)
    monkeypatch.setenv(READ_FIRST_ENV, "0")
    sampler = forking_sampler()
    rules = BranchRules(FORK, CHILD, max_branches=4)
    roots, _, batch = run_batch(model, drafter, AR, [(PROMPT, sampler, 0, 10, True)], rules, 3)
    assert True in answers and False in answers
    assert 1 < len(roots[0].tree.branches) <= 4 and len(batch.rows) <= 3
