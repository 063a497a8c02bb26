"""The prompt cache shared across requests (``engine/loop/prompt_cache.py``): a request that
shares a long prefix with an earlier one prefills only its new part and gives the cold
request's tokens; the LRU stays within its bytes."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.loop.prompt_cache import PromptCache
from redrafter_mlx.engine.verifier.entries import Slots, State
from redrafter_mlx.serve.anthropic_reply import usage as anthropic_usage
from redrafter_mlx.serve.protocol import usage
from redrafter_mlx.serve.scheduler import Request, Scheduler
from tests.support.models import tiny_drafter, tiny_model
from tests.support.serving import Collector, drain


def entry(n: int) -> tuple:
    return (Slots(mx.zeros((1, 1, n, 4)), mx.zeros((1, 1, n, 4))),)


def test_lru_evicts_by_bytes_and_finds_the_longest_prefix():
    one = PromptCache.size(entry(8))
    cache = PromptCache(2 * one)
    cache.store(list(range(8)), entry(8))
    cache.store([*range(4), 9, 9, 9, 9], entry(8))
    n, got = cache.lookup([*range(6), 7, 7])
    assert n == 6 and got[0].slots == 6
    assert cache.lookup(list(range(7)))[0] == 6  # one token always left to prefill
    cache.store([5] * 8, entry(8))  # the least recently used goes
    assert cache.bytes <= cache.capacity and len(cache.entries) == 2
    assert cache.lookup([*range(4), 9, 9, 9, 9, 1])[0] == 4  # its own entry is gone
    assert cache.lookup([5] * 9)[0] == 8


def test_a_recurrent_state_is_used_only_whole():
    cache = PromptCache(1 << 20)
    cache.store([1, 2, 3], (*entry(3), State(mx.ones((1, 1, 5)))))
    assert cache.lookup([1, 2, 4, 5])[0] == 0
    assert cache.lookup([1, 2, 3])[0] == 0  # the whole prompt: nothing left to prefill
    assert cache.lookup([1, 2, 3, 7])[0] == 3


def run(sched, prompt, sampler=None):
    sink = Collector()
    request = Request(prompt, 12, sink, *(() if sampler is None else (sampler,)))
    sched.submit(request)
    while not sink.tokens:  # admitted and prefilled before the next request comes
        sched.run_once()
    drain(sched)
    return sink.tokens, request.cached_tokens


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_a_shared_prefix_prefills_its_new_part_and_gives_the_cold_tokens(seeded):
    model = tiny_model(2, vocab=64, hidden=32)
    drafter = tiny_drafter(model, 4)
    rng = random.Random(0)
    prefix = [1] + [rng.randrange(64) for _ in range(1000)]
    second = [*prefix, 5, 6, 7]
    sampler = SamplerConfig(temperature=0.8, seed=3) if seeded else None
    cold = Scheduler(model, drafter, BeamShape(2, 3), (), max_batch=2)
    warm = Scheduler(model, drafter, BeamShape(2, 3), (), max_batch=2, prompt_cache_bytes=1 << 30)
    want, none = run(cold, second, sampler)
    assert none == 0
    run(warm, prefix, sampler)
    got, cached = run(warm, second, sampler)
    assert len(second) - cached < 100 and got == want
    assert warm.health()["prompt_cache"]["entries"] == 2


def test_usage_reports_cached_tokens():
    counts = usage(1003, 12, 1000)
    assert counts["prompt_tokens_details"]["cached_tokens"] == 1000
    assert anthropic_usage(counts)["cache_read_input_tokens"] == 1000
    assert "prompt_tokens_details" not in usage(3, 1)  # none cached
