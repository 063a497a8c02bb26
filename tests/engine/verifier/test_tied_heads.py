"""No checkpoint tensor is dropped silently: whether the output layer is ``lm_head.weight`` or
the input embedding is one rule (``engine.verifier.config.ties_head``) for loading and converting.

Every folder here is written by mlx-lm's own model classes (``mlx_lm.models.<family>``) with
mlx-lm's own save functions, and the model that wrote it is the reference: our loader (and a
conversion of the folder) must give its logits and greedy tokens.

* config silent, ``lm_head.weight`` in the file: the head is used (mlx-lm's Gemma 3 unties by
  the tensor's presence; we used to tie Gemma's and drop it);
* config silent, no head: tied (mlx-lm's Llama / Qwen2 default; we used to refuse the load);
* config says tied, the file holds a different head: refused, naming both;
* the head is a copy of the embedding and the config says tied or nothing: nothing is lost,
  it loads tied (a PyTorch ``.bin`` of a tied model stores both).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from redrafter_mlx.engine.loop.loading import LoadError, load_model
from tests.support.families import BASE, CONFIGS, PROMPT, _prefill_hidden
from tests.support.models import _randomize, run_decode

TIE = "tie_word_embeddings"
FAMILIES = {
    "llama": dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"]),
    "mistral": dict(BASE, model_type="mistral", architectures=["MistralForCausalLM"]),
    "qwen2": CONFIGS["qwen2"],
    "qwen3": CONFIGS["qwen3"],
    # mlx-lm's Gemma 2 forward has no sliding window: one wider than any sequence here
    "gemma2": dict(CONFIGS["gemma2"], sliding_window=512),
    "gemma3_text": CONFIGS["gemma3_text"],
}
MLX_LM_MODULE = {"mistral": "llama"}  # mlx-lm's MODEL_REMAPPING
# mlx-lm's classes that can hold an output layer of their own (Gemma 2's never does)
UNTIEABLE = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"]
GREEDY = 8


def silent(name: str) -> dict:
    """The family's config.json without ``tie_word_embeddings``."""
    return {k: v for k, v in FAMILIES[name].items() if k != TIE}


def mlx_lm_writer(name: str, head: bool, seed: int = 0):
    """mlx-lm's own model of the family, random, with its own output layer or tied."""
    family = FAMILIES[name]["model_type"]
    module = importlib.import_module(f"mlx_lm.models.{MLX_LM_MODULE.get(family, family)}")
    model = module.Model(module.ModelArgs.from_dict({**silent(name), TIE: not head}))
    if name == "gemma3_text" and not head:
        model.sanitize({})  # mlx-lm's own way to a tied Gemma 3: no lm_head.weight given
    _randomize(model, seed, 2.0)
    assert ("lm_head" in model) == head
    return model


def save_like_mlx_lm(model, config: dict, folder: Path, extra: dict | None = None) -> Path:
    """``mlx_lm.utils.save_model`` and ``save_config``; ``extra`` tensors added to the file."""
    from mlx_lm.utils import save_config, save_model

    save_model(folder, model)
    if extra:
        file = str(folder / "model.safetensors")
        mx.save_safetensors(file, {**mx.load(file), **extra}, metadata={"format": "mlx"})
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        index["weight_map"].update({k: "model.safetensors" for k in extra})
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    save_config(dict(config), folder / "config.json")
    return folder


def reference(model) -> tuple[np.ndarray, list[int]]:
    """mlx-lm's logits over PROMPT (T, V) and its greedy continuation (GREEDY tokens)."""
    from mlx_lm.models.cache import make_prompt_cache

    logits = np.array(model(mx.array([PROMPT]))[0])
    cache = make_prompt_cache(model)
    out = model(mx.array([PROMPT]), cache=cache)[0, -1]
    tokens = []
    for _ in range(GREEDY):
        tokens.append(int(mx.argmax(out)))
        out = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
    return logits, tokens


def assert_same_model(folder: Path, writer) -> None:
    """Our load of ``folder`` gives the writer's logits and greedy tokens."""
    want_logits, want_tokens = reference(writer)
    ours, _ = load_model(folder, mx.float32)
    got = np.array(ours.logits(_prefill_hidden(ours)))
    np.testing.assert_allclose(got, want_logits, atol=1e-4, rtol=1e-4)
    tokens, _ = run_decode(ours, None, [PROMPT], max_tokens=GREEDY)
    assert tokens[0] == want_tokens


@pytest.mark.parametrize("name", UNTIEABLE)
def test_a_silent_config_with_a_head_in_the_file_uses_the_head(name, tmp_path):
    """mlx-lm's Gemma 3 classes always write lm_head.weight and no tie_word_embeddings: the
    head is the model's (we tied Gemma 3 by default and dropped it)."""
    writer = mlx_lm_writer(name, head=True)
    folder = save_like_mlx_lm(writer, silent(name), tmp_path / "m")
    assert_same_model(folder, writer)
    ours, _ = load_model(folder, mx.float32)
    assert not ours.args.tie_word_embeddings and "lm_head" in ours


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_silent_config_without_a_head_is_tied(name, tmp_path):
    """mlx-lm's Llama / Qwen2 tie by default (we refused: 'missing lm_head.weight')."""
    writer = mlx_lm_writer(name, head=False)
    folder = save_like_mlx_lm(writer, silent(name), tmp_path / "m")
    assert_same_model(folder, writer)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_tied_config_with_a_different_head_is_refused(name, tmp_path):
    """The config says tied and the file holds another head: one line naming both, never a
    silent drop (we dropped it)."""
    writer = mlx_lm_writer(name, head=name in UNTIEABLE)
    extra = None
    if name not in UNTIEABLE:  # Gemma 2's class has no head to write: add one to its file
        embed = writer.model.embed_tokens.weight
        extra = {"lm_head.weight": 2 * embed}
    folder = save_like_mlx_lm(writer, {**silent(name), TIE: True}, tmp_path / "m", extra)
    with pytest.raises(LoadError) as caught:
        load_model(folder, mx.float32)
    message = str(caught.value)
    assert "tie_word_embeddings" in message and "lm_head.weight" in message, message
    assert str(folder) in message and "\n" not in message


@pytest.mark.parametrize("name", ["llama", "gemma2", "gemma3_text"])
def test_a_tied_config_with_a_copy_of_the_embedding_loads_tied(name, tmp_path):
    writer = mlx_lm_writer(name, head=False)
    extra = {"lm_head.weight": writer.model.embed_tokens.weight}
    folder = save_like_mlx_lm(writer, {**silent(name), TIE: True}, tmp_path / "m", extra)
    assert_same_model(folder, writer)


@pytest.mark.parametrize("name", ["qwen2", "gemma3_text"])
def test_a_silent_config_with_a_copy_of_the_embedding_loads_tied(name, tmp_path):
    writer = mlx_lm_writer(name, head=False)
    extra = {"lm_head.weight": writer.model.embed_tokens.weight}
    folder = save_like_mlx_lm(writer, silent(name), tmp_path / "m", extra)
    assert_same_model(folder, writer)
    ours, _ = load_model(folder, mx.float32)
    assert ours.args.tie_word_embeddings and "lm_head" not in ours


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text"])
def test_an_untied_config_uses_the_head(name, tmp_path):
    writer = mlx_lm_writer(name, head=True)
    folder = save_like_mlx_lm(writer, {**silent(name), TIE: False}, tmp_path / "m")
    assert_same_model(folder, writer)


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_an_untied_config_without_a_head_is_tied_as_convert_writes_it(name, tmp_path):
    """Nothing else could be the head: the loader reads it as the converter always has."""
    writer = mlx_lm_writer(name, head=False)
    folder = save_like_mlx_lm(writer, {**silent(name), TIE: False}, tmp_path / "m")
    assert_same_model(folder, writer)
    _convert(folder, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())[TIE] is True


def test_gemma3_loads_as_mlx_lm_loads_it(tmp_path):
    """The Gemma 3 folder of the issue: mlx_lm.load and our loader agree token for token."""
    from mlx_lm.utils import load_model as mlx_lm_load

    writer = mlx_lm_writer("gemma3_text", head=True, seed=5)
    folder = save_like_mlx_lm(writer, silent("gemma3_text"), tmp_path / "m")
    ref, _ = mlx_lm_load(folder)
    assert_same_model(folder, ref)


def test_a_tie_setting_that_is_not_a_boolean_is_refused(tmp_path):
    writer = mlx_lm_writer("qwen3", head=True)
    folder = save_like_mlx_lm(writer, {**silent("qwen3"), TIE: "false"}, tmp_path / "m")
    with pytest.raises(LoadError, match=r"tie_word_embeddings.*'false'.*true or false"):
        load_model(folder, mx.float32)


# --- the converter applies the same rule ---------------------------------------------------------


def _convert(folder: Path, out: Path):
    from weights_convert import convert

    return convert(str(folder), out, dtype="float32", progress=False)


@pytest.mark.parametrize("name", ["qwen2", "gemma3_text"])
def test_converting_a_silent_config_with_a_head_keeps_the_head(name, tmp_path):
    writer = mlx_lm_writer(name, head=True)
    folder = save_like_mlx_lm(writer, silent(name), tmp_path / "m")
    summary = _convert(folder, tmp_path / "out")
    assert "lm_head.weight" not in summary.dropped
    assert json.loads((tmp_path / "out" / "config.json").read_text())[TIE] is False
    assert_same_model(tmp_path / "out", writer)


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_converting_a_tied_config_with_a_different_head_is_refused(name, tmp_path):
    from weights_convert import ConversionError

    writer = mlx_lm_writer(name, head=True)
    folder = save_like_mlx_lm(writer, {**silent(name), TIE: True}, tmp_path / "m")
    with pytest.raises(ConversionError) as caught:
        _convert(folder, tmp_path / "out")
    message = str(caught.value)
    assert "tie_word_embeddings" in message and "lm_head.weight" in message, message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tie", [True, None])
def test_converting_drops_a_copy_of_the_embedding_and_says_so(tie, tmp_path):
    writer = mlx_lm_writer("gemma3_text", head=False)
    extra = {"lm_head.weight": writer.model.embed_tokens.weight}
    config = silent("gemma3_text") if tie is None else {**silent("gemma3_text"), TIE: tie}
    folder = save_like_mlx_lm(writer, config, tmp_path / "m", extra)
    summary = _convert(folder, tmp_path / "out")
    assert summary.dropped == ["lm_head.weight"]
    assert json.loads((tmp_path / "out" / "config.json").read_text())[TIE] is True
    assert_same_model(tmp_path / "out", writer)


def test_every_family_of_the_validator_is_covered():
    from redrafter_mlx.engine.verifier.config import SUPPORTED_MODEL_TYPES

    assert {c["model_type"] for c in FAMILIES.values()} == set(SUPPORTED_MODEL_TYPES)


def test_a_quantized_gemma3_folder_keeps_its_quantized_head(tmp_path):
    """mlx-community's Gemma 3 folders are quantized: the head's scales and biases load too."""
    import mlx.nn as nn
    from mlx_lm.utils import load_model as mlx_lm_load

    writer = mlx_lm_writer("gemma3_text", head=True, seed=2)
    nn.quantize(writer, group_size=32, bits=8)
    quantization = {"group_size": 32, "bits": 8, "mode": "affine"}
    config = {**silent("gemma3_text"), "quantization": quantization}
    folder = save_like_mlx_lm(writer, config, tmp_path / "m")
    assert "lm_head.scales" in mx.load(str(folder / "model.safetensors"))
    ref, _ = mlx_lm_load(folder)
    want_logits, want_tokens = reference(ref)
    ours, _ = load_model(folder, mx.float32)
    got = np.array(ours.logits(_prefill_hidden(ours)))
    np.testing.assert_allclose(got, want_logits, atol=1e-3, rtol=1e-3)
    assert run_decode(ours, None, [PROMPT], max_tokens=GREEDY)[0][0] == want_tokens
