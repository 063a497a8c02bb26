"""APAR branching rows for the loop's and the server's tests: the fork/child ids and rules, a
batch run of branching requests, each branch checked against plain decoding of its own sequence."""

from __future__ import annotations

import mlx.core as mx

from redrafter_mlx.engine.core.branches import BranchRules, BranchTree, request_rows, split_rows
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.decoding.cache import Session, ensure_slots, text_history
from redrafter_mlx.engine.decoding.decode import DecodeState
from redrafter_mlx.engine.decoding.step import make_batch_step
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.loop.batch import BatchGenerator
from redrafter_mlx.engine.loop.batch_choice import FixedShape
from redrafter_mlx.engine.loop.prefilling import Prefill
from redrafter_mlx.engine.loop.rows import Row, RowStats
from redrafter_mlx.engine.verifier.entries import cache_slots
from tests.support.models import near_bigram_model, tiny_drafter

FORK, CHILD, EOS = 30, 31, 29
PROMPT = [1, 2, 3, 4, 5, 6, 7]
RULES = BranchRules(FORK, CHILD, max_depth=2, max_branches=64)  # no branch limit reached


def forking_sampler(**kw) -> SamplerConfig:
    """A logit bias that makes the fork token likely (the tiny model knows no APAR)."""
    return SamplerConfig(logit_bias=((FORK, 3.0),), **kw)


def model_and_drafter():
    model = near_bigram_model(seed=5, vocab=32)
    return model, tiny_drafter(model, 3)


def run_batch(
    model,
    drafter,
    shape,
    requests,
    rules=RULES,
    max_batch=64,
    eos=(EOS,),
    draft_model=None,
    budget=False,
):
    """Decode ``requests`` [(prompt, sampler, seed, limit, branching)] together; returns each
    request's root row (its ``family`` and tree hold the branches). ``draft_model``: a draft model
    for the shape's ``D1×L`` chain. ``budget``: a branching request's ``limit``
    bounds its answer (``BranchTree.budget``, as ``generate_steps`` and the server set it),
    else each of its rows."""
    drafter = drafter if shape.drafts else None
    sources = held_sources(drafter, draft_model)
    batch = BatchGenerator(model, sources, FixedShape(shape), eos, max_batch)
    batch.reset()
    roots = []
    for prompt, sampler, seed, limit, branching in requests:
        tree = BranchTree(rules) if branching else None
        if branching and budget:
            limit, tree = request_rows(rules, limit)
        row = Row(sampler, limit, len(prompt), RowStats(len(prompt)), tree=tree)
        batch.insert(Prefill([prompt], sampler, seed, Session(model, 1), rows=[row]))
        roots.append(row)
    outs = [[] for _ in roots]
    for _ in range(500):
        if all(r.request_done for r in roots) and not batch.prefills:
            break
        turn = batch.next()
        for got in [*turn.joined, *turn.stepped]:
            for i, root in enumerate(roots):
                if got.row is root:
                    outs[i] += got.new
        assert not turn.failed
    else:
        raise AssertionError("the batch did not finish")
    return roots, outs, batch


def reference(model, drafter, shape, prompt, sampler, seed, limit, forks, rules=RULES, eos=(EOS,)):
    """Plain decoding of one linear sequence, alone: the same step at one row, the branching
    masks on (a fork token is kept as text), the child token forced after each of ``forks``
    (emitted-token counts), the depth going up there; stops at EOS or ``limit``."""
    session = Session(model, 1)
    row = Row(sampler, limit, len(prompt), RowStats(len(prompt)), tree=BranchTree(rules))
    job = Prefill([prompt], sampler, seed, session, rows=[row])
    while not job.complete:
        job.advance()
    depth = 0
    first, keys = job.first_token(model, [depth < rules.max_depth])
    out = list(first)
    history = text_history(session.cached, session.slots)
    state = DecodeState(mx.array(first), job.hidden, session.lengths, session.cache, history)
    settings = row.sampling
    mode = settings.mode._replace(split=rules.split_ids)
    step = make_batch_step(
        model, held_sources(drafter if shape else None), shape, mode, compiled=False
    )
    active = mx.array([True])

    while out[-1] not in eos and len(out) < limit:
        forced = rules.child_id if len(out) in forks else -1
        depth += forced >= 0
        split = split_rows([True], [depth < rules.max_depth], [forced])
        state = ensure_slots(state, len(prompt) + len(out) + 64)
        window = cache_slots(state.cache)
        state, keys, o = step(state, keys, active, settings.settings, window, split)
        out += o.tokens.tolist()[0][: o.count.item()]
    for i, t in enumerate(out):
        if t in eos:
            return out[:i]
    return out[:limit]


def fork_points(tree: BranchTree, b: int) -> list[int]:
    """The emitted-token counts after which branch ``b``'s row was forced a child token."""
    points = []
    while tree.branches[b].parent is not None:
        points.append(tree.branches[b].base)
        b = tree.branches[b].parent
    return points


def check_branches(model, drafter, shape, root, prompt, sampler, seed, limit):
    tree = root.tree
    assert len(tree.branches) > 2, "the test needs forks"
    assert len(tree.branches) < tree.rules.max_branches  # no limit reached: masks by depth
    for b in range(len(tree.branches)):
        want = reference(model, drafter, shape, prompt, sampler, seed, limit, fork_points(tree, b))
        assert tree.row(b) == want, f"branch {b}"


class Collector:
    def __init__(self):
        self.events = []

    def __call__(self, event):
        self.events.append(event)

    @property
    def tokens(self):
        return [t for e in self.events for t in e.tokens]


def drain(sched):
    for _ in range(2000):
        busy = sched.active_rows or sched.batch.pending is not None or sched.queue.qsize()
        if not busy and not sched.batch.prefills:
            return
        sched.run_once()
    raise AssertionError("scheduler did not finish")
