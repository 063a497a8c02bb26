"""``distill --model M --out D`` without ``--data``: the model makes its own training data.

End to end on a tiny random Llama with the Vicuna tokenizer and a toy budget: built-in and
model-written prompts, answers with their hidden states, self targets with soft labels,
held-out selection, a drafter in ``M/drafter`` that ``chat``/``generate --model M`` pick up
and whose greedy output equals plain decoding; a rerun with ``--resume`` generates nothing
more.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from redrafter_mlx.train import selfdata
from tests.support.models import VICUNA_TOKENIZER, near_bigram_model, run_decode, save_model_dir
from tests.support.train import TOY


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """M (a tiny model dir) and the CLI result of ``distill --model M --out M/drafter``."""
    from redrafter_mlx.cli import _register, app

    _register()
    model_dir = tmp_path_factory.mktemp("tiny") / "model"
    save_model_dir(near_bigram_model(seed=0, vocab=32000, hidden=32), model_dir, VICUNA_TOKENIZER)
    out = model_dir / "drafter"
    args = ["distill", "--model", str(model_dir), "--out", str(out), *TOY]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return model_dir, out, result, args


def _work(out):
    (work,) = (out / "cache").glob("selfdata-*")
    return work


@pytest.mark.slow  # about 15 s together (one toy run), make test-fast skips
def test_builds_a_drafter_that_the_model_folder_serves_and_greedy_output_is_unchanged(built):
    from redrafter_mlx.cli.common import resolve_paths
    from redrafter_mlx.engine.loop.loading import load_drafter, load_model

    model_dir, out, result, _ = built
    assert "drafter saved to" in result.output and "kept step" in result.output
    assert "use it without --drafter" in result.output
    paths = resolve_paths(str(model_dir), None)  # what chat / generate --model M use
    assert paths.drafter == str(out)
    model, _ = load_model(model_dir)
    drafter = load_drafter(out, model.model.norm.weight.dtype)
    config = json.loads((out / "config.json").read_text())
    assert config["predict_tokens"] == 3 and config["distill_targets"] == "self"
    assert config["selected"]["step"] >= 1  # the held-out selection chose these weights
    prompts = [[1, 319, 1781, 338], [1, 3575, 29901]]
    plain, _ = run_decode(model, None, prompts, max_tokens=20)
    fast, _ = run_decode(model, drafter, prompts, max_tokens=20, beam_width=2, beam_length=3)
    assert fast == plain
    report = json.loads((out / "eval.json").read_text())
    assert report["source"] == "built-in prompts held out from training"


@pytest.mark.slow
def test_the_data_stages_are_on_disk_and_held_out_prompts_are_not_trained_on(built):
    _, out, _, _ = built
    work = _work(out)
    prompts = selfdata.read_jsonl(work / "prompts.jsonl")
    answers = selfdata.read_jsonl(work / "answers.jsonl")
    meta = json.loads((work / "prompts_meta.json").read_text())
    # The model was asked to write user turns (a random model's rarely end: none kept here).
    assert meta["asked"] >= 4 and meta["kept"] == sum(p["source"] == "model" for p in prompts)
    held = selfdata.heldout_turns()
    assert not [p for p in prompts if selfdata.normalize(p["prompt"]) in held]
    assert sum(len(a["response_ids"]) for a in answers) >= 1500
    state = json.loads(
        sorted((out / "checkpoints").iterdir())[-1].joinpath("training_state.json").read_text()
    )
    data = state["run"]["data"]
    # The held-out answers come first; training takes the first answers whose positions reach
    # the 1,500 budget (the batches in flight when it was reached wrote more).
    assert data["held_out_answers"] == 3
    trained = answers[3 : 3 + data["answers"]]
    assert sum(len(a["response_ids"]) for a in trained[:-1]) < 1500
    assert sum(len(a["response_ids"]) for a in trained) >= 1500 or trained == answers[3:]
    assert state["selection"]["history"]


@pytest.mark.slow
def test_resume_generates_nothing_more(built):
    from redrafter_mlx.cli import app

    _, out, _, args = built
    before = (_work(out) / "answers.jsonl").read_text()
    result = CliRunner().invoke(app, [*args, "--resume", "--quiet"])
    assert result.exit_code == 0, result.output
    assert (_work(out) / "answers.jsonl").read_text() == before


def test_no_mt_bench_or_vicuna_bench_prompt_in_the_built_in_data():
    held = selfdata.heldout_turns()
    assert len(held) > 100
    rows = selfdata.builtin_prompts()
    assert len(rows) > 10_000
    assert not [r["prompt"] for r in rows if selfdata.normalize(r["prompt"]) in held]


@pytest.mark.parametrize(
    "text, want",
    [
        ("30m", ("seconds", 1800.0)),
        ("2h", ("seconds", 7200.0)),
        ("1h30m", ("seconds", 5400.0)),
        ("90s", ("seconds", 90.0)),
        ("200k", ("positions", 200_000.0)),
        ("500000", ("positions", 500_000.0)),
    ],
)
def test_budget_forms(text, want):
    assert selfdata.parse_budget(text) == want


@pytest.mark.parametrize("text", ["", "soon", "0m", "5x", "1.5k"])
def test_a_bad_budget_says_what_is_accepted(text):
    with pytest.raises(ValueError, match="30m, 2h"):
        selfdata.parse_budget(text)


def test_budget_with_data_files_is_refused(tmp_path):
    from redrafter_mlx.engine.base.errors import ParamError
    from redrafter_mlx.train.distill import DistillOptions

    with pytest.raises(ParamError, match="--steps"):
        DistillOptions(budget="30m").for_data(builtin=False)
    with pytest.raises(ParamError, match="needs --data"):
        DistillOptions(targets="distill").for_data(builtin=True)


def test_a_budget_too_small_to_answer_anything_says_so(built, tmp_path):
    """A 10 ms budget answers the held-out prompts only: one line saying what to do."""
    from redrafter_mlx.cli import app

    model_dir, _, _, _ = built
    args = ["distill", "--model", str(model_dir), "--out", str(tmp_path / "d"), *TOY]
    args[args.index("--budget") + 1] = "0.01s"
    result = CliRunner().invoke(app, [*args, "--quiet"])
    assert result.exit_code == 1
    assert "larger --budget" in result.output


def test_time_budget_steps_fit_the_time_and_stop_at_max_epochs(tmp_path):
    from redrafter_mlx.train import distill as D
    from redrafter_mlx.train.selfdata import SelfData
    from tests.support.models import tiny_model

    class Tok:
        eos_token_ids = frozenset({7})

        def chat_prompt(self, messages):
            return [1] + [3 + (ord(c) % 40) for c in messages[-1]["content"]]

    model = tiny_model(seed=1, vocab=48)
    data = SelfData(tmp_path, model, Tok(), temperature=0.0, answer_tokens=32, batch=8, seed=0)
    rows = data.generate(
        [dict(id=i, source="t", prompt=f"q{i}") for i in range(8)], lambda _: False
    )
    cache = data.targets(rows, 3)
    opts = D.DistillOptions(predict_tokens=3, batch_size=16).for_data(builtin=True)
    order = D.training_order(cache, opts, 1)
    assert D.budget_steps(model, cache, order, opts, None, 0.0) == 1
    most = D.planned_steps(opts, order, D.MAX_EPOCHS)
    assert D.budget_steps(model, cache, order, opts, None, 1e9) == most


def test_hidden_rows_are_read_in_place_from_the_answer_shards(tmp_path):
    """The target cache's hidden states index the shards like one concatenated array."""
    import numpy as np

    rng = np.random.default_rng(0)
    shards = {n: rng.standard_normal((9, 4)).astype(np.float16) for n in ("a.npy", "b.npy")}
    for name, arr in shards.items():
        np.save(tmp_path / name, arr)
    rows = [
        dict(hidden=dict(shard="a.npy", offset=0), response_ids=[1] * 3),
        dict(hidden=dict(shard="a.npy", offset=3), response_ids=[1] * 4),  # merges with the first
        dict(hidden=dict(shard="b.npy", offset=2), response_ids=[1] * 5),
    ]
    segments = selfdata.segments_of(rows)
    assert segments == [["a.npy", 0, 7], ["b.npy", 2, 5]]
    view = selfdata.ShardRows(tmp_path, segments)
    whole = np.concatenate([shards["a.npy"][:7], shards["b.npy"][2:7]])
    assert view.shape == whole.shape and len(view) == 12
    idx = np.array([[11, 0], [6, 7]])
    np.testing.assert_array_equal(view[idx], whole[idx])
    np.testing.assert_array_equal(np.asarray(view), whole)
