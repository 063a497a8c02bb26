"""Reading and checking a model's ``config.json``: one validator for loading and converting.

The supported model types are listed here once, with the Hugging Face ``architectures`` class
of each. A config that is not a JSON object, names another architecture (in ``model_type``
or ``architectures``, or the two disagree), or lacks a size the forward needs gets a
:class:`ConfigError` naming the file, the problem and the fix, never an internal error.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..base.errors import RedrafterError
from .refusals import NEEDS

# model_type -> the Hugging Face causal-LM classes that name it in ``architectures``.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM",),
    "mistral": ("MistralForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
    "gemma2": ("Gemma2ForCausalLM",),
    "gemma3_text": ("Gemma3ForCausalLM",),
}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)

# What each family's keys mean when config.json leaves them out: the defaults of transformers'
# config classes (``configuration_<family>.py``, transformers 5.24), which Hugging Face loads the
# same checkpoint with. mlx-lm's ModelArgs differ in places (Qwen2's rope_theta 1e6, Gemma 2's
# query_pre_attn_scalar 144, Gemma 3's sliding_window 512; Qwen3 and Gemma 2 require head_dim,
# rope_theta, num_key_value_heads): the checkpoint's authors wrote the config for transformers,
# so an absent key means its default (``for_mlx_lm`` fills them in before mlx-lm builds the
# class). A key that is absent here and in the config takes mlx-lm's own rule.
_ROPE = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6}
_GEMMA = dict(
    _ROPE,
    num_key_value_heads=4,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    tie_word_embeddings=True,
)
FAMILY_DEFAULTS = {
    "llama": dict(_ROPE, tie_word_embeddings=False),
    "mistral": dict(_ROPE, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen2": dict(_ROPE, num_key_value_heads=32, tie_word_embeddings=False),
    "qwen3": dict(
        _ROPE,
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "gemma2": dict(_GEMMA, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(
        _GEMMA, rope_theta=1_000_000.0, rope_local_base_freq=10000.0, sliding_window_pattern=6
    ),
}


def for_mlx_lm(config: dict, names, file: Path | str, is_copy=None) -> dict:
    """The config.json mlx-lm builds the verifier's class from (``loading.load_model``).

    For the families whose checkpoints are written for transformers' classes
    (:data:`FAMILY_DEFAULTS`): ``architectures`` and the sizes checked (ConfigError),
    ``rope_parameters`` read into ``rope_theta`` / ``rope_scaling``, every key left out at
    transformers' default, and the output layer's tie decided from the checkpoint's tensor
    ``names`` (:func:`ties_head`; ``is_copy()`` says whether its head copies the embedding,
    and a tied config with another head is refused). Any other family: unchanged.
    """
    model_type = config.get("model_type")
    if model_type not in FAMILY_DEFAULTS:
        return config
    check_family(config, file)
    tied = ties_head(config, names, file, is_copy)
    if tied and HEAD in names and config.get(TIE_KEY) and not (is_copy is not None and is_copy()):
        raise different_head(file)
    return {**completed(config), TIE_KEY: tied}


def check_family(config: dict, file: Path | str) -> None:
    """The context, where given, is a positive integer; for the families ``for_mlx_lm``
    completes: ``architectures`` agrees with ``model_type`` and the sizes are positive
    integers (ConfigError), before any weight file is read; other families' own keys are
    their mlx-lm class's to check."""
    model_type = config.get("model_type")
    _check_context(config, file)
    if model_type in FAMILY_DEFAULTS:
        _check_architectures(config, model_type, file)
        _check_sizes(config, file)


def _check_context(config: dict, file: Path | str) -> None:
    """``max_position_embeddings``, where given (or in ``text_config``), is a positive
    integer: the context every cache and beam shape is sized by (ConfigError otherwise, so a
    0 is not reported later as no shape fitting the context)."""
    for block in (config, config.get("text_config")):
        value = block.get("max_position_embeddings") if isinstance(block, dict) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(
                f"{file} has max_position_embeddings {value!r}, but the model's context is a "
                "positive number of tokens: set it to the context length the model was "
                "trained for (its model card says), or remove the key"
            )


def rope_parameters(config: dict) -> dict:
    """``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq`` read from the
    ``rope_parameters`` block newer transformers write instead (per layer type for Gemma 3)."""
    params = config.get("rope_parameters")
    if not isinstance(params, dict):
        return {}
    if "full_attention" in params or "sliding_attention" in params:
        out = _rope_settings(params.get("full_attention") or {})
        local = params.get("sliding_attention") or {}
        if "rope_theta" in local:
            out["rope_local_base_freq"] = local["rope_theta"]
        return out
    return _rope_settings(params)


def _rope_settings(params: dict) -> dict:
    """One ``rope_parameters`` entry -> ``rope_theta`` and, unless default, ``rope_scaling``."""
    out = {"rope_theta": params["rope_theta"]} if "rope_theta" in params else {}
    if params.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    return out


def completed(config: dict) -> dict:
    """``config`` as ``for_mlx_lm`` hands it on, tie aside: its ``rope_parameters`` read,
    then every key its family leaves out at transformers' default."""
    return with_family_defaults({**rope_parameters(config), **config})


def with_family_defaults(config: dict) -> dict:
    """``config`` with each key its ``model_type`` defines but it leaves out set to the
    family's reference default (:data:`FAMILY_DEFAULTS`); a key present (even null) is kept."""
    return {**FAMILY_DEFAULTS.get(config.get("model_type"), {}), **config}


REQUIRED_INT_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


class ConfigError(RedrafterError, ValueError):
    """A config.json that cannot describe a supported model; the message says why."""


def read_config(folder: Path, what: str = "model") -> dict:
    """The JSON object in ``folder/config.json``."""
    file = Path(folder) / "config.json"
    if not file.is_file():
        raise ConfigError(f"{folder} has no config.json; is it a {what} directory?")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file} is not valid JSON ({e}); re-download or re-convert it") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"{file} holds a JSON {type(config).__name__}, not an object with the model's "
            f"settings; re-download or re-convert it"
        )
    return config


def convert_command(model_type: str | None, source) -> str:
    """The command that makes a folder the loader reads from the Hugging Face checkpoint of a
    ``model_type`` model at ``source``: ours for the families our converter takes, mlx-lm's
    (every family it implements) for the others, and with ``model_type`` unknown, both."""
    ours = f"redrafter-mlx convert --model {source} --out <dir>"
    theirs = f"mlx_lm convert --hf-path {source} --mlx-path <dir>"
    if model_type in SUPPORTED_MODEL_TYPES:
        return ours
    if model_type is not None and not _mlx_lm_implements(model_type):
        return (
            "no converter here takes it: upgrade mlx-lm (pip install -U mlx-lm) for newer families"
        )
    if model_type is None:
        return f"{ours} ({', '.join(SUPPORTED_MODEL_TYPES)}), else {theirs}"
    return theirs


def _mlx_lm_implements(model_type: str) -> bool:
    from mlx_lm.utils import _get_classes

    if model_type in NEEDS:  # its module would end the process without its package
        return True
    try:
        _get_classes({"model_type": model_type})
    except ValueError:
        return False
    return True


def check_model_config(config: dict, file: Path | str) -> None:
    """Refuse a config that is not a supported model type with integer sizes."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = (
            "; for Gemma 3 (multimodal checkpoints), convert a text-only Gemma3ForCausalLM "
            "checkpoint (model_type gemma3_text)"
            if model_type == "gemma3"
            else ""
        )
        if model_type != "gemma3":
            hint = f"; {convert_command(model_type, Path(file).parent)}"
        raise ConfigError(
            f"{file} has model_type {model_type!r}, which our converter does not take (it "
            f"takes {', '.join(SUPPORTED_MODEL_TYPES)}){hint}"
        )
    _check_architectures(config, model_type, file)
    if config.get("use_sliding_window"):
        raise ConfigError(
            f"{file} sets use_sliding_window for a {model_type} model, which is not supported "
            "(only Gemma's sliding-window layers are); set it to false only if the model was "
            "trained without it"
        )
    _check_sizes(config, file)


def _check_sizes(config: dict, file: Path | str) -> None:
    """The sizes every family needs are positive integers (ConfigError naming those not)."""
    missing = [
        k
        for k in REQUIRED_INT_KEYS
        if not isinstance(config.get(k), int) or isinstance(config.get(k), bool) or config[k] <= 0
    ]
    if missing:
        raise ConfigError(
            f"{file} lacks positive integer {', '.join(missing)}; re-download the config"
        )


def _check_architectures(config: dict, model_type: str, file: Path | str) -> None:
    """``architectures``, when present, must name ``model_type``'s causal-LM class."""
    names = config.get("architectures")
    if names is None:
        return
    if isinstance(names, str):
        names = [names]
    expected = ARCHITECTURES[model_type]
    if not isinstance(names, list) or not names or any(n not in expected for n in names):
        raise ConfigError(
            f"{file} has model_type {model_type!r} but architectures {names!r}; a "
            f"{model_type} model is {' or '.join(expected)}. The config does not describe one "
            "model: re-download it, or fix model_type or architectures to match the weights"
        )


# --- the output layer: tied to the input embedding, or the checkpoint's own lm_head ---------------

TIE_KEY = "tie_word_embeddings"
HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


def ties_head(config: dict, names, file: Path | str, is_copy=None) -> bool:
    """Whether the output layer is the input embedding rather than ``lm_head.weight``: the one
    rule for loading and converting, from the config and the checkpoint's tensor ``names``.

    * no ``lm_head.weight`` in the checkpoint: tied, whatever the config says (nothing else
      could be the head; mlx-lm's Gemma 3 reads it so, and Llama's and Qwen2's default);
    * ``tie_word_embeddings`` set: as it says. A tied config whose checkpoint holds a head
      keeps it only as a copy of the embedding (the caller checks with :func:`head_pairs`
      and refuses another head with :func:`different_head`): no tensor is dropped unread;
    * not set: the checkpoint's head is used. That is mlx-lm's Gemma 3 rule (its
      ``sanitize`` unties by the tensor's presence) and transformers' default for Llama,
      Mistral and Qwen; mlx-lm's Llama and Qwen2 would drop the head silently, which is
      never done here. Only when ``is_copy()`` (a callable, asked only then) says the head
      is an exact copy of the embedding (a PyTorch ``.bin`` of a tied model stores both) is
      the model tied, the same logits in less memory.
    """
    said = config.get(TIE_KEY)
    if said is not None and not isinstance(said, bool):
        raise ConfigError(
            f"{file} sets {TIE_KEY} to {said!r}, not true or false; write it as a JSON "
            f"boolean (true: the output layer is the embedding, false: {HEAD})"
        )
    if HEAD not in names:
        return True
    if said is None:
        return bool(is_copy is not None and is_copy())
    return said


def head_pairs(names) -> list[tuple[str, str]]:
    """(``lm_head.<x>``, ``model.embed_tokens.<x>``) for each head tensor in ``names``
    (the weight, and the scales and biases of a quantized head)."""
    return [
        (n, "model.embed_tokens." + n[len("lm_head.") :]) for n in names if n.startswith("lm_head.")
    ]


def different_head(file: Path | str) -> ConfigError:
    """The one-line refusal of a tied config whose checkpoint holds another head."""
    return ConfigError(
        f"{file} sets {TIE_KEY} true, but the checkpoint's {HEAD} differs from {EMBEDDING}; "
        f"set {TIE_KEY} to false to use {HEAD}, or remove {HEAD} to tie the output to the "
        "embedding"
    )


def transformers_rejects(folder: Path, error: Exception) -> str | None:
    """One line if ``error`` (the tokenizer's load failing) is transformers' config class for
    ``folder``'s config.json failing to read it (the tokenizer's load reads it for the
    tokenizer's class, as ``mlx_lm.load`` does), else None. exaone4 without ``layer_types``
    and with a text ``sliding_window_pattern`` ("LLGL", which mlx-lm reads) is one such."""
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(str(folder))
    except Exception as e:  # the same failure as the tokenizer's: the config is the cause
        if type(e) is not type(error) or str(e) != str(error):
            return None
    else:
        return None
    config = json.loads((Path(folder) / "config.json").read_text())
    first = (str(error).strip().splitlines() or [""])[0]
    fix = "fix that field, or download the config again"
    if isinstance(config.get("sliding_window_pattern"), str) and "layer_types" not in config:
        fix = (
            "add its layer_types (a 'sliding_attention' or 'full_attention' per layer, as "
            "published configs of the family have) to config.json"
        )
    return (
        f"{folder}/config.json cannot be read by transformers' config class for model_type "
        f"{config.get('model_type')!r} ({type(error).__name__}: {first}), which the tokenizer's "
        f"load reads, as mlx_lm.load does; {fix}"
    )
