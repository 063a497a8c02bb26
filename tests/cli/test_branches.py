"""``--branches auto|on|off`` on generate (and chat, serve): an APAR model's answer is the
rebuilt text, the stats count its branches, and ``on`` without split tokens says the fix."""

import json

import pytest
from typer.testing import CliRunner

from redrafter_mlx.engine.base.bundled import demo_paths


def generate(app, folder, *extra):
    args = ["generate", "--model", folder, "--raw", "--prompt", "def f(x):", "-n", "12"]
    args += ["--logit-bias", "4094:40", "--no-adapt", *extra]
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "120"})


def test_generate_auto_decodes_an_apar_models_branches(cli_app, apar_folder):
    result = generate(cli_app, apar_folder, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["stats"]["branches"] > 1
    assert 4094 not in out["tokens"] and 4095 not in out["tokens"]  # the rebuilt text
    off = json.loads(generate(cli_app, apar_folder, "--json", "--branches", "off").stdout)
    assert off["stats"]["branches"] == 0  # one sequence: neither split token drawn
    assert 4094 not in off["tokens"] and 4095 not in off["tokens"]


def test_generate_prints_the_rebuilt_text_and_counts_branches(cli_app, apar_folder):
    result = generate(cli_app, apar_folder)
    assert result.exit_code == 0, result.output
    assert " branches · " in result.stderr


def test_branches_on_without_split_tokens_names_the_fix(cli_app):
    base, _ = demo_paths()
    result = generate(cli_app, base, "--branches", "on")
    assert result.exit_code != 0
    assert "--branches off" in result.output and "[SplitSop]" in result.output


def test_bench_runs_every_configuration_with_branches(cli_app, apar_folder):
    """Greedy branches are the same whatever shape runs: bench's configurations agree."""
    args = ["bench", "--model", apar_folder, "--num-prompts", "1", "-n", "8"]
    args += ["--logit-bias", "4094:40", "--json"]
    result = CliRunner().invoke(cli_app, [str(a) for a in args], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["ok"] is True
    base, _ = demo_paths()
    args = ["bench", "--model", base, "--num-prompts", "1", "-n", "4", "--branches", "on"]
    result = CliRunner().invoke(cli_app, [str(a) for a in args], env={"COLUMNS": "120"})
    assert result.exit_code != 0 and "--branches off" in result.output


def test_chat_answers_turn_after_turn_with_branches(cli_app, apar_folder):
    """Each turn's answer is its rebuilt text; the cache, whose rows were branches, starts
    afresh, so the next turn prefills the conversation and goes on."""
    args = ["chat", "--model", apar_folder, "-n", "8", "--logit-bias", "4094:40", "--no-adapt"]
    script = "hi\n/stats\nhello again\n/stats\n/quit\n"
    result = CliRunner().invoke(
        cli_app, [str(a) for a in args], input=script, env={"COLUMNS": "120"}
    )
    assert result.exit_code == 0, result.output
    assert result.output.count(" branches · ") == 2, result.output


def test_branch_limits_are_flags(cli_app, apar_folder):
    def branches(*flags):
        result = generate(cli_app, apar_folder, "--json", *flags)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["stats"]["branches"]

    assert branches() > 3
    assert 1 < branches("--max-branches", "3") <= 3
    assert branches("--branch-depth", "0") == 1  # the root may not fork
    bad = generate(cli_app, apar_folder, "--max-branches", "0")
    assert bad.exit_code != 0 and "branch limit must be >= 1" in bad.output


def test_branches_with_a_draft_model_count_sources_and_branches(cli_app, apar_folder):
    """The APAR model as its own draft model: the stats line carries both the per-source
    accepted drafts and the branches decoded."""
    result = generate(cli_app, apar_folder, "--draft-model", apar_folder)
    assert result.exit_code == 0, result.output
    assert "draft model" in result.stderr and " branches · " in result.stderr
    assert "with --draft-model" in result.stderr


def test_branch_text_shows_control_characters_visibly(cli_app, apar_folder):
    """The rebuilt text goes through ``terminal.visible`` like any answer: a BEL (id 10,
    biased up) in a branch prints as ``^G``, never raw."""
    result = generate(cli_app, apar_folder, "--logit-bias", "10:30")
    assert result.exit_code == 0, result.output
    assert " branches · " in result.stderr
    assert "^G" in result.stdout and "\x07" not in result.stdout


def test_max_tokens_bounds_the_answer_not_each_branch(cli_app, apar_folder):
    """``-n 12`` with branches: the answer (the rebuilt text) holds 12 tokens, as a plain
    answer would; each branch is not given 12 of its own. The rule is in --help."""
    out = json.loads(generate(cli_app, apar_folder, "--json").stdout)
    assert out["stats"]["branches"] > 1
    assert len(out["tokens"]) == 12 and out["finish_reason"] == "length"
    for command in ("generate", "chat", "bench"):
        result = CliRunner().invoke(cli_app, [command, "--help"], env={"COLUMNS": "200"})
        text = " ".join(result.output.replace("│", " ").split())
        assert "the answer is the first N tokens of the rebuilt text" in text, command


def test_piped_chat_prints_the_rebuilt_answer_once(cli_app, apar_folder):
    """Off a terminal, no live view: each answer is the rebuilt text, printed once, the
    same text ``generate`` gives the same turn."""
    flags = ["--model", apar_folder, "-n", "16", "--logit-bias", "4094:40", "--no-adapt"]
    args = ["generate", "--prompt", "hi", "--json", *flags]
    answer = json.loads(CliRunner().invoke(cli_app, [str(a) for a in args]).stdout)
    assert answer["stats"]["branches"] > 1 and answer["text"].strip()
    result = CliRunner().invoke(
        cli_app, [str(a) for a in ["chat", *flags]], input="hi\n/quit\n", env={"COLUMNS": "120"}
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.count(answer["text"]) == 1 and "▌" not in result.stdout


def test_generate_json_reports_forks_steps_and_answer_tokens(cli_app, apar_folder):
    out = json.loads(generate(cli_app, apar_folder, "--json").stdout)
    stats = out["stats"]
    answer = len(out["tokens"])
    decode_s = stats["generation_tokens"] / stats["generation_tps"]
    assert out["branches"] == {
        "forks": stats["branches"] - 1,
        "steps": stats["steps"],
        "answer_tokens": answer,
        "answer_tokens_per_step": answer / stats["steps"],
        "answer_tps": pytest.approx(answer / decode_s),
    }
    assert out["branches"]["forks"] > 0
    assert stats["generation_tokens"] > answer  # every branch's: not the answer's
    off = json.loads(generate(cli_app, apar_folder, "--json", "--branches", "off").stdout)
    assert off["branches"] is None


def test_bench_reports_branches_per_answer_and_shows_them_in_its_table(cli_app, apar_folder):
    import io

    from rich.console import Console

    from redrafter_mlx.cli.bench_report import render_table

    args = ["bench", "--model", apar_folder, "--num-prompts", "2", "-n", "10"]
    args += ["--logit-bias", "4094:40", "--configs", "AR,K1xL4", "--json"]
    result = CliRunner().invoke(cli_app, [str(a) for a in args], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for row in data["configs"]:
        runs = data["per_prompt"][row["config"]]
        assert row["forks_per_answer"] == sum(r["branches"] - 1 for r in runs) / 2 > 0
        assert row["steps_per_answer"] == sum(r["steps"] for r in runs) / 2
        assert row["tokens_per_answer"] == sum(r["tokens"] for r in runs) / 2 == 10
    console = Console(file=io.StringIO(), width=80)
    console.print(render_table(data["configs"], "bench"))
    header = next(line for line in console.file.getvalue().splitlines() if "tok/s" in line)
    assert header.split()[:1] == ["config"] and "forks" in header and "tok/ans" in header
    assert "eff" not in header  # its place: the branch columns, within 80 columns


def test_serve_checks_memory_for_the_branch_rows_longer_rows(cli_app, apar_folder, monkeypatch):
    """A branch row holds its split tokens besides the answer (``BranchRules.row_tokens``):
    serve's start-up memory check sizes for that once it knows the model branches."""
    import redrafter_mlx.cli.serve as serve
    from redrafter_mlx.cli.common import FlagError

    seen = []

    def check_memory(engine, shape, max_tokens, sampling, batch):
        seen.append((max_tokens, batch))
        raise FlagError("stopped before serving")  # the test needs no server

    monkeypatch.setattr(serve, "check_memory", check_memory)
    args = ["serve", "--model", apar_folder, "--max-tokens-limit", "100", "--max-batch", "4"]
    args += ["--max-branches", "8", "--branch-depth", "2", "--port", "0"]
    result = CliRunner().invoke(cli_app, [str(a) for a in args])
    assert "stopped before serving" in result.output
    assert seen == [(100 + 8 + 2, 4)]


# --- the stats line with branches: the answer's tokens, as --json says -------------------


def plan(speculative: bool = False):
    from types import SimpleNamespace

    from redrafter_mlx.engine.core.shape import BeamShape

    shape = BeamShape(1, 4) if speculative else BeamShape.autoregressive()
    return SimpleNamespace(speculative=speculative, shape=shape, label="W1×L4", source="preset")


def response(branches: int, **extra):
    from redrafter_mlx.engine.loop.generation import GenerationResponse

    return GenerationResponse(
        generation_tokens=300,
        generation_tps=60.0,  # 5 s of decoding
        steps=109,
        branches=branches,
        time_to_first_token=0.05,
        finish_reason="stop",
        **extra,
    )


def test_the_stats_line_with_branches_counts_the_answers_tokens_not_every_branchs():
    """300 tokens decoded over 4 branches (split tokens and text past the answer's end
    included), 163 of them in the rebuilt text the user reads: the line says 163, and their
    speed over the same 5 s; then the branches and the sequential steps."""
    from redrafter_mlx.cli.stats import stats_line

    line = stats_line(response(4), plan(), answer_tokens=163)
    assert line.startswith("163 tokens · 32.6 tok/s · 4 branches · 109 steps (1.50 tok/step) · ")
    assert "300" not in line and "60.0" not in line
    spec = stats_line(response(4, accept_hist=[80, 20, 9]), plan(True), answer_tokens=163)
    assert "branch steps emitting 1/2/3 tokens: 80/20/9" in spec
    assert spec.count("tok/step") == 1  # the answer's per sequential step, not a row's
    # without branches nothing changes: every token is the answer's
    assert stats_line(response(0), plan(), answer_tokens=163).startswith("300 tokens · 60.0 tok/s")
    with pytest.raises(ValueError, match="rebuilt text"):
        stats_line(response(4), plan())


def test_generates_stats_line_says_what_its_json_reports(cli_app, apar_folder):
    """The same greedy answer: the stats line's tokens, steps and tokens per step are the
    ``--json`` object's ``branches``, the answer's (12 tokens), not ``stats``' count."""
    out = json.loads(generate(cli_app, apar_folder, "--json").stdout)
    branches = out["branches"]
    assert branches["answer_tokens"] == 12 < out["stats"]["generation_tokens"]
    line = generate(cli_app, apar_folder).stderr
    per_step = branches["answer_tokens_per_step"]
    assert line.startswith("12 tokens · ")
    assert f" · {out['stats']['branches']} branches · " in line
    assert f" · {branches['steps']} steps ({per_step:.2f} tok/step) · " in line


def test_chats_stats_line_and_stats_command_count_the_answers_tokens(cli_app, apar_folder):
    """Piped chat, one branching turn of at most 16 tokens: the line after it says the
    answer's 16 tokens (what ``generate --json`` reports), ``/stats`` too, beside what all
    the branches decoded."""
    flags = ["--model", apar_folder, "-n", "16", "--logit-bias", "4094:40", "--no-adapt"]
    args = ["generate", "--prompt", "hi", "--json", *flags]
    answer = json.loads(CliRunner().invoke(cli_app, [str(a) for a in args]).stdout)
    decoded, steps = answer["stats"]["generation_tokens"], answer["branches"]["steps"]
    assert answer["branches"]["answer_tokens"] == 16 < decoded
    result = CliRunner().invoke(
        cli_app,
        [str(a) for a in ["chat", *flags]],
        input="hi\n/stats\n/quit\n",
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    line = next(line for line in lines if " branches · " in line)
    assert line.startswith("16 tokens · ") and f" · {steps} steps ({16 / steps:.2f} " in line
    stats = next(line for line in lines if line.startswith("answer: "))
    assert stats.startswith("answer: 16 tokens, ") and f"({decoded} decoded in " in stats
