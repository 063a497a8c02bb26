"""Lookup that follows a periodic run: when the text ends in a row of ``=``,
a run of digits or any repetition, the latest match of its suffix overlaps the suffix, and the
chain continues periodically instead of stopping after one period. Step counts of greedy
decoding (deterministic) give the tokens per step; every output equals plain decoding's."""

from __future__ import annotations

import mlx.core as mx
import pytest

from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.drafting.lookup import LookupShadow, lookup_chains
from tests.support.models import run_decode
from weights_convert.smollm2 import smollm2_path

K1xL8 = BeamShape.lookup_only(1, 8)
SMOLLM2 = smollm2_path()  # before the tests' private REDRAFTER_MLX_HOME (conftest) is set


def test_a_run_of_one_token_gives_a_full_chain():
    """``= = = =`` then the init ``=``: the latest match ends one token back, and the chain
    is the run continued, every position present (it was one token, the rest absent)."""
    text = [5, 7, 3, 3, 3, 3]  # the last 3 is the init token
    history = mx.array([text[:-1] + [0, 0, 0]])
    got = lookup_chains(history, mx.array([len(text) - 1]), mx.array([3]), 1, 8)
    assert got.tokens[0, 0].tolist() == [3] * 8
    assert got.present[0, 0].tolist() == [True] * 8
    assert got.match[0, 0].item() == 3  # 3 3 3 then the init 3 (a 7 before the first)


def test_a_run_with_a_longer_period_repeats_its_period():
    """A repeated word of three tokens (period 3): the chain cycles through it."""
    text = [9, 1, 2, 3, 1, 2, 3, 1]
    history = mx.array([text[:-1] + [0] * 4])
    got = lookup_chains(history, mx.array([len(text) - 1]), mx.array([1]), 1, 8)
    assert got.tokens[0, 0].tolist() == [1, 2, 3, 1, 2, 3, 1, 2]
    shadow = LookupShadow([text], horizon=7)
    assert shadow.chain(0) == [2, 3, 1, 2, 3, 1, 2]  # the host mirror agrees
    assert shadow.match(0) == got.match[0, 0].item()


@pytest.fixture(scope="module")
def demo():
    from redrafter_mlx.engine.base.bundled import demo_paths
    from redrafter_mlx.engine.base.tokenizer import load_tokenizer
    from redrafter_mlx.engine.loop.loading import load_model

    base, _ = demo_paths()
    return load_model(base)[0], load_tokenizer(base)


def tokens_per_step(model, prompt, max_tokens, eos=()):
    """(tokens per step of K1xL8 pinned, whether its output equals plain decoding's)."""
    ar, _ = run_decode(model, None, [prompt], max_tokens=max_tokens, shape=AR, eos_token_ids=eos)
    out, stats = run_decode(
        model, None, [prompt], max_tokens=max_tokens, shape=K1xL8, adapt=False, eos_token_ids=eos
    )
    return len(out[0]) / stats["steps"], out == ar, len(out[0])


@pytest.mark.parametrize("text", ["# " + "=" * 120, "x = 9999999999"], ids=["equals", "nines"])
def test_demo_continues_a_run_at_five_tokens_per_step(demo, text):
    """The demo cases: 1.00 and 1.37 tokens/step before (a chain of one token)."""
    model, tokenizer = demo
    rate, same, n = tokens_per_step(model, tokenizer.encode(text), 64)
    assert same
    assert n == 64  # the model writes the run to the limit (no EOS), so the rate is the run's
    assert rate >= 5, rate


def test_smollm2_copies_a_run_of_zeros_at_five_tokens_per_step():
    """The SmolLM2 case: copying ``1`` and 60 zeros ran at 1.04 tokens/step."""
    path = SMOLLM2
    if not (path / "config.json").is_file():
        pytest.skip(f"SmolLM2 is not converted at {path}; run `make smollm2` (make install)")
    from redrafter_mlx.engine.base.tokenizer import load_tokenizer
    from redrafter_mlx.engine.loop.loading import load_model

    model, _ = load_model(path)
    tokenizer = load_tokenizer(path)
    ask = "Copy this number exactly: 1" + "0" * 60
    prompt = tokenizer.chat_prompt([{"role": "user", "content": ask}])
    rate, same, n = tokens_per_step(model, prompt, 64, tuple(tokenizer.eos_token_ids))
    assert same
    assert n >= 48
    assert rate >= 5, rate
