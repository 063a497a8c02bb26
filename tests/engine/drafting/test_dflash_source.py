"""A DFlash block drafter as a draft source (``head_sources.BlockSource``): the whole chain
from one head forward over ``[init token, mask x (block - 1)]`` attending to the fused
features of every committed position. Greedy output equals plain decoding, alone and with
lookup and the drafter in one tree, solo and batched, and on a hybrid target; after every
step the head's context holds exactly the committed text's entries; a published-format
folder loads through ``--draft-model``; seeded sampling is exact."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.drafting.head_sources import BlockSource, as_head_source, head_source
from redrafter_mlx.engine.drafting.heads import HeadMismatch
from redrafter_mlx.engine.drafting.heads.block import BlockConfig, BlockHead
from redrafter_mlx.engine.drafting.sources import SOURCE_NAMES
from tests.support.heads import assert_state_follows_the_text
from tests.support.models import run_decode, tiny_drafter, tiny_model
from tests.support.paths import FIXTURES

FIXTURE = FIXTURES / "heads" / "dflash"
PROMPTS = [[1, 5, 2, 3, 5, 7], [2, 7, 6, 4], [3, 3, 6, 1, 2, 3, 6, 1, 2]]


def head_config(vocab: int = 8, hidden: int = 32, layers: int = 4, taps=(0, 2)) -> dict:
    """The fixture's published config.json for a target of these sizes."""
    config = json.loads((FIXTURE / "config.json").read_text())
    config.update(vocab_size=vocab, hidden_size=hidden, num_target_layers=layers)
    config["dflash_config"] = {"mask_token_id": vocab - 1, "target_layer_ids": list(taps)}
    return config


def tiny_head(seed: int = 3, **dims) -> BlockHead:
    """A random DFlash head (block of 4) for a tiny target, peaked enough to be accepted."""
    head = BlockHead(BlockConfig.from_config(head_config(**dims)))
    key = mx.random.key(seed)
    params = []
    for i, (name, a) in enumerate(tree_flatten(head.parameters())):
        noise = mx.random.normal(a.shape, key=mx.random.split(key, i + 2)[i + 1]) * 0.3
        params.append((name, a + noise if "norm" in name else noise))
    head.load_weights(params)
    mx.eval(head.parameters())
    return head


def plain(model, prompts, n=20):
    out, _ = run_decode(model, None, prompts, max_tokens=n, shape=AR)
    return out


def pair():
    model = tiny_model(3, vocab=8, layers=4)
    return model, as_head_source(tiny_head(), model)


@pytest.mark.parametrize("label", ["D1xL4", "D1xL6", "K1xL5+D1xL4", "W2xL3+D1xL4"])
def test_greedy_output_equals_plain_decoding_batched_and_solo(label):
    model, source = pair()
    assert isinstance(source, BlockSource) and source.feature_layers == (1, 3)
    drafter = tiny_drafter(model, 4) if label.startswith("W") else None
    want = plain(model, PROMPTS)
    shape = BeamShape.parse(label)
    got, stats = run_decode(model, drafter, PROMPTS, max_tokens=20, shape=shape, draft_model=source)
    assert got == want
    assert model.feature_layers == (1, 3)  # the run tapped the head's layers
    for r, prompt in enumerate(PROMPTS):
        solo, _ = run_decode(
            model, drafter, [prompt], max_tokens=20, shape=shape, draft_model=source
        )
        assert solo[0] == want[r]
    assert "dflash" in SOURCE_NAMES and "dflash" in stats["source_tokens"]


def test_its_drafts_are_accepted_in_adaptive_runs():
    model, source = pair()
    want = plain(model, PROMPTS, 40)
    got, stats = run_decode(model, None, PROMPTS, max_tokens=40, draft_model=source)
    assert got == want
    assert stats["source_tokens"]["dflash"] > 0, stats


def test_context_holds_the_committed_texts_entries_after_every_step():
    """After each step, whichever source's path was accepted, the head's K/V equal a
    prefill of the committed text at every committed position but the last."""
    model, source = pair()
    assert_state_follows_the_text(model, source, [1, 5, 2, 3, 5, 7, 1, 5])


def test_a_folder_loads_through_draft_model_and_misfits_are_refused(tmp_path):
    folder = tmp_path / "dflash"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(head_config()))
    weights = dict(tree_flatten(tiny_head().parameters()))
    mx.save_safetensors(
        str(folder / "model.safetensors"), {f"model.{k}": v for k, v in weights.items()}
    )
    model = tiny_model(3, vocab=8, layers=4)
    source = head_source(folder, model, mx.float32)
    assert isinstance(source, BlockSource)
    assert source.describe() == "dflash (block 4, layers [1, 3])"
    got, _ = run_decode(
        model, None, PROMPTS[:2], max_tokens=12, shape=BeamShape.parse("D1xL4"), draft_model=source
    )
    assert got == plain(model, PROMPTS[:2], 12)
    with pytest.raises(HeadMismatch, match="last layer") as e:  # taps the last layer's output
        (folder / "config.json").write_text(json.dumps(head_config(taps=(0, 3))))
        head_source(folder, model, mx.float32)
    assert "\n" not in str(e.value)


def test_the_head_drafts_losslessly_for_a_hybrid_qwen3_5_target():
    from redrafter_mlx.engine.verifier.lm_model import from_config

    config = json.loads((FIXTURES / "heads" / "qwen3_5_mtp" / "config.json").read_text())
    model = from_config(config, mx.float32)
    text = config["text_config"]
    layers = text["num_hidden_layers"]
    head = tiny_head(vocab=text["vocab_size"], hidden=text["hidden_size"], layers=layers)
    source = as_head_source(head, model)
    want = plain(model, PROMPTS, 12)
    for label in ("D1xL4", "K1xL4+D1xL4"):
        got, _ = run_decode(
            model, None, PROMPTS, max_tokens=12, shape=BeamShape.parse(label), draft_model=source
        )
        assert got == want, label


def test_sampling_with_a_dflash_head_is_exact():
    """Its chain with a lookup chain in one tree: the sequence distribution is the target's
    own (chi-square; the power check is test_sampling's biased one)."""
    import tests.support.sampling as sampling
    from tests.support.models import near_bigram_model

    model = near_bigram_model(7, attn_scale=0.05, vocab=6, hidden=32, scale=1.0)
    cfg = SamplerConfig(temperature=1.0)
    n = 3000
    layers = len(model.layers)
    source = as_head_source(tiny_head(vocab=6, layers=layers, taps=(0,)), model)
    counts, stats = sampling.sample_counts(
        model, None, cfg, n, seed=99, shape=BeamShape.parse("K1xL3+D1xL4"), adapt=False,
        draft_model=source,
    )  # fmt: skip
    assert stats["source_tokens"]["dflash"] > 0.05 * n
    assert sampling.chi_square_pvalue(counts, sampling.exact_joint(model, cfg), n) > 1e-3
