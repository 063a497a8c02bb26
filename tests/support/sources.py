"""Draft sources under test: early-exit and draft-model pairs, plain decoding references, driving
the loop through a changing shape, and the caches a source holds."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

import redrafter_mlx.cli.tune
from redrafter_mlx.engine.core.sampling import (
    SamplerConfig,
)
from redrafter_mlx.engine.core.shape import AR
from redrafter_mlx.engine.decoding.cache import (
    Session,
    ensure_slots,
)
from redrafter_mlx.engine.drafting.early_exit import (
    EarlyExitAdapter,
    EarlyExitArgs,
)
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.drafting.sources import (
    DraftContext,
)
from redrafter_mlx.engine.loop.batch import BatchGenerator
from redrafter_mlx.engine.loop.batch_choice import FixedShape
from redrafter_mlx.engine.loop.memory import (
    decode_window,
)
from redrafter_mlx.engine.loop.prefilling import Prefill
from redrafter_mlx.engine.loop.rows import Row, RowStats
from redrafter_mlx.train import early_exit as EE
from redrafter_mlx.train.early_exit import new_adapter
from tests.support.fakes import FakeClock
from tests.support.models import (
    _randomize,
    near_bigram_model,
    run_decode,
    tiny_model,
)
from tests.support.tuning import LookupChip

PROMPTS = [[1, 5, 9, 3, 5, 9, 1, 5], [2, 7, 7, 4], [3, 3, 8, 1, 2, 3, 8, 1, 2]]


def random_pair(seed=0):
    model = tiny_model(seed, vocab=48, layers=3)
    adapter = EarlyExitAdapter(EarlyExitArgs.for_target(model.args, 2))
    _randomize(adapter, seed + 7, 1.0)
    return model, adapter


def plain(model, prompts, n=24):
    out, _ = run_decode(model, None, prompts, max_tokens=n, shape=AR)
    return out


def transparent_pair():
    """A 2-layer target whose layer 1 adds nothing (zero o_proj and down_proj) and a fresh
    adapter exiting after layer 1 (zero o_proj, the target's final norm): the chain drafts
    exactly the target's greedy tokens."""
    model = tiny_model(seed=4, vocab=48, layers=2)
    layer = model.model.layers[1]
    layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    return model, EE.new_adapter(model, 1, seed=0)


REPEATING = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]  # a prompt lookup chains find matches in


def bigram_pair():
    """A 3-layer near-bigram target and a random adapter exiting after its layer 2."""
    model = near_bigram_model(3, vocab=32, layers=3)
    adapter = EarlyExitAdapter(EarlyExitArgs.for_target(model.args, 2))
    _randomize(adapter, 9, 1.0)
    return model, adapter


def states_follow_the_text(model, step, state, slots: int, steps: int, checks) -> set[int]:
    """Run ``steps`` steps of ``step`` (one row) from ``state``; after each, for every
    ``(source, held index, prefill)`` of ``checks`` the source's next draft leaves its state
    (``state.sources[index]``) equal, at every committed slot, to ``prefill(text)`` of the
    committed text. Returns the ids of the sources that won steps."""
    won = set()
    for _ in range(steps):
        state, out = step(state, slots)
        won.add(int(out.source[0]))
        n = int(state.lengths[0])
        ctx = DraftContext(
            model, state.hidden, state.init_token, state.lengths, state.history, slots,
            cache=state.cache,
        )  # fmt: skip
        text = [state.history[0, :n].tolist()]
        for source, index, prefill in checks:
            mine = source.propose(ctx._replace(own=state.sources[index])).state
            theirs = prefill(text)
            for a, b in zip([a for e in mine for a in e], [b for e in theirs for b in e]):
                assert mx.allclose(a[:, :, :n], b[:, :, :n], atol=1e-4).item()
    return won


def transparent_bigram():
    """A near-bigram target (attention almost off: ``OracleDrafter`` with no noise drafts
    it well) whose layer 1 adds nothing, and a fresh adapter exiting after layer 0 with
    eta 0: the adapter's chain drafts exactly the target's greedy tokens, and a longer
    drafter beam wins the steps where it is right further."""
    model = near_bigram_model(2, attn_scale=0.005, vocab=32, layers=2)
    layer = model.model.layers[1]
    layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    adapter = EE.new_adapter(model, 1, seed=0)
    adapter.args.extra["eta"] = 0.0
    return model, adapter


TOKENS = 300  # prompt and answer


def held_cache(model, drafter, shape, rows, draft_model=None) -> int:
    """Bytes of the caches the loop holds for ``rows`` rows at the window of ``TOKENS``
    tokens: the target's K/V, the token history and every draft source's state."""
    sources = held_sources(drafter, draft_model)
    batch = BatchGenerator(model, sources, FixedShape(shape), max_batch=rows)
    batch.reset()
    batch.batch_state.resize(rows)
    state = ensure_slots(batch.state, decode_window(TOKENS, model.max_context, shape))
    arrays = [*(a for entry in state.cache for a in entry), state.history]
    arrays += [a for source in state.sources for part in source for a in part]
    return sum(a.nbytes for a in arrays)


def rows_of(prompts, n):
    return [Row(SamplerConfig(), n, len(p), RowStats(len(p))) for p in prompts]


def drive(batch, waves, steps_between=3):
    """Join each wave of (prompts, limit) after ``steps_between`` turns of the one before
    (the later waves join mid-cycle, while the source is off or on), run to the end;
    returns (rows, their emitted tokens)."""
    batch.reset()
    rows, out = [], {}
    for w, (prompts, n) in enumerate(waves):
        new = rows_of(prompts, n)
        rows += new
        out.update({id(r): [] for r in new})
        session = Session(batch.model, len(prompts))
        batch.insert(Prefill(prompts, SamplerConfig(), 0, session, rows=new))
        turns = steps_between if w + 1 < len(waves) else 200
        for _ in range(turns):
            turn = batch.next()
            for got in turn.joined + turn.stepped:
                out[id(got.row)] += got.new
            if all(r.finished for r in rows):
                break
    return rows, [out[id(r)] for r in rows]


def assert_rows_plain(model, got, waves) -> None:
    """Each row ``drive`` ran (``got``, in the order of ``waves``' prompts) equals plain
    decoding of its own prompt to its own limit."""
    for tokens, (prompt, n) in zip(got, [(p, n) for ps, n in waves for p in ps]):
        assert tokens == plain(model, [prompt], n)[0]


def source_cache(batch, sid, row):
    """Row ``row``'s held state of source ``sid`` (keys of its first layer), (S, ...)."""
    return batch.state.sources[[s.source_id for s in batch.batch_state.stateful].index(sid)][0][0][
        row
    ]


class DraftChip(LookupChip):
    """A fake chip on which a draft model's chain (``D1×Ld``) is accepted with probability
    ``draft_accept`` per depth, beside the drafter's beams and lookup chains."""

    def __init__(self, clock, *, draft_accept=0.9, **kwargs):
        super().__init__(clock, **kwargs)
        self.draft_accept = draft_accept

    def tokens_per_step(self, shape):
        total = 1.0
        for depth in range(1, shape.longest):
            beams = shape.width if shape.drafts and depth < shape.length else 0
            miss = (1 - self.accept**depth) ** beams
            if depth < shape.chain_length:
                miss *= (1 - self.lookup_accept**depth) ** shape.lookup
            if depth < shape.model_length:
                miss *= 1 - self.draft_accept**depth
            total += 1 - miss
        return total


def fake_draft_measure(monkeypatch) -> list:
    """``tune``'s measure replaced by a ``DraftChip`` on a fake clock (the draft model's chain
    accepted well); returns the list each build appends its ``draft_model`` to."""
    clock = FakeClock()
    chip = DraftChip(clock, per_token=0.004, lookup_accept=0.3, draft_accept=0.9)
    loaded = []

    def build(model, drafter, *_args, draft_model=None, **_kwargs):
        loaded.append(draft_model)
        return chip, clock

    monkeypatch.setattr(redrafter_mlx.cli.tune, "build_measure", build)
    return loaded


N = 3000  # rows per chi-square sample (as tests/engine/core/test_sampling.py)


HOT = SamplerConfig(temperature=1.0)


def target():
    """A 2-layer near-bigram target over 6 tokens (the exact joint is enumerable)."""
    return near_bigram_model(7, attn_scale=0.05, vocab=6, hidden=32, scale=1.0)


def early_exit_pair(eta=None):
    """The target and an adapter exiting after its first layer ('logit lens' start: the
    target's final norm and head read the exit state), so its drafts are often right.
    ``eta``: the confidence cut (None: the adapter's default, 0.6)."""
    model = target()
    adapter = new_adapter(model, 1, seed=0)
    if eta is not None:
        adapter.args.extra["eta"] = eta
    return model, adapter


def draft_model_for(model):
    """A draft model over the same vocabulary: the target without its last layer (its
    embedding, first layer, final norm and head), so it agrees with the target often."""
    draft = tiny_model(vocab=6, hidden=32, layers=1)
    kept = [(k, v) for k, v in tree_flatten(model.parameters()) if ".layers.1." not in k]
    draft.load_weights(kept)
    mx.eval(draft.parameters())
    return draft
