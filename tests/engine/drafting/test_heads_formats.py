"""The draft heads people download compute what the reference computes: tiny heads written
with their published config keys and tensor names (``tests/fixtures/heads/``, written by
``scripts/make_head_fixtures.py`` from mlx-vlm 0.7.10's drafter classes), run through two
draft rounds, give the reference's drafts exactly and its logits within 1e-5 (float32).
Where mlx-vlm is installed (the optional ``heads-ref`` extra), fresh fixtures are made from
it and checked the same way. Also: both EAGLE-3 layouts load to the same module, a 4-bit
quantized head of each kind loads and runs, each fit check refuses in one line, and the
registry of source kinds recognises each head's folder."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from redrafter_mlx.engine.base.errors import RedrafterError
from redrafter_mlx.engine.drafting import kinds
from redrafter_mlx.engine.drafting.heads import (
    HeadMismatch,
    Target,
    TargetDims,
    block,
    check_fit,
    eagle3,
    load_head,
    mtp,
)
from redrafter_mlx.engine.drafting.heads.loading import read_weights
from redrafter_mlx.engine.verifier import slots
from tests.support.paths import FIXTURES as ALL_FIXTURES
from tests.support.paths import ROOT

FIXTURES = ALL_FIXTURES / "heads"
NAMES = ("eagle3", "eagle3_original", "dflash", "qwen3_5_mtp")
KIND = {"eagle3": "eagle3", "eagle3_original": "eagle3", "dflash": "block", "qwen3_5_mtp": "mtp"}
SLOTS = 32


def target_of(case) -> Target:
    E, W = mx.array(case["target_embed"]), mx.array(case["target_head"])
    return Target(lambda t: E[t], lambda h: (h @ W.T).astype(mx.float32))


def rounds(head, case, batch: int = 1):
    """Our two rounds of the fixture's case, as the reference ran them: round 1 after the
    prompt; round 2 after ``accepted`` drafts and the next bonus were committed (EAGLE-3
    re-runs the accepted drafts with the verified features, as mlx-vlm does; MTP keeps its
    own entries of accepted drafts and adds the bonus's; DFlash adds the committed
    positions' features). Rows: ``batch`` copies. Returns (drafts1, logits1, drafts2,
    logits2)."""
    tile = lambda x: mx.concatenate([mx.array(x)] * batch, axis=0)
    ids, hidden, verify = tile(case["ids"]), tile(case["hidden"]), tile(case["verify"])
    b, b2, a, depth = (int(case[k]) for k in ("bonus", "bonus2", "accepted", "depth"))
    P = ids.shape[1]
    at = lambda n: mx.full((batch,), n, mx.int32)
    token = lambda t: mx.full((batch, 1), t, mx.int32)
    target = target_of(case)
    state = head.make_state(batch, SLOTS)
    if head.kind == "block":
        d1, l1, state = block.propose(head, target, state, hidden, at(0), at(b))
        d2, l2, _ = block.propose(head, target, state, verify[:, : a + 1], at(P), at(b2))
        return d1, l1, d2, l2
    module = eagle3 if head.kind == "eagle3" else mtp
    tokens = mx.concatenate([ids[:, 1:], token(b)], axis=1)
    d1, l1, state = module.propose(head, target, state, tokens, hidden, at(0), depth)
    if head.kind == "eagle3":
        again = mx.concatenate([d1[:, :a], token(b2)], axis=1)
        d2, l2, _ = module.propose(head, target, state, again, verify[:, : a + 1], at(P), depth)
    else:
        d2, l2, _ = module.propose(
            head, target, state, token(b2), verify[:, a : a + 1], at(P + a), depth
        )
    return d1, l1, d2, l2


def check_against(folder: Path) -> None:
    head = load_head(folder)
    case = dict(np.load(folder / "case.npz"))
    d1, l1, d2, l2 = rounds(head, case)
    for name, ours in (("drafts1", d1), ("drafts2", d2)):
        assert np.array_equal(np.array(ours), case[name]), (folder.name, name)
    for name, ours in (("logits1", l1), ("logits2", l2)):
        assert ours.dtype == mx.float32
        np.testing.assert_allclose(np.array(ours), case[name], atol=1e-5, rtol=0, err_msg=name)


@pytest.mark.parametrize("fused", (False, True), ids=("composed", "fused"))
@pytest.mark.parametrize("name", NAMES)
def test_proposals_equal_the_reference_fixtures(name, fused, monkeypatch):
    """Both attention/rope paths (fused kernels on Metal/CUDA, composed on the CPU)."""
    monkeypatch.setattr(slots, "FUSED_KERNELS", fused)
    check_against(FIXTURES / name)


def test_the_fixtures_can_fail():
    """A changed weight changes the proposal past the tolerance (the check is not vacuous)."""
    folder = FIXTURES / "eagle3"
    head = load_head(folder)
    mlp = head.layers[0].mlp
    mlp.down_proj.weight = mlp.down_proj.weight * 1.01
    case = dict(np.load(folder / "case.npz"))
    _, l1, _, _ = rounds(head, case)
    assert np.abs(np.array(l1) - case["logits1"]).max() > 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_rows_of_a_batch_each_propose_their_solo_drafts(name):
    folder = FIXTURES / name
    head, case = load_head(folder), dict(np.load(folder / "case.npz"))
    d1, l1, d2, l2 = rounds(head, case, batch=3)
    for row in range(3):
        assert np.array_equal(np.array(d1[row : row + 1]), case["drafts1"])
        np.testing.assert_allclose(np.array(l1[row : row + 1]), case["logits1"], atol=1e-5, rtol=0)
        assert np.array_equal(np.array(d2[row : row + 1]), case["drafts2"])
        np.testing.assert_allclose(np.array(l2[row : row + 1]), case["logits2"], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """Fixtures made now from mlx-vlm (the optional reference), in a temporary folder."""
    try:
        import mlx_vlm.speculative.drafters  # noqa: F401
    except ImportError as e:
        pytest.skip(f"mlx-vlm 0.7.10 is optional (pip install -e '.[heads-ref]'): {e}")
    spec = importlib.util.spec_from_file_location(
        "make_head_fixtures", ROOT / "scripts" / "make_head_fixtures.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.OUT = tmp_path_factory.mktemp("heads")
    for build in script.BUILDERS.values():
        build()
    return script.OUT


@pytest.mark.parametrize("name", NAMES)
def test_proposals_equal_mlx_vlm_run_now(fresh, name):
    check_against(fresh / name)


def test_both_eagle3_layouts_load_to_the_same_module():
    spec, original = load_head(FIXTURES / "eagle3"), load_head(FIXTURES / "eagle3_original")
    assert type(spec) is type(original) is eagle3.Eagle3Head
    assert (spec.config.layout, original.config.layout) == ("speculators", "original")
    a, b = dict(tree_flatten(spec.parameters())), dict(tree_flatten(original.parameters()))
    assert sorted(a) == sorted(b) and "layers.0.self_attn.q_proj.weight" in a
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    # what the layouts' configs say differently, read from each
    assert spec.config.norm_before_residual and not original.config.norm_before_residual
    assert spec.config.feature_layers(8) == (1, 2, 4) and original.config.feature_layers(8) == (
        1,
        3,
        4,
    )


def _quantized_copy(name: str, tmp_path: Path) -> tuple[Path, nn.Module]:
    """The fixture head quantized to 4 bits (group 32) and saved as mlx-community does
    (quantized tensors, ``quantization`` in config.json); the MTP head as a sidecar."""
    src = FIXTURES / name
    config = json.loads((src / "config.json").read_text())
    head = load_head(src)
    nn.quantize(head, group_size=32, bits=4)
    if KIND[name] == "mtp":
        config = {"model_type": mtp.SIDECAR_MODEL_TYPE, "text_config": config["text_config"]}
    config["quantization"] = {"group_size": 32, "bits": 4}
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(head.parameters())))
    shutil.copy(src / "case.npz", folder / "case.npz")
    return folder, head


@pytest.mark.parametrize("name", ("eagle3", "dflash", "qwen3_5_mtp"))
def test_a_4bit_quantized_head_loads_and_runs(name, tmp_path):
    folder, quantized = _quantized_copy(name, tmp_path)
    head = load_head(folder)
    linears = [m for _, m in head.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert linears and all(m.bits == 4 for m in linears)
    case = dict(np.load(folder / "case.npz"))
    ours, theirs = rounds(head, case), rounds(quantized, case)
    for x, y in zip(ours, theirs):
        assert np.array_equal(np.array(x), np.array(y))
    assert ours[0].shape == case["drafts1"].shape


def test_quantization_mlx_lacks_is_refused(tmp_path):
    folder, _ = _quantized_copy("dflash", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization"]["bits"] = 7
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadMismatch, match="quantized to 7 bits, which mlx does not run"):
        load_head(folder)


FITS = TargetDims(hidden_size=32, vocab_size=128, num_layers=5)
DFLASH_FITS = TargetDims(hidden_size=32, vocab_size=128, num_layers=4)


@pytest.mark.parametrize(
    "name, dims, change, message",
    [
        (
            "eagle3",
            FITS._replace(hidden_size=64),
            None,
            "EAGLE-3 head reads hidden size 32, the model's is 64",
        ),
        (
            "eagle3",
            FITS._replace(vocab_size=256),
            None,
            "EAGLE-3 head's vocabulary has 128 ids, the model's 256",
        ),
        (
            "eagle3",
            FITS._replace(num_layers=4),
            None,
            "taps hidden-state index .* 5, past the model's 4 layers",
        ),
        (
            "dflash",
            DFLASH_FITS._replace(num_layers=3),
            None,
            r"taps layer \(dflash_config.target_layer_ids\) 3, past the model's 3",
        ),
        (
            "dflash",
            DFLASH_FITS._replace(num_layers=6),
            None,
            "trained on a 4-layer model, this one has 6 layers",
        ),
        (
            "dflash",
            DFLASH_FITS,
            ("mask_token_id", 128),
            "mask token 128 is outside the model's vocabulary",
        ),
        (
            "qwen3_5_mtp",
            FITS._replace(hidden_size=48),
            None,
            "MTP head reads hidden size 32, the model's is 48",
        ),
        ("qwen3_5_mtp", FITS._replace(vocab_size=100), None, "MTP head's vocabulary has 128 ids"),
    ],
)
def test_a_head_that_does_not_fit_is_refused_in_one_line(name, dims, change, message):
    head = load_head(FIXTURES / name)
    fits = DFLASH_FITS if name == "dflash" else FITS
    check_fit(head, fits)  # the fixture fits its own target
    if change:
        setattr(head.config, *change)
    with pytest.raises(HeadMismatch, match=message) as e:
        check_fit(head, dims)
    assert isinstance(e.value, RedrafterError) and isinstance(e.value, ValueError)
    assert "\n" not in str(e.value) and "use the head published for this model" in str(e.value)


def test_a_folder_that_is_no_head_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(HeadMismatch, match="describes no draft head this engine reads"):
        load_head(tmp_path)
    assert kinds.kind_of(tmp_path) is None


def test_tensors_that_do_not_match_the_config_are_refused(tmp_path):
    shutil.copytree(FIXTURES / "dflash", tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["intermediate_size"] = 48
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadMismatch, match="tensors do not match its config.json"):
        load_head(tmp_path / "d")


def test_mtp_tensors_are_read_from_the_target_checkpoint_only():
    weights = read_weights(FIXTURES / "qwen3_5_mtp", "mtp")
    assert "fc.weight" in weights and "layers.0.self_attn.q_proj.weight" in weights
    assert not any("embed_tokens" in k or k.startswith("lm_head") for k in weights)


@pytest.mark.parametrize("name", NAMES)
def test_the_registry_of_source_kinds_recognises_each_head(name):
    assert kinds.kind_of(FIXTURES / name) == KIND[name]
    assert KIND[name] in kinds.HEADS and not kinds.is_source_folder(FIXTURES / name)
