"""Qwen2, Qwen3, Gemma 2 and Gemma 3 (text) through the one forward: logits equal mlx-lm's own
model classes on the same weights (prefill and single-token steps, sliding windows crossed),
greedy ReDrafter equals plain decoding, and the families load from mlx-lm and Hugging Face
folders. GGUF round trips per family are in tests/convert/test_gguf.py."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from redrafter_mlx.engine.verifier import slots as model_module
from redrafter_mlx.engine.verifier.lm_model import LmModel, from_config
from redrafter_mlx.engine.verifier.protocol import Verifier
from tests.support.families import (
    CONFIGS,
    GGUF_ARCH,
    GGUF_CONFIGS,
    PROMPT,
    STEPS,
    WINDOW,
    _prefill_hidden,
    filled,
    gemma,
    our_logits,
    write_family_gguf,
)
from tests.support.models import _randomize, run_decode, tiny_drafter


def family_model(name: str, seed: int = 0, scale: float = 2.0, **changes) -> LmModel:
    """The verifier (mlx-lm's class) for ``CONFIGS[name]`` (completed as the loader does,
    ``config.for_mlx_lm``) with random weights (Gemma norms near zero: 1 + w)."""
    model = from_config(filled(dict(CONFIGS[name], **changes)))
    _randomize(model, seed, scale)
    if gemma(model):
        model.load_weights(
            [(k, v - 1.0) for k, v in tree_flatten(model.parameters()) if "norm" in k],
            strict=False,
        )
    mx.eval(model.parameters())
    return model


def mlx_lm_model(name: str, weights: dict):
    """mlx-lm's own class for the config, holding ``weights``."""
    module = importlib.import_module(f"mlx_lm.models.{CONFIGS[name]['model_type']}")
    ref = module.Model(module.ModelArgs.from_dict(filled(CONFIGS[name])))
    if hasattr(ref, "sanitize"):
        weights = ref.sanitize(dict(weights))
    ref.load_weights(list(weights.items()), strict=True)
    mx.eval(ref.parameters())
    return ref


def reference_logits(name: str, ref) -> list[np.ndarray]:
    """mlx-lm's logits at the prompt's positions, then after each of ``STEPS``: (V,) each
    (its own forward and caches)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(ref)
    out = list(np.array(ref(mx.array([PROMPT]), cache=cache)[0]))
    for t in STEPS:
        out.append(np.array(ref(mx.array([[t]]), cache=cache)[0, 0]))
    return out


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_equal_mlx_lm_in_prefill_and_steps(name, fused, monkeypatch):
    monkeypatch.setattr(model_module, "FUSED_KERNELS", fused)
    model = family_model(name)
    ref = mlx_lm_model(name, dict(tree_flatten(model.parameters())))
    want, got = reference_logits(name, ref), our_logits(model)
    assert len(got) == len(want) == len(PROMPT) + len(STEPS)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=f"{name} position {i}")


def test_sliding_window_changes_the_logits():
    """The window is really applied: without it the later positions differ."""
    windowed = our_logits(family_model("gemma3_text"))
    wide = our_logits(family_model("gemma3_text", sliding_window=10_000))
    assert np.allclose(windowed[WINDOW - 1], wide[WINDOW - 1], atol=1e-5)
    assert not np.allclose(windowed[-1], wide[-1], atol=1e-3)


def near_bigram(name: str, seed: int, attn: float = 0.01) -> Verifier:
    """A family model whose attention output is scaled by ``attn``: the next token is nearly
    a function of the current one, so :class:`FamilyOracle` gets long runs accepted, while
    attention (and the sliding window) still changes some tokens."""
    model = family_model(name, seed)
    for layer in model.layers:
        if "pre_feedforward_layernorm" in layer:  # Gemma: the attention output is normed
            norm = layer.post_attention_layernorm
            norm.weight = (1.0 + norm.weight) * attn - 1.0
        else:
            layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * attn
    mx.eval(model.parameters())
    return model


class FamilyOracle:
    """A drafter double predicting the model's attention-free next token (any family), its
    hidden state perturbed by ``noise`` so that some drafts are wrong."""

    def __init__(self, model: Verifier, noise: float = 0.3, seed: int = 3):
        self.model = model
        self.args = tiny_drafter(model).args
        H = model.hidden_size
        self.noise = noise * mx.random.normal((H, H), key=mx.random.key(seed))

    def next_state(self, state, token_emb):
        return token_emb

    def __call__(self, hidden, state):
        scaled = gemma(self.model)  # Gemma scales its embeddings by sqrt(H)
        x = state * self.model.hidden_size**0.5 if scaled else state
        for layer in self.model.layers:
            if "pre_feedforward_layernorm" in layer:
                x = x + layer.post_feedforward_layernorm(
                    layer.mlp(layer.pre_feedforward_layernorm(x))
                )
            else:
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = self.model.model.norm(x)
        return self.model.logits(h + h @ self.noise)  # perturbed inside any logit soft cap


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_redrafter_equals_plain_decoding(name):
    prompts = [PROMPT, PROMPT[:3] + [9, 9]]  # two rows of different lengths
    accepted = 0
    for model in (family_model(name, seed=3), near_bigram(name, seed=3)):
        plain, _ = run_decode(model, None, prompts, max_tokens=24)
        for drafter in (tiny_drafter(model, seed=4), FamilyOracle(model, noise=0.05)):
            for width, length in ((1, 4), (3, 3)):
                fast, stats = run_decode(
                    model, drafter, prompts, max_tokens=24, beam_width=width, beam_length=length
                )
                assert fast == plain, (name, width, length)
                accepted += stats["accepted_tokens"]
    assert accepted > 40  # runs of drafted tokens were verified, accepted and committed


def _write_folder(folder: Path, config: dict, weights: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma2", "gemma3_text"])
def test_loads_from_an_mlx_lm_folder_and_converts_from_a_hf_folder(name, tmp_path):
    from mlx_lm.utils import load_model as mlx_lm_load

    from redrafter_mlx.engine.loop.loading import load_model
    from weights_convert import convert

    model = family_model(name)
    weights = dict(tree_flatten(model.parameters()))
    hf = _write_folder(tmp_path / "hf", CONFIGS[name], weights)
    convert(str(hf), tmp_path / "out", dtype="float32", progress=False)
    tokens = mx.array([PROMPT])
    ref, _ = mlx_lm_load(tmp_path / "out")
    want = np.array(ref(tokens)[0]) if name != "gemma2" else None
    for folder in (hf, tmp_path / "out"):
        ours, _ = load_model(folder, mx.float32)
        got = np.array(ours.logits(_prefill_hidden(ours)))
        np.testing.assert_allclose(got, np.stack(our_logits(model)[: len(PROMPT)]), atol=1e-5)
        if want is not None:
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


# --- the config validator ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_family_config_passes_the_validator(name):
    from redrafter_mlx.engine.verifier.config import check_model_config

    check_model_config(CONFIGS[name], "config.json")


def test_architectures_must_agree_with_model_type():
    from redrafter_mlx.engine.verifier.config import ConfigError, check_model_config

    config = dict(CONFIGS["qwen2"], model_type="llama")
    with pytest.raises(ConfigError, match=r"model_type 'llama' but architectures \['Qwen2"):
        check_model_config(config, "config.json")
    with pytest.raises(ConfigError, match="Qwen3ForCausalLM"):
        check_model_config(dict(CONFIGS["qwen2"], architectures=["Qwen3ForCausalLM"]), "c")
    check_model_config({k: v for k, v in config.items() if k != "architectures"}, "c")


def test_unsupported_types_are_listed_and_qwen2_windows_refused():
    from redrafter_mlx.engine.verifier.config import ConfigError, check_model_config

    with pytest.raises(ConfigError, match="llama, mistral, qwen2, qwen3, gemma2, gemma3_text"):
        check_model_config(dict(CONFIGS["qwen2"], model_type="phi3"), "c")
    with pytest.raises(ConfigError, match="Gemma3ForCausalLM"):
        check_model_config(dict(CONFIGS["gemma3_text"], model_type="gemma3"), "c")
    with pytest.raises(ConfigError, match="use_sliding_window"):
        check_model_config(dict(CONFIGS["qwen2"], use_sliding_window=True), "c")


def test_convert_refuses_mismatched_architectures(tmp_path):
    from weights_convert import ConversionError, convert

    model = family_model("qwen2")
    config = dict(CONFIGS["qwen2"], model_type="llama")
    src = _write_folder(tmp_path / "hf", config, dict(tree_flatten(model.parameters())))
    with pytest.raises(ConversionError, match="Qwen2ForCausalLM"):
        convert(str(src), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# --- GGUF round trips, written as llama.cpp's convert_hf_to_gguf.py writes each family ----------


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("name", list(GGUF_ARCH))
def test_gguf_round_trip_gives_the_same_logits(name, qtype, tmp_path):
    pytest.importorskip("gguf")
    from redrafter_mlx.engine.loop.loading import load_model
    from weights_convert import convert

    model = write_family_gguf(tmp_path / "m.gguf", name, qtype)
    convert(str(tmp_path / "m.gguf"), tmp_path / "out", dtype="float32", progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == CONFIGS[name]["model_type"]
    loaded, _ = load_model(tmp_path / "out", mx.float32)
    want = model.logits(_prefill_hidden(model))
    got = loaded.logits(_prefill_hidden(loaded))
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)
    for key in ("sliding_window", "sliding_window_pattern"):
        assert config.get(key) == filled(GGUF_CONFIGS[name]).get(key), key


def test_rope_parameters_blocks_are_read():
    from redrafter_mlx.engine.verifier.config import rope_parameters

    config = dict(CONFIGS["gemma3_text"])
    for key in ("rope_theta", "rope_scaling", "rope_local_base_freq"):
        config.pop(key)
    config["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    args = rope_parameters(config)
    assert args["rope_theta"] == 1e6 and args["rope_local_base_freq"] == 10000.0
    assert args["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    qwen = dict(CONFIGS["qwen3"], rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    qwen.pop("rope_theta")
    assert filled(qwen)["rope_theta"] == 5e5
    assert "rope_scaling" not in rope_parameters(qwen)
    # and the model built from the block rotates as the one given the keys themselves
    a, b = family_model("gemma3_text"), from_config(filled(config))
    b.load_weights(list(tree_flatten(a.parameters())))
    np.testing.assert_allclose(np.stack(our_logits(b)), np.stack(our_logits(a)), atol=1e-5)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma3_text"])
def test_quantized_folders_load_and_match_mlx_lm(name, tmp_path):
    from mlx_lm.utils import load_model as mlx_lm_load

    from redrafter_mlx.engine.loop.loading import load_model
    from weights_convert import convert

    model = family_model(name)
    hf = _write_folder(tmp_path / "hf", CONFIGS[name], dict(tree_flatten(model.parameters())))
    convert(str(hf), tmp_path / "q", quantize=True, q_bits=4, q_group_size=32, progress=False)
    ours, _ = load_model(tmp_path / "q", mx.float32)
    ref, _ = mlx_lm_load(tmp_path / "q")
    ref.set_dtype(mx.float32)
    got = np.array(ours.logits(_prefill_hidden(ours)))
    want = np.array(ref(mx.array([PROMPT]))[0].astype(mx.float32))
    np.testing.assert_allclose(got, want, atol=1e-3, rtol=1e-3)


def test_a_rope_type_of_mlx_lm_alone_runs_as_mlx_lm_builds_it(tmp_path):
    """A rope scaling our forward lacks (yarn) loads through mlx-lm, with its frequencies."""
    from mlx_lm.utils import load_model as mlx_lm_load

    from redrafter_mlx.engine.loop.loading import load_model
    from redrafter_mlx.engine.verifier.lm_model import LmModel

    model = family_model("qwen2")
    config = dict(CONFIGS["qwen2"], rope_scaling={"rope_type": "yarn", "factor": 4.0})
    _write_folder(tmp_path / "m", config, dict(tree_flatten(model.parameters())))
    ours, _ = load_model(tmp_path / "m", mx.float32)
    assert isinstance(ours, LmModel)
    ref, _ = mlx_lm_load(tmp_path / "m")
    ref.set_dtype(mx.float32)
    got = np.array(ours.logits(_prefill_hidden(ours)))
    want = np.array(ref(mx.array([PROMPT]))[0].astype(mx.float32))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
