"""Self-distillation targets (``--targets self``) and the shortlist drafter vocabulary (FR-Spec)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from redrafter_mlx.engine.drafting.drafter import Drafter, DrafterArgs, beam_search
from redrafter_mlx.train import distill as D
from redrafter_mlx.train.data import Sequence, load_training_data
from tests.support.models import _randomize, run_decode, tiny_model
from weights_convert.smollm2 import smollm2_path

SMOLLM2 = smollm2_path()  # at import: the tests' home fixture points the cache elsewhere


def _greedy_sequence(model, prompt: list[int], n: int) -> list[int]:
    """prompt + the model's own greedy answer of n tokens (engine decoding, as the build does)."""
    out, _ = run_decode(model, None, [prompt], max_tokens=n)
    assert len(out[0]) == n
    return prompt + out[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_self_targets_equal_rollouts_on_greedy_self_generated_responses(seed):
    model = tiny_model(seed=seed, vocab=48)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, model.vocab_size, 7).tolist()
    tokens = _greedy_sequence(model, prompt, 20)
    N, depth = len(tokens), 4
    positions = list(range(len(prompt) - 1, N - 1))  # every position whose next token is answer
    toks, pos = mx.array(tokens), mx.array(positions)
    h_self, g_self, valid = D.self_targets(model, toks, pos, depth)
    h_roll, g_roll = D.rollout_targets(model, toks, pos, depth)
    g_roll = np.array(g_roll)
    # Inside the sequence every target is valid and equals the real rollout; past the end none.
    inside = np.array([[t + k <= N - 1 for k in range(1, depth + 1)] for t in positions])
    assert (valid == inside).all()
    assert (g_self[:, 0] == g_roll[:, 0]).all()  # x0
    assert (g_self[:, 1:][valid] == g_roll[:, 1:][valid]).all()
    assert valid.sum() > 0.8 * valid.size
    assert mx.allclose(h_self, h_roll, atol=1e-5).item()


def test_self_targets_stop_exactly_where_the_data_departs_from_greedy():
    """On data that is not the model's own output, the valid targets are still exact."""
    model = tiny_model(seed=5, vocab=48)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, model.vocab_size, 24).tolist()
    positions = list(range(2, 23))
    depth = 4
    _, g_self, valid = D.self_targets(model, mx.array(tokens), mx.array(positions), depth)
    _, g_roll = D.rollout_targets(model, mx.array(tokens), mx.array(positions), depth)
    g_roll = np.array(g_roll)
    assert (g_self[:, 0] == g_roll[:, 0]).all()
    assert (g_self[:, 1:][valid] == g_roll[:, 1:][valid]).all()
    assert not valid.all()  # random data departs from greedy somewhere
    # Valid steps form a prefix (a departure ends a position's targets).
    assert all(list(row) == sorted(row, reverse=True) for row in valid)


def test_target_cache_self_mode_and_its_meta(tmp_path):
    model = tiny_model(seed=3, vocab=48)
    tokens = _greedy_sequence(model, [1, 5, 9, 4], 12)
    seq = Sequence(tokens, [False] * 4 + [True] * 12)
    cache = D.build_target_cache(model, [seq], 3, "self", tmp_path / "c")
    assert cache.size == 12
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    assert meta["mode"] == "self"
    # The targets are the response itself: x0 = y_{t+1}, target_k = y_{t+1+k} (the last
    # step may be the model's greedy token right after the sequence, also exact).
    for j, t in enumerate(seq.positions()):
        for k in range(4):
            if (k == 0 or cache.valid[j, k - 1]) and t + 1 + k < len(tokens):
                assert cache.tokens[j, k] == tokens[t + 1 + k]
    assert cache.valid[:, 0].all()


def test_records_with_exact_token_ids_are_used_unchanged(tmp_path):
    from redrafter_mlx.engine.base.tokenizer import load_tokenizer
    from tests.support.models import VICUNA_TOKENIZER

    f = tmp_path / "gen.jsonl"
    rows = [
        dict(prompt="hi", response="x", prompt_ids=[1, 7, 8], response_ids=[9, 10, 2]),
        dict(prompt="a", response="b", prompt_ids=[1, 3], response_ids=[4, 5]),
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seqs = load_training_data([f], load_tokenizer(VICUNA_TOKENIZER), seq_len=64)
    assert [s.tokens for s in seqs] == [[1, 7, 8, 9, 10, 2], [1, 3, 4, 5]]
    assert seqs[0].train == [False, False, False, True, True, True]
    assert seqs[0].positions() == [2, 3, 4]


# ------------------------------------------------------------------------------------------
# shortlist vocabulary


def shortlist_drafter(model, ids, seed=1, exit_dim=None) -> Drafter:
    H = model.hidden_size
    args = DrafterArgs(
        vocab_size=model.vocab_size,
        hidden_size=H,
        exit_dim=exit_dim or 2 * H,
        num_draft_layers=1,
        draft_vocab=list(ids),
    )
    drafter = Drafter(args)
    _randomize(drafter, seed, 2.0)
    return drafter


def test_shortlist_vocab_ranks_by_training_frequency():
    seqs = [
        Sequence([1, 5, 5, 5, 7, 7, 9, 3], [False, True, True, True, True, True, True, False]),
        Sequence([1, 7, 11, 11], [False, True, False, False]),
    ]
    # training tokens: 5 x3, 7 x3, 9 x1 (1, 3 and 11 are not training tokens)
    assert D.shortlist_vocab(seqs, 2, 16) == [5, 7]
    assert D.shortlist_vocab(seqs, 2, 16, always=[2]) == [2, 5]
    assert D.shortlist_vocab(seqs, 10, 16) == [5, 7, 9]  # unseen ids are not listed
    index = D.shortlist_index([5, 7, 9], 16)
    assert index[[5, 7, 9, 0]].tolist() == [0, 1, 2, -1]


def test_read_batch_maps_targets_into_the_shortlist_and_masks_the_rest(tmp_path):
    model = tiny_model(seed=2, vocab=32)
    cache = D.TargetCache(
        tmp_path,
        np.zeros((2, model.hidden_size), np.float32),
        np.array([[4, 5, 6, 7], [8, 9, 5, 4]], np.int32),
        np.array([[True, True, True], [True, True, False]]),
    )
    index = D.shortlist_index([4, 5, 7, 9], model.vocab_size)
    _, emb, targets, valid = D.read_batch(cache, model, np.array([0, 1]), index)
    assert valid.tolist() == [[True, False, True], [True, True, False]]
    assert targets.tolist()[0] == [1, 0, 2] and targets.tolist()[1][:2] == [3, 1]
    # The RNN still reads the true tokens' embeddings (6 and 8 are outside the list).
    assert mx.allclose(emb[1, 0], model.embed(mx.array([8]))[0]).item()


def test_shortlisted_beam_search_only_proposes_listed_ids():
    model = tiny_model(seed=4, vocab=64)
    ids = [3, 10, 11, 20, 33, 40, 41, 50, 63]
    drafter = shortlist_drafter(model, ids)
    hidden = mx.random.normal((3, model.hidden_size), key=mx.random.key(0))
    beams, scores, log_probs = beam_search(drafter, model.embed, hidden, mx.array([0, 1, 2]), 4, 5)
    assert beams.shape == (3, 4, 5) and log_probs.shape == (3, 4, 4, len(ids))
    assert beams[:, :, 0].tolist() == [[0] * 4, [1] * 4, [2] * 4]
    assert set(np.array(beams[:, :, 1:]).ravel().tolist()) <= set(ids)
    # A beam's score is the sum of its drafted tokens' log-probs over the shortlist.
    where = {t: i for i, t in enumerate(ids)}
    lp, b, s = np.array(log_probs), np.array(beams), np.array(scores)
    for r in range(3):
        for i in range(4):
            total = sum(lp[r, i, k, where[b[r, i, k + 1]]] for k in range(4))
            assert abs(total - s[r, i]) < 1e-4


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_redrafter_with_a_shortlist_drafter_equals_autoregressive(seed):
    model = tiny_model(seed=seed, vocab=64)
    rng = np.random.default_rng(seed)
    # A shortlist that misses some of the model's tokens: those can only come as bonus tokens.
    ids = sorted(rng.choice(model.vocab_size, 24, replace=False).tolist())
    drafter = shortlist_drafter(model, ids, seed=seed + 10)
    prompts = [rng.integers(0, model.vocab_size, n).tolist() for n in (3, 9, 5)]
    ar, _ = run_decode(model, None, prompts, max_tokens=24)
    for w, length in ((1, 3), (2, 4), (4, 5)):
        spec, _ = run_decode(
            model, drafter, prompts, max_tokens=24, beam_width=w, beam_length=length
        )
        assert spec == ar, (w, length)


def test_shortlist_drafter_directory_round_trip(tmp_path):
    from redrafter_mlx.engine.loop.loading import LoadError, check_pair, load_drafter
    from tests.support.models import save_drafter_dir

    model = tiny_model(seed=6, vocab=64)
    drafter = shortlist_drafter(model, [2, 8, 9, 30], exit_dim=16)
    save_drafter_dir(drafter, tmp_path / "d")
    cfg = json.loads(Path(tmp_path / "d" / "config.json").read_text())
    assert cfg["draft_vocab"] == [2, 8, 9, 30] and cfg["vocab_size"] == 64
    loaded = load_drafter(tmp_path / "d", mx.float32)
    check_pair(model, loaded)
    assert loaded.lm_head[-1].weight.shape == (4, 16)
    assert loaded.full_ids(mx.array([0, 3])).tolist() == [2, 30]
    h = mx.ones((1, model.hidden_size))
    assert mx.allclose(loaded(h, h), drafter(h, h)).item()
    cfg["draft_vocab"] = [2, 8, 9, 64]  # an id past the model's vocabulary
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match="draft_vocab"):
        check_pair(model, load_drafter(tmp_path / "d", mx.float32))


def test_the_packaged_smollm2_drafter_is_offered_only_for_the_gguf_weights(tmp_path):
    """The float32 install and the GGUF's own quantization kept (Metal) get the drafter;
    re-quantized weights do not (tests/convert/test_quantized_drafter.py converts both for real)."""
    from redrafter_mlx.engine.base import bundled
    from weights_convert import smollm2

    assert bundled.SMOLLM2_MARKER == smollm2.MARKER
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert bundled.bundled_drafter_for(folder) is None  # any other model folder
    (folder / smollm2.MARKER).write_text(json.dumps({"quantization": None}))
    expected = (
        bundled.SMOLLM2_DRAFTER if (bundled.SMOLLM2_DRAFTER / "config.json").exists() else None
    )
    assert bundled.bundled_drafter_for(folder) == expected
    kept = {"model_type": "llama", "quantization": bundled.SMOLLM2_GGUF_QUANTIZATION}
    (folder / "config.json").write_text(json.dumps(kept))
    assert bundled.bundled_drafter_for(folder) == expected
    requantized = {"model_type": "llama", "quantization": {"group_size": 64, "bits": 4}}
    (folder / "config.json").write_text(json.dumps(requantized))
    assert bundled.bundled_drafter_for(folder) is None  # not the weights it was trained on


def test_shipped_smollm2_drafter_loads_and_pairs_with_the_model_config():
    """The packaged drafter (when built) is a valid shortlist drafter for SmolLM2's shapes."""
    from redrafter_mlx.engine.base import bundled
    from redrafter_mlx.engine.loop.loading import load_drafter

    if not (bundled.SMOLLM2_DRAFTER / "config.json").exists():
        pytest.skip("the SmolLM2 drafter is not built (make smollm2-drafter)")
    drafter = load_drafter(bundled.SMOLLM2_DRAFTER, mx.float32)
    args = drafter.args
    assert (args.vocab_size, args.hidden_size) == (49152, 576)
    assert args.draft_vocab and all(0 <= i < 49152 for i in args.draft_vocab)
    assert 2 in args.draft_vocab  # <|im_end|> can be drafted
    size = sum(f.stat().st_size for f in bundled.SMOLLM2_DRAFTER.iterdir())
    assert size <= 16 * 2**20


@pytest.mark.slow
def test_shipped_drafter_on_the_real_smollm2_is_lossless():
    """Greedy ReDrafter with the packaged drafter reproduces plain decoding on SmolLM2."""
    from redrafter_mlx.engine.base import bundled
    from redrafter_mlx.engine.loop.loading import load

    if not (SMOLLM2 / "config.json").exists():
        pytest.skip("SmolLM2 is not converted; run `make smollm2` (part of `make install`)")
    if not (bundled.SMOLLM2_DRAFTER / "config.json").exists():
        pytest.skip("the SmolLM2 drafter is not built (make smollm2-drafter)")
    model, drafter, tok = load(SMOLLM2, bundled.SMOLLM2_DRAFTER, "float32")
    prompts = [
        tok.chat_prompt([{"role": "user", "content": q}]) for q in ("Hi!", "Why is the sky blue?")
    ]
    ar, _ = run_decode(model, None, prompts, max_tokens=24, eos_token_ids=[2])
    spec, stats = run_decode(
        model, drafter, prompts, max_tokens=24, eos_token_ids=[2], beam_width=2, beam_length=4
    )
    assert spec == ar
    assert stats["tokens_per_step"] > 1.0  # the drafter is accepted sometimes


# soft targets


def test_teacher_targets_are_the_models_distribution_at_the_targets_position(tmp_path):
    """On self-generated data, row t+k of the cache is the position whose greedy draw is step
    k's target: the teacher there is the LLM's softmax, its argmax the hard target."""
    model = tiny_model(seed=7, vocab=48)
    seqs = []
    for s in range(2):
        prompt = np.random.default_rng(s).integers(0, model.vocab_size, 5).tolist()
        tokens = _greedy_sequence(model, prompt, 12)
        seqs.append(Sequence(tokens, [False] * len(prompt) + [True] * 12))
    depth = 3
    cache = D.build_target_cache(model, seqs, depth, "self", tmp_path / "c")
    idx = np.arange(cache.size)
    teacher, soft = D.teacher_targets(cache, model, idx)
    soft = np.array(soft)
    valid = np.asarray(cache.valid)
    # Soft targets exist exactly where the target position is a cached row of the same answer:
    # every valid step but the read-past-the-end one at each answer's last positions.
    assert (soft <= valid).all()
    assert valid.sum() - 2 * depth <= soft.sum() <= valid.sum()
    hard = np.asarray(cache.tokens)[:, 1:]
    assert (np.array(mx.argmax(teacher, axis=-1))[soft] == hard[soft]).all()
    j, k = np.argwhere(soft)[5]
    want = mx.softmax(model.logits(mx.array(cache.hidden[j + k + 1])), axis=-1)
    assert mx.allclose(teacher[j, k], want, rtol=1e-4, atol=1e-7).item()
    # Over a shortlist: renormalised over its ids.
    ids = list(range(0, 48, 3))
    short, _ = D.teacher_targets(cache, model, idx[:4], ids)
    full = model.logits(mx.array(cache.hidden[1:5]))[:, mx.array(ids)]
    assert mx.allclose(short[:, 0], mx.softmax(full, axis=-1), rtol=1e-4, atol=1e-7).item()


def test_soft_loss_is_the_cross_entropy_to_the_teacher_where_given():
    model = tiny_model(seed=8, vocab=32)
    drafter = shortlist_drafter(model, range(32))
    B, T, H = 4, 2, model.hidden_size
    hidden = mx.random.normal((B, H), key=mx.random.key(1))
    emb = mx.random.normal((B, T, H), key=mx.random.key(2))
    targets = mx.array(np.random.default_rng(0).integers(0, 32, (B, T)), dtype=mx.int32)
    valid = mx.ones((B, T), dtype=mx.bool_)
    teacher = mx.softmax(mx.random.normal((B, T, 32), key=mx.random.key(3)), axis=-1)
    none = mx.zeros((B, T), dtype=mx.bool_)
    hard, _, _ = D.drafter_loss(drafter, hidden, emb, targets, valid)
    same, _, _ = D.drafter_loss(drafter, hidden, emb, targets, valid, teacher, none)
    assert mx.allclose(hard, same).item()
    onehot = mx.eye(32)[targets]  # a one-hot teacher = hard CE
    one, _, _ = D.drafter_loss(drafter, hidden, emb, targets, valid, onehot, ~none)
    assert mx.allclose(hard, one, atol=1e-4).item()
    soft, _, _ = D.drafter_loss(drafter, hidden, emb, targets, valid, teacher, ~none)
    assert not mx.allclose(hard, soft).item()
