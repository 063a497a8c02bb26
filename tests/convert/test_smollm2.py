"""The real SmolLM2-135M-Instruct (converted by ``make install`` / ``make smollm2``) against
references from transformers' GGUF tokenizer and model (``tests/fixtures/smollm2_refs.json``,
made by ``tests/fixtures/make_smollm2_refs.py``): token ids, chat prompts, greedy answers that
stop at ``<|im_end|>``, in our engine and in mlx-lm."""

from __future__ import annotations

import json

import pytest

from tests.support.paths import FIXTURES
from weights_convert.smollm2 import smollm2_path

REFS = json.loads((FIXTURES / "smollm2_refs.json").read_text())
MODEL = smollm2_path()
END_OF_TURN = 2  # <|im_end|>

pytestmark = pytest.mark.skipif(
    not (MODEL / "config.json").is_file(),
    reason=f"SmolLM2 is not converted at {MODEL}; run `make smollm2` (part of `make install`)",
)


@pytest.fixture(scope="module")
def engine():
    import redrafter_mlx

    model, _, tokenizer = redrafter_mlx.load(MODEL)
    return model, tokenizer


@pytest.fixture(scope="module")
def mlx_lm_pair():
    import mlx_lm

    return mlx_lm.load(str(MODEL))


def _split_system(messages: list[dict]) -> tuple[list[dict], str | None]:
    system = [m["content"] for m in messages if m["role"] == "system"]
    return [m for m in messages if m["role"] != "system"], (system[0] if system else None)


@pytest.mark.parametrize("case", REFS["texts"], ids=lambda c: c["text"][:20])
def test_token_ids_equal_transformers_gguf_tokenizer(engine, mlx_lm_pair, case):
    _, tokenizer = engine
    assert tokenizer.encode(case["text"], add_bos=False) == case["ids"]
    assert mlx_lm_pair[1].encode(case["text"], add_special_tokens=False) == case["ids"]


@pytest.mark.parametrize("case", REFS["chats"], ids=lambda c: c["messages"][-1]["content"][:20])
def test_chat_prompts_equal_transformers_chat_template(engine, mlx_lm_pair, case):
    _, tokenizer = engine
    messages, system = _split_system(case["messages"])
    assert tokenizer.chat_prompt(messages, system=system) == case["prompt_ids"]
    ids = mlx_lm_pair[1].apply_chat_template(case["messages"], add_generation_prompt=True)
    assert list(ids) == case["prompt_ids"]


def test_end_of_turn_is_an_eos(engine, mlx_lm_pair):
    assert END_OF_TURN in engine[1].eos_token_ids
    assert END_OF_TURN in mlx_lm_pair[1].eos_token_ids


@pytest.mark.parametrize("case", REFS["chats"], ids=lambda c: c["messages"][-1]["content"][:20])
def test_greedy_answers_equal_transformers_gguf_model(engine, case):
    import redrafter_mlx

    model, tokenizer = engine
    chunks = list(
        redrafter_mlx.stream_generate(
            model, None, tokenizer, case["prompt_ids"], max_tokens=REFS["max_new_tokens"]
        )
    )
    tokens = [t for chunk in chunks for t in chunk.tokens]
    expected = case["greedy"]
    if expected[-1] == END_OF_TURN:  # the engine stops at EOS without emitting it
        assert tokens == expected[:-1] and chunks[-1].finish_reason == "stop"
    else:
        assert tokens == expected and chunks[-1].finish_reason == "length"


def test_mlx_lm_greedy_answer_equals_transformers_gguf_model(mlx_lm_pair):
    import mlx_lm

    case = REFS["chats"][0]
    model, tokenizer = mlx_lm_pair
    stream = mlx_lm.stream_generate(
        model, tokenizer, case["prompt_ids"], max_tokens=REFS["max_new_tokens"]
    )
    assert [r.token for r in stream] == case["greedy"]


def test_answers_the_capital_of_france(engine):
    import redrafter_mlx

    model, tokenizer = engine
    prompt = tokenizer.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    answer = redrafter_mlx.generate(model, None, tokenizer, prompt, max_tokens=32)
    assert answer == "The capital of France is Paris."
