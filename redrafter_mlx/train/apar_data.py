"""APAR training data (arXiv 2401.06761): answers made into paragraph trees by rule, and each
branch as a causal training sequence of its own.

A paragraph tree is a :class:`Stream`: text pieces with child streams between them. Written
as the model sees it, a stream is its text with the fork token where each child stands
(``1. Title:[SplitMask]\\n2. Title:...``); a child stream is the details the fork leaves out
(`` details of item 1``). Rebuilt root -> detail -> next (:meth:`Stream.text`), a tree gives
back the answer exactly.

The rules (APAR's data pipeline, the first turn of a conversation only):

1. *List*: a numbered or bulleted list of at least ``MIN_ITEMS`` lines shaped
   ``N. title: details`` (``- title: details``, or ``N. **title** - details`` as small chat
   models write it) puts each item's details in a child stream;
   the parent keeps ``N. title:``, the fork token and the line break. A stream shorter than
   ``MIN_STREAM_CHARS`` rejects the sample.
2. *Paragraphs*: otherwise, text of more than 2 paragraphs keeps each paragraph's first
   sentence in the parent, followed by the fork token, and the rest becomes a child; only
   where both pieces have ``MIN_PIECE_CHARS`` characters; fewer than ``MIN_FORKS`` forks
   reject the sample.
3. Code, maths, markup, links and CJK text reject the sample before either rule.

Training: every stream is one sequence: prompt, the ancestors' text up to the fork (their
earlier forks kept as fork tokens), fork and child tokens, the stream's own text, EOS; the
loss starts after the last child token (after the prompt for the root). Structured samples
and unstructured ones (the answer as one stream, no fork) are mixed half and half.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field

MIN_ITEMS = 3  # list items needed for the list rule
MIN_STREAM_CHARS = 10  # a stream shorter than this rejects a list sample
MIN_PIECE_CHARS = 20  # a paragraph's first sentence and its rest both at least this long
MIN_FORKS = 3  # forks needed for the paragraph rule
MIN_PARAGRAPHS = 3  # "more than 2 paragraphs"

# One regex per excluded kind; the first that matches names the rejection.
EXCLUDED = {
    "code": re.compile(
        r"```|^(?: {4}|\t)\S|^\s*(?:def|class|import|function|const|var)\s+\w|[;{]\s*$", re.M
    ),
    "maths": re.compile(r"\$|\\[([]|\\frac|\\sum|\\sqrt|\b\w+\^\w|\d\s*[=<>]\s*\d|[∑∫√≤≥≠±×÷]"),
    "markup": re.compile(
        r"</?[A-Za-z][^>\n]*>|^\s*#{1,6}\s|^\s*\|.*\|\s*$|\*\*\*|^\s*---+\s*$", re.M
    ),
    "link": re.compile(r"https?://|www\.|\]\(|\b\S+\.(?:com|org|net|io)\b"),
    "cjk": re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uff00-\uffef]"),
}
# "1. Title: details", "2) **Title**: details", "- Title: details", and the dash form small
# chat models write, "1. **Title** - details" (also – and —); the title has no colon and at
# most 80 characters (the first separator ends it); the details run to the end of the line.
LIST_ITEM = re.compile(
    r"^(?P<head>[ \t]*(?P<mark>\d{1,2}[.)]|[-*+•])[ \t]+[^:\n]{1,80}?(?::|[ \t][-–—]))"
    r"(?P<details>[^\n]*\S)[ \t]*$",
    re.M,
)
PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
FIRST_SENTENCE = re.compile(r".+?[.!?](?=\s)", re.S)


@dataclass
class Stream:
    """One stream of a paragraph tree: ``parts`` alternate text and child streams."""

    parts: list = field(default_factory=list)

    def text(self) -> str:
        """The linear text, each child's text where its fork stands."""
        return "".join(p if isinstance(p, str) else p.text() for p in self.parts)

    def marked(self, fork: str) -> str:
        """The stream as the model writes it: ``fork`` where each child stands."""
        return "".join(p if isinstance(p, str) else fork for p in self.parts)

    def children(self) -> list[Stream]:
        return [p for p in self.parts if isinstance(p, Stream)]

    def streams(self) -> list[Stream]:
        """This stream and all below it, parents first."""
        out = [self]
        for child in self.children():
            out.extend(child.streams())
        return out


@dataclass(frozen=True)
class TreeResult:
    """A paragraph tree (None when rejected) and the rule that decided: ``list``,
    ``paragraphs``, or a rejection (``code``, ``maths``, ``markup``, ``link``, ``cjk``,
    ``short stream``, ``few forks``, ``no structure``)."""

    tree: Stream | None
    rule: str


def paragraph_tree(answer: str) -> TreeResult:
    """The paragraph tree of ``answer`` by the rules in the module docstring."""
    for kind, pattern in EXCLUDED.items():
        if pattern.search(answer):
            return TreeResult(None, kind)
    listed = list_tree(answer)
    if listed is not None:
        return listed
    return paragraphs_tree(answer)


def list_tree(answer: str) -> TreeResult | None:
    """Rule 1, or None when the answer has no list of ``MIN_ITEMS`` items of one kind."""
    items = list(LIST_ITEM.finditer(answer))
    runs: list[list[re.Match]] = []
    for m in items:  # consecutive items of one marker kind (numbers, or one bullet)
        kind = "n" if m["mark"][0].isdigit() else m["mark"]
        prev = runs[-1][-1] if runs else None
        joined = prev is not None and answer[prev.end() : m.start()].strip() == ""
        if joined and ("n" if prev["mark"][0].isdigit() else prev["mark"]) == kind:
            runs[-1].append(m)
        else:
            runs.append([m])
    run = max(runs, key=len, default=[])
    if len(run) < MIN_ITEMS:
        return None
    parts, at = [], 0
    for m in run:
        parts += [answer[at : m.end("head")], Stream([m["details"]])]
        at = m.end("details")
    parts.append(answer[at:])
    tree = Stream(parts)
    if any(len(s.marked("").strip()) < MIN_STREAM_CHARS for s in tree.streams()):
        return TreeResult(None, "short stream")
    return TreeResult(tree, "list")


def paragraphs_tree(answer: str) -> TreeResult:
    """Rule 2: each paragraph's first sentence stays, the rest becomes a child."""
    pieces = PARAGRAPH_BREAK.split(answer)
    breaks = PARAGRAPH_BREAK.findall(answer)
    if len([p for p in pieces if p.strip()]) < MIN_PARAGRAPHS:
        return TreeResult(None, "no structure")
    parts, forks = [], 0
    for i, piece in enumerate(pieces):
        first = FIRST_SENTENCE.match(piece)
        rest = piece[first.end() :] if first else ""
        if (
            first
            and len(first[0].strip()) >= MIN_PIECE_CHARS
            and len(rest.strip()) >= MIN_PIECE_CHARS
        ):
            parts += [first[0], Stream([rest])]
            forks += 1
        else:
            parts.append(piece)
        if i < len(breaks):
            parts.append(breaks[i])
    if forks < MIN_FORKS:
        return TreeResult(None, "few forks")
    return TreeResult(Stream(_merge_text(parts)), "paragraphs")


def _merge_text(parts: list) -> list:
    """Adjacent text pieces joined (so text and child streams alternate)."""
    out: list = []
    for p in parts:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        else:
            out.append(p)
    return out


def trim_cut(answer: str) -> str | None:
    """An answer cut at the token limit, ended at its last paragraph break (the unfinished
    paragraph dropped); None when it has no finished paragraph."""
    breaks = list(PARAGRAPH_BREAK.finditer(answer))
    return answer[: breaks[-1].start()].rstrip() if breaks else None


@dataclass(frozen=True)
class SplitIds:
    """The token ids a training sequence needs besides text."""

    fork: int
    child: int
    eos: int


def branch_sequences(
    prompt: list[int], tree: Stream, encode, ids: SplitIds
) -> list[tuple[list[int], int]]:
    """Each stream of ``tree`` as ``(tokens, loss_from)``: the causal sequence its decoding row
    holds (module docstring) and the index of the first token with loss (mlx-lm's
    ``(tokens, offset)`` dataset items). ``encode(text)`` gives ids without BOS; each text
    piece is encoded on its own, so a parent's prefix has the same ids in every sequence."""
    out: list[tuple[list[int], int]] = []

    def walk(stream: Stream, head: list[int]) -> None:
        own: list[int] = []
        forks: list[tuple[int, Stream]] = []
        for p in stream.parts:
            if isinstance(p, str):
                own += encode(p) if p else []
            else:
                own.append(ids.fork)
                forks.append((len(own), p))
        out.append((head + own + [ids.eos], len(head)))
        for end, child in forks:
            walk(child, head + own[:end] + [ids.child])

    walk(tree, list(prompt))
    return out


def mixed_samples(
    results: list[TreeResult], answers: list[str], seed: int = 0
) -> list[tuple[int, Stream]]:
    """Structured and unstructured samples half and half: ``[(answer index, tree), ...]``,
    every structured tree, and as many answers without structure (rejected ones first
    choice: they teach the model not to fork) as single streams, in a seeded order."""
    structured = [(i, r.tree) for i, r in enumerate(results) if r.tree is not None]
    plain = [i for i, r in enumerate(results) if r.tree is None]
    rng = random.Random(seed)
    rng.shuffle(plain)
    unstructured = [(i, Stream([answers[i]])) for i in plain[: len(structured)]]
    mixed = structured + unstructured
    rng.shuffle(mixed)
    return mixed


def rule_counts(results: list[TreeResult]) -> dict[str, int]:
    """How many answers each rule kept or rejected."""
    return dict(Counter(r.rule for r in results))
