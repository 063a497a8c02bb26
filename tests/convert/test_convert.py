"""End-to-end conversion: exact tensors, mlx-lm loading and logits, quantization, drafters,
errors that leave nothing behind, and the HF-hub offline path."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.support.paths import CONVERT as FIXTURES
from tests.support.torch_pickles import _payloads, _torch_zip
from weights_convert import ConversionError, convert
from weights_convert.safetensors_io import read_safetensors

NOT_WEIGHTS = ("prompt", "logits", "logits_tied")


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """torch's fp32 -> bf16 rounding, from the fixture script (which checked it against torch)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.bf16_bits(x)


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / "llama_expected.npz"))


def _as_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 master weights -> the exact bits of their ``dtype`` cast (uint view for comparison)."""
    if dtype == "float32":
        return x.astype(np.float32).view(np.uint32)
    if dtype == "float16":
        return x.astype(np.float16).view(np.uint16)
    return _bf16_bits(x)


def _load_output(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of a converted folder, read with ``mx.load`` (independent of our reader),
    as numpy bit patterns (uint16/uint32 views for floats)."""
    import mlx.core as mx

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        for name, array in mx.load(str(folder / shard)).items():
            assert index["weight_map"][name] == shard
            view = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16}.get(
                array.dtype, array.dtype
            )
            out[name] = np.array(array.view(view))
    return out


def _tree_hash(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _mlx_logits(folder: Path, prompt: np.ndarray) -> np.ndarray:
    import mlx.core as mx
    import mlx_lm

    model, _ = mlx_lm.load(str(folder))
    return np.array(model(mx.array(prompt)[None])[0].astype(mx.float32))


def _copy_fixture(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / "src" / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


# --- exact tensors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fixture, dtype",
    [
        ("llama_bin", "float32"),  # fp32 .bin with shared-storage views: passthrough
        ("llama_bin_sharded", "float16"),  # fp16 sharded .bin: passthrough
        ("llama_st_bf16", "bfloat16"),  # bf16 safetensors: passthrough
        ("llama_bin", "bfloat16"),  # fp32 -> bf16 cast (round to nearest even, like torch)
        ("llama_bin", "float16"),  # fp32 -> fp16 cast
    ],
)
def test_converted_tensors_equal_the_source_bit_for_bit(tmp_path, expected, fixture, dtype):
    src = FIXTURES / fixture
    before = _tree_hash(src)
    out = tmp_path / "out"
    summary = convert(str(src), out, dtype=dtype, progress=False)
    got = _load_output(out)
    weights = {k: v for k, v in expected.items() if k not in NOT_WEIGHTS}
    assert set(got) == set(weights)
    for name, master in weights.items():
        np.testing.assert_array_equal(got[name], _as_bits(master, dtype), err_msg=name)
    assert _tree_hash(src) == before  # sources never modified
    config = json.loads((out / "config.json").read_text())
    assert (
        config["tie_word_embeddings"] is False
        and config["torch_dtype"] == dtype
        and "quantization" not in config
    )
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert summary.parameters == sum(v.size for v in weights.values())
    assert summary.bytes_on_disk == sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    if fixture == "llama_bin":
        assert sorted(summary.dropped) == [
            f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(2)
        ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_fp32_output_loads_with_mlx_lm_and_gives_the_source_logits(tmp_path, expected):
    out = tmp_path / "out"
    convert(str(FIXTURES / "llama_bin"), out, dtype="float32", progress=False)
    logits = _mlx_logits(out, expected["prompt"])
    np.testing.assert_allclose(logits, expected["logits"], atol=2e-4, rtol=1e-4)


def test_tied_embeddings_from_save_pretrained(tmp_path, expected):
    out = tmp_path / "out"
    summary = convert(str(FIXTURES / "llama_st_tied"), out, dtype="float32", progress=False)
    got = _load_output(out)
    assert "lm_head.weight" not in got and summary.tensors == len(got)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    logits = _mlx_logits(out, expected["prompt"])
    np.testing.assert_allclose(logits, expected["logits_tied"], atol=2e-4, rtol=1e-4)


def test_missing_lm_head_means_tied_even_if_config_says_untied(tmp_path, expected):
    src = _copy_fixture("llama_st_tied", tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    out = tmp_path / "out"
    convert(str(src), out, dtype="float32", progress=False)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    np.testing.assert_allclose(
        _mlx_logits(out, expected["prompt"]), expected["logits_tied"], atol=2e-4, rtol=1e-4
    )


# --- quantization --------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_output_matches_mlx_lm_quantize_model(tmp_path, expected, bits):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    plain, quant = tmp_path / "plain", tmp_path / "quant"
    convert(str(FIXTURES / "llama_bin"), plain, dtype="float16", progress=False)
    summary = convert(
        str(FIXTURES / "llama_bin"),
        quant,
        dtype="float16",
        quantize=True,
        q_bits=bits,
        progress=False,
    )

    model, _, config = mlx_lm.load(str(plain), return_config=True)
    ref_model, ref_config = quantize_model(model, config, group_size=64, bits=bits)
    ours = json.loads((quant / "config.json").read_text())
    assert (
        ours["quantization"]
        == {"group_size": 64, "bits": bits, "mode": "affine"}
        == ref_config["quantization"]
    )
    assert ours["quantization_config"] == ours["quantization"]

    got = _load_output(quant)
    ref = {
        k: np.array(v.view({mx.float16: mx.uint16}.get(v.dtype, v.dtype)))
        for k, v in tree_flatten(ref_model.parameters())
    }
    assert set(got) == set(ref)
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
    assert summary.quantized_tensors == 16  # 14 projections + embed_tokens + lm_head

    loaded, _ = mlx_lm.load(str(quant))  # loads as a quantized model and runs
    assert isinstance(loaded.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    logits = np.array(loaded(mx.array(expected["prompt"])[None])[0].astype(mx.float32))
    error = np.abs(logits - expected["logits"]).mean() / np.abs(expected["logits"]).mean()
    assert error < (0.25 if bits == 4 else 0.02)


# --- drafters ------------------------------------------------------------------------------------


def test_reference_drafter_bin_is_kept_under_reference_names(tmp_path):
    out = tmp_path / "out"
    summary = convert(
        str(FIXTURES / "llama_bin_sharded"),
        out,
        drafter=str(FIXTURES / "drafter_bin"),
        dtype="float32",
        progress=False,
    )
    drafter_expected = dict(np.load(FIXTURES / "drafter_bin_expected.npz"))
    got = _load_output(out / "drafter")
    assert set(got) == set(drafter_expected) - {"emb_norm.weight"}
    for name, value in got.items():
        np.testing.assert_array_equal(value, drafter_expected[name].view(np.uint32), err_msg=name)
    config = json.loads((out / "drafter" / "config.json").read_text())
    source_config = json.loads((FIXTURES / "drafter_bin" / "config.json").read_text())
    for key in (
        "vocab_size",
        "hidden_size",
        "exit_dim",
        "num_draft_layers",
        "rnn",
        "num_lookback_tokens",
        "model_type",
    ):
        assert config[key] == source_config[key]
    assert "quantization" not in config and "drafter emb_norm.weight" in summary.dropped
    assert summary.drafter_parameters == sum(
        v.size for k, v in drafter_expected.items() if k != "emb_norm.weight"
    )


def test_quantized_drafter_follows_the_mlx_lm_rule(tmp_path):
    import mlx.core as mx

    out = tmp_path / "out"
    convert(
        str(FIXTURES / "llama_bin"),
        out,
        drafter=str(FIXTURES / "drafter_st"),
        quantize_drafter=True,
        q_bits=8,
        progress=False,
    )
    got = _load_output(out / "drafter")
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    quantized = {k[: -len(".scales")] for k in got if k.endswith(".scales")}
    # input dims: input_proj 128, rnn 64 -> quantized; exit_dim=96 layers aren't multiples of 64
    assert quantized == {"input_proj", "rnn_u", "rnn_w"}
    assert (
        got["lm_head.2.weight"].dtype == np.uint16 and got["input_proj.weight"].dtype == np.uint32
    )
    source = {
        r.name: r.load() for r in read_safetensors(FIXTURES / "drafter_st" / "model.safetensors")
    }
    w = mx.dequantize(
        mx.array(got["rnn_u.weight"]),
        mx.array(got["rnn_u.scales"]).view(mx.float16),
        mx.array(got["rnn_u.biases"]).view(mx.float16),
        group_size=64,
        bits=8,
    )
    np.testing.assert_allclose(
        np.array(w.astype(mx.float32)), source["rnn_u.weight"].astype(np.float32), atol=0.02
    )
    assert (
        json.loads((out / "config.json").read_text()).get("quantization") is None
    )  # base not quantized


def _write_safetensors(path: Path, arrays: dict[str, np.ndarray]) -> None:
    from weights_convert.safetensors_io import SafetensorsWriter, TensorSpec

    codes = {np.dtype("float16"): "F16", np.dtype("float32"): "F32"}
    specs = [TensorSpec(k, codes[v.dtype], v.shape) for k, v in arrays.items()]
    with SafetensorsWriter(path, specs) as writer:
        for k, v in arrays.items():
            writer.write(k, v)


def _alt_name(name: str) -> str:
    return name.replace("input_proj.", "input_projs.0.").replace("lm_head.", "lm_heads.0.")


def test_multi_head_layout_is_mapped_to_reference_names(tmp_path):
    src = _copy_fixture("drafter_st", tmp_path)
    source = {r.name: np.array(r.load()) for r in read_safetensors(src / "model.safetensors")}
    _write_safetensors(src / "model.safetensors", {_alt_name(k): v for k, v in source.items()})
    out = tmp_path / "out"
    convert(str(FIXTURES / "llama_bin"), out, drafter=str(src), progress=False)
    got = _load_output(out / "drafter")
    assert set(got) == set(source)
    for name, value in source.items():
        np.testing.assert_array_equal(got[name], value.view(np.uint16), err_msg=name)


# --- errors: a clear message, nothing left behind ------------------------------------------------


def _assert_fails_cleanly(
    tmp_path: Path, message: str, model: str, drafter: str | None = None
) -> None:
    outs = tmp_path / "outs"
    with pytest.raises(ConversionError, match=message):
        convert(model, outs / "nested" / "model", drafter=drafter, progress=False)
    assert not outs.exists()  # neither the output, nor a temp folder, nor created parents


def test_error_truncated_bin(tmp_path):
    src = _copy_fixture("llama_bin", tmp_path)
    blob = (src / "pytorch_model.bin").read_bytes()
    (src / "pytorch_model.bin").write_bytes(blob[: len(blob) * 2 // 3])
    _assert_fails_cleanly(tmp_path, "truncated or corrupt.*re-download", str(src))


def test_error_corrupt_safetensors_header(tmp_path):
    src = _copy_fixture("llama_st_bf16", tmp_path)
    blob = bytearray((src / "model.safetensors").read_bytes())
    blob[8:20] = b"{garbage!!!!"
    (src / "model.safetensors").write_bytes(bytes(blob))
    _assert_fails_cleanly(tmp_path, "corrupt safetensors header.*invalid JSON", str(src))


def test_error_shape_mismatch_against_config(tmp_path):
    src = _copy_fixture("llama_bin_sharded", tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
    _assert_fails_cleanly(
        tmp_path,
        r"mlp\.\w+_proj\.weight .* has shape \[\d+, \d+\] but .*config\.json implies",
        str(src),
    )


def test_error_missing_shard_listed_in_index(tmp_path):
    src = _copy_fixture("llama_bin_sharded", tmp_path)
    (src / "pytorch_model-00002-of-00002.bin").unlink()
    _assert_fails_cleanly(
        tmp_path,
        "shard pytorch_model-00002-of-00002.bin listed in .*index.json is missing",
        str(src),
    )


def test_error_missing_tensor(tmp_path):
    src = _copy_fixture("llama_bin_sharded", tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    _assert_fails_cleanly(tmp_path, "lacks model.layers.2.", str(src))


@pytest.mark.parametrize(
    "key, value, what",
    [
        ("hidden_size", 32, "hidden_size is 32 but the base model's is 64"),
        ("vocab_size", 100, "vocab_size is 100 but the base model's is 128"),
    ],
)
def test_error_drafter_llm_mismatch(tmp_path, key, value, what):
    drafter = _copy_fixture("drafter_bin", tmp_path)
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**config, key: value}))
    _assert_fails_cleanly(
        tmp_path,
        f"drafter/LLM mismatch: the drafter's {what}",
        str(FIXTURES / "llama_bin"),
        str(drafter),
    )


def test_error_second_drafter_head_is_refused(tmp_path):
    src = _copy_fixture("drafter_st", tmp_path)
    source = {r.name: np.array(r.load()) for r in read_safetensors(src / "model.safetensors")}
    renamed = {_alt_name(k): v for k, v in source.items()}
    renamed["lm_heads.1.2.weight"] = source["lm_head.2.weight"]
    _write_safetensors(src / "model.safetensors", renamed)
    _assert_fails_cleanly(tmp_path, "several heads", str(FIXTURES / "llama_bin"), str(src))


def test_error_legacy_format(tmp_path):
    _assert_fails_cleanly(tmp_path, r"legacy \(pre-zip", str(FIXTURES / "legacy"))


def test_error_malicious_bin_in_a_model_folder(tmp_path):
    src = _copy_fixture("llama_bin", tmp_path)
    marker = tmp_path / "pwned"
    _torch_zip(src / "pytorch_model.bin", _payloads(marker)["os.system"][0], {})
    _assert_fails_cleanly(tmp_path, "refused to load.*system", str(src))
    assert not marker.exists()


def test_error_bad_options_and_missing_folder(tmp_path):
    _assert_fails_cleanly(tmp_path, "no such folder", str(tmp_path / "nope"))
    with pytest.raises(ConversionError, match="--dtype 'int8' is not supported"):
        convert(str(FIXTURES / "llama_bin"), tmp_path / "o", dtype="int8", progress=False)
    with pytest.raises(ConversionError, match="--q-bits 7"):
        convert(
            str(FIXTURES / "llama_bin"), tmp_path / "o", quantize=True, q_bits=7, progress=False
        )


def test_interrupt_mid_write_leaves_nothing_and_keeps_the_old_output(tmp_path, monkeypatch):
    import weights_convert.writer as writer

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    real, calls = writer.materialize, []

    def interrupted(job):
        calls.append(job)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(job)

    monkeypatch.setattr(writer, "materialize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(str(FIXTURES / "llama_bin"), out, force=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_existing_output_needs_force_and_sources_are_protected(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(ConversionError, match="exists and is not empty.*--force"):
        convert(str(FIXTURES / "llama_bin"), out, progress=False)
    assert (out / "old.txt").exists()
    convert(str(FIXTURES / "llama_bin"), out, force=True, progress=False)
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    src = _copy_fixture("llama_bin", tmp_path)
    with pytest.raises(ConversionError, match="would overwrite the source"):
        convert(str(src), src.parent, force=True, progress=False)
    assert (src / "pytorch_model.bin").is_file()


def test_existing_empty_output_folder_is_used_without_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    convert(str(FIXTURES / "llama_bin_sharded"), out, progress=False)
    assert (out / "model.safetensors").is_file() and sorted(p.name for p in tmp_path.iterdir()) == [
        "out"
    ]


def test_hub_download_asks_only_for_the_needed_files():
    from weights_convert.sources import _choose_repo_files

    vicuna = [
        ".gitattributes",
        "README.md",
        "config.json",
        "generation_config.json",
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    patterns = _choose_repo_files("lmsys/vicuna-7b-v1.3", vicuna)
    assert sorted(patterns) == sorted(
        [
            "config.json",
            "generation_config.json",
            "special_tokens_map.json",
            "tokenizer.model",
            "tokenizer_config.json",
            "pytorch_model.bin.index.json",
            "pytorch_model-*.bin",
        ]
    )
    both = [
        "config.json",
        "model.safetensors",
        "pytorch_model.bin",
        "tokenizer.json",
        "flax_model.msgpack",
    ]
    assert sorted(_choose_repo_files("x/y", both)) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    with pytest.raises(ConversionError, match="no model.safetensors or pytorch_model.bin"):
        _choose_repo_files("x/gguf", ["config.json", "model.gguf"])


def test_hub_repo_offline_with_empty_cache_says_how_to_get_the_files(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with pytest.raises(ConversionError) as err:
        convert("lmsys/vicuna-7b-v1.3", tmp_path / "outs" / "vicuna", progress=False)
    message = str(err.value)
    assert "not in the Hugging Face cache" in message and "HF_HUB_OFFLINE" in message
    assert "hf download lmsys/vicuna-7b-v1.3" in message and "local folder" in message
    assert not (tmp_path / "outs").exists()


def test_hub_repo_from_a_populated_cache(tmp_path, monkeypatch):
    """A repo id resolves through the hub cache (offline) exactly like a local folder."""
    cache = tmp_path / "hf" / "hub" / "models--tiny--llama"
    snapshot = cache / "snapshots" / ("0" * 40)
    shutil.copytree(FIXTURES / "llama_st_bf16", snapshot)
    (cache / "refs").mkdir(parents=True)
    (cache / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    out = tmp_path / "out"
    convert("tiny/llama", out, dtype="bfloat16", progress=False)
    assert _tree_hash(out)["model.safetensors"] and (out / "tokenizer.json").is_file()
