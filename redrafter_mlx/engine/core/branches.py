"""Parallel branches (APAR, arXiv 2401.06761): the per-request bookkeeping, host side.

A model post-trained on paragraph trees emits the fork token (``[SplitMask]`` in the public
checkpoints) where what follows is the details of a list item or a paragraph. Decoding then
copies the row into a new one, forced to emit the child token (``[SplitSop]``) next, that
writes those details; the parent goes on with the next item. The linear text is rebuilt
root -> detail -> next: each fork token is replaced by its child's text.

Rows and sequences. A branch's *row* is the token sequence its decoding row sees after the
prompt: the root's row is its own tokens; a child's row is its parent's row up to and
including the fork token, then the child token, then the child's own tokens. Each branch is
plain decoding of its own row (docs/design: "each branch equals plain decoding of its own
linear sequence").

The rules (``BranchRules``; APAR's decoder):

- the child token is never sampled freely: only a fork puts it into a row (forced);
- two split tokens never follow each other: no fork right after a fork or a child token;
- a branch at depth ``max_depth`` (the root is depth 0) does not fork, nor does any branch
  once the request holds ``max_branches`` branches (the root counted);
- where a rule forbids it, the fork token is masked out of the distribution
  (:func:`mask_split_tokens`, one rule set for greedy, sampling and verification), so it
  can neither be sampled nor accepted from a draft. The tree checks this: a fork token
  where the rules forbid one raises (the sampler did not mask it). One case the mask set at
  the step's start cannot see: rows of one request that fork in the same step past the
  branch limit. Their forks come in row order; a fork past the limit is dropped with the
  tokens after it, as if rejected, and the row redraws there with forks masked.

The answer's length (``--max-tokens N``, ``BranchTree(rules, budget=N)``): the answer is the
rebuilt text, so N bounds the rebuilt text, as it bounds a plain answer: the answer is the
first N tokens of the rebuilt text. Branches run side by side, so a branch cannot know where
its text will land until the text before it is final; what it knows is a lower bound, the
text already written before its next token (:meth:`BranchTree.ends`). A branch stops once
that bound reaches N (everything it could still write lies past the answer's end), a fork
there makes no child, and the rebuilt text is cut at N. Each branch is still plain decoding
of its own row, up to where the answer ends; its row's own bound
(:meth:`BranchRules.row_tokens`) only keeps it inside the context. (The APAR code bounds each
sequence instead, so its answers run to several times its limit; ours do not.) The context
(the model's, or ``--max-kv-size``) bounds each branch's row, as it bounds a plain row, not
the answer; a branch it cuts inside the answer makes the request finish ``"context"``
(``rows.Row.request_finish``).

One fork per row per step: of a step's accepted tokens, the row keeps those up to and
including the first fork token (:class:`Extension`); the rest are dropped as if rejected
(the next step redraws them from the fork token, where the rules ban a second split token).

Everything here is host-side Python on token ids, except :func:`mask_split_tokens`, a pure
tensor op for the decode step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx

from ..base.errors import ParamError

FORK_TOKEN = "[SplitMask]"  # the fork token's name in THUDM/apar-7b and -13b
CHILD_TOKEN = "[SplitSop]"  # the child token's name there
MAX_DEPTH = 2  # APAR's depth limit: root (0) -> detail (1) -> detail of a detail (2)
MAX_BRANCHES = 32  # APAR's branch limit per request, the root counted
BRANCH_MODES = ("auto", "on", "off")  # --branches: config's choice, forced on, off


@dataclass(frozen=True)
class BranchRules:
    """The two split token ids and the limits of one model's branching."""

    fork_id: int
    child_id: int
    max_depth: int = MAX_DEPTH
    max_branches: int = MAX_BRANCHES

    def __post_init__(self):
        if self.fork_id == self.child_id or min(self.fork_id, self.child_id) < 0:
            raise ParamError(
                "branches",
                f"fork and child token ids must be two distinct ids >= 0, got "
                f"{self.fork_id} and {self.child_id}",
            )
        if self.max_depth < 0:
            raise ParamError(
                "branch_depth", f"branch depth limit must be >= 0, got {self.max_depth}"
            )
        if self.max_branches < 1:
            raise ParamError(
                "max_branches", f"branch limit must be >= 1 (the root), got {self.max_branches}"
            )

    @property
    def split_ids(self) -> tuple[int, int]:
        return (self.fork_id, self.child_id)

    def row_tokens(self, max_tokens: int) -> int:
        """The most tokens a branch's row holds (after the prompt) while the answer's first
        ``max_tokens`` tokens are still being written: its text before the answer's end and
        its split tokens (a fork token per fork of the request, one kept as text at the
        row's end, and a child token per level). A row that reaches it is past the
        answer's end (module docstring), so this bound never cuts the answer."""
        return max_tokens + self.max_branches + self.max_depth


@dataclass(frozen=True)
class Fork:
    """A new branch forked from a row.

    parent:     the forking branch's id.
    child:      the new branch's id.
    prefix_len: tokens after the prompt that the child's row copies from the parent's row
                (tokens and K/V), the fork token last; the child's next token is forced to
                ``rules.child_id``: its row is ``parent_row[:prefix_len] + [child_id]``.
    """

    parent: int
    child: int
    prefix_len: int


@dataclass(frozen=True)
class Extension:
    """What :meth:`BranchTree.extend` made of a row's new tokens: the row keeps the first
    ``keep`` (the rest are dropped as rejected: the row's cache and length roll back to
    them), and ``fork`` is the branch it forked, if any (the kept tokens end with its fork
    token)."""

    keep: int
    fork: Fork | None = None


class Piece(NamedTuple):
    """A run of one branch's text in the rebuilt text (:meth:`BranchTree.pieces`): its
    ``tokens`` (split tokens left out), and ``writing``: the branch is still running and
    writes its next token right after this run."""

    branch: int
    tokens: tuple[int, ...]
    writing: bool


@dataclass
class Branch:
    """One branch: ``tokens`` are its own (a child's start with the child token),
    ``drafted`` marks each of them that was an accepted draft (``--show-accepted``),
    ``base`` the length of the parent row prefix before them (through the fork token),
    ``forks`` ``[(index of a fork token in tokens, child id), ...]``."""

    id: int
    parent: int | None
    depth: int
    base: int
    tokens: list[int] = field(default_factory=list)
    forks: list[tuple[int, int]] = field(default_factory=list)
    done: bool = False
    drafted: list[bool] = field(default_factory=list)

    def add(self, tokens: list[int], drafted: list[bool]) -> None:
        """Append ``tokens`` with their draft marks."""
        self.tokens.extend(tokens)
        self.drafted.extend(drafted)


class BranchTree:
    """The branches of one request; branch 0 is the root (the request's first row).

    ``budget``: the answer's most tokens (``--max-tokens``; None: no bound here, each row
    bounded by its own limit): the rebuilt text is its first ``budget`` tokens, and branches
    whose text would all lie past them stop (module docstring, "The answer's length")."""

    def __init__(self, rules: BranchRules, budget: int | None = None):
        if budget is not None and budget < 1:
            raise ParamError("max_tokens", f"the answer's token budget must be >= 1, got {budget}")
        self.rules = rules
        self.budget = budget
        self.branches: list[Branch] = [Branch(id=0, parent=None, depth=0, base=0)]
        self._taken = 0  # final tokens already handed out by take_final

    def row(self, branch: int) -> list[int]:
        """The tokens after the prompt that ``branch``'s row holds."""
        b = self.branches[branch]
        head = [] if b.parent is None else self.row(b.parent)[: b.base]
        return head + b.tokens

    def fork_allowed(self, branch: int) -> bool:
        """Whether ``branch`` may fork at all (depth and branch limits; the position rule,
        no split token after a split token, is per position: :func:`mask_split_tokens`)."""
        b = self.branches[branch]
        return (
            not b.done
            and b.depth < self.rules.max_depth
            and len(self.branches) < self.rules.max_branches
        )

    def fork_allowed_rows(self, branches) -> list[bool]:
        """:meth:`fork_allowed` for each of ``branches`` (the ``fork_ok`` of
        :func:`mask_split_tokens`; it changes only when the request forks or a branch ends,
        so it is rebuilt then, not every step)."""
        return [self.fork_allowed(b) for b in branches]

    def extend(self, branch: int, new_tokens, can_fork: bool = True, drafted=None) -> Extension:
        """Record a row's newly accepted tokens (stop tokens left out): all of them, or those
        through the first fork token, which makes a child branch (its child token recorded
        as its first token), or those before a fork past the branch limit (module
        docstring). ``can_fork=False``: the row ends with these tokens (its token limit), so
        a fork token among them makes no child (no room for one): it stays as text, which
        the rebuilt text leaves out; so does a fork whose child's text would lie past the
        answer's ``budget``. ``drafted``: per token, whether it was an accepted draft (None:
        none was); the rebuilt text carries the marks (:meth:`take_final_marked`)."""
        b = self.branches[branch]
        if b.done:
            raise ValueError(f"branch {branch} is finished; it takes no more tokens")
        new_tokens = [int(t) for t in new_tokens]
        marks = [bool(d) for d in drafted or ()][: len(new_tokens)]
        marks += [False] * (len(new_tokens) - len(marks))
        fork_id, child_id = self.rules.split_ids
        # where the text of a fork at new_tokens[i] would land: past the answer, no child
        at = self.ends()[branch] if self.budget is not None else None
        for i, token in enumerate(new_tokens):
            previous = new_tokens[i - 1] if i else self._last(branch)
            if token == child_id:
                raise ValueError(
                    f"branch {branch} emitted the child token {child_id}, which is only forced "
                    "by a fork: the sampler must mask it (mask_split_tokens)"
                )
            if token != fork_id:
                continue
            if not can_fork or (at is not None and at + i >= self.budget):
                if previous in self.rules.split_ids:
                    raise ValueError(f"branch {branch}: a fork token after a split token")
                continue
            if previous in self.rules.split_ids or b.depth >= self.rules.max_depth:
                raise ValueError(
                    f"branch {branch} emitted the fork token {fork_id} where the rules forbid "
                    "it (after a split token, or past the depth limit): the sampler must mask "
                    "it (mask_split_tokens)"
                )
            if len(self.branches) >= self.rules.max_branches:  # another row took the last
                b.add(new_tokens[:i], marks[:i])
                return Extension(keep=i)
            b.add(new_tokens[: i + 1], marks[: i + 1])
            prefix_len = b.base + len(b.tokens)
            child = Branch(
                id=len(self.branches),
                parent=branch,
                depth=b.depth + 1,
                base=prefix_len,
                tokens=[child_id],
                drafted=[False],
            )
            b.forks.append((len(b.tokens) - 1, child.id))
            self.branches.append(child)
            return Extension(keep=i + 1, fork=Fork(branch, child.id, prefix_len))
        b.add(new_tokens, marks)
        return Extension(keep=len(new_tokens))

    def finish(self, branch: int) -> None:
        """Mark ``branch`` finished (it stopped: EOS, a stop string, its token budget)."""
        self.branches[branch].done = True

    @property
    def done(self) -> bool:
        return all(b.done for b in self.branches)

    def ends(self) -> list[int]:
        """Per branch, where its next token would land in the rebuilt text: the text tokens
        before it (its own and its children's spliced in, and all before its start). Other
        branches still write text before it, so it is a lower bound."""
        ends = [0] * len(self.branches)

        def walk(branch: int, at: int) -> int:
            b = self.branches[branch]
            children = dict(b.forks)
            for i, token in enumerate(b.tokens):
                if i in children:
                    at = walk(children[i], at)
                elif token not in self.rules.split_ids:
                    at += 1
            ends[branch] = at
            return at

        walk(0, 0)
        return ends

    def past_budget(self) -> list[int]:
        """The unfinished branches whose text would all lie past the answer's ``budget``
        (:meth:`ends` at or past it): they stop (the caller ends their rows)."""
        if self.budget is None:
            return []
        ends = self.ends()
        return [b.id for b in self.branches if not b.done and ends[b.id] >= self.budget]

    def linear(self) -> list[int]:
        """The whole text as token ids, root -> detail -> next, split tokens left out (its
        first ``budget`` tokens)."""
        return [t for t, _ in self._walk(0, stop_unfinished=False)[0][: self.budget]]

    def final(self) -> list[int]:
        """The longest prefix of :meth:`linear` that no later token can change: the walk in
        text order stops at the end of the first unfinished branch it meets (its next token,
        or a later branch's, would come there)."""
        return [t for t, _ in self._final()]

    def pieces(self) -> tuple[Piece, ...]:
        """The rebuilt text so far, all branches' (not only its final part), as runs of one
        branch each in text order; a running branch's last run is marked ``writing`` (a
        run may be empty, where a branch has not yet written past a fork). Cut at
        ``budget`` like :meth:`linear`. For a live view of the branches growing."""
        out: list[Piece] = []

        def walk(branch: int) -> None:
            b = self.branches[branch]
            children = dict(b.forks)
            run: list[int] = []
            for i, token in enumerate(b.tokens):
                if i in children:
                    out.append(Piece(branch, tuple(run), False))
                    run = []
                    walk(children[i])
                elif token not in self.rules.split_ids:
                    run.append(token)
            out.append(Piece(branch, tuple(run), not b.done))

        walk(0)
        left = self.budget if self.budget is not None else sum(len(p.tokens) for p in out)
        cut = []
        for piece in out:  # at most ``budget`` tokens, like ``linear``
            cut.append(piece._replace(tokens=piece.tokens[:left]))
            left -= len(cut[-1].tokens)
        return tuple(p for p in cut if p.tokens or p.writing)

    def take_final(self) -> list[int]:
        """The tokens of :meth:`final` not handed out by an earlier call (for streaming)."""
        return self.take_final_marked()[0]

    def take_final_marked(self) -> tuple[list[int], list[bool]]:
        """:meth:`take_final` with each token's draft mark (``extend``'s ``drafted``: the
        marks of the branch that wrote it), so the rebuilt text can show accepted drafts."""
        final = self._final()
        new, self._taken = final[self._taken :], len(final)
        return [t for t, _ in new], [d for _, d in new]

    def _final(self) -> list[tuple[int, bool]]:
        """:meth:`final` as (token, drafted) pairs."""
        return self._walk(0, stop_unfinished=True)[0][: self.budget]

    def _walk(self, branch: int, stop_unfinished: bool) -> tuple[list[tuple[int, bool]], bool]:
        """(text tokens of ``branch`` with its children spliced in, each with its draft
        mark, whether the walk stopped inside it)."""
        b = self.branches[branch]
        children = dict(b.forks)
        out: list[tuple[int, bool]] = []
        for i, (token, drafted) in enumerate(zip(b.tokens, b.drafted, strict=True)):
            if i in children:
                text, stopped = self._walk(children[i], stop_unfinished)
                out.extend(text)
                if stopped:
                    return out, True
            elif token not in self.rules.split_ids:
                out.append((token, drafted))
        return out, stop_unfinished and not b.done

    def _last(self, branch: int) -> int | None:
        """The token before ``branch``'s next one in its row (None at the prompt's end)."""
        tokens = self.branches[branch].tokens  # a child's holds its child token at least
        return tokens[-1] if tokens else None


def request_rows(rules: BranchRules | None, max_tokens: int) -> tuple[int, BranchTree | None]:
    """A request's (most tokens each of its rows may hold, its tree): with branching on,
    :meth:`BranchRules.row_tokens` and a tree whose ``budget`` is ``max_tokens`` (the
    answer's length); off, ``max_tokens`` and None. The one rule for every client of the
    loop (``generation``, the server's scheduler)."""
    if rules is None:
        return max_tokens, None
    return rules.row_tokens(max_tokens), BranchTree(rules, budget=max_tokens)


def mask_split_tokens(logits: mx.array, tokens: mx.array, fork_ok: mx.array, rules: BranchRules):
    """The branching rules applied to a step's logits: (B, N, V) -> (B, N, V).

    tokens  (B, N) int32: the token at each position (its logits predict the next one).
    fork_ok (B,) bool:    :meth:`BranchTree.fork_allowed` of each row's branch.
    The child token gets -inf everywhere; the fork token gets -inf where the row may not
    fork or the position's token is a split token. Apply before temperature and filters, so
    greedy, sampling and draft verification all see the same distribution.
    """
    vocab = mx.arange(logits.shape[-1])
    after_split = (tokens == rules.fork_id) | (tokens == rules.child_id)  # (B, N)
    fork_banned = after_split | ~fork_ok[:, None]  # (B, N)
    banned = (vocab == rules.child_id) | ((vocab == rules.fork_id) & fork_banned[..., None])
    return mx.where(banned, mx.array(-float("inf"), logits.dtype), logits)


class SplitRows(NamedTuple):
    """A batch step's per-row branching arrays (the static fork and child ids are the step
    mode's ``split``):

    on      (B,) bool:  the row belongs to a request with branching on (others: untouched)
    fork_ok (B,) bool:  the row may fork this step (:meth:`BranchTree.fork_allowed`, the
                        request's branch limit and the batch's free rows counted)
    forced  (B,) int32: the token the row's root draw is forced to (a new child's child
                        token), -1: none
    linear  (B,) bool:  a row with branching off of a model whose split tokens are its own
                        (``Model.split_ids``): it never draws them (other rows: untouched,
                        whatever the rest of the batch does)
    """

    on: mx.array
    fork_ok: mx.array
    forced: mx.array
    linear: mx.array


def split_rows(on, fork_ok, forced, own: bool = False) -> SplitRows:
    """:class:`SplitRows` from per-row Python lists; ``own``: the split ids are the model's
    own (``Model.split_ids``), so the rows with branching off never draw them."""
    linear = [own and not o for o in on]
    return SplitRows(
        mx.array(list(on), mx.bool_),
        mx.array(list(fork_ok), mx.bool_),
        mx.array(forced, mx.int32),
        mx.array(linear, mx.bool_),
    )


def step_split(trees, fork_ok, forced, model_ids=()) -> tuple[tuple[int, ...], SplitRows | None]:
    """A draw's split ids and per-row arrays: ``trees`` per row (a branching row's
    ``BranchTree``, else None), ``fork_ok`` and ``forced`` per row (:class:`SplitRows`). The
    ids are the branching rows' rules', else the model's own split tokens (``model_ids``,
    ``Model.split_ids``); neither: ``((), None)``, the draw untouched. Where the ids are the
    model's own, its rows with branching off never draw them (``SplitRows.linear``)."""
    model_ids = tuple(model_ids)
    ids = next((t.rules.split_ids for t in trees if t is not None), model_ids)
    if not ids:
        return (), None
    on = [t is not None for t in trees]
    return ids, split_rows(on, fork_ok, forced, own=ids == model_ids)


def split_logits(logits: mx.array, tokens: mx.array, root, sampler) -> mx.array:
    """The branching rules in a step's draws: (B, N, V) -> (B, N, V), unchanged unless the
    step's mode holds split ids (``StepMode.split``: a batch with a branching row, or rows
    of an APAR model, ``Model.split_ids``).

    tokens (B, N): each position's token; root (B or 1, N) bool: positions of the row's
    first draw this step (a forced child token goes there). Rows with branching on get
    :func:`mask_split_tokens`; rows with it off of a model whose split tokens these are
    (``SplitRows.linear``) never draw either; a row with a forced token draws it (every
    other token -inf there), so greedy and sampled draws and verification all take it.
    Apply after the logit bias and penalties, before temperature and filters.
    """
    split, rows = sampler.mode.split, sampler.split
    if not split or rows is None:
        return logits
    rules = BranchRules(*split)
    masked = mask_split_tokens(logits, tokens, rows.fork_ok, rules)
    vocab = mx.arange(logits.shape[-1])
    split_ids = (vocab == rules.fork_id) | (vocab == rules.child_id)
    linear = mx.where(rows.linear[:, None, None] & split_ids, -float("inf"), logits)
    logits = mx.where(rows.on[:, None, None], masked, linear.astype(logits.dtype))
    vocab = mx.arange(logits.shape[-1])
    only = mx.where(vocab == rows.forced[:, None, None], 0.0, -float("inf")).astype(logits.dtype)
    forced_at = (rows.forced[:, None] >= 0) & root  # (B, N)
    return mx.where(forced_at[..., None], only, logits)


NO_TOKEN = -2  # a draft slot no draw equals (token ids and ABSENT are >= -1)


def fork_not_drafted(beams: mx.array, sampler) -> mx.array:
    """Candidates (B, N, L) as acceptance compares them: a branching row's fork token never
    matches its draw, so a step accepts drafts only up to a fork, which can only be the
    step's bonus token (the last one emitted). The row then needs no roll-back: its state
    after the step is the fork's (the fork token drawn, not yet in the cache), which is
    what the child's row copies (:class:`Fork`). Lossless: the draw there is unchanged."""
    split, rows = sampler.mode.split, sampler.split
    if not split or rows is None:
        return beams
    fork = (beams == split[0]) & rows.on.reshape((-1,) + (1,) * (beams.ndim - 1))
    return mx.where(fork, NO_TOKEN, beams)


def find_token_id(model_dir, name: str) -> int | None:
    """The id of the added token ``name`` in a model folder's tokenizer files
    (``added_tokens.json``, ``tokenizer.json``'s ``added_tokens`` or vocabulary,
    ``tokenizer_config.json``'s ``added_tokens_decoder``), None when none names it."""
    path = Path(model_dir)
    added = _read_json(path / "added_tokens.json")
    if isinstance(added, dict) and name in added:
        return _token_id(added[name], path / "added_tokens.json", name)
    tok = _read_json(path / "tokenizer.json") or {}
    for entry in tok.get("added_tokens") or []:
        if isinstance(entry, dict) and entry.get("content") == name:
            return _token_id(entry.get("id"), path / "tokenizer.json", name)
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and name in vocab:
        return _token_id(vocab[name], path / "tokenizer.json", name)
    config = _read_json(path / "tokenizer_config.json") or {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(entry, dict) and entry.get("content") == name:
            return _token_id(key, path / "tokenizer_config.json", name)
    return None


def _token_id(value, file: Path, name: str) -> int:
    """A token id as a tokenizer file gives it (an int, or a whole number as a string in
    ``added_tokens_decoder``); ParamError naming the file otherwise."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ParamError(
        "model",
        f"{file} gives {name} the id {value!r}, not a token id (a whole number >= 0); fix the "
        "file or re-download the tokenizer",
    )


def check_branching_model(model) -> None:
    """ValueError for branches on a model with recurrent layers: a fork copies its parent's
    cache at the fork, and a recurrent state cannot be rewound to it."""
    if getattr(model, "recurrent", False):
        raise ValueError(
            f"parallel branches copy a row's cache at each fork, which {model.model_type}'s "
            "recurrent state cannot be rewound to; decode it as one sequence (--branches off)"
        )


def branch_rules(model_dir, mode: str = "auto", **limits) -> BranchRules | None:
    """The model's branching rules under ``--branches mode``, None when branching is off.

    ``auto`` turns branching on when the model's ``config.json`` has a ``branches`` block
    (``{"fork": name, "child": name}``, written by ``convert`` for APAR checkpoints);
    ``on`` forces it, with the public checkpoints' token names unless the config names
    others. The block may set the model's own ``max_depth`` / ``max_branches`` (a model
    trained on one-level trees: ``max_depth`` 1); ``limits`` (the flags) override them."""
    if mode not in BRANCH_MODES:
        raise ParamError(
            "branches", f"--branches must be one of {', '.join(BRANCH_MODES)}, got {mode!r}"
        )
    config = _read_json(Path(model_dir) / "config.json") or {}
    names = config.get("branches")
    if mode == "off" or (mode == "auto" and not names):
        return None
    names = names or {}
    fork_name = names.get("fork", FORK_TOKEN)
    child_name = names.get("child", CHILD_TOKEN)
    ids = {n: find_token_id(model_dir, n) for n in (fork_name, child_name)}
    missing = [n for n, i in ids.items() if i is None]
    if missing:
        raise ParamError(
            "branches",
            f"--branches {mode} needs the split tokens {fork_name} and {child_name} in the "
            f"model's tokenizer, but {model_dir} has no {' or '.join(missing)}: use an APAR "
            "model (e.g. THUDM/apar-7b through `redrafter-mlx convert`) or --branches off",
        )
    own = {k: names[k] for k in LIMIT_KEYS if k in names}  # the model's own limits
    for key, value in own.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise ParamError(
                "branches",
                f"{model_dir}/config.json's branches block gives {key} {value!r}, not a whole "
                "number: fix the file or pass the limit as a flag",
            )
    return BranchRules(fork_id=ids[fork_name], child_id=ids[child_name], **{**own, **limits})


LIMIT_KEYS = ("max_depth", "max_branches")  # a config's branches block may set them


def split_token_ids(model_dir) -> tuple[int, ...]:
    """The (fork, child) ids of the split tokens a model folder's ``config.json`` names in
    its ``branches`` block (an APAR model), () for any other model or when the tokenizer
    lacks them. A row of such a model that decodes one sequence (branching off) never draws
    them (:func:`split_logits`): they are structure, and the model writes linear text
    without them."""
    config = _read_json(Path(model_dir) / "config.json") or {}
    names = config.get("branches")
    if not isinstance(names, dict):
        return ()
    ids = [
        find_token_id(model_dir, names.get(k, d))
        for k, d in (("fork", FORK_TOKEN), ("child", CHILD_TOKEN))
    ]
    return () if None in ids else tuple(ids)


def _read_json(path: Path):
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ParamError("model", f"cannot read {path}: {e}; fix or remove the file") from e
