"""Greedy answers with their hidden states (train/selfgen.py): one-pass self-distillation data."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from redrafter_mlx.train import distill as D
from redrafter_mlx.train.selfgen import answer_targets, answers_with_hidden, greedy_with_hidden
from tests.support.models import run_decode, tiny_model


@pytest.mark.parametrize("seed", [0, 1])
def test_answers_equal_engine_greedy_and_targets_equal_self_targets(seed):
    model = tiny_model(seed=seed, vocab=48)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, model.vocab_size, n).tolist() for n in (5, 9, 3)]
    eos = [int(rng.integers(3, model.vocab_size))]
    answers = greedy_with_hidden(model, prompts, 40, eos)
    ref, _ = run_decode(model, None, prompts, max_tokens=40, eos_token_ids=eos)
    depth = 4
    for prompt, ans, want in zip(prompts, answers, ref):
        ended = ans.finish == "stop"
        assert ans.ids == want + (eos if ended else [])
        assert len(ans.ids) == (len(want) + 1 if ended else 40)
        assert ans.hidden.shape == (len(ans.ids), model.hidden_size)
        # The targets read off the answer are self_targets' on prompt + answer, hidden included.
        tokens = prompt + ans.ids
        positions = list(range(len(prompt) - 1, len(tokens) - 1))
        h_ref, g_ref, v_ref = D.self_targets(model, mx.array(tokens), mx.array(positions), depth)
        hidden, toks, valid = answer_targets(ans, depth)
        n = len(positions)
        assert (toks[:n, 0] == g_ref[:, 0]).all()
        assert (toks[:n, 1:][valid[:n]] == g_ref[:, 1:][valid[:n]]).all()
        # Same valid targets, except that self_targets also reads the greedy token after the
        # answer's last one (decoding stopped before drawing it): one more per depth.
        assert (valid[:n] <= v_ref).all()
        assert (v_ref & ~valid[:n]).sum() == min(depth, n)
        np.testing.assert_allclose(hidden[:n], np.array(h_ref), atol=2e-2, rtol=1e-2)


def test_a_row_that_ends_at_once_and_all_rows_ending_stop_early():
    model = tiny_model(seed=3, vocab=48)
    prompts = [[4, 5, 6], [7, 8]]
    first = greedy_with_hidden(model, prompts, 1, [])
    eos = [first[0].ids[0]]  # row 0's first token is an end-of-turn id
    answers = greedy_with_hidden(model, prompts, 64, eos)
    assert answers[0].ids == eos and answers[0].finish == "stop"
    assert answers[0].hidden.shape == (1, model.hidden_size)


def test_sampled_answers_are_seeded_and_keep_the_states_that_drew_them():
    """At a temperature the answers are the model's draws (seeded), and hidden[j] is still
    the state at the token before ids[j]: one forward over prompt + answer gives it."""
    model = tiny_model(seed=5, vocab=48)
    prompts = [[4, 5, 6, 9], [7, 8, 3]]
    a = answers_with_hidden(model, prompts, 24, [], temperature=1.0, seed=11)
    b = answers_with_hidden(model, prompts, 24, [], temperature=1.0, seed=11)
    c = answers_with_hidden(model, prompts, 24, [], temperature=1.0, seed=12)
    greedy = greedy_with_hidden(model, prompts, 24, [])
    assert [x.ids for x in a] == [x.ids for x in b] != [x.ids for x in c]
    assert [x.ids for x in a] != [x.ids for x in greedy]
    for prompt, ans in zip(prompts, a):
        tokens = prompt + ans.ids
        positions = list(range(len(prompt) - 1, len(tokens) - 1))
        h_ref = D.sequence_hidden(model, mx.array(tokens), mx.array(positions))
        np.testing.assert_allclose(ans.hidden, np.array(h_ref), atol=2e-2, rtol=1e-2)


def _check_answers(model, prompts, answers, eos):
    """Each answer is its prompt's engine greedy decoding (alone), and hidden[j] the state
    that drew ids[j] (one forward over prompt + answer)."""
    for prompt, ans in zip(prompts, answers):
        want, _ = run_decode(model, None, [prompt], max_tokens=40, eos_token_ids=eos)
        ended = ans.finish == "stop"
        assert ans.ids == want[0] + (eos if ended else [])
        tokens = prompt + ans.ids
        positions = list(range(len(prompt) - 1, len(tokens) - 1))
        h_ref = D.sequence_hidden(model, mx.array(tokens), mx.array(positions))
        np.testing.assert_allclose(ans.hidden, np.array(h_ref), atol=2e-2, rtol=1e-2)


def test_a_shared_prompt_prefix_runs_once_and_changes_no_answer(monkeypatch):
    from redrafter_mlx.train import selfgen

    model = tiny_model(seed=9, vocab=48)
    rng = np.random.default_rng(9)
    system = rng.integers(3, 48, 12).tolist()  # a chat template's system turn, say
    prompts = [system + rng.integers(3, 48, n).tolist() for n in (1, 4, 7)]
    runs = []
    real = selfgen.prefill_session

    def counted(session, tokens, quantum, **kw):
        runs.append([len(t) for t in tokens])
        return real(session, tokens, quantum, **kw)

    monkeypatch.setattr(selfgen, "prefill_session", counted)
    answers = answers_with_hidden(model, prompts, 40, [])
    assert runs[0] == [12] and runs[1] == [1, 4, 7]  # the prefix once, then each row's rest
    _check_answers(model, prompts, answers, [])


def test_rows_that_ended_leave_the_batch_and_the_others_answer_as_alone(monkeypatch):
    from redrafter_mlx.train import selfgen

    model = tiny_model(seed=4, vocab=48)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 48, int(rng.integers(2, 9))).tolist() for _ in range(20)]
    free = greedy_with_hidden(model, prompts, 40, [])
    # an end-of-turn id that many rows emit, at different steps: some rows end, others not
    firsts = [next(iter(a.ids[2:]), -1) for a in free]
    eos = [max(set(firsts), key=firsts.count)]
    kept = []
    real = selfgen.take_rows
    monkeypatch.setattr(selfgen, "take_rows", lambda s, k, i: kept.append(i.size) or real(s, k, i))
    answers = answers_with_hidden(model, prompts, 40, eos)
    ends = sorted(len(a.ids) for a in answers if a.finish == "stop")
    assert kept and all(k % 8 == 0 and k < 20 for k in kept), (kept, ends)
    assert any(a.finish == "length" for a in answers)
    _check_answers(model, prompts, answers, eos)
    assert selfgen.rows_to_keep(np.array([1, 0, 0, 0, 0, 0, 0, 0], bool)).tolist() == list(range(8))
    keep = selfgen.rows_to_keep(np.array([1] * 6 + [0] * 10, bool))
    assert keep.tolist() == list(range(16))  # 10 running rows need 16 slots: none leave
    keep = selfgen.rows_to_keep(np.array([1] * 10 + [0] * 6, bool))
    assert keep.tolist() == [0, 1] + list(range(10, 16))  # 6 running + 2 ended = 8


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batches_in_lanes_give_each_batch_its_own_answers(temperature):
    """Two lanes (two CPU streams, steps queued in turn) answer every batch as that batch
    alone does, greedy or sampled (per-batch seeds), hidden states included, whatever order
    the batches end in; a third batch starts when a lane frees up."""
    from redrafter_mlx.train.selfgen import Job, answers_in_lanes

    model = tiny_model(seed=6, vocab=48)
    rng = np.random.default_rng(6)
    jobs = []
    for key, (rows, tokens) in enumerate([(3, 30), (2, 9), (4, 20)]):
        prompts = [rng.integers(3, 48, int(rng.integers(2, 9))).tolist() for _ in range(rows)]
        jobs.append(Job(key, prompts, tokens, (5,), temperature, seed=100 + key))
    done = {job.key: answers for job, answers in answers_in_lanes(model, iter(jobs), lanes=2)}
    assert sorted(done) == [0, 1, 2]
    for job in jobs:
        alone = answers_with_hidden(
            model, job.prompts, job.max_tokens, job.eos_token_ids, temperature, job.seed
        )
        assert [a.ids for a in done[job.key]] == [a.ids for a in alone]
        assert [a.finish for a in done[job.key]] == [a.finish for a in alone]
        for a, b in zip(done[job.key], alone):
            np.testing.assert_array_equal(a.hidden, b.hidden)
