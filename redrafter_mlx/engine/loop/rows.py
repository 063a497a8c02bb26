"""The loop's rows: a sequence in a batch row (``Row``, its ``RowStats``), what one step
gave it (``RowStep``), and the re-lay of rows over a batch size (``take_rows``,
``row_buckets``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any, NamedTuple

import mlx.core as mx

from ..core.branches import BranchTree
from ..core.sampling import RowSampling, SamplerConfig
from ..core.shape import BeamShape
from ..decoding.decode import DecodeState
from ..drafting.lookup import LookupShadow
from ..drafting.sources import SOURCE_NAMES, map_states
from ..verifier.entries import rows_of


@dataclass
class RowStats:
    """One row's counters (the server's per-request stats; a generation call sums its rows'
    into ``generation.DecodeStats``). Its steps are counted once, in ``accept_hist``: the
    step count, tokens they emitted and accepted drafts are read from it."""

    prompt_tokens: int
    generated: int = 0
    by_source: list[int] = field(default_factory=lambda: [0] * len(SOURCE_NAMES))  # accepted
    drafted: int = 0  # draft tokens its steps could accept (a shape's longest candidate, less 1)
    packed: int = 0  # tree slots its steps used
    accept_hist: list[int] = field(default_factory=list)  # [i]: steps that emitted i + 1
    queued_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    branches: int = 0  # a branching request's branches (``request_stats``), 0: branching off

    @property
    def steps(self) -> int:
        """Steps that advanced it."""
        return sum(self.accept_hist)

    @property
    def emitted_by_steps(self) -> int:
        """Tokens its steps emitted (accepted drafts + a bonus each)."""
        return sum((i + 1) * n for i, n in enumerate(self.accept_hist))

    @property
    def tokens_per_step(self) -> float:
        return self.emitted_by_steps / max(self.steps, 1)

    @property
    def accepted_drafts(self) -> int:
        """Draft tokens its steps' verifier accepted: each step emits them and one more."""
        return self.emitted_by_steps - self.steps

    @staticmethod
    def summed(stats: Sequence[RowStats]) -> RowStats:
        """The counters of ``stats`` (rows of one request or call, the first the root; at
        least one) added up: tokens, steps (row-steps, so tokens per step stays a per-row
        mean), accepted drafts per source, tree slots and the accept histogram; prompt
        tokens and times are the first's, decode time the longest."""
        root = stats[0]
        hist = [0] * max(len(r.accept_hist) for r in stats)
        for r in stats:
            for i, n in enumerate(r.accept_hist):
                hist[i] += n
        return RowStats(
            root.prompt_tokens,
            generated=sum(r.generated for r in stats),
            by_source=[sum(c) for c in zip_longest(*(r.by_source for r in stats), fillvalue=0)],
            drafted=sum(r.drafted for r in stats),
            packed=sum(r.packed for r in stats),
            accept_hist=hist,
            queued_s=root.queued_s,
            ttft_s=root.ttft_s,
            decode_s=max(r.decode_s for r in stats),
        )

    def record(
        self, count: int, by_source: tuple[int, ...], packed: int, shape: BeamShape | None
    ) -> None:
        """A step of ``shape`` (None: plain decoding) gave this row ``count`` tokens
        (accepted drafts + the bonus), its accepted drafts ``by_source`` (one count per
        ``SOURCE_NAMES``), in ``packed`` tree slots."""
        self.by_source = [a + b for a, b in zip_longest(self.by_source, by_source, fillvalue=0)]
        self.drafted += shape.longest - 1 if shape else 0
        self.packed += packed
        self.accept_hist += [0] * (count - len(self.accept_hist))
        self.accept_hist[count - 1] += 1

    def to_dict(self) -> dict:
        """JSON-ready speculation stats; ``acceptance_rate`` = accepted / drafted tokens."""
        drafted = self.drafted
        return dict(
            steps=self.steps,
            tokens_per_step=round(self.tokens_per_step, 4),
            accepted_draft_tokens=self.accepted_drafts,
            **{
                f"accepted_from_{name}": n
                for name, n in zip_longest(SOURCE_NAMES, self.by_source, fillvalue=0)
            },
            acceptance_rate=round(self.accepted_drafts / drafted, 4) if drafted else 0.0,
            generation_tps=round(self.generated / max(self.decode_s, 1e-9), 2),
            time_to_first_token=round(self.ttft_s, 4),
            queue_s=round(self.queued_s, 4),
            **({"branches": self.branches} if self.branches else {}),
        )


@dataclass
class Row:
    """A sequence in a batch row. ``length``: its exact cache length as last read; ``limit``:
    the most tokens it may emit, ``at_limit`` why (``"length"`` / ``"context"``);
    ``owner``: the client's handle (the scheduler's request record).

    Branching (APAR, ``engine.core.branches``): ``tree`` is the request's ``BranchTree``
    (None: branching off) and ``branch`` this row's branch in it; every branch of a request
    is a row (``family``: all of them, the root first; a child shares its root's owner,
    sampler and limit, which bounds its own row like any row's). ``forced``: the token its
    next root draw is forced to (a new child's child token), -1: none."""

    sampler: SamplerConfig
    limit: int
    length: int
    stats: RowStats
    owner: Any = None
    at_limit: str = "length"
    joined: float = field(default_factory=time.perf_counter)
    slot: int = 0
    out: int = 0
    finished: bool = False
    finish: str | None = None  # why it finished: "stop" (EOS), "length" or "context"
    shadow: LookupShadow | None = None  # what lookup would have given it (adaptive shapes)
    sampling: RowSampling | None = (
        None  # its sampling as arrays (``one_row``); None: built at its step
    )
    tree: BranchTree | None = None
    branch: int = 0
    forced: int = -1
    forced_queued: bool = False  # its forced draw is in a queued step (later ones draw freely)
    logprobs: int | None = None  # the top count of its tokens' logprobs (None: it wants none)
    family: list = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self):
        if not self.family:
            self.family.append(self)

    @property
    def request_done(self) -> bool:
        """Whether every row of its request finished (branching off: this row)."""
        return all(r.finished for r in self.family)

    @property
    def request_finish(self) -> str | None:
        """Why its request finished (None: it goes on): branching off, this row's reason;
        with branches, once every branch has, from the answer alone, not from which branch
        stopped how (that follows the timing: a branch whose text lies past the answer's
        end may stop at the budget or at its EOS): ``"context"`` when the context cap
        (``at_limit``) cut a branch inside the answer (the text before its cut ends before
        the budget: ``BranchTree.ends``), else ``"length"`` when the answer reached its
        budget (as a plain answer of ``max_tokens`` tokens does) or a row's own limit cut
        it, else ``"stop"``. Each branch's row is bounded by the context on its own (the
        prompt, its row: ``BranchTree.row``), so an answer may hold more tokens than the
        cap."""
        if self.tree is None:
            return self.finish
        if not self.request_done:
            return None
        tree, budget = self.tree, self.tree.budget
        ends = tree.ends()
        for row in self.family:
            if row.finish == "context" and (budget is None or ends[row.branch] < budget):
                return "context"
        if budget is not None and len(tree.linear()) >= budget:
            return "length"
        limits = (r.finish for r in self.family if r.finish not in ("stop", "context", None))
        return next(limits, "stop")

    def request_stats(self) -> RowStats:
        """Its request's counters: this row's, or with branches every branch's row's summed
        (``RowStats.summed``), ``branches`` set."""
        if self.tree is None:
            return self.stats
        total = RowStats.summed([r.stats for r in self.family])
        total.branches = len(self.tree.branches)
        return total


class RowStep(NamedTuple):
    """What one step gave one row: the tokens it emits (``new``, exact stop), why it finished
    (None: it goes on), and the step's own count (accepted drafts + bonus), tree slots used
    and accepted drafts per source (``SOURCE_NAMES`` order; empty: none); ``logprobs``: per
    token of ``new``, ``(logprob, ((id, logprob), ...))`` when the row asked for them
    (``Row.logprobs``; ``core.logprobs.rows_of``), else None."""

    row: Row
    new: list[int]
    finish: str | None
    count: int
    packed: int
    by_source: tuple[int, ...] = ()
    logprobs: list | None = None


def take_rows(
    state: DecodeState, row_keys: mx.array, idx: mx.array | None, extra: int = 0
) -> tuple[DecodeState, mx.array]:
    """The decode state and keys (B, 2) of rows ``idx`` (b,) in that order (None: all B),
    then ``extra`` empty rows (zeros): the cache rows (the draft sources' states too)
    copied (rare: a batch's resize)."""

    def pick(a):  # (B, ...) -> (b + extra, ...)
        a = a if idx is None else a[idx]
        if extra:
            return mx.concatenate([a, mx.zeros((extra, *a.shape[1:]), a.dtype)])
        return a

    s = state
    return s._replace(
        init_token=pick(s.init_token),
        hidden=pick(s.hidden),
        lengths=pick(s.lengths),
        cache=rows_of(s.cache, pick),
        history=None if s.history is None else pick(s.history),
        sources=map_states(s.sources, pick),
    ), pick(row_keys)


def row_buckets(max_batch: int) -> list[int]:
    """Batch sizes the step is compiled for: 1, 2, 4, ... below ``max_batch``, then it."""
    sizes = [1]
    while sizes[-1] * 2 < max_batch:
        sizes.append(sizes[-1] * 2)
    return sizes + ([max_batch] if max_batch > 1 else [])
