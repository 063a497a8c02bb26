"""Reading and checking a model's ``config.json``: one validator for loading and converting.

The supported model types are listed here once. A config that is not a JSON object, names
another architecture, or lacks a size the Llama forward needs gets a :class:`ConfigError`
naming the file, the problem and the fix, never an internal error.
"""

from __future__ import annotations

import json
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral")
REQUIRED_INT_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


class ConfigError(ValueError):
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


def check_model_config(config: dict, file: Path | str) -> None:
    """Refuse a config that is not a Llama-family model with integer sizes."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{file} has model_type {model_type!r}, which is not supported; only Llama-family "
            f"models ({', '.join(SUPPORTED_MODEL_TYPES)}) are supported"
        )
    missing = [
        k
        for k in REQUIRED_INT_KEYS
        if not isinstance(config.get(k), int) or isinstance(config.get(k), bool) or config[k] <= 0
    ]
    if missing:
        raise ConfigError(
            f"{file} lacks positive integer {', '.join(missing)}; re-download the config"
        )
