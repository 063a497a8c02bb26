"""The draft slot's folders are told apart by one registry of kinds (``kinds.slot_kind``):
the built-in early-exit adapter, a registered third-party source, else a draft model; a
folder naming a kind no installed package registers is refused in one line naming it,
not loaded as a model (tests/test_source_entry_points.py registers one and runs it)."""

import json

import pytest

from redrafter_mlx.engine.drafting import kinds
from redrafter_mlx.engine.loop.loading import LoadError, draft_slot_paths


def folder_of(tmp_path, name, config):
    where = tmp_path / name
    where.mkdir()
    (where / "config.json").write_text(json.dumps(config))
    return where


def test_the_kinds_of_the_draft_slots_folders(tmp_path):
    assert kinds.slot_kind(folder_of(tmp_path, "ee", {"kind": "early-exit"})) == "early-exit"
    assert kinds.slot_kind(folder_of(tmp_path, "model", {"model_type": "llama"})) is None
    with pytest.raises(ValueError, match="no installed package registers"):
        kinds.slot_kind(folder_of(tmp_path, "odd", {"kind": "nobody-registers-this"}))


def test_an_unregistered_kind_given_as_draft_model_is_one_line_naming_it(tmp_path):
    odd = folder_of(tmp_path, "odd", {"kind": "nobody-registers-this"})
    with pytest.raises(LoadError) as e:
        draft_slot_paths(str(odd))
    message = str(e.value)
    assert "'nobody-registers-this'" in message and "install the package" in message
    assert "\n" not in message
