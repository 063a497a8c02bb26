"""`redrafter-mlx convert` through typer, and the converted pair running in the engine."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from tests.support.paths import CONVERT as FIXTURES


def _run(app, *args: str):
    return CliRunner().invoke(app, ["convert", *args])


def test_cli_success_prints_a_summary(app, tmp_path):
    out = tmp_path / "vicuna"
    result = _run(
        app,
        "--model",
        str(FIXTURES / "llama_bin_sharded"),
        "--drafter",
        str(FIXTURES / "drafter_st"),
        "--out",
        str(out),
        "-q",
        "--q-bits",
        "8",
        "--q-group-size",
        "64",
        "--dtype",
        "bfloat16",
        "--quantize-drafter",
    )
    assert result.exit_code == 0, result.output
    for fact in (
        "converted",
        "parameters",
        "bfloat16",
        "8-bit affine, group size 64",
        "size on disk",
        "time",
    ):
        assert fact in result.output
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert json.loads((out / "drafter" / "config.json").read_text())["quantization"]["bits"] == 8
    assert (out / "model.safetensors").is_file() and (
        out / "drafter" / "model.safetensors"
    ).is_file()


def test_cli_refuses_a_non_empty_out_without_force(app, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    result = _run(app, "--model", str(FIXTURES / "llama_bin"), "--out", str(out), "--no-progress")
    assert result.exit_code == 1
    assert (
        "error:" in result.output
        and "--force" in result.output
        and "Traceback" not in result.output
    )
    assert (out / "precious.txt").read_text() == "keep me"
    result = _run(
        app, "--model", str(FIXTURES / "llama_bin"), "--out", str(out), "--force", "--no-progress"
    )
    assert result.exit_code == 0, result.output
    assert not (out / "precious.txt").exists() and (out / "config.json").is_file()


def test_cli_bad_input_exits_1_with_one_line_and_no_traceback(app, tmp_path):
    result = _run(
        app, "--model", str(FIXTURES / "legacy"), "--out", str(tmp_path / "o"), "--no-progress"
    )
    assert result.exit_code == 1
    assert "legacy (pre-zip" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o").exists()
    result = _run(
        app,
        "--model",
        str(FIXTURES / "legacy"),
        "--out",
        str(tmp_path / "o"),
        "--verbose",
        "--no-progress",
    )
    assert result.exit_code == 1 and "Traceback" in result.output


def test_converted_pair_runs_in_the_engine_and_redrafter_equals_greedy(tmp_path):
    """The engine loads the converted model + drafter (weights strictly, drafter quantized),
    and greedy ReDrafter tokens equal greedy autoregressive tokens."""
    import mlx.core as mx

    import redrafter_mlx
    from redrafter_mlx.engine.loop import loading
    from weights_convert import convert

    out = tmp_path / "pair"
    convert(
        str(FIXTURES / "llama_bin"),
        out,
        drafter=str(FIXTURES / "drafter_st"),
        dtype="float32",
        quantize_drafter=True,
        q_bits=8,
        progress=False,
    )
    model, _ = loading.load_model(out, mx.float32)
    drafter = loading.load_drafter(out / "drafter", mx.float32)
    prompt = [1, 17, 42, 99, 5, 63]
    plain = redrafter_mlx.batch_generate(model, None, None, [prompt], max_tokens=12)[0]
    drafted = redrafter_mlx.batch_generate(
        model, drafter, None, [prompt], max_tokens=12, shape=redrafter_mlx.BeamShape(3, 4)
    )[0]
    assert len(plain) == 12 and drafted == plain
