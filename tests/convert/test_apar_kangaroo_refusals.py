"""Converting a damaged APAR checkpoint (split token ids that are not ids, or one id) or a
Kangaroo adapter without its norm: one clear error, nothing written."""

from __future__ import annotations

import json

import pytest


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
