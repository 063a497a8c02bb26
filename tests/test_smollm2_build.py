"""The SmolLM2 drafter build's data path (scripts/build_smollm2_drafter.py, smollm2_train.py)
on a tiny model: answers with kept hidden states give the same training positions as one
forward per answer, and the held-out chain score is the greedy acceptance it stands for."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from redrafter_mlx.train import distill as D
from scripts.build_smollm2_drafter import answer_batch, append_jsonl
from scripts.smollm2_train import chain_score, forward_targets, generation_targets, init_from_base
from tests.helpers import run_decode, tiny_drafter, tiny_model


class ToyTokenizer:
    """Just what the build reads: a chat prompt of ids, decode, end-of-turn ids."""

    eos_token_ids = frozenset({7})

    def chat_prompt(self, messages):
        return [1] + [3 + (ord(c) % 40) for c in messages[-1]["content"]]

    def decode(self, ids):
        return " ".join(map(str, ids))


def _answers(tmp_path, model):
    tok = ToyTokenizer()
    chunk = [dict(id=i, source="t", prompt=p) for i, p in enumerate(["hello", "a b c", "xyz!"])]
    shards = tmp_path / "hidden"
    shards.mkdir()
    rows = answer_batch(model, tok, chunk, 24, shards)
    append_jsonl(tmp_path / "generations.jsonl", rows)
    return rows


def test_kept_hidden_states_give_the_positions_of_one_forward_per_answer(tmp_path):
    model = tiny_model(seed=2, vocab=48)
    rows = _answers(tmp_path, model)
    ref, _ = run_decode(
        model, None, [r["prompt_ids"] for r in rows], max_tokens=24, eos_token_ids=[7]
    )
    for r, want in zip(rows, ref):
        assert r["response_ids"] == want + ([7] if r["finish"] == "stop" else [])
    depth = 3
    h_gen, t_gen, v_gen = generation_targets(tmp_path, rows, depth)
    plain = [{k: v for k, v in r.items() if k != "hidden"} for r in rows]
    h_fwd, t_fwd, v_fwd = forward_targets(tmp_path, plain, model, None, depth, {})
    assert t_gen.shape == t_fwd.shape == (sum(len(r["response_ids"]) for r in rows), depth + 1)
    assert (t_gen[:, 0] == t_fwd[:, 0]).all()
    assert (t_gen[:, 1:][v_gen] == t_fwd[:, 1:][v_gen]).all()
    assert (v_gen <= v_fwd).all()
    np.testing.assert_allclose(
        h_gen.astype(np.float32), h_fwd.astype(np.float32), atol=3e-2, rtol=1e-2
    )
    assert json.loads((tmp_path / "generations.jsonl").read_text().splitlines()[0])["hidden"]


def test_chain_score_is_the_greedy_width_one_acceptance_it_estimates(tmp_path):
    """With every position a step start, the chain score's accepted run is what greedy W=1
    decoding accepts from that position: check it against decoding from each prefix."""
    model = tiny_model(seed=4, vocab=48)
    drafter = tiny_drafter(model, seed=5)
    rows = _answers(tmp_path, model)
    depth, length = 3, 4
    h, t, v = generation_targets(tmp_path, rows, depth)
    val = dict(hidden=h, tokens=t, valid=v)
    score = chain_score(drafter, model, val, None, length)
    # Reference: per position, the drafter's own greedy chain vs the answer's next tokens.
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


def test_base_head_init_predicts_the_models_own_next_token():
    model = tiny_model(seed=6, vocab=48, tie_word_embeddings=True)
    opts = D.DistillOptions(predict_tokens=3, exit_dim=model.hidden_size).validate()
    drafter = D.new_drafter(D.drafter_args(model, opts, list(range(0, 48, 2))), 0)
    init_from_base(drafter, model, list(range(0, 48, 2)), freeze_head=True)
    assert "lm_head.2.weight" not in dict(tree_flatten(drafter.trainable_parameters()))
    h = mx.random.normal((5, model.hidden_size), key=mx.random.key(0))
    logits = drafter(h, mx.zeros_like(h))
    base = model.logits(h)[:, ::2]
    # Identity input_proj (+1% noise) and 0.1-scaled residual blocks: close to the base head.
    top = (mx.argmax(logits, -1) == mx.argmax(base, -1)).astype(mx.float32).mean().item()
    assert top >= 0.6
