"""Parallel branches (APAR, ``engine.core.branches``), the loop's optional part around its
rows: ``Branches``, built (``batch.BatchGenerator.insert``) only once a row that may branch
is admitted, so a loop with no such row never calls into it (its part is None).

A row whose ``branches`` holds its request's ``BranchTree`` passes its emitted tokens
through it (``grow_branches``); a fork makes a new row copied from the parent's (``fork``:
no prefill, no roll-back, the fork being always a step's last token) whose next draw is
forced to the child token (``SplitRows.forced``). Forks are granted per step where the
branch limit leaves room (``fork_grants``), never by the batch's free rows: a child with
none free waits (``WaitingFork``, ``seat``), and its parent's slot goes to it when the
parent leaves first, so a request's answer is the one it gives alone (``reserved``: free
rows kept for the step in flight's forks). Where the backend reads first
(``platform.read_first``: the CPU) a branching row's step is read before the next is
queued; elsewhere the next step is queued first as long as no fork the step in flight may
make could change the next one's grants (``queue_ahead``: the limits far off), and a fork
then copies that step's own end state (``Queued.end``). docs/design.md, "The loop".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..base.platform import read_first
from ..core.branches import Fork
from .batch_state import BatchState
from .prefilling import PromptProcessing
from .rows import Row, RowStats
from .stepping import Queued


@dataclass
class WaitingFork:
    """A child branch's row waiting for a slot (``BatchGenerator.fork``): ``row`` (in its
    request's ``family``, slot -1 until seated), ``source``: the running row whose cache
    holds the child's prefix (its parent, or the heir its parent's slot went to), ``end``:
    the small arrays of the fork, (init_token (1,), hidden (1, H), lengths (1,), row_keys
    (1, 2))."""

    row: Row
    source: Row
    end: tuple


class Branches:
    """The branching part over ``batch`` (the rows and their arrays) and ``prompts`` (whose
    waiting prefills keep the rows they will take): forks, the children waiting for a row
    (``waiting``), the per-step fork grants."""

    def __init__(self, batch: BatchState, prompts: PromptProcessing):
        self.batch, self.prompts = batch, prompts
        self.waiting: list[WaitingFork] = []  # children waiting for a free row (``fork``)
        # Branching rows: each step read first as well (the CPU's measured default), else
        # queued ahead wherever no fork can change the next step (``queue_ahead``).
        self.read_first = read_first()
        self.ahead = 0  # steps queued while one with a branching row was in flight

    def grow(
        self,
        row: Row,
        new: list[int],
        finish: str | None,
        drafted: list[bool] | None = None,
        read: tuple[Queued, int] | None = None,
    ) -> None:
        """A branching row's emitted tokens into its request's tree (``BranchTree.extend``,
        with ``drafted``: which were accepted drafts); a fork makes the child's row
        (``fork``; ``read``: the step read and the row's index in it, None: its first
        token, just joined), a finished row finishes its branch."""
        tree = row.tree
        if tree is None:
            return
        drafted = drafted or [False] * len(new)
        if row.forced >= 0:  # a child's first step: its forced child token, already recorded
            if new[:1] != [row.forced]:
                raise RuntimeError(f"branch {row.branch} did not draw its forced child token")
            new, drafted, row.forced = new[1:], drafted[1:], -1
        # A row that ends here makes no child: a fork at its token limit has no room for one.
        ext = tree.extend(row.branch, new, can_fork=finish is None, drafted=drafted)
        if ext.keep != len(new):  # fork_ok grants no fork past the limits (``step_split``)
            raise RuntimeError(f"branch {row.branch} forked past the branch limit")
        if ext.fork is not None:
            self.fork(row, ext.fork, read)
        if finish is not None:
            tree.finish(row.branch)

    def past_budget(self, rows) -> list[Row]:
        """After a step (or a join) of ``rows``: the branches whose text would all lie past
        their answer's end (``BranchTree.past_budget``), finished (``"length"``) in their
        trees, for the caller to free their rows. Once per step, after every row's tokens,
        so what a request decodes never depends on its rows' order in the batch."""
        ended = []
        for row in {id(r.tree): r for r in rows if r.tree is not None}.values():
            past = row.tree.past_budget()
            for other in row.family:
                if other.branch in past:
                    other.finish = "length"
                    row.tree.finish(other.branch)
                    ended.append(other)
        return ended

    def fork(self, parent: Row, fork: Fork, read: tuple[Queued, int] | None = None) -> Row:
        """A new row for ``fork``'s child: a copy of the parent's row (K/V, the draft
        sources' states such as a draft model's cache, text, hidden state, init token = the
        fork token, key; no prefill), whose next draw is forced to the child token.

        The fork's state is the parent's after the step that drew the fork token (a fork is
        always a step's last token: ``branches.fork_not_drafted``): ``read``, that step and
        the parent's index in it, whose end state (``Queued.end``) gives the small arrays
        (None: the parent's row as it is now, a first token, the row just joined); they are
        kept with the child (``WaitingFork.end``). The caches and the text are copied when
        the child is seated, from the row that holds the prefix then (``WaitingFork.source``):
        its later steps write only past the fork's length, which the child's own steps
        overwrite. With no row free the child waits (``seat``; its parent goes on) rather
        than the fork being refused: a request forks where it would alone."""
        tree = parent.tree
        child = Row(
            parent.sampler,
            parent.limit,
            parent.length,
            RowStats(parent.stats.prompt_tokens),
            owner=parent.owner,
            at_limit=parent.at_limit,
            slot=-1,
            out=parent.out,
            sampling=parent.sampling,
            tree=tree,
            branch=fork.child,
            forced=tree.rules.child_id,
            family=parent.family,
        )
        parent.family.append(child)
        if read is not None:
            step, i = read
            end = tuple(a[i : i + 1] for a in step.end)  # this row's: (1,), (1, H), (1,), (1, 2)
        else:
            end = self.batch.end_of(parent)
        self.waiting.append(WaitingFork(child, parent, end))
        self.seat()
        return child

    @property
    def free_rows(self) -> int:
        """Rows a waiting child may take now: ``max_batch`` less the running rows and the
        rows the waiting prefills will take (admitted first, they keep theirs)."""
        batch = self.batch
        return batch.max_batch - len(batch.active) - self.prompts.rows_waiting

    def seat(self) -> None:
        """Seat waiting children (``fork``) in free rows, oldest first."""
        while self.waiting and self.free_rows > 0:
            waiting = self.waiting.pop(0)
            c = self.batch.free_slot()
            self._seat(waiting, c)

    def _seat(self, waiting: WaitingFork, c: int) -> None:
        child = waiting.row
        self.batch.seat(child, c, waiting.source, waiting.end)
        child.joined = time.perf_counter()

    def stop_waiting(self, row: Row) -> bool:
        """Whether ``row`` was a child waiting for a row (it stops waiting)."""
        waiting = next((w for w in self.waiting if w.row is row), None)
        if waiting is not None:
            self.waiting.remove(waiting)
        return waiting is not None

    def hand_over(self, row: Row) -> bool:
        """Whether ``row``, leaving, hands its slot to the waiting child with the longest
        prefix among those whose prefix its cache holds (the others' lie in that one's)."""
        heirs = [w for w in self.waiting if w.source is row]
        if not heirs:
            return False
        heir = max(heirs, key=lambda w: w.row.length)
        self.waiting.remove(heir)
        self._seat(heir, row.slot)
        for w in heirs:
            w.source = heir.row
        return True

    def drop_waiting(self, family: list[Row]) -> None:
        """The waiting children of ``family`` (a request's rows) stop waiting."""
        self.waiting = [w for w in self.waiting if w.row.family is not family]

    def fork_grants(
        self, rows: list[Row | None], pending: Queued | None, in_flight: bool = True
    ) -> list[bool]:
        """Which of ``rows`` may fork in the draw made now: each branching row its tree
        allows (``BranchTree.fork_allowed``), in row order, as long as its request's branch
        limit leaves room for the children (one fork per row per draw), so every fork drawn
        is made. The batch's free rows play no part: a child with no row free waits for one
        (``fork``), so a request forks where it would alone, whatever else the batch runs.
        ``pending``: the step in flight, not yet read, which forks wherever it was granted
        (the branches it may make are taken) unless ``in_flight`` is False."""
        taken: dict[int, int] = {}
        if in_flight and pending is not None:
            for row, granted in zip(pending.owners, pending.grants):
                if granted:
                    taken[id(row.tree)] = taken.get(id(row.tree), 0) + 1
        room: dict[int, int] = {}
        grants = []
        for row in rows:
            tree = row.tree if row is not None else None
            ok = tree is not None and not row.finished and tree.fork_allowed(row.branch)
            if ok:
                left = tree.rules.max_branches - len(tree.branches) - taken.get(id(tree), 0)
                ok = room.setdefault(id(tree), left) > 0
            if ok:
                room[id(tree)] -= 1
            grants.append(ok)
        return grants

    def reserved(self, pending: Queued | None) -> int:
        """Free rows kept for the forks of the step in flight ``pending`` (its grants, at
        most the rows free after the waiting children's: ``free_rows``), so that a new
        request admitted meanwhile does not make them wait."""
        if pending is None:
            return 0
        return max(0, min(sum(pending.grants), self.free_rows - len(self.waiting)))

    @property
    def branching(self) -> bool:
        """Whether a running row has branching on."""
        return any(r.tree is not None for r in self.batch.active)

    def queue_ahead(self, pending: Queued | None) -> bool:
        """Whether the next step may be queued before ``pending`` (in flight) is read, with
        branching rows (each a fork in waiting): when no fork that step could make changes
        the next step's grants (limits far off: its grants are the same whether it forks
        everywhere it may or nowhere). A fork then copies the step's own end state
        (``Queued.end``): the next step only writes past it. Otherwise the step is read
        first and the grants see its forks."""
        if not self.branching:
            return True
        rows = self.batch.rows
        return self.fork_grants(rows, pending) == self.fork_grants(rows, pending, False)
