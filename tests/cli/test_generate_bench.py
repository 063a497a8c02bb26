"""`redrafter-mlx generate` / `bench` and shared error handling, through typer's CliRunner,
on a tiny random model + drafter saved with the Vicuna tokenizer."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.support.cli import CONTEXT, invoke, model_args, run_json

# --------------------------------------------------------------------------- help


def test_help_lists_the_commands(app):
    result = invoke(app, "--help")
    assert result.exit_code == 0
    for name in ("chat", "generate", "bench"):
        assert name in result.stdout


@pytest.mark.parametrize("command", ["chat", "generate", "bench"])
def test_command_help_shows_the_shared_flags(app, command):
    result = invoke(app, command, "--help")
    assert result.exit_code == 0
    for flag in (
        "--model",
        "--drafter",
        "--max-tokens",
        "--temp",
        "--beam-width",
        "--no-draft",
        "--dtype",
        "--verbose",
    ):
        assert flag in result.stdout


# --------------------------------------------------------------------------- generate


def test_generate_streams_the_answer_then_a_stats_line(app, pair):
    result = invoke(app, "generate", *model_args(pair), "--prompt", "Hello", "--max-tokens", 6)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()  # the answer
    assert "6 tokens" in result.stderr
    assert "tok/s" in result.stderr and "preset" in result.stderr


def test_generate_json_has_text_tokens_stats_and_config(app, pair):
    data = run_json(app, "generate", *model_args(pair), "-p", "Hello", "-n", 6)
    assert set(data) >= {
        "text",
        "tokens",
        "finish_reason",
        "stats",
        "beam",
        "model",
        "drafter",
        "dtype",
        "sampling",
    }
    assert len(data["tokens"]) == 6 and all(isinstance(t, int) for t in data["tokens"])
    assert data["finish_reason"] == "length"
    assert data["dtype"] == "float32"
    assert data["beam"]["speculative"] is True and "preset" in data["beam"]["source"]
    for key in (
        "prompt_tokens",
        "generation_tokens",
        "generation_tps",
        "tokens_per_step",
        "time_to_first_token",
        "peak_memory_gb",
    ):
        assert isinstance(data["stats"][key], (int, float))
    assert sum(data["stats"]["accept_hist"]) == data["stats"]["steps"]


def test_no_draft_gives_the_same_greedy_text(app, pair):
    drafted = run_json(app, "generate", *model_args(pair), "-p", "Tell me a story", "-n", 10)
    plain = run_json(
        app, "generate", *model_args(pair), "-p", "Tell me a story", "-n", 10, "--no-draft"
    )
    assert plain["beam"]["speculative"] is False and plain["drafter"] is None
    assert plain["tokens"] == drafted["tokens"]
    assert plain["text"] == drafted["text"]


def test_generate_reads_stdin_and_raw_skips_the_template(app, pair):
    chat = run_json(app, "generate", *model_args(pair), "-p", "-", "-n", 2, input="Hello\n")
    raw = run_json(app, "generate", *model_args(pair), "-p", "-", "-n", 2, "--raw", input="Hello\n")
    assert raw["chat_template"] is False
    assert raw["stats"]["prompt_tokens"] < chat["stats"]["prompt_tokens"]  # no system prompt


def test_beam_flags_override_the_preset(app, pair):
    data = run_json(
        app,
        "generate",
        *model_args(pair),
        "-p",
        "Hi",
        "-n",
        4,
        "--beam-width",
        2,
        "--beam-length",
        3,
        "--capacity",
        4,
        "--no-lookup",
    )
    assert data["beam"] == {
        "width": 2,
        "length": 3,
        "capacity": 4,
        "speculative": True,
        "source": "beam shape from flags",
        "label": "W2×L3 C4",
    }


def test_lookup_flags_join_the_beam_shape(app, pair):
    """The chains get their own slots beside the drafter's capacity."""
    args = [*model_args(pair), "-p", "Hi", "-n", 4, "--beam-width", 2, "--beam-length", 3]
    data = run_json(app, "generate", *args, "--capacity", 4, "--lookup", 2, "--lookup-length", 5)
    assert data["beam"]["label"] == "W2×L3+K2×L5 C12"
    assert data["beam"]["source"] == "beam shape from flags, with context lookup"
    assert run_json(app, "generate", *args)["beam"]["label"] == "W2×L3+K1×L8"  # the default
    result = invoke(app, "generate", *args, "--lookup", 1, "--no-lookup")
    one_red_line(result, 2, "--no-lookup contradicts --lookup 1")
    result = invoke(app, "generate", *args, "--lookup-length", 1)
    one_red_line(result, 2, "--lookup-length must be >= 2")


def test_no_drafter_speculates_with_lookup_alone(app, pair):
    data = run_json(app, "generate", *model_args(pair, drafter=False), "-p", "Hi", "-n", 3)
    assert data["beam"]["speculative"] is True and data["beam"]["label"] == "K1×L8"
    assert "no --drafter given: context lookup alone" in data["beam"]["source"]


def test_no_drafter_no_lookup_decodes_plainly_and_says_why(app, pair):
    args = [*model_args(pair, drafter=False), "-p", "Hi", "-n", 3, "--no-lookup"]
    data = run_json(app, "generate", *args)
    assert data["beam"]["speculative"] is False
    assert "no --drafter" in data["beam"]["source"]


# --------------------------------------------------------------------------- errors


def one_red_line(result, code: int, needle: str) -> None:
    """The failure contract: exit code, one ``error:`` line naming the problem, no traceback."""
    assert result.exit_code == code, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_unknown_model_dir(app, tmp_path, command):
    extra = ["-p", "hi"] if command == "generate" else []
    result = invoke(app, command, "--model", tmp_path / "missing", *extra)
    one_red_line(result, 1, "model directory not found")


def test_drafter_for_another_base_model(app, pair):
    model, _, other = pair
    result = invoke(app, "generate", "--model", model, "--drafter", other, "-p", "hi", "-n", 2)
    one_red_line(result, 1, "another base model")


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--beam-length", "1"], "--beam-length"),
        (["--beam-width", "0"], "--beam-width"),
        (["--beam-width", "2", "--beam-length", "3", "--capacity", "9"], "--capacity"),
        (["--temp", "-1"], "--temp"),
        (["--top-p", "0"], "--top-p"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--dtype", "int8"], "--dtype"),
    ],
)
def test_bad_flag_values_exit_2(app, pair, flags, needle):
    result = invoke(app, "generate", *model_args(pair), "-p", "hi", *flags)
    one_red_line(result, 2, needle)


def test_missing_prompt(app, pair):
    one_red_line(invoke(app, "generate", *model_args(pair)), 2, "--prompt")


def test_prompt_over_the_context(app, pair):
    result = invoke(app, "generate", *model_args(pair), "-p", "word " * (CONTEXT + 10))
    one_red_line(result, 1, "does not fit the model's context")


def test_verbose_shows_the_traceback(app, tmp_path):
    result = invoke(app, "generate", "--model", tmp_path / "missing", "-p", "hi", "--verbose")
    assert result.exit_code == 1
    assert "Traceback" in result.stderr and "error: model directory not found" in result.stderr


def test_no_model_and_no_demo(app, monkeypatch):
    import redrafter_mlx.engine.base.bundled as bundled

    monkeypatch.setattr(bundled, "demo_paths", lambda: (Path("/nonexistent/demo"), None))
    one_red_line(invoke(app, "generate", "-p", "hi"), 1, "pass --model")  # install, not usage


def test_demo_model_is_the_default(app, pair, monkeypatch):
    import redrafter_mlx.engine.base.bundled as bundled

    model, drafter, _ = pair
    monkeypatch.setattr(bundled, "demo_paths", lambda: (Path(model), Path(drafter)))
    monkeypatch.setattr(bundled, "DEMO_NOTE", "DEMO NOTE")
    result = invoke(app, "generate", "-p", "hi", "-n", 3, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["demo"] is True and data["model"] == model and data["drafter"] == drafter
    assert result.stderr.count("DEMO NOTE") == 1


# --------------------------------------------------------------------------- bench: units


def test_parse_grid():
    from redrafter_mlx.cli.bench_report import BenchError, parse_grid

    assert parse_grid("1,2x3,4") == [(1, 3), (1, 4), (2, 3), (2, 4)]
    assert parse_grid("2×5") == [(2, 5)]
    for bad in ("1,2", "ax3", "1x"):
        with pytest.raises(BenchError, match="--grid"):
            parse_grid(bad)


@pytest.mark.parametrize("name", ["mt-bench", "vicuna-bench", "edit", "demo"])
def test_bundled_prompt_sets(name):
    from redrafter_mlx.engine.base.prompts import load_prompts

    prompts = load_prompts(name, 3)
    assert len(prompts) == 3 and all(isinstance(p, str) and p for p in prompts)


def test_prompt_file_and_bad_names(tmp_path):
    from redrafter_mlx.engine.base.prompts import PromptSetError, load_prompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"turns": ["first", "second"]}\n\n{"turns": ["again"]}\n')
    assert load_prompts(str(f)) == ["first", "again"]
    with pytest.raises(PromptSetError, match="neither a prompt set"):
        load_prompts("no-such-set")
    f.write_text("not json\n")
    with pytest.raises(PromptSetError, match="turns"):
        load_prompts(str(f))


# --------------------------------------------------------------------------- bench: command

NUMERIC = (
    "tokens",
    "decode_s",
    "tokens_per_s",
    "speedup",
    "tokens_per_step",
    "efficiency",
    "ttft_s",
    "peak_memory_gb",
)


def test_bench_json_schema(app, pair):
    data = run_json(app, "bench", *model_args(pair), "--num-prompts", 2, "-n", 5)
    assert data["ok"] is True and data["mismatches"] == [] and data["greedy"] is True
    assert data["num_prompts"] == 2 and data["prompt_set"] == "mt-bench"
    assert "preset" in data["beam_source"] and "as chat runs" in data["beam_source"]
    names = [c["config"] for c in data["configs"]]
    assert names == ["AR", "adaptive W1×L4+K1×L8"]  # AR, then chat's: the preset, adaptive
    for row in data["configs"]:
        for key in NUMERIC:
            assert isinstance(row[key], (int, float)) and row[key] >= 0, key
        assert row["prompts"] == 2
        assert row["turn"] == 1
    assert data["turns"] == [1] and data["num_runs"] == 2 and data["spread"] is False
    ar, rd = data["configs"]
    assert ar["speedup"] == pytest.approx(1.0) and ar["matches_ar"] is None
    assert rd["matches_ar"] is True and rd["tree_size"] == 4 + 8  # W·L + K·Lk
    assert (rd["lookup_chains"], rd["lookup_length"]) == (1, 8)
    assert isinstance(rd["mean_packed"], float) and rd["mean_packed"] <= rd["tree_size"]
    assert rd["efficiency"] == pytest.approx(rd["speedup"] / rd["tokens_per_step"])
    assert ar["lookup_share"] is None and 0.0 <= rd["lookup_share"] <= 1.0
    assert isinstance(rd["lookup_share"], float)
    assert [len(v) for v in data["per_prompt"].values()] == [2, 2]


def test_bench_no_adapt_pins_the_chat_shape(app, pair):
    data = run_json(app, "bench", *model_args(pair), "--num-prompts", 1, "-n", 3, "--no-adapt")
    assert [c["config"] for c in data["configs"]] == ["AR", "W1×L4+K1×L8"]
    assert "as chat runs" not in data["beam_source"]


def test_bench_sampling_does_not_claim_equality_with_ar(app, pair):
    """Samples are not compared with AR's tokens, so '= AR' must not say yes."""
    data = run_json(
        app, "bench", *model_args(pair), "--num-prompts", 1, "-n", 4, "--temp", 0.7, "--seed", 0
    )
    assert data["greedy"] is False and data["mismatches"] == []
    assert [row["matches_ar"] for row in data["configs"]] == [None, None]


def test_bench_grid_table_and_csv(app, pair, tmp_path):
    out = tmp_path / "bench.csv"
    result = invoke(
        app,
        "bench",
        *model_args(pair),
        "--num-prompts",
        1,
        "-n",
        4,
        "--grid",
        "1,2x2,3",
        "--csv",
        out,
        "--prompts",
        "vicuna-bench",
        "--lookup-length",
        4,
    )
    assert result.exit_code == 0, result.output
    names = ["AR", "W1×L2+K1×L4", "W1×L3+K1×L4", "W2×L2+K1×L4", "W2×L3+K1×L4"]
    for name in (*names, "speedup", "tok/step", "lookup"):
        assert name in result.stdout
    rows = list(csv.DictReader(out.open()))
    assert [r["config"] for r in rows] == names
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)
    assert [r["turn"] for r in rows] == ["1"] * 5
    assert rows[0]["lookup_share"] == "" and 0 <= float(rows[1]["lookup_share"]) <= 1
    data = run_json(
        app,
        "bench",
        *model_args(pair),
        "--num-prompts",
        1,
        "-n",
        3,
        "--grid",
        "1x2,3",
        "--no-lookup",
    )
    assert [c["config"] for c in data["configs"]] == ["AR", "W1×L2", "W1×L3"]
    assert data["configs"][1]["lookup_share"] is None


def corrupt_third_token(monkeypatch) -> None:
    """Every ReDrafter run's third token changed (+1): a mismatch with AR at token 2."""
    import redrafter_mlx.cli.bench_report as logic

    real = logic.run_engine

    def corrupt(engine, config, ids, max_tokens, sampling, branches="auto"):
        run = real(engine, config, ids, max_tokens, sampling, branches)
        if config.kind == "redrafter":
            run.tokens = run.tokens[:2] + [run.tokens[2] + 1] + run.tokens[3:]
        return run

    monkeypatch.setattr(logic, "run_engine", corrupt)


def test_bench_reports_mismatches_loudly(app, pair, monkeypatch):
    corrupt_third_token(monkeypatch)
    result = invoke(app, "bench", *model_args(pair), "--num-prompts", 2, "-n", 4)
    assert result.exit_code == 1
    assert result.stderr.count("MISMATCH: adaptive W1×L4+K1×L8 differs from AR") == 2
    assert "at token 2" in result.stderr

    result = invoke(app, "bench", *model_args(pair), "--num-prompts", 1, "-n", 4, "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["ok"] is False
    (m,) = data["mismatches"]
    assert {k: m[k] for k in ("config", "prompt", "turn", "position", "tokens", "ar_tokens")} == (
        dict(config="adaptive W1×L4+K1×L8", prompt=0, turn=1, position=2, tokens=4, ar_tokens=4)
    )
    # A changed token is no near-tie: AR's leads by far more than float32's rounding.
    assert m["near_tie"] is False and m["lead"] > 1e3 * m["noise"]
    assert data["configs"][1]["matches_ar"] is False and data["configs"][1]["near_tie"] is False


def test_bench_near_tie_mismatch_is_a_note_not_a_failure(app, pair, monkeypatch):
    """A mismatch at a near-tie (rounding-level lead) is reported in yellow, the row shows
    "tie", and the bench succeeds; the JSON carries the lead and the noise."""
    from redrafter_mlx.measure import near_tie

    corrupt_third_token(monkeypatch)
    monkeypatch.setattr(near_tie, "check", lambda *a: near_tie.TieCheck(lead=0.004, noise=0.01))
    result = invoke(app, "bench", *model_args(pair), "--num-prompts", 1, "-n", 4)
    assert result.exit_code == 0, result.output
    assert "near-tie: adaptive W1×L4+K1×L8 differs from AR on prompt 1 at token 2" in result.stderr
    assert "MISMATCH" not in result.stderr and "tie" in result.stdout
    data = run_json(app, "bench", *model_args(pair), "--num-prompts", 1, "-n", 4)
    assert data["ok"] is True and data["configs"][1]["near_tie"] is True
    assert (data["mismatches"][0]["lead"], data["mismatches"][0]["noise"]) == (0.004, 0.01)


def test_bench_mlx_lm_baseline(app, pair):
    data = run_json(app, "bench", *model_args(pair), "--num-prompts", 1, "-n", 4, "--mlx-lm")
    assert [c["config"] for c in data["configs"]] == ["AR", "adaptive W1×L4+K1×L8", "mlx-lm"]
    assert data["mlx_lm_matching_prompts"] == 1  # same greedy tokens as our AR path
    assert data["configs"][2]["tokens"] == 4


def test_bench_bad_grid_and_prompts(app, pair):
    one_red_line(invoke(app, "bench", *model_args(pair), "--grid", "2,4"), 2, "--grid")
    one_red_line(invoke(app, "bench", *model_args(pair), "--grid", "1x1"), 2, "--beam-length")
    one_red_line(invoke(app, "bench", *model_args(pair), "--prompts", "nope"), 2, "nope")
    one_red_line(invoke(app, "bench", *model_args(pair), "--turns", 3), 2, "--turns")


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--configs", "W1xL3,W1xL4 junk"], "--configs 'W1xL4 junk': 'W1xL4 junk' is not a beam"),
        (["--configs", "W2xL1"], "--configs 'W2xL1': beam length must be >= 2"),
        (["--configs", "K1xL1"], "--configs 'K1xL1': lookup chain length must be >= 2"),
        (["--configs", "W1xL4 C2"], "--configs 'W1xL4 C2': capacity 2"),
        (["--configs", " , "], "--configs ' , ' must be comma-separated shapes"),
        (["--configs", "W1xL3", "--grid", "1x3"], "--grid and --configs"),
        (["--configs", "W1xL3,K1xL8", "--no-draft"], "--configs W1×L3 need the drafter"),
        (["--lookup", 1, "--no-lookup"], "--no-lookup contradicts --lookup 1"),
    ],
)
def test_bench_bad_configs_exit_2(app, pair, flags, needle):
    one_red_line(invoke(app, "bench", *model_args(pair), "--num-prompts", 1, *flags), 2, needle)


def test_bench_configs_run_lookup_alone_without_the_drafter(app, pair, monkeypatch):
    import redrafter_mlx.cli.bench_report as logic

    real, drafters = logic.measure_generation, {}

    def spy(model, drafter, tokenizer, ids, shape, max_tokens, **kw):
        drafters[shape.label] = drafter
        return real(model, drafter, tokenizer, ids, shape, max_tokens, **kw)

    monkeypatch.setattr(logic, "measure_generation", spy)
    args = [*model_args(pair), "--num-prompts", 1, "-n", 4]
    data = run_json(app, "bench", *args, "--configs", "AR,W1xL3,W1xL3+K2xL4 C7,k1xl6")
    names = [c["config"] for c in data["configs"]]
    assert names == ["AR", "W1×L3", "W1×L3+K2×L4 C7", "K1×L6"]
    assert data["beam_source"] == "beam shapes from --configs" and data["ok"] is True
    assert drafters["K1×L6"] is None and drafters["AR"] is None
    assert drafters["W1×L3"] is not None and drafters["W1×L3+K2×L4 C7"] is not None
    shares = [c["lookup_share"] for c in data["configs"]]
    assert shares[:2] == [None, None] and all(isinstance(v, float) for v in shares[2:])
    # lookup alone on a model without a drafter; --adapt starts from the plan (K1×L8)
    data = run_json(
        app,
        "bench",
        *model_args(pair, drafter=False),
        "--num-prompts",
        1,
        "-n",
        4,
        "--configs",
        "K1xL6",
        "--adapt",
    )
    assert [c["config"] for c in data["configs"]] == ["AR", "K1×L6", "adaptive K1×L8"]


def test_bench_verify_cost(app, monkeypatch):
    import redrafter_mlx.measure.verify_cost as benchmarks

    seen = {}

    def fake(hidden, layers, **kw):
        seen.update(hidden=hidden, layers=layers)
        return [dict(capacity=4, ar_ms=2.0, verify_ms=3.0, ratio=1.5)]

    monkeypatch.setattr(benchmarks, "verify_cost", fake)
    result = invoke(app, "bench", "--verify-cost", "--hidden", 64, "--layers", 2)
    assert result.exit_code == 0, result.output
    assert seen == dict(hidden=64, layers=2)
    assert "1.50×" in result.stdout and "verify" in result.stdout
    data = run_json(app, "bench", "--verify-cost", "--hidden", 64, "--layers", 2)
    assert data["rows"][0]["ratio"] == 1.5


def test_bench_turns_2_continues_with_the_models_own_answer(app, pair, monkeypatch):
    """Turn 2 is [user turn 1, assistant: AR's greedy answer, user turn 2], run by every
    configuration and reported apart; a one-turn prompt stays turn 1 only."""
    import redrafter_mlx.cli.bench_report as logic

    real, calls = logic.run_engine, []

    def spy(engine, config, ids, max_tokens, sampling, branches="auto"):
        run = real(engine, config, ids, max_tokens, sampling, branches)
        calls.append((engine, config.name, list(ids), run.tokens))
        return run

    monkeypatch.setattr(logic, "run_engine", spy)
    args = ["--num-prompts", 2, "-n", 5, "--turns", 2, "--spread", "--mlx-lm"]
    data = run_json(app, "bench", *model_args(pair), *args)
    assert data["ok"] is True and data["turns"] == [1, 2] and data["num_runs"] == 4
    rows = [(c["turn"], c["config"]) for c in data["configs"]]
    configs = ["AR", "adaptive W1×L4+K1×L8", "mlx-lm"]
    assert rows == [(1, name) for name in configs] + [(2, name) for name in configs]
    assert all(c["prompts"] == 2 for c in data["configs"])
    assert all(c["matches_ar"] is True for c in data["configs"] if c["kind"] == "redrafter")
    assert [(e["prompt"], e["turn"]) for e in data["per_prompt"]["AR"]] == [
        (0, 1),
        (0, 2),
        (1, 1),
        (1, 2),
    ]
    assert data["mlx_lm_matching_prompts"] == 4

    from redrafter_mlx.engine.base.prompts import load_records

    spread = load_records("mt-bench", 2, spread_categories=True)
    assert [r.category for r in spread] == ["writing", "roleplay"]
    engine = calls[0][0]
    ar = [(ids, tokens) for _, name, ids, tokens in calls[1:] if name == "AR"]  # no warm-up
    for record, (first_ids, answer), (second_ids, _) in zip(spread, ar[0::2], ar[1::2]):
        user = {"role": "user", "content": record.turns[0]}
        assert first_ids == engine.tokenizer.chat_prompt([user])
        conversation = [
            user,
            {"role": "assistant", "content": engine.tokenizer.decode(answer)},
            {"role": "user", "content": record.turns[1]},
        ]
        assert second_ids == engine.tokenizer.chat_prompt(conversation)

    result = invoke(app, "bench", *model_args(pair), "--num-prompts", 1, "-n", 3, "--turns", 2)
    assert result.exit_code == 0, result.output
    assert "turn 1" in result.stdout and "turn 2" in result.stdout


def test_bench_turns_2_with_one_turn_prompts(app, pair, tmp_path):
    f = tmp_path / "mixed.jsonl"
    f.write_text('{"turns": ["Hi", "More"]}\n{"turns": ["Bye"]}\n{"prompt": "Why"}\n')
    args = [*model_args(pair), "--prompts", f, "-n", 3, "--turns", 2, "--configs", "K1xL4"]
    data = run_json(app, "bench", *args)
    runs = [(e["prompt"], e["turn"]) for e in data["per_prompt"]["K1×L4"]]
    assert runs == [(0, 1), (0, 2), (1, 1), (2, 1)] and data["num_prompts"] == 3
    assert [(c["turn"], c["prompts"]) for c in data["configs"]] == [(1, 3), (1, 3), (2, 1), (2, 1)]
    f.write_text('{"turns": ["Bye"]}\n')
    result = invoke(app, "bench", *args)
    assert result.exit_code == 0, result.output
    assert "no prompt of" in result.stderr and "turn 2" not in result.stdout


def test_bench_profile_times_lookup_shapes_as_a_whole_step(app, pair, monkeypatch):
    import redrafter_mlx.measure.profile as profile

    real = profile.profile_steps

    def quick(model, sources, shapes, prompt, repeats):
        return real(model, sources, shapes, prompt, repeats=2, loop_tokens=6, loop_rounds=1)

    monkeypatch.setattr(profile, "profile_steps", quick)
    args = [*model_args(pair), "--profile", "--configs", "W1xL3,W1xL3+K1xL4,K1xL4"]
    data = run_json(app, "bench", *args)
    _, drafted, mixed, alone = data["rows"]
    assert [r["config"] for r in data["rows"]] == ["AR", "W1×L3 C3", "W1×L3+K1×L4 C6", "K1×L4 C4"]
    assert "verify_ms" in drafted and "phases_ms" in drafted
    for row in (mixed, alone):
        assert row["step_ms"] > 0 and row["loop_ms"] > 0 and row["lookup"] == 1
        assert "verify_ms" not in row and "phases_ms" not in row
    assert data["mac"]["launch_us"] == 4.0 and data["mac"]["bandwidth_gbs"] == 100.0
    assert data["mac"]["dtype"] == "float16" and data["mac"]["model_bytes"] > 0
    for row in data["rows"]:  # each step priced where launches dominate, over AR's
        assert row["mac_ms"] == pytest.approx(row["mac_launch_ms"] + row["mac_memory_ms"])
        assert row["mac_launch_ms"] == pytest.approx(row["step_kernels"] * 4e-3)
    assert data["rows"][0]["mac_x_ar"] == 1.0
    assert drafted["mac_bytes"] > alone["mac_bytes"] == data["rows"][0]["mac_bytes"]
    result = invoke(app, "bench", *args)
    assert result.exit_code == 0, result.output
    assert "K1×L4 C4" in result.stdout and "launch-bound estimate" in result.stdout
    flags = ["--launch-us", 0, "--bandwidth-gbs", 400, "--mac-dtype", "float32"]
    data = run_json(app, "bench", *args, *flags)
    assert data["mac"] == {**data["mac"], "launch_us": 0, "bandwidth_gbs": 400, "dtype": "float32"}
    assert all(row["mac_launch_ms"] == 0 for row in data["rows"])


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--launch-us", 5], "--launch-us prices the --profile steps; add --profile"),
        (["--bandwidth-gbs", 200], "--bandwidth-gbs prices the --profile steps"),
        (["--profile", "--bandwidth-gbs", 0], "--bandwidth-gbs must be > 0, got 0.0"),
        (["--profile", "--launch-us", -1], "--launch-us must be >= 0, got -1.0"),
        (["--profile", "--mac-dtype", "int4"], "--mac-dtype must be one of float16, bfloat16"),
    ],
)
def test_bench_mac_estimate_flags(app, pair, flags, needle):
    one_red_line(invoke(app, "bench", *model_args(pair), *flags), 2, needle)
