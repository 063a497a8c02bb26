"""The parts of mlx-lm the engine relies on beyond its documented API, checked one by one.

pyproject.toml pins mlx-lm to the range these were tested with. A newer mlx-lm may rename a
class, drop a keyword or change a protocol; each test here names the internal it checks and
where the engine uses it, so an upgrade fails on a line that says what to adapt, not deep
inside a forward.
"""

from __future__ import annotations

import inspect
import json
import re

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from redrafter_mlx.engine.verifier.lm_model import ATTENTION_CACHES
from redrafter_mlx.engine.verifier.lm_parts import LAYER_LISTS
from redrafter_mlx.engine.verifier.lm_rope import is_rope, rope_layout
from tests.support.paths import ROOT

VICUNA_TOKENIZER = ROOT / "tests" / "fixtures" / "vicuna-tokenizer"

LLAMA = dict(
    model_type="llama",
    hidden_size=32,
    num_hidden_layers=2,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def relied(internal: str, where: str, what: str) -> str:
    """The failure message: which internal of which mlx-lm, where the engine uses it, what
    changed."""
    return f"mlx-lm {mlx_lm.__version__}: {internal} (used by {where}): {what}"


def parameters(function) -> set[str]:
    return set(inspect.signature(function).parameters)


def tiny_llama():
    """A tiny Llama built by mlx-lm's own classes (``_get_classes``)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(LLAMA)
    model = model_class(args_class.from_dict(LLAMA))
    mx.eval(model.parameters())
    return model


# --------------------------------------------------------------------------- the version


def pinned_range() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(lowest, first excluded) version of pyproject.toml's ``mlx-lm>=A,<B``."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r'"mlx-lm>=([\d.]+),<([\d.]+)"', text)
    assert match, "pyproject.toml pins mlx-lm as mlx-lm>=LOW,<HIGH"
    return tuple(map(int, match[1].split("."))), tuple(map(int, match[2].split(".")))


def test_the_installed_mlx_lm_is_in_the_pinned_range():
    low, high = pinned_range()
    version = tuple(int(p) for p in re.findall(r"\d+", mlx_lm.__version__)[:3])
    assert low <= version < high, relied(
        "mlx_lm.__version__",
        "pyproject.toml",
        f"outside the tested range {low} to {high}; run this file and test_any_model.py "
        "before widening the pin",
    )


# --------------------------------------------------------------------------- loading


def test_get_classes_maps_a_model_type_and_refuses_an_unknown_one():
    from mlx_lm.utils import _get_classes

    where = "engine/loop/loading.py's load_lm_model"
    model_class, args_class = _get_classes(dict(LLAMA))
    assert issubclass(model_class, nn.Module), relied(
        "mlx_lm.utils._get_classes", where, "no longer returns (Model, ModelArgs)"
    )
    assert hasattr(args_class, "from_dict"), relied(
        "mlx_lm.utils._get_classes", where, "its ModelArgs has no from_dict"
    )
    with pytest.raises(ValueError):  # the engine turns it into "not a family mlx-lm knows"
        _get_classes({"model_type": "no_such_family"})


def test_load_model_takes_lazy_and_strict_and_returns_the_model_and_config(tmp_path):
    from mlx_lm.utils import load_model

    where = "engine/loop/loading.py's load_lm_model"
    assert {"lazy", "strict"} <= parameters(load_model), relied(
        "mlx_lm.utils.load_model(path, lazy=, strict=)", where, "lazy or strict is gone"
    )
    (tmp_path / "config.json").write_text(json.dumps(LLAMA), encoding="utf-8")
    mx.save_safetensors(
        str(tmp_path / "model.safetensors"), dict(tree_flatten(tiny_llama().parameters()))
    )
    loaded = load_model(tmp_path, lazy=True, strict=True)
    assert isinstance(loaded, tuple) and len(loaded) == 2, relied(
        "mlx_lm.utils.load_model", where, "no longer returns (model, config)"
    )
    model, config = loaded
    assert isinstance(model, nn.Module) and config["model_type"] == "llama"


def test_load_tokenizer_takes_eos_ids_and_wraps_what_the_tokenizer_uses():
    from mlx_lm.utils import load_tokenizer

    where = "engine/base/tokenizer.py"
    assert "eos_token_ids" in parameters(load_tokenizer), relied(
        "mlx_lm.utils.load_tokenizer(path, eos_token_ids=)", where, "eos_token_ids is gone"
    )
    wrapper = load_tokenizer(VICUNA_TOKENIZER, eos_token_ids=[2])
    used = ("bos_token_id", "eos_token_ids", "get_vocab", "encode", "decode")
    used += ("apply_chat_template", "all_special_tokens")
    missing = [name for name in used if not hasattr(wrapper, name)]
    assert not missing, relied("mlx_lm's TokenizerWrapper", where, f"has no {missing}")
    assert 2 in set(wrapper.eos_token_ids)


def test_load_returns_the_model_and_its_tokenizer():
    where = "bench --mlx-lm (cli/bench_report.py's load_mlx_lm)"
    assert "path_or_hf_repo" in parameters(mlx_lm.load), relied(
        "mlx_lm.load(path)", where, "its first parameter changed"
    )


# --------------------------------------------------------------------------- the model object


def test_the_layers_live_in_a_list_under_the_outer_model():
    model = tiny_llama()
    where = "engine/verifier/lm_parts.py's layers_owner, the hidden-state and layer taps"
    inner = getattr(model, "model", None)
    assert isinstance(inner, nn.Module), relied("model.model", where, "no inner model")
    layers = getattr(inner, "layers", None)
    assert isinstance(layers, list) and all(isinstance(m, nn.Module) for m in layers), relied(
        "model.model.layers", where, "not a list of modules"
    )
    assert len(layers) == LLAMA["num_hidden_layers"] and "layers" in LAYER_LISTS
    assert isinstance(inner.embed_tokens, nn.Embedding), relied(
        "model.model.embed_tokens", "lm_model.py's _embedding", "not an nn.Embedding"
    )


def test_the_model_takes_a_cache_list_and_gives_logits():
    model = tiny_llama()
    where = "engine/verifier/lm_model.py (self.lm(tokens, cache=caches))"
    assert "cache" in parameters(model.__call__), relied(
        "Model.__call__(inputs, cache=)", where, "no cache parameter"
    )
    logits = model(mx.zeros((1, 3), dtype=mx.int32), cache=[None] * len(model.model.layers))
    assert logits.shape == (1, 3, LLAMA["vocab_size"]), relied(
        "Model.__call__", where, f"logits of shape {logits.shape}"
    )


# --------------------------------------------------------------------------- caches


@pytest.mark.parametrize("name", ATTENTION_CACHES)
def test_the_attention_cache_classes_keep_their_names(name):
    from mlx_lm.models import cache

    assert isinstance(getattr(cache, name, None), type), relied(
        f"mlx_lm.models.cache.{name}",
        "engine/verifier/lm_model.py's ATTENTION_CACHES (a layer's cache told by its class name)",
        "no such class: an attention cache would be refused",
    )


def test_a_recurrent_cache_is_a_list_of_arrays_with_a_lengths_hook():
    from mlx_lm.models.cache import ArraysCache

    where = "engine/verifier/lm_model.py's _probe and lm_cache.py's StateCache"
    arrays = ArraysCache(2)
    assert isinstance(arrays.cache, list) and len(arrays.cache) == 2, relied(
        "mlx_lm.models.cache.ArraysCache.cache", where, "not a list of one entry per array"
    )
    for name in ("lengths", "left_padding"):
        assert hasattr(arrays, name), relied(
            f"mlx_lm.models.cache.ArraysCache.{name}",
            where,
            "gone: the right-padding hook a commit keeps the accepted state with",
        )
    assert list(inspect.signature(ArraysCache.make_mask).parameters) == ["self", "N"], relied(
        "ArraysCache.make_mask(N)", where, "takes other arguments"
    )


class Recorder:
    """A cache that records how mlx-lm asks it for a mask (as ``SlotCache`` answers)."""

    def __init__(self):
        self.calls = []

    def make_mask(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "mask"


def test_attention_masks_come_from_the_cache_s_make_mask():
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    where = "engine/verifier/lm_cache.py's SlotCache.make_mask (the tree's mask)"
    h = mx.zeros((1, 5, 8))
    cache = Recorder()
    assert create_attention_mask(h, cache, window_size=3) == "mask", relied(
        "mlx_lm.models.base.create_attention_mask", where, "does not ask the cache"
    )
    assert cache.calls == [((5,), {"return_array": False, "window_size": 3})], relied(
        "cache.make_mask(N, return_array=, window_size=)", where, f"called as {cache.calls}"
    )
    ssm = Recorder()
    assert create_ssm_mask(h, ssm) == "mask" and ssm.calls == [((5,), {})], relied(
        "mlx_lm.models.base.create_ssm_mask -> cache.make_mask(N)",
        "lm_cache.py's StateCache",
        f"called as {ssm.calls}",
    )


# --------------------------------------------------------------------------- rope


def rope_classes() -> list[type]:
    from mlx_lm.models import rope_utils

    return [
        value
        for value in vars(rope_utils).values()
        if isinstance(value, type)
        and issubclass(value, nn.Module)
        and value.__module__ == rope_utils.__name__
    ]


@pytest.mark.parametrize("cls", rope_classes(), ids=lambda c: c.__name__)
def test_every_rope_class_is_found_by_its_name(cls):
    assert is_rope(cls.__new__(cls)), relied(
        f"mlx_lm.models.rope_utils.{cls.__name__}",
        "engine/verifier/lm_rope.py's is_rope (a rope module is found by its class name)",
        "its name holds neither 'rope' nor 'rotary': its layers would rotate at mlx-lm's "
        "offsets, not each token's own position",
    )


SCALINGS = {
    "default": None,
    "linear": {"type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 4096,
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
    },
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.5},
    "mrope": {"rope_type": "mrope", "mrope_section": [2, 3, 3]},
}


@pytest.mark.parametrize("kind", SCALINGS)
def test_a_rope_module_rotates_each_row_at_its_own_offset(kind):
    from mlx_lm.models.rope_utils import initialize_rope

    rope = initialize_rope(16, 10000.0, False, SCALINGS[kind], max_position_embeddings=8192)
    name = f"mlx_lm.models.rope_utils.initialize_rope({kind!r}) -> {type(rope).__name__}"
    where = "engine/verifier/lm_rope.py's rope_tap (one offset per row, an array)"
    assert is_rope(rope), relied(name, where, "not found by its class name")
    x = mx.random.normal((4, 1, 1, 16), key=mx.random.key(0))
    offsets = mx.array([0, 1, 7, 1000])
    try:
        rows = rope(x, offsets)
    except Exception as e:  # any failure is the finding
        pytest.fail(relied(name, where, f"refuses an array of offsets ({type(e).__name__}: {e})"))
    alone = mx.concatenate([rope(x[i : i + 1], int(offsets[i])) for i in range(4)])
    assert bool(mx.allclose(rows, alone, atol=1e-4)), relied(
        name, where, "an array of offsets rotates otherwise than one offset per call"
    )
    layout = rope_layout(rope)
    assert layout is None or layout[0] <= 16, relied(
        f"{name}'s dims / traditional", "lm_rope.py's rope_layout", f"read as {layout}"
    )


# --------------------------------------------------------------------------- bench --mlx-lm


def test_bench_s_mlx_lm_row_finds_its_generator_and_samplers():
    from mlx_lm.generate import GenerationResponse, stream_generate
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    where = "bench --mlx-lm (cli/bench_report.py's run_mlx_lm)"
    assert {"temp", "top_p", "min_p", "top_k"} <= parameters(make_sampler), relied(
        "mlx_lm.sample_utils.make_sampler(temp, top_p=, min_p=, top_k=)", where, "changed"
    )
    wanted = {"logit_bias", "repetition_penalty", "repetition_context_size"}
    assert wanted <= parameters(make_logits_processors), relied(
        "mlx_lm.sample_utils.make_logits_processors", where, "changed"
    )
    assert {"model", "tokenizer", "prompt", "max_tokens"} <= parameters(stream_generate), relied(
        "mlx_lm.generate.stream_generate", where, "changed"
    )
    fields = set(getattr(GenerationResponse, "__dataclass_fields__", {}))
    assert {"token", "finish_reason", "from_draft"} <= fields, relied(
        "mlx_lm.generate.GenerationResponse", where, f"has only {sorted(fields)}"
    )


# --------------------------------------------------------------------------- APAR's LoRA


def test_the_lora_trainer_keeps_what_the_apar_adapter_uses():
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.trainer import TrainingArgs, train
    from mlx_lm.tuner.utils import linear_to_lora_layers

    where = "train/apar_lora.py"
    assert len(parameters(linear_to_lora_layers)) >= 3, relied(
        "mlx_lm.tuner.utils.linear_to_lora_layers(model, layers, config)", where, "changed"
    )
    assert hasattr(TrainingCallback, "on_train_loss_report"), relied(
        "mlx_lm.tuner.callbacks.TrainingCallback.on_train_loss_report", where, "gone"
    )
    used = {"batch_size", "iters", "steps_per_report", "steps_per_eval", "steps_per_save"}
    used |= {"max_seq_length", "adapter_file"}
    missing = used - set(TrainingArgs.__dataclass_fields__)
    assert not missing, relied("mlx_lm.tuner.trainer.TrainingArgs", where, f"lacks {missing}")
    assert "training_callback" in parameters(train), relied(
        "mlx_lm.tuner.trainer.train(..., training_callback=)", where, "changed"
    )
