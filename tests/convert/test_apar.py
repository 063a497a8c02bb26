"""Converting an APAR checkpoint (THUDM/apar-7b's layout, in miniature): a Llama whose
vocabulary grew by the two split tokens, Medusa heads beside it."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from redrafter_mlx.engine.core.branches import CHILD_TOKEN, FORK_TOKEN, BranchRules, branch_rules
from tests.support.convert import GROWN, apar_checkpoint
from tests.support.paths import CONVERT as FIXTURES
from weights_convert import ConversionError, convert


@pytest.mark.parametrize("added", ["added_tokens.json", "tokenizer.json"])
def test_apar_checkpoint_converts_as_a_branching_model(tmp_path, added):
    src = tmp_path / "apar"
    weights = apar_checkpoint(src, added)
    out = tmp_path / "out"
    summary = convert(str(src), out, dtype="float32", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["branches"] == {"fork": FORK_TOKEN, "child": CHILD_TOKEN}
    assert config["vocab_size"] == 130 and list(config) == sorted(config)
    got = mx.load(str(out / "model.safetensors"))
    for name in GROWN:
        np.testing.assert_array_equal(np.array(got[name]), weights[name])
    assert branch_rules(out) == BranchRules(fork_id=128, child_id=129)  # on by default
    notes = "\n".join(summary.lines())
    assert "branching model (APAR)" in notes
    assert "medusa left out" in notes and "medusa_lm_head.safetensors left out" in notes
    assert not (out / "medusa").exists()

    import mlx_lm

    model, tokenizer = mlx_lm.load(str(out))
    assert model(mx.array([[1, 5, 128, 129]])).shape == (1, 4, 130)
    assert tokenizer.convert_tokens_to_ids(FORK_TOKEN) == 128


def test_plain_llama_gets_no_branches_block(tmp_path):
    out = tmp_path / "out"
    summary = convert(str(FIXTURES / "llama_st_bf16"), out, progress=False)
    assert "branches" not in json.loads((out / "config.json").read_text())
    assert branch_rules(out) is None and not summary.notes


def test_one_split_token_only_is_refused(tmp_path):
    src = tmp_path / "apar"
    apar_checkpoint(src)
    (src / "added_tokens.json").write_text(json.dumps({FORK_TOKEN: 128}))
    with pytest.raises(ConversionError, match=r"names the APAR token \[SplitMask\] but not"):
        convert(str(src), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_split_token_outside_the_vocabulary_is_refused(tmp_path):
    src = tmp_path / "apar"
    apar_checkpoint(src)
    (src / "added_tokens.json").write_text(json.dumps({FORK_TOKEN: 128, CHILD_TOKEN: 130}))
    with pytest.raises(ConversionError, match=r"id 130, outside the model's vocabulary"):
        convert(str(src), tmp_path / "out", progress=False)
