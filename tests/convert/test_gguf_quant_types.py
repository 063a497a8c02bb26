"""GGUF tensor types as llama.cpp writes them: every weight type converts to the gguf package's
own dequantization (bit for bit in float32, rounded once in float16), the types MLX's affine
format holds (Q5_0, Q5_1, Q4_K, Q5_K) are kept quantized with the same values, and a
Q4_K_M-like mix (Q4_K, Q6_K, Q5_0, Q8_0, F32 norms) converts to a folder that loads and gives
the reference logits. The files are written with ``gguf.GGUFWriter``; types without a gguf
quantizer (K-quants, i-quants) get random blocks in their layout
(``tests/support/gguf_files.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.gguf_files import WIDE, Dims, TinyGGUF, write_llama_gguf
from weights_convert import ConversionError, convert
from weights_convert.gguf import KEEP_QUANTIZED_ENV

NARROW = Dims(hidden=256, inter=256, layers=1)  # the smallest model of whole super-blocks
DEQUANTIZED_TYPES = (
    "Q2_K", "Q3_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
    "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4",
)  # fmt: skip
KEPT_TYPES = {"Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5}
# llama.cpp's Q4_K_M: mostly Q4_K, Q6_K for the output and some attn_v / ffn_down, and the
# fallbacks for rows that are not whole super-blocks (Q5_0 for Q4_K, Q8_0 for Q6_K).
Q4_K_M = {
    "token_embd.weight": "Q8_0",
    "output.weight": "Q6_K",
    "blk.0.attn_v.weight": "Q6_K",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.ffn_down.weight": "Q5_0",
}
PROMPT = [1, 17, 150, 42, 3, 299, 88, 201, 5, 64]


def _arrays(folder: Path) -> dict[str, np.ndarray]:
    import mlx.core as mx

    return {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}


def _dequantized(arrays: dict[str, np.ndarray], prefix: str, bits: int) -> np.ndarray:
    """MLX's dequantization of a kept triple, scales and biases in float32."""
    import mlx.core as mx

    return np.array(
        mx.dequantize(
            mx.array(arrays[f"{prefix}.weight"]),
            mx.array(arrays[f"{prefix}.scales"]).astype(mx.float32),
            mx.array(arrays[f"{prefix}.biases"]).astype(mx.float32),
            group_size=32,
            bits=bits,
        )
    )


def _hf_checkpoint(tiny: TinyGGUF, folder: Path) -> Path:
    """The reference weights (gguf's dequantization, HF layout) as a float32 checkpoint."""
    import mlx.core as mx

    folder.mkdir()
    mx.save_safetensors(
        str(folder / "model.safetensors"), {k: mx.array(v) for k, v in tiny.reference.items()}
    )
    (folder / "config.json").write_text(json.dumps(tiny.config))
    return folder


def _engine_logits(folder: Path) -> np.ndarray:
    """The engine's last-position logits for :data:`PROMPT`, the model loaded in float32."""
    import mlx.core as mx

    from redrafter_mlx.engine.loop.loading import load_model
    from tests.support.models import greedy_prefilled

    model, _ = load_model(folder, dtype=mx.float32)
    state = greedy_prefilled(model, PROMPT, len(PROMPT) + 1)
    return np.array(model.logits(state.hidden))


def _mlx_lm_logits(folder: Path) -> np.ndarray:
    """mlx-lm's logits for every position, with every floating parameter (float16 scales
    included, which mlx-lm would otherwise compute in) cast to float32."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)
    model.update(
        tree_map(
            lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x,
            model.parameters(),
        )
    )
    return np.array(model(mx.array(PROMPT)[None])[0])


@pytest.fixture
def keep_on_cpu(monkeypatch):
    monkeypatch.setenv(KEEP_QUANTIZED_ENV, "1")


@pytest.fixture
def on_metal(monkeypatch):
    import mlx.core as mx

    monkeypatch.setattr(mx.metal, "is_available", lambda: True)


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory) -> TinyGGUF:
    path = tmp_path_factory.mktemp("q4km") / "tiny-Q4_K_M.gguf"
    return write_llama_gguf(path, "Q4_K", tensor_types=Q4_K_M, dims=WIDE)


# --- every type ----------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", DEQUANTIZED_TYPES + tuple(KEPT_TYPES))
def test_every_llama_cpp_type_converts_to_the_gguf_dequantization(tmp_path, qtype):
    tiny = write_llama_gguf(tmp_path / f"{qtype}.gguf", qtype, dims=NARROW)
    summary = convert(str(tiny.path), tmp_path / "out", dtype="float32", progress=False)
    got = _arrays(tmp_path / "out")
    assert set(got) == set(tiny.reference) and summary.quantization is None
    for name, ref in tiny.reference.items():  # Q/K un-permuted: compared in the HF layout
        assert np.isfinite(ref).all() and ref.std() > 0.01, name  # a real test of the values
        np.testing.assert_array_equal(got[name], ref, err_msg=name)


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_kept_types_hold_the_gguf_values_bit_for_bit(tmp_path, keep_on_cpu, qtype):
    """With float32 floats, MLX's dequantization of every kept triple is gguf's, exactly;
    K-quant scales (``d * sc``, up to 17 significant bits) are written in float32 for that."""
    tiny = write_llama_gguf(tmp_path / f"{qtype}.gguf", qtype, dims=NARROW)
    summary = convert(str(tiny.path), tmp_path / "out", progress=False)
    bits = KEPT_TYPES[qtype]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": bits, "mode": "affine"}
    assert summary.quantized_tensors == 9  # embedding, lm_head, 7 linears: every 2-D weight
    got = _arrays(tmp_path / "out")
    scale_dtype = np.float32 if qtype.endswith("_K") else np.float16
    for name, ref in tiny.reference.items():
        if ref.ndim == 1:
            np.testing.assert_array_equal(got[name], ref, err_msg=name)
            continue
        prefix = name[: -len(".weight")]
        assert got[f"{prefix}.scales"].dtype == scale_dtype, name
        np.testing.assert_array_equal(_dequantized(got, prefix, bits), ref, err_msg=name)


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_metal_default_keeps_them_with_float16_scales(tmp_path, on_metal, monkeypatch, qtype):
    """Float16 holds the 32-block types' scales exactly; a K-quant's are its float32 scales
    rounded once to float16 (the precision a float16 model computes in)."""
    tiny = write_llama_gguf(tmp_path / f"{qtype}.gguf", qtype, dims=NARROW)
    convert(str(tiny.path), tmp_path / "metal", progress=False)
    monkeypatch.setattr("mlx.core.metal.is_available", lambda: False)
    monkeypatch.setenv(KEEP_QUANTIZED_ENV, "1")
    convert(str(tiny.path), tmp_path / "exact", progress=False)
    metal, exact = _arrays(tmp_path / "metal"), _arrays(tmp_path / "exact")
    for name, array in metal.items():
        if name.endswith((".scales", ".biases")):
            assert array.dtype == np.float16, name
            np.testing.assert_array_equal(array, exact[name].astype(np.float16), err_msg=name)
        elif array.dtype == np.uint32:
            np.testing.assert_array_equal(array, exact[name], err_msg=name)
    if not qtype.endswith("_K"):
        name = "model.layers.0.mlp.down_proj"
        np.testing.assert_array_equal(
            _dequantized(metal, name, KEPT_TYPES[qtype]), tiny.reference[f"{name}.weight"]
        )


# --- a Q4_K_M file, end to end -------------------------------------------------------------------


def test_q4_k_m_mix_converts_with_per_layer_bits_and_gives_the_reference_logits(
    q4_k_m, tmp_path, keep_on_cpu
):
    from typer.testing import CliRunner

    from redrafter_mlx import cli

    out = tmp_path / "kept"
    cli._register()
    result = CliRunner().invoke(
        cli.app, ["convert", "--model", str(q4_k_m.path), "--out", str(out), "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8},
        "model.layers.1.mlp.down_proj": {"group_size": 32, "bits": 5},
    }
    got = _arrays(out)
    for name in ("lm_head", "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.down_proj"):
        assert f"{name}.scales" not in got  # Q6_K: dequantized, float32 here
        np.testing.assert_array_equal(got[f"{name}.weight"], q4_k_m.reference[f"{name}.weight"])
    for name, bits in (("model.layers.1.mlp.down_proj", 5), ("model.layers.1.mlp.up_proj", 4)):
        np.testing.assert_array_equal(
            _dequantized(got, name, bits), q4_k_m.reference[f"{name}.weight"]
        )
    hf = _hf_checkpoint(q4_k_m, tmp_path / "hf")
    convert(str(hf), tmp_path / "from_hf", dtype="float32", progress=False)
    reference = _engine_logits(tmp_path / "from_hf")
    logits = _engine_logits(out)
    assert np.abs(reference).max() > 1.0  # logits of some size, compared at float tolerance
    np.testing.assert_allclose(logits, reference, rtol=1e-4, atol=1e-4)
    assert np.argmax(logits) == np.argmax(reference)
    np.testing.assert_allclose(
        _mlx_lm_logits(out), _mlx_lm_logits(tmp_path / "from_hf"), rtol=1e-4, atol=1e-4
    )


def test_q4_k_m_mix_dequantized_is_exact_to_the_dtype(q4_k_m, tmp_path):
    """Without keeping (the CPU default): float32 gives gguf's values and the reference logits
    exactly; float16 and bfloat16 round each value once."""
    import mlx.core as mx

    convert(str(q4_k_m.path), tmp_path / "f32", progress=False)
    hf = _hf_checkpoint(q4_k_m, tmp_path / "hf")
    convert(str(hf), tmp_path / "from_hf", dtype="float32", progress=False)
    np.testing.assert_array_equal(
        _engine_logits(tmp_path / "f32"), _engine_logits(tmp_path / "from_hf")
    )
    for dtype in ("float16", "bfloat16"):
        convert(str(q4_k_m.path), tmp_path / dtype, dtype=dtype, progress=False)
        got = mx.load(str(tmp_path / dtype / "model.safetensors"))
        for name, ref in q4_k_m.reference.items():
            assert got[name].dtype == getattr(mx, dtype), name
            expected = mx.array(ref).astype(getattr(mx, dtype))
            assert mx.array_equal(got[name], expected).item(), f"{dtype} {name}"


def test_q4_k_m_mix_kept_on_metal_loads_and_stays_close(q4_k_m, tmp_path, on_metal):
    hf = _hf_checkpoint(q4_k_m, tmp_path / "hf")
    convert(str(hf), tmp_path / "from_hf", dtype="float32", progress=False)
    summary = convert(str(q4_k_m.path), tmp_path / "metal", progress=False)
    assert summary.dtype == "float16" and summary.quantized_tensors == 13  # all but the Q6_K
    assert "4-bit affine, group size 32; 2 layers at 5/8-bit" in "\n".join(summary.lines())
    reference = _engine_logits(tmp_path / "from_hf")
    logits = _engine_logits(tmp_path / "metal")
    # K-quant scales and the other floats in float16: off by the float16 rounding only.
    np.testing.assert_allclose(logits, reference, rtol=0, atol=2e-3 * np.abs(reference).max())
    assert np.argmax(logits) == np.argmax(reference)


@pytest.mark.parametrize("keep", [True, False])
def test_a_gemma3_q5_0_file_converts_kept_or_dequantized(tmp_path, monkeypatch, keep):
    """Gemma 3 270M's Q4_K_M is mostly Q5_0 (its rows of 640 are not whole super-blocks):
    kept as MLX 5-bit, or dequantized, it gives the logits of the model it was written from."""
    import mlx.core as mx

    from redrafter_mlx.engine.loop.loading import load_model
    from tests.support.families import _prefill_hidden, write_family_gguf

    if keep:
        monkeypatch.setenv(KEEP_QUANTIZED_ENV, "1")
    model = write_family_gguf(tmp_path / "gemma3.gguf", "gemma3_text", "Q5_0")
    summary = convert(str(tmp_path / "gemma3.gguf"), tmp_path / "out", progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and summary.dtype == "float32"
    assert config.get("quantization") == (
        {"group_size": 32, "bits": 5, "mode": "affine"} if keep else None
    )
    loaded, _ = load_model(tmp_path / "out", mx.float32)
    want = np.array(model.logits(_prefill_hidden(model)))
    got = np.array(loaded.logits(_prefill_hidden(loaded)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


# --- errors --------------------------------------------------------------------------------------


def _refused(src: Path, tmp_path: Path, match: str) -> None:
    out = tmp_path / "never"
    with pytest.raises(ConversionError, match=match):
        convert(str(src), out, progress=False)
    assert not out.exists() and not list(tmp_path.glob(".never*"))


def test_a_k_quant_too_large_for_float16_fails_mid_write_and_leaves_nothing(tmp_path, on_metal):
    """The last layer's Q4_K scale ``d * sc`` overflows float16: the error comes after other
    tensors were written, and the half-written folder is removed."""
    from weights_convert.gguf import read_gguf

    path = tmp_path / "big.gguf"
    write_llama_gguf(path, "Q4_K", dims=WIDE)
    tensor = read_gguf(path).tensors["blk.1.ffn_up.weight"]
    data = bytearray(path.read_bytes())
    data[tensor.offset : tensor.offset + 2] = np.float16(60000.0).tobytes()  # block 0's d
    data[tensor.offset + 4] |= 0x3F  # its first sub-block's scale: 63
    path.write_bytes(bytes(data))
    _refused(path, tmp_path, r"blk\.1\.ffn_up\.weight has values too large.*--dtype float32")
    summary = convert(str(path), tmp_path / "f32", dtype="float32", progress=False)
    assert summary.dtype == "float32"  # the same file converts dequantized


@pytest.mark.parametrize(
    "type_id, match",
    [
        (15, r"blk\.0\.ffn_up\.weight is Q8_K \(ggml type 15\), which is not a weight type"),
        (26, r"blk\.0\.ffn_up\.weight is I32 \(ggml type 26\)"),
        (99, r"blk\.0\.ffn_up\.weight has ggml type 99, which the installed gguf package"),
    ],
)
def test_types_that_are_not_weights_are_refused_naming_type_and_tensor(tmp_path, type_id, match):
    path = tmp_path / "odd.gguf"
    write_llama_gguf(path, "Q8_0", type_ids={"blk.0.ffn_up.weight": type_id})
    _refused(path, tmp_path, match)


def test_without_the_gguf_package_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    import sys

    path = tmp_path / "q.gguf"
    write_llama_gguf(path, "Q8_0")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    _refused(path, tmp_path, "needs the gguf package.*pip install gguf")
