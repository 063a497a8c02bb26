"""A new draft source is one class and one registration, with no engine file changed: a toy
source defined here ("continue the text after the last earlier occurrence of the init
token") is registered through the public API (``redrafter_mlx.register_source``), passed in
the draft slot, and speculates losslessly, batched and solo, beside the built-in sources;
its accepted drafts are counted under its own name."""

from __future__ import annotations

import mlx.core as mx
import pytest

from redrafter_mlx import DraftContext, DraftSource, Proposal, register_source
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.drafting.sources import ABSENT
from tests.support.models import near_bigram_model, run_decode, tiny_drafter


class RepeatSource(DraftSource):
    """One chain of the shape's ``D1×L``: the ``L - 1`` committed tokens that followed the
    latest earlier occurrence of the init token (absent where the text runs out)."""

    source_id = register_source("repeat")

    def propose(self, ctx: DraftContext) -> Proposal:
        history, lengths, init = ctx.history, ctx.lengths, ctx.init_token
        B, S = history.shape
        slots = mx.arange(S)[None, :]
        seen = (history == init[:, None]) & (slots < lengths[:, None])  # (B, S)
        last = mx.max(mx.where(seen, slots, -1), axis=1)  # (B,) -1: never seen
        at = last[:, None] + mx.arange(1, self.length)[None, :]  # (B, L - 1)
        ok = (last[:, None] >= 0) & (at < lengths[:, None])
        drafts = mx.take_along_axis(history, mx.clip(at, 0, S - 1), axis=1)
        present = mx.concatenate([mx.ones((B, 1), mx.bool_), ok], axis=1)
        present = mx.cumprod(present.astype(mx.int32), axis=1) > 0  # a prefix of the chain
        tokens = mx.concatenate([init[:, None], drafts], axis=1).astype(mx.int32)
        tokens = mx.where(present, tokens, ABSENT)
        return Proposal(tokens[:, None], present[:, None], rank=1)


PROMPTS = [[3, 5, 7, 3, 5, 7, 3, 5], [1, 2, 3, 4, 1, 2, 3], [9, 8, 9, 8, 9, 8, 9, 8, 9]]


def decode(shape, prompts, draft_model=None, drafter=None, sampler=None, seed=0):
    model = near_bigram_model(11, vocab=16, hidden=32)
    out, stats = run_decode(
        model,
        drafter,
        prompts,
        max_tokens=24,
        shape=shape,
        draft_model=draft_model,
        sampler=sampler or SamplerConfig(),
        seed=seed,
    )
    return model, out, stats


def test_the_toy_source_is_registered_under_its_name():
    from redrafter_mlx.engine.drafting.sources import SOURCE_NAMES

    assert SOURCE_NAMES[RepeatSource.source_id] == "repeat"
    assert register_source("repeat") == RepeatSource.source_id  # once per name
    assert RepeatSource().describe() == "repeat"


@pytest.mark.parametrize("label", ["D1xL4", "K1xL6+D1xL4"])
def test_greedy_output_equals_plain_decoding_batched_and_solo(label):
    _, want, _ = decode(BeamShape.autoregressive(), PROMPTS)
    _, got, stats = decode(BeamShape.parse(label), PROMPTS, RepeatSource())
    assert got == want
    # its chains were accepted (beside lookup, whose chains it repeats, lookup ranks first)
    assert stats["source_tokens"]["repeat" if label == "D1xL4" else "lookup"] > 0
    for prompt, row in zip(PROMPTS, want):
        _, solo, _ = decode(BeamShape.parse(label), [prompt], RepeatSource())
        assert solo == [row]


def test_beside_the_drafter_and_a_draft_model():
    """The toy source in the draft slot with a draft model, the drafter's beams and lookup:
    four sources in one tree, plain decoding's tokens."""
    model = near_bigram_model(11, vocab=16, hidden=32)
    drafter = tiny_drafter(model, 5)
    _, want, _ = decode(BeamShape.autoregressive(), PROMPTS)
    shape = BeamShape.parse("W2xL3+K1xL5+D1xL4")
    out, stats = run_decode(
        model,
        drafter,
        PROMPTS,
        max_tokens=24,
        shape=shape,
        draft_model=[RepeatSource(), model],
    )
    assert out == want
    assert stats["source_tokens"]["repeat"] + stats["source_tokens"]["draft_model"] > 0


def test_sampling_with_the_toy_source_is_exact():
    """Seeded chi-square of the first two tokens after a prompt, the toy source's chain in
    every step's tree: the target's own distribution (a wrong temperature is rejected)."""
    import tests.support.sampling as sampling

    model = near_bigram_model(7, attn_scale=0.05, vocab=4, hidden=32, scale=0.5)
    cfg, n = SamplerConfig(temperature=1.0), 1500
    counts, stats = sampling.sample_counts(
        model, None, cfg, n, seed=11, shape=BeamShape.parse("D1xL3"), adapt=False,
        draft_model=RepeatSource(),
    )  # fmt: skip
    assert stats["source_tokens"]["repeat"] > 0
    assert sampling.chi_square_pvalue(counts, sampling.exact_joint(model, cfg), n) > 1e-3
    wrong = sampling.exact_joint(model, SamplerConfig(temperature=0.5))
    assert sampling.chi_square_pvalue(counts, wrong, n) < 1e-3  # the test has power


def test_the_server_holds_and_names_the_toy_source():
    """The server's scheduler takes the toy source in the draft slot, serves plain
    decoding's tokens with it (rows joining a running batch), and ``/health`` names it."""
    from redrafter_mlx.serve.scheduler import Scheduler
    from tests.support.serving import staggered

    model = near_bigram_model(11, vocab=16, hidden=32)
    _, want, _ = decode(BeamShape.autoregressive(), PROMPTS)
    sched = Scheduler(model, None, BeamShape.parse("D1xL4"), (), draft_model=[RepeatSource()])
    assert sched.health()["sources"] == ["lookup", "repeat"]
    sinks = staggered(sched, PROMPTS, [24] * len(PROMPTS))
    assert [s.tokens for s in sinks] == want
    accepted = [s.last.stats.to_dict()["accepted_from_repeat"] for s in sinks]
    assert sum(accepted) > 0  # each request's stats count its source by name


def test_a_source_states_its_whole_life_when_its_class_is_made():
    """A source without ``propose`` cannot be made; a stateful one without its state's life
    (``empty_state``, ``prefill``, ``catch_up``) is refused when its class is defined."""

    class NoProposal(DraftSource):
        source_id = register_source("repeat")

    with pytest.raises(TypeError, match="propose"):
        NoProposal()
    with pytest.raises(TypeError, match="is stateful but does not define prefill, catch_up"):

        class HalfStateful(RepeatSource):
            stateful = True

            def empty_state(self, model, batch, slots):
                return ()
