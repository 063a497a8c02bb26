"""The live view of an answer whose APAR branches decode side by side (``chat`` on a terminal).

While the branches run, the view shows the whole rebuilt text so far in order: the part no
branch can change any more (the answer's final text, as streamed) in the normal style, then
the text of the branches still being written, each in place (a list item's details under its
heading, the next item after them), dimmed, with a cursor where each running branch writes
next, and a status line (branches, how many are writing, sequential steps). With
``--show-accepted`` the final part colours the tokens accepted from drafts, as a linear
answer does. When the answer ends the view goes away and the chat prints the final text as a
normal answer.

:func:`render_branches` is a pure function of the view's state (:class:`BranchView`), so the
tests drive it with scripted events; the chat owns the ``rich.live.Live`` around it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.text import Text

from redrafter_mlx.cli.terminal import visible

OPEN_STYLE = "dim"  # text of branches still running
CURSOR = "▌"  # where a running branch writes next
CURSOR_STYLE = "cyan"


@dataclass
class BranchView:
    """The state of one answer's live view, updated by each streamed response.

    decode:      token ids -> text (the tokenizer's)
    final_text:  the answer's final text so far (the responses' ``text``, exact)
    final_count: its tokens (the responses' ``tokens``): the first ``final_count`` tokens of
                 ``pieces`` are final
    pieces:      the whole rebuilt text so far by branch (``GenerationResponse.branch_pieces``)
    steps:       sequential steps so far
    branches:    branches so far, the root counted
    marked:      with ``--show-accepted``, ``final_text`` as shown, its accepted drafts
                 coloured (the chat builds it: ``chat_ui.accepted_chunk``); None: plain
    """

    decode: Callable[[Sequence[int]], str]
    final_text: str = ""
    final_count: int = 0
    pieces: tuple = ()
    steps: int = 0
    branches: int = 1
    marked: Text | None = None

    def update(self, response) -> None:
        """Take one streamed ``GenerationResponse``."""
        self.final_text += response.text
        self.final_count += len(response.tokens)
        self.pieces = response.branch_pieces or self.pieces
        self.steps = response.steps
        self.branches = max(response.branches, 1)


def render_branches(view: BranchView, width: int, height: int | None = None) -> Text:
    """The view as text: final text, then the open branches' text in place (dim), a cursor
    at each running branch, and a status line; wrapped to ``width`` and, with ``height``,
    cut to its last ``height`` lines (the status line always shown), so a live display never
    outgrows the terminal."""
    body = Text(visible(view.final_text)) if view.marked is None else view.marked.copy()
    skip = view.final_count  # tokens of the pieces that are already in final_text
    for piece in view.pieces:
        tokens = piece.tokens[skip:]
        skip = max(skip - len(piece.tokens), 0)
        if tokens:
            body.append(visible(view.decode(list(tokens))), style=OPEN_STYLE)
        if piece.writing and skip == 0:
            body.append(CURSOR, style=CURSOR_STYLE)
    status = Text(status_line(view), style="dim")
    if height is None:
        return Text("\n").join([body, status])
    lines = body.wrap(Console(width=width, color_system=None), width)
    kept = list(lines)[-max(height - 1, 1) :]
    return Text("\n").join([*kept, status])


def status_line(view: BranchView) -> str:
    """``[5 branches, 2 writing · 14 steps]``."""
    writing = sum(p.writing for p in view.pieces)
    return f"[{view.branches} branches, {writing} writing · {view.steps} steps]"


__all__ = ["BranchView", "render_branches", "status_line"]
