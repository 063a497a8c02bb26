"""Bad inputs, round 4: the features added since round 3 misused as a user would (a damaged
early-exit adapter or draft model, distill --kind early-exit's flags and --resume, convert's
APAR and Kangaroo layouts, APAR branch limits, tune --draft-length, the server's request
fields, a prompts file): one clear error naming the problem and the fix, no traceback,
nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from redrafter_mlx.engine.base.bundled import demo_paths
from redrafter_mlx.engine.drafting.early_exit import EarlyExitAdapter, EarlyExitArgs, save_adapter
from redrafter_mlx.engine.loop.loading import LoadError, load, load_model
from tests.support.cli import error_line, invoke
from tests.support.models import SHAREGPT_SAMPLE, VICUNA_TOKENIZER, save_model_dir, tiny_model

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


def generate(app, *args):
    return invoke(app, "generate", "--model", "demo", "-p", "def f(", "-n", 4, *args)


# --------------------------------------------------------------------------- early-exit adapters


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
        line = error_line(generate(cli_app, flag, folder), 1)
        assert says in line and str(folder) in line and "train or convert" in line


def test_a_truncated_adapter_weights_file_is_named(cli_app, adapter_dir, tmp_path):
    data = (adapter_dir / "model.safetensors").read_bytes()
    folder = damaged(adapter_dir, tmp_path, weights=data[: len(data) // 2])
    line = error_line(generate(cli_app, "--drafter", folder), 1)
    assert "model.safetensors" in line and "truncated" in line and "unexpected" not in line


def test_an_adapter_for_another_model_is_named_before_its_weights(cli_app, adapter_dir, tmp_path):
    wide = damaged(adapter_dir, tmp_path, hidden_size=64)
    line = error_line(generate(cli_app, "--drafter", wide), 1)
    assert "made for hidden size 64" in line and "adapter trained for this model" in line
    shutil.rmtree(wide)
    deep = damaged(adapter_dir, tmp_path, exit_layer=4)
    line = error_line(generate(cli_app, "--draft-model", deep), 1)
    assert "exits after layer 4, but the model has 4 layers" in line


def test_a_misspelt_adapter_kind_is_named(cli_app, adapter_dir, tmp_path):
    folder = damaged(adapter_dir, tmp_path, kind="early_exit")
    for flag in ("--drafter", "--draft-model"):
        line = error_line(generate(cli_app, flag, folder), 1)
        assert "kind 'early_exit', not 'early-exit'" in line and "is a model" not in line


# --------------------------------------------------------------------------- draft models


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


# --------------------------------------------------------------------------- distill --kind ee

DISTILL = ["distill", "--model", "demo", "--data", SHAREGPT_SAMPLE, "--seq-len", 64]
DISTILL += ["--kind", "early-exit", "--quiet"]


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--exit-layer", 0], "--exit-layer: exit layer 0 is outside"),
        (["--exit-layer", 4], "pass --exit-layer between 1 and 3"),
        (["--draft-vocab", 5000], "--draft-vocab: 5000 ids exceed the model's vocabulary (4096"),
    ],
)
def test_distill_early_exit_flags_out_of_range_exit_2(cli_app, tmp_path, flags, says):
    out = tmp_path / "out"
    line = error_line(invoke(cli_app, *DISTILL, "--steps", 1, "--out", out, *flags), 2)
    assert says in line and not out.exists()


def test_a_zero_budget_is_refused_up_front(cli_app, tmp_path):
    out = tmp_path / "out"
    args = ["distill", "--model", "demo", "--kind", "early-exit", "--quiet", "--out", out]
    for budget in ("0", "0k"):
        line = error_line(invoke(cli_app, *args, "--budget", budget), 2)
        assert f"got '{budget}'" in line and "positions > 0" in line
    assert not out.exists()


def test_resume_with_changed_settings_is_refused(cli_app, tmp_path):
    out = tmp_path / "out"
    run = [*DISTILL, "--out", out, "--batch-size", 128]
    assert invoke(cli_app, *run, "--steps", 2).exit_code == 0
    before = (out / "model.safetensors").read_bytes()
    changed = invoke(cli_app, *run, "--steps", 3, "--seed", 7, "--draft-vocab", 50, "--resume")
    line = error_line(changed, 1)
    assert "--seed 0 (now 7)" in line and "--draft-vocab not given (now 50)" in line
    assert "--steps 2 (now 3)" in line and "--overwrite" in line
    assert (out / "model.safetensors").read_bytes() == before
    line = error_line(invoke(cli_app, *run[:-1], 64, "--steps", 2, "--resume"), 1)
    assert "--batch-size 128 (now 64)" in line


# --------------------------------------------------------------------------- convert


def test_apar_split_token_ids_that_are_not_ids_or_are_one_id(tmp_path):
    from redrafter_mlx.engine.base.errors import ParamError
    from redrafter_mlx.engine.core.branches import CHILD_TOKEN, FORK_TOKEN
    from tests.support.convert import apar_checkpoint
    from weights_convert import ConversionError, convert

    src = tmp_path / "apar"
    apar_checkpoint(src)
    (src / "added_tokens.json").write_text(json.dumps({FORK_TOKEN: "x", CHILD_TOKEN: 129}))
    with pytest.raises(ParamError, match=r"added_tokens.json gives \[SplitMask\] the id 'x'"):
        convert(str(src), tmp_path / "out", progress=False)
    (src / "added_tokens.json").write_text(json.dumps({FORK_TOKEN: 128, CHILD_TOKEN: 128}))
    with pytest.raises(ConversionError, match="both APAR tokens .* the id 128"):
        convert(str(src), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    (src / "added_tokens.json").unlink()  # Medusa heads, no split tokens: a plain model
    notes = "\n".join(convert(str(src), tmp_path / "out", progress=False).lines())
    assert "no APAR split tokens" in notes and "converted as a plain model" in notes
    assert "branching runs" not in notes


def test_a_kangaroo_adapter_without_its_norm_says_so(tmp_path):
    from tests.support.convert import BASE, adapter_weights, make_adapter
    from weights_convert import ConversionError, convert

    weights = adapter_weights()
    del weights["norm.weight"]
    src = make_adapter(tmp_path / "k", weights)
    with pytest.raises(ConversionError, match="lacks norm.weight"):
        convert(str(BASE), tmp_path / "out", drafter=str(src), exit_layer=1, progress=False)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- branches


def test_branch_limits_on_a_model_that_does_not_branch_are_refused(cli_app):
    line = error_line(generate(cli_app, "--max-branches", 3), 2)
    assert "--max-branches 3" in line and "does not branch" in line
    line = error_line(generate(cli_app, "--branch-depth", 2, "--branches", "off"), 2)
    assert "--branch-depth 2" in line and "--branches off" in line
    line = error_line(generate(cli_app, "--branches", "maybe"), 2)
    assert line.count("--branches") == 1 and "auto, on, off" in line


def test_too_many_branches_for_memory_names_max_branches(monkeypatch):
    from redrafter_mlx.engine.base.errors import ParamError
    from redrafter_mlx.engine.core.sampling import SamplerConfig
    from redrafter_mlx.engine.core.shape import BeamShape
    from redrafter_mlx.engine.loop import memory, run

    def check(model, drafter, shape, batch, *rest, **kw):
        if batch > 1:
            raise memory.ShapeTooLarge("lookup_length", f"needs 9 GiB for {batch} rows")

    monkeypatch.setattr(run, "check_step_memory", check)
    with pytest.raises(ParamError) as e:
        run.check_branch_memory(None, None, BeamShape(1, 4), 1, 100, 64, SamplerConfig(), None)
    assert e.value.param == "max_branches" and "lower --max-branches" in e.value.message
    assert "100 branches per answer make up to 100 rows" in e.value.message


def test_the_server_refuses_request_fields_that_are_server_settings():
    from redrafter_mlx.serve.protocol import ProtocolError, parse_chat

    for field, flag in (("max_branches", "--max-branches"), ("branches", "--branches")):
        body = {"messages": [{"role": "user", "content": "hi"}], field: 0}
        with pytest.raises(ProtocolError, match=f"start the server with {flag}") as e:
            parse_chat(body, 64)
        assert e.value.status == 400


# --------------------------------------------------------------------------- tune, bench


def test_tune_draft_length_without_a_draft_model_is_refused(cli_app):
    result = invoke(cli_app, "tune", "--model", "demo", "--draft-length", 3, "--json")
    line = error_line(result, 2)
    assert "--draft-length 3" in line and "add --draft-model" in line


def test_a_prompts_line_with_an_empty_turn_is_refused(tmp_path):
    from redrafter_mlx.engine.base.prompts import PromptSetError, parse_records

    text = '{"turns": ["hi", "there"]}\n{"turns": ["first", "  "]}\n'
    with pytest.raises(PromptSetError, match=r"p.jsonl:2's turn 2 is empty"):
        parse_records(text, "p.jsonl")
