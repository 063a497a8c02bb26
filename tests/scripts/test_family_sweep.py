"""The family sweep (``scripts/experiments/family_sweep.py``) over a few families of each
kind: plain decoding is mlx-lm's, speculation (a tree shape, the model as its own draft
model) is plain decoding's, or the load refuses in one line; never a different token, never
a crash. The whole sweep (every family of ``tests/support/mlx_lm_sweep.py``) is the script's.
"""

from __future__ import annotations

import pytest

from scripts.experiments.family_sweep import OUT, sweep

FEW = [
    "llama", "gpt2", "nanochat", "cohere", "lfm2", "qwen3_next", "phi3small", "gemma3n",
    "gpt_neox", "bailing_moe_linear", "mamba", "dbrx", "falcon_h1", "llama4", "olmo", "step3p5",
]  # fmt: skip


@pytest.mark.slow
def test_a_few_families_decode_plain_decodings_tokens_or_are_refused_in_one_line():
    rows = {r.family: r for r in sweep(set(FEW))}
    assert set(rows) == set(FEW)
    bad = [r.line() for r in rows.values() if r.status not in ("ok", "refused")]
    assert not bad, bad
    assert rows["phi3small"].status == "refused" and rows["gpt2"].status == "ok"
    committed = {line.split()[0]: line for line in OUT.read_text().splitlines()[1:]}
    stale = [r.line() for r in rows.values() if committed.get(r.family) != r.line()]
    assert not stale, f"{OUT} is not what the sweep finds now (rerun it): {stale}"
