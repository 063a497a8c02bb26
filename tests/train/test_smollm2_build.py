"""The self-distillation data path that built the SmolLM2 drafter, on a tiny model: answers
with kept hidden states give the training positions of one forward per answer, the held-out
chain score is the greedy acceptance it stands for, and the build script's recorded settings
are flags the distill command takes."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
from typer.testing import CliRunner

from redrafter_mlx.train import distill as D
from redrafter_mlx.train.data import load_training_data
from redrafter_mlx.train.evaluation import chain_score
from redrafter_mlx.train.selfdata import SelfData, write_jsonl_atomic
from scripts.build_smollm2_drafter import command
from tests.support.models import run_decode, tiny_drafter, tiny_model


class ToyTokenizer:
    """Just what the answers need: a chat prompt of ids, end-of-turn ids."""

    eos_token_ids = frozenset({7})

    def chat_prompt(self, messages):
        return [1] + [3 + (ord(c) % 40) for c in messages[-1]["content"]]


def _answers(tmp_path, model):
    data = SelfData(
        tmp_path / "work", model, ToyTokenizer(), temperature=0.0, answer_tokens=24, batch=8, seed=0
    )
    chunk = [dict(id=i, source="t", prompt=p) for i, p in enumerate(["hello", "a b c", "xyz!"])]
    return data, data.generate(chunk, lambda _n: False)


def test_kept_hidden_states_give_the_positions_of_one_forward_per_answer(tmp_path):
    model = tiny_model(seed=2, vocab=48)
    data, rows = _answers(tmp_path, model)
    ref, _ = run_decode(
        model, None, [r["prompt_ids"] for r in rows], max_tokens=24, eos_token_ids=[7]
    )
    for r, want in zip(rows, ref):
        assert r["response_ids"] == want + ([7] if r["finish"] == "stop" else [])
    depth = 3
    kept = data.targets(rows, depth)
    plain = tmp_path / "plain.jsonl"
    write_jsonl_atomic(plain, [{k: r[k] for k in ("prompt_ids", "response_ids")} for r in rows])
    seqs = load_training_data([plain], None, 512)
    fwd = D.build_target_cache(model, seqs, depth, "self", tmp_path / "forward")
    t_gen, v_gen, t_fwd, v_fwd = (
        np.asarray(a) for a in (kept.tokens, kept.valid, fwd.tokens, fwd.valid)
    )
    assert t_gen.shape == t_fwd.shape == (sum(len(r["response_ids"]) for r in rows), depth + 1)
    assert (t_gen[:, 0] == t_fwd[:, 0]).all()
    assert (t_gen[:, 1:][v_gen] == t_fwd[:, 1:][v_gen]).all()
    assert (v_gen <= v_fwd).all()
    np.testing.assert_allclose(
        np.asarray(kept.hidden, np.float32),
        np.asarray(fwd.hidden, np.float32),
        atol=3e-2,
        rtol=1e-2,
    )


def test_chain_score_is_the_greedy_width_one_acceptance_it_estimates(tmp_path):
    """With every position a step start, the chain score's accepted run is what greedy W=1
    decoding accepts from that position: check it against the drafter's own chains."""
    model = tiny_model(seed=4, vocab=48)
    drafter = tiny_drafter(model, seed=5)
    data, rows = _answers(tmp_path, model)
    depth, length = 3, 4
    cache = data.targets(rows, depth)
    h, t, v = (np.asarray(a) for a in (cache.hidden, cache.tokens, cache.valid))
    score = chain_score(drafter, model, dict(hidden=h, tokens=t, valid=v), None, length)
    runs = []
    for j in range(len(t)):
        state = mx.zeros((1, model.hidden_size))
        hid = mx.array(h[j : j + 1]).astype(mx.float32)
        n = 0
        for k in range(length - 1):
            state = drafter.next_state(state, model.embed(mx.array(t[j : j + 1, k])))
            guess = int(mx.argmax(drafter(hid, state), axis=-1).item())
            if not v[j, k] or guess != int(t[j, k + 1]):
                break
            n += 1
        runs.append(n)
    assert abs(score["score"] - (1 + np.mean(runs))) < 1e-6


def test_the_recorded_build_settings_are_distill_flags(tmp_path):
    from redrafter_mlx.cli import _register, app

    _register()
    cmd = command(tmp_path / "no-model", tmp_path / "out", resume=False)
    assert cmd[:2] == ["redrafter-mlx", "distill"] and "--data" not in cmd
    result = CliRunner().invoke(app, cmd[1:])
    assert result.exit_code != 0
    assert "No such option" not in result.output and "no-model" in result.output
    assert json.dumps(cmd)  # a plain list of strings
