"""Drafter distillation: targets, training, checkpoints/resume, data errors, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from redrafter_mlx.engine.base.errors import ParamError
from redrafter_mlx.engine.core.tree import cache_mask, chain_mask
from redrafter_mlx.train import distill as D
from redrafter_mlx.train import training as TR
from redrafter_mlx.train.data import DataError, Sequence, load_training_data
from tests.support.models import (
    VICUNA_TOKENIZER,
    near_bigram_model,
    run_decode,
    tiny_model,
)
from tests.support.train import SHAREGPT

TOKENIZER = VICUNA_TOKENIZER

pytestmark = pytest.mark.slow  # make test-fast leaves these out


def naive_rollout(model, tokens: list[int], t: int, depth: int) -> list[int]:
    """Greedy continuation of tokens[:t+1] for depth+1 tokens, one token at a time."""
    slots = t + depth + 2
    cache = model.make_cache(1, slots)
    idx = mx.arange(t + 1)[None]
    mask = cache_mask(mx.array([0]), chain_mask(t + 1), slots)
    h, cache = model(mx.array(tokens[: t + 1])[None], idx, mask, cache, idx)
    cur = int(mx.argmax(model.logits(h[0, -1])))
    out, length = [cur], t + 1
    for _ in range(depth):
        mask = cache_mask(mx.array([length]), chain_mask(1), slots)
        pos = mx.array([[length]])
        h, cache = model(mx.array([[cur]]), pos, mask, cache, pos)
        cur = int(mx.argmax(model.logits(h[0, -1])))
        out.append(cur)
        length += 1
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_rollouts_equal_naive_greedy(seed):
    model = tiny_model(seed=seed)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, model.vocab_size, 24).tolist()
    positions = [0, 2, 3, 7, 11, 12, 19, 22]
    depth = 4
    hidden, greedy = D.rollout_targets(model, mx.array(tokens), mx.array(positions), depth)
    assert greedy.shape == (len(positions), depth + 1)
    assert greedy.tolist() == [naive_rollout(model, tokens, t, depth) for t in positions]
    # The hidden states are the causal forward's, at the training positions.
    full = D.sequence_hidden(model, mx.array(tokens), mx.arange(len(tokens)))
    assert mx.allclose(hidden, full[mx.array(positions)], atol=1e-5).item()


def test_ground_truth_targets_mask_steps_past_the_end_and_non_training_tokens():
    seq = Sequence([1, 10, 11, 12, 13, 14], [False, False, True, True, False, True])
    toks, valid = D.ground_truth_targets(seq, [1, 3], depth=3)
    assert toks.tolist() == [[11, 12, 13, 14], [13, 14, 0, 0]]
    assert valid.tolist() == [[True, False, True], [True, False, False]]


def test_sequence_positions_follow_the_training_mask():
    seq = Sequence([1, 5, 6, 7, 8], [False, False, True, True, False])
    assert seq.positions() == [1, 2]


# ------------------------------------------------------------------------------------------
# training on a tiny near-bigram model


def _random_sequences(vocab: int, n: int, length: int, seed: int) -> list[Sequence]:
    rng = np.random.default_rng(seed)
    return [
        Sequence(rng.integers(0, vocab, length).tolist(), [False] + [True] * (length - 1))
        for _ in range(n)
    ]


def test_training_reduces_loss_and_raises_tokens_per_step(tmp_path):
    model = near_bigram_model(seed=0, attn_scale=0.02)
    model.freeze()
    T = 3
    cache = D.build_target_cache(
        model, _random_sequences(model.vocab_size, 12, 48, 0), T, "distill", tmp_path / "cache"
    )
    assert cache.size == 12 * 47
    opts = D.DistillOptions(predict_tokens=T, lr=3e-3, warmup=0.1, batch_size=64).validate()
    steps = 120
    drafter = D.new_drafter(D.drafter_args(model, opts), seed=0)
    prompts = [p.tokens[:8] for p in _random_sequences(model.vocab_size, 4, 8, 99)]
    shapes = [(2, 4)]
    before = D.evaluate(model, drafter, prompts, shapes, max_tokens=24)[0]["tokens_per_step"]

    trainer = D.Trainer(drafter, opts, steps)
    order = D.DataOrder(cache.size, opts.batch_size, seed=0)
    losses = []
    for step in range(steps):
        loss, _, accs = trainer.step([D.read_batch(cache, model, order.batch(step))])
        losses.append(loss.item())
    after = D.evaluate(model, drafter, prompts, shapes, max_tokens=24)[0]["tokens_per_step"]
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:5])
    assert accs[0].item() > 0.5
    assert after > before + 0.3, (before, after)
    # Speculation never changes greedy output: the trained drafter still decodes losslessly.
    ar, _ = run_decode(model, None, prompts, max_tokens=24)
    spec, _ = run_decode(model, drafter, prompts, max_tokens=24, beam_width=2, beam_length=4)
    assert spec == ar


def test_data_order_is_a_pure_function_of_seed_and_index():
    a = D.DataOrder(100, 16, seed=3)
    b = D.DataOrder(100, 16, seed=3)
    assert a.per_epoch == 6
    seen = np.concatenate([a.batch(i) for i in range(6)])
    assert len(set(seen.tolist())) == 96  # one epoch: distinct positions
    assert [b.batch(i).tolist() for i in (7, 2, 7)] == [a.batch(i).tolist() for i in (7, 2, 7)]
    assert a.batch(0).tolist() != a.batch(6).tolist()  # a new permutation each epoch
    # Two processes split each global batch between them.
    r0, r1 = D.DataOrder(100, 8, 3, rank=0, world=2), D.DataOrder(100, 8, 3, rank=1, world=2)
    assert sorted(r0.batch(0).tolist() + r1.batch(0).tolist()) == sorted(a.batch(0).tolist())


def test_lr_schedule_warms_up_then_decays_to_zero():
    sched = D.lr_schedule(1e-3, total_steps=20, warmup=0.25)
    values = [sched(mx.array(i)).item() for i in range(21)]
    assert values[0] == 0.0 and values[5] == pytest.approx(1e-3)
    assert values[3] < values[4] < values[5] > values[10] > values[19]
    assert values[20] == pytest.approx(0.0, abs=1e-9)


# ------------------------------------------------------------------------------------------
# the full run: API, checkpoints, resume, CLI


RUN = dict(
    predict_tokens=3,
    steps=6,
    batch_size=32,
    seq_len=128,
    save_every=3,
    quiet=True,
    lr=2e-3,
    eval_prompts=1,
    eval_max_tokens=8,
    eval_shapes=((2, 3),),
)


def _weights(path: Path) -> dict:
    return {k: np.array(v) for k, v in mx.load(str(path / "model.safetensors")).items()}


def test_distill_loads_the_model_with_its_serving_blas_threads(model_dir, monkeypatch):
    """The answer and training stages run with the threads serving would pick for this model
    (every core for a weight-bound one), not the start-up default of all cores but one."""
    from redrafter_mlx.engine.base import platform

    fitted = []
    monkeypatch.setattr(platform, "fit_blas_threads", lambda *models: fitted.append(models))
    model, *_ = D.load_serving(model_dir, D.DistillOptions().validate())
    assert len(fitted) == 1 and fitted[0][0] is model


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(model_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    full = D.distill(model_dir, [SHAREGPT], tmp_path / "full", cache_dir=cache, **RUN)
    assert full["steps"] == 6 and full["resumed_from"] == 0

    real_save = D.save_checkpoint

    def save_then_crash(out, trainer, step, config, run):
        real_save(out, trainer, step, config, run)
        raise KeyboardInterrupt(f"killed after step {step}")

    monkeypatch.setattr(D, "save_checkpoint", save_then_crash)
    with pytest.raises(KeyboardInterrupt, match="after step 3"):
        D.distill(model_dir, [SHAREGPT], tmp_path / "split", cache_dir=cache, **RUN)
    monkeypatch.setattr(D, "save_checkpoint", real_save)
    assert [p.name for p in D.list_checkpoints(tmp_path / "split")] == ["step-00000003"]

    resumed = D.distill(
        model_dir, [SHAREGPT], tmp_path / "split", cache_dir=cache, resume=True, **RUN
    )
    assert resumed["resumed_from"] == 3
    assert [h["step"] for h in resumed["history"]] == [4, 5, 6]
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in full["history"][3:]]
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "split")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    sa = mx.load(str(tmp_path / "full/checkpoints/step-00000006/training_state.safetensors"))
    sb = mx.load(str(tmp_path / "split/checkpoints/step-00000006/training_state.safetensors"))
    for k in sa:
        np.testing.assert_array_equal(np.array(sa[k]), np.array(sb[k]), err_msg=k)


def test_resume_refuses_changed_settings_and_fresh_runs_refuse_old_checkpoints(model_dir, tmp_path):
    run = dict(RUN, steps=3, eval_shapes=())
    D.distill(model_dir, [SHAREGPT], tmp_path / "out", **run)
    with pytest.raises(FileExistsError, match="--resume"):
        D.distill(model_dir, [SHAREGPT], tmp_path / "out", **run)
    with pytest.raises(ValueError, match="lr"):
        D.distill(model_dir, [SHAREGPT], tmp_path / "out", resume=True, **dict(run, lr=1e-2))


def test_checkpoint_write_is_atomic(model_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    D.distill(model_dir, [SHAREGPT], out, **dict(RUN, steps=3, eval_shapes=()))
    [old] = D.list_checkpoints(out)
    before = _weights(old)

    model, _ = __import__("redrafter_mlx.engine.loop.loading", fromlist=["load_model"]).load_model(
        model_dir
    )
    opts = D.DistillOptions(predict_tokens=3).validate()
    trainer = D.Trainer(D.new_drafter(D.drafter_args(model, opts), seed=5), opts, 10)
    real = mx.save_safetensors

    def crash_on_state(path, arrays, *a, **kw):
        if path.endswith("training_state.safetensors"):
            Path(path).write_bytes(b"partial")
            raise OSError("disk full")
        return real(path, arrays, *a, **kw)

    monkeypatch.setattr(D.mx, "save_safetensors", crash_on_state)
    with pytest.raises(OSError, match="disk full"):
        D.save_checkpoint(out, trainer, 4, D.drafter_config(trainer.drafter.args, 3, "distill"), {})
    monkeypatch.undo()
    assert list((out / "checkpoints").iterdir()) == [old]  # no partial dir left behind
    after = _weights(old)
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])
    top = _weights(out)  # out/ still holds the old checkpoint's weights
    for k in before:
        np.testing.assert_array_equal(before[k], top[k])
    # A hard kill leaves a hidden temp dir: never listed as a checkpoint, removed on restart.
    (out / "checkpoints" / ".tmp-step-00000009-1").mkdir()
    assert D.list_checkpoints(out) == [old]
    D.clean_stale_temps(out)
    assert list((out / "checkpoints").iterdir()) == [old]


def test_cli_distill_writes_a_loadable_drafter(model_dir, tmp_path):
    from typer.testing import CliRunner

    import redrafter_mlx
    from redrafter_mlx.cli import _register, app

    _register()
    out = tmp_path / "drafter"
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(json.dumps({"turns": ["Write a haiku about the sea."]}) + "\n")
    result = CliRunner().invoke(
        app,
        [
            "distill",
            "--model",
            str(model_dir),
            "--data",
            str(SHAREGPT),
            "--out",
            str(out),
            "--predict-tokens",
            "3",
            "--steps",
            "4",
            "--batch-size",
            "32",
            "--seq-len",
            "128",
            "--layers",
            "1",
            "--no-rnn",
            "--eval-data",
            str(eval_file),
            "--eval-max-tokens",
            "8",
            "--targets",
            "ground-truth",
            "--grad-accum",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    model, drafter, _tok = redrafter_mlx.load(model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["predict_tokens"] == 3 and cfg["rnn"] is False and cfg["num_draft_layers"] == 1
    assert drafter.args.exit_dim == 2 * model.hidden_size and "input_proj" not in drafter
    report = json.loads((out / "eval.json").read_text())
    assert report["prompts"] == 1
    assert [(r["beam_width"], r["beam_length"]) for r in report["results"]] == [
        (1, 3),
        (2, 4),
        (4, 4),
    ]
    assert all(1.0 <= r["tokens_per_step"] <= r["beam_length"] for r in report["results"])


def test_cli_reports_bad_data_with_file_and_record(model_dir, tmp_path):
    from typer.testing import CliRunner

    from redrafter_mlx.cli import _register, app

    _register()
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            [
                {"conversations": [{"from": "human", "value": "hi"}]},
                {"conversations": [{"from": "robot", "value": "x"}]},
            ]
        )
    )
    result = CliRunner().invoke(
        app,
        [
            "distill",
            "--model",
            str(model_dir),
            "--data",
            str(bad),
            "--out",
            str(tmp_path / "o"),
            "--quiet",
        ],
    )
    assert result.exit_code == 1
    assert "bad.json" in result.output and "record 1" in result.output and "robot" in result.output


# ------------------------------------------------------------------------------------------
# data


@pytest.fixture(scope="module")
def tokenizer():
    from redrafter_mlx.engine.base.tokenizer import load_tokenizer

    return load_tokenizer(TOKENIZER)


def test_sharegpt_renders_vicuna_with_loss_on_replies_only(tokenizer):
    [seq] = load_training_data([SHAREGPT], tokenizer, seq_len=100_000)
    record = json.loads(SHAREGPT.read_text())[0]["conversations"]
    msgs = [
        {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
        for t in record
    ]
    # The context of the first reply is exactly the chat engine's prompt.
    prompt = tokenizer.chat_prompt(msgs[:1])
    assert seq.tokens[: len(prompt)] == prompt and not any(seq.train[: len(prompt)])
    first_reply = tokenizer.encode(msgs[1]["content"], add_bos=False) + [tokenizer.eos_token_id]
    span = seq.tokens[len(prompt) : len(prompt) + len(first_reply)]
    assert span == first_reply and all(seq.train[len(prompt) : len(prompt) + len(first_reply)])
    # Every reply (and its EOS) is trained; nothing else is.
    trained = sum(
        len(tokenizer.encode(m["content"], add_bos=False)) + 1
        for m in msgs
        if m["role"] == "assistant"
    )
    assert sum(seq.train) == trained
    assert seq.tokens.count(tokenizer.eos_token_id) == 6


def test_jsonl_and_txt_formats(tokenizer, tmp_path):
    jl = tmp_path / "d.jsonl"
    jl.write_text(
        json.dumps({"prompt": "Hi", "response": "Hello there"})
        + "\n\n"
        + json.dumps({"text": "plain words here"})
        + "\n"
    )
    chat, text = load_training_data([jl], tokenizer, seq_len=512)
    assert chat.tokens[
        : len(tokenizer.chat_prompt([{"role": "user", "content": "Hi"}]))
    ] == tokenizer.chat_prompt([{"role": "user", "content": "Hi"}])
    assert sum(chat.train) == len(tokenizer.encode("Hello there", add_bos=False)) + 1
    assert text.train == [False] + [True] * (len(text.tokens) - 1)
    txt = tmp_path / "d.txt"
    txt.write_text("first paragraph\n\nsecond one\n")
    [seq] = load_training_data([txt], tokenizer, seq_len=4)[:1]
    assert len(seq.tokens) == 4  # cut into windows of seq_len


@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("a.json", '[{"conversations": 5}]', r"a\.json: record 0: 'conversations' must be a list"),
        ("b.json", "{not json", r"b\.json: invalid JSON at line 1"),
        (
            "c.jsonl",
            '{"prompt": "x", "response": "y"}\n{"prompt": "x"}\n',
            r"c\.jsonl: line 2: needs both 'prompt' and 'response'",
        ),
        (
            "d.json",
            '[{"conversations": [{"from": "human", "value": "a"}, '
            '{"from": "human", "value": "b"}]}]',
            r"d\.json: record 0: turn 1: two user turns in a row",
        ),
        ("e.jsonl", '{"turns": ["q"]}\n', r"e\.jsonl: line 1: 'turns' holds user prompts only"),
        ("f.jsonl", "[1, 2]\n", r"f\.jsonl: line 1: expected an object, got list"),
        ("g.csv", "a,b\n", r"g\.csv: unknown data format"),
        (
            "h.json",
            '[{"conversations": [{"from": "human", "value": "q"}]}]',
            r"h\.json: no training tokens",
        ),
        ("i.jsonl", '{"text": 3}\n', r"i\.jsonl: line 1: 'text' must be a string"),
    ],
)
def test_bad_data_names_file_and_record(tokenizer, tmp_path, name, content, expected):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=expected):
        load_training_data([path], tokenizer, seq_len=64)


def test_missing_data_file(tokenizer, tmp_path):
    with pytest.raises(DataError, match="nope.json: data file not found"):
        load_training_data([tmp_path / "nope.json"], tokenizer, seq_len=64)


def test_a_folder_as_data_file_says_it_is_a_folder(tokenizer, tmp_path):
    with pytest.raises(DataError, match="is a folder, not a data file; give a .json"):
        load_training_data([tmp_path], tokenizer, seq_len=64)


def test_api_accepts_single_paths_and_a_projected_exit_dim(model_dir, tmp_path):
    from redrafter_mlx.engine.loop.loading import load_drafter

    prompts = tmp_path / "eval.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi", "response": "unused"}) + "\n")
    summary = D.distill(
        model_dir,
        str(SHAREGPT),
        tmp_path / "out",
        **dict(RUN, steps=2, exit_dim="48", eval_data=str(prompts), eval_shapes=((1, 2), (3, 9))),
    )
    drafter = load_drafter(tmp_path / "out")
    assert drafter.args.exit_dim == 48 and "input_proj" in drafter
    shapes = [(r["beam_width"], r["beam_length"]) for r in summary["eval"]["results"]]
    assert shapes == [(1, 2), (3, 4)]  # L capped at T+1
    assert summary["eval"]["source"] == [str(prompts)]


def test_soft_targets_train_in_self_mode_and_are_refused_elsewhere(model_dir, tmp_path):
    run = dict(RUN, steps=3, eval_shapes=(), targets="self", soft_targets=True)
    summary = D.distill(model_dir, [SHAREGPT], tmp_path / "soft", **run)
    assert summary["steps"] == 3 and np.isfinite(summary["final_loss"])
    with pytest.raises(ParamError, match="--targets self"):
        D.distill(model_dir, [SHAREGPT], tmp_path / "x", **dict(run, targets="distill"))


# ------------------------------------------------------------------------------------------
# the model's output rows (soft targets over a shortlist)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("tied", [True, False])
def test_output_rows_and_shortlist_soft_targets_read_the_models_head(quantized, tied, tmp_path):
    import mlx.nn as nn

    from redrafter_mlx.train.targets import TargetCache

    model = tiny_model(seed=3, vocab=64, hidden=64, tie_word_embeddings=tied)
    if quantized:
        nn.quantize(model, group_size=32, bits=8)
    layer = model.model.embed_tokens if tied else model.lm_head
    reference = layer.weight
    if quantized:
        reference = mx.dequantize(layer.weight, layer.scales, layer.biases, 32, 8)
    ids = [0, 3, 5, 9, 17, 30]
    np.testing.assert_array_equal(np.array(model.head_rows()), np.array(reference))
    np.testing.assert_array_equal(np.array(model.head_rows(ids)), np.array(reference)[ids])
    # A shortlist's soft targets are the model's distribution renormalised over its ids.
    rng = np.random.default_rng(0)
    P, T = 6, 2
    tokens = rng.integers(0, 64, (P, T + 1)).astype(np.int32)
    tokens[1:, 0] = tokens[:-1, 1]  # rows continue one sequence
    hidden = rng.normal(size=(P, 64)).astype(np.float32)
    cache = TargetCache(tmp_path, hidden, tokens, np.ones((P, T), dtype=bool))
    teacher, soft = TR.teacher_targets(cache, model, np.arange(P - T), ids)
    logits = np.array(model.logits(mx.array(hidden)))[:, ids]
    want = np.exp(logits - logits.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    assert bool(soft[0, 0])
    np.testing.assert_allclose(np.array(teacher[0, 0]), want[1], atol=1e-5)
