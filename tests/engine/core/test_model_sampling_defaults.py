"""A model's recommended sampling (generation_config.json) as the engine reads it, and the
SmolLM2 conversion writing its model card's values."""

import json

from redrafter_mlx.engine.core.sampling import model_defaults
from weights_convert.smollm2 import CARD_SAMPLING, write_card_sampling


def write(folder, config) -> None:
    (folder / "generation_config.json").write_text(json.dumps(config))


def test_values_present_become_defaults(tmp_path):
    write(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50})
    assert model_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 50}


def test_do_sample_false_means_greedy(tmp_path):
    write(tmp_path, {"do_sample": False, "temperature": 0.6, "repetition_penalty": 1.12})
    assert model_defaults(tmp_path) == {"temperature": 0.0, "repetition_penalty": 1.12}


def test_missing_broken_or_out_of_range_values_are_ignored(tmp_path):
    assert model_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert model_defaults(tmp_path) == {}
    write(tmp_path, {"temperature": -1, "top_p": 0, "top_k": "many", "repetition_penalty": 1.2})
    assert model_defaults(tmp_path) == {"repetition_penalty": 1.2}


def test_smollm2_folder_gets_its_card_sampling_once(tmp_path):
    write(tmp_path, {"bos_token_id": 1, "eos_token_id": [2]})
    assert write_card_sampling(tmp_path) is True
    config = json.loads((tmp_path / "generation_config.json").read_text())
    assert config == {"bos_token_id": 1, "eos_token_id": [2], **CARD_SAMPLING}
    assert write_card_sampling(tmp_path) is False  # idempotent
    assert model_defaults(tmp_path) == {
        "temperature": 0.2,
        "top_p": 0.9,
        "repetition_penalty": 1.12,
    }
    assert not list(tmp_path.glob("*.part"))
