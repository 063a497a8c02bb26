"""A damaged early-exit adapter or draft model folder, misused as a user would: one clear error
naming the problem and the fix, no traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from redrafter_mlx.engine.base.bundled import demo_paths
from redrafter_mlx.engine.drafting.early_exit import EarlyExitAdapter, EarlyExitArgs, save_adapter
from redrafter_mlx.engine.loop.loading import LoadError, load, load_model
from tests.support.cli import error_line, generate_demo
from tests.support.models import VICUNA_TOKENIZER, save_model_dir, tiny_model

DEMO = demo_paths()[0]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    """A (random) early-exit adapter for the demo model, exit layer 1, with a shortlist."""
    model, _ = load_model(DEMO)
    adapter = EarlyExitAdapter(EarlyExitArgs.for_target(model.args, 1))
    adapter.set_shortlist([2, 5, 9, 40])
    folder = tmp_path_factory.mktemp("ee") / "ee"
    save_adapter(folder, adapter)
    return folder


def damaged(adapter_dir: Path, tmp_path: Path, weights=None, **config) -> Path:
    """A copy of the adapter folder with ``config`` keys set (None: removed) and, given
    ``weights`` (bytes), another model.safetensors."""
    folder = tmp_path / "damaged"
    shutil.copytree(adapter_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(config)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(cfg))
    if weights is not None:
        (folder / "model.safetensors").write_bytes(weights)
    return folder


@pytest.mark.parametrize(
    "change, says",
    [
        (dict(draft_vocab=[2, 5, 5]), "lists id 5 more than once"),
        (dict(draft_vocab=[]), "draft_vocab is empty"),
        (dict(draft_vocab="2,5"), "draft_vocab is str"),
        (dict(draft_vocab=[2, 5.5]), "holds 5.5, not a token id"),
        (dict(num_attention_heads=0), "num_attention_heads 0, not a whole number >= 1"),
        (dict(exit_layer="1"), "exit_layer '1', not a whole number"),
    ],
)
def test_a_damaged_adapter_config_is_named(cli_app, adapter_dir, tmp_path, change, says):
    folder = damaged(adapter_dir, tmp_path, **change)
    for flag in ("--drafter", "--draft-model"):
        line = error_line(generate_demo(cli_app, flag, folder), 1)
        assert says in line and str(folder) in line and "train or convert" in line


def test_a_truncated_adapter_weights_file_is_named(cli_app, adapter_dir, tmp_path):
    data = (adapter_dir / "model.safetensors").read_bytes()
    folder = damaged(adapter_dir, tmp_path, weights=data[: len(data) // 2])
    line = error_line(generate_demo(cli_app, "--drafter", folder), 1)
    assert "model.safetensors" in line and "truncated" in line and "unexpected" not in line


def test_an_adapter_for_another_model_is_named_before_its_weights(cli_app, adapter_dir, tmp_path):
    wide = damaged(adapter_dir, tmp_path, hidden_size=64)
    line = error_line(generate_demo(cli_app, "--drafter", wide), 1)
    assert "made for hidden size 64" in line and "adapter trained for this model" in line
    shutil.rmtree(wide)
    deep = damaged(adapter_dir, tmp_path, exit_layer=4)
    line = error_line(generate_demo(cli_app, "--draft-model", deep), 1)
    assert "exits after layer 4, but the model has 4 layers" in line


def test_a_misspelt_adapter_kind_is_named(cli_app, adapter_dir, tmp_path):
    folder = damaged(adapter_dir, tmp_path, kind="early_exit")
    for flag in ("--drafter", "--draft-model"):
        line = error_line(generate_demo(cli_app, flag, folder), 1)
        assert "kind 'early_exit', not 'early-exit'" in line and "is a model" not in line


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    """(model, draft without tokenizer files, draft with a damaged tokenizer.json)."""
    root = tmp_path_factory.mktemp("draft")
    save_model_dir(tiny_model(vocab=32000, hidden=32), root / "model", VICUNA_TOKENIZER)
    save_model_dir(tiny_model(3, vocab=32000, hidden=16, heads=2, kv_heads=1), root / "bare")
    (root / "bare" / "tokenizer_config.json").write_text("{}")  # no vocabulary file
    save_model_dir(tiny_model(3, vocab=32000, hidden=16, heads=2, kv_heads=1), root / "broken")
    (root / "broken" / "tokenizer.json").write_text('{"model": ')
    return root / "model", root / "bare", root / "broken"


def test_a_draft_model_without_a_tokenizer_is_checked_by_vocabulary(draft_dirs):
    model, bare, broken = draft_dirs
    assert load(model, draft_model=bare)[3] is not None
    with pytest.raises(LoadError, match=f"tokenizer in {broken} cannot be read"):
        load(model, draft_model=broken)
