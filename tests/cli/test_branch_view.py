"""The chat's live view of APAR branches (cli/branch_view.py, ``chat_ui.BranchAnswer``): the
rebuilt text in order, final text plain, open branches dim in place with a cursor each; on a
terminal it gives way to the final text, off one only the final text is printed."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from rich.console import Console

from redrafter_mlx.cli.branch_view import CURSOR, OPEN_STYLE, BranchView, render_branches
from redrafter_mlx.cli.chat_ui import ChatLoop
from redrafter_mlx.cli.common import BeamFlags, ModelPaths, load_engine, plan_from_flags
from redrafter_mlx.engine.core.branches import BranchRules, BranchTree, Piece
from redrafter_mlx.engine.core.sampling import SamplerConfig

F, C = 6, 7  # toy fork and child ids; text tokens 1..5 decode to letters a..e
TOY = BranchRules(fork_id=F, child_id=C)


def letters(ids) -> str:
    return "".join(chr(ord("a") + i - 1) for i in ids)


def test_pieces_are_the_rebuilt_text_by_branch_with_the_writers_marked():
    tree = BranchTree(TOY)
    tree.extend(0, [1, 2, F])  # the detail of [1, 2] goes to branch 1
    tree.extend(0, [3])
    tree.extend(1, [4])
    assert tree.pieces() == (
        Piece(0, (1, 2), False),
        Piece(1, (4,), True),
        Piece(0, (3,), True),
    )
    tree.finish(1)
    tree.finish(0)
    assert [p.writing for p in tree.pieces()] == [False, False, False]
    assert [t for p in tree.pieces() for t in p.tokens] == tree.linear()
    budget = BranchTree(TOY, budget=3)
    budget.extend(0, [1, 2, F])
    budget.extend(0, [3])
    budget.extend(1, [4, 5])
    assert [t for p in budget.pieces() for t in p.tokens] == budget.linear() == [1, 2, 4]


def test_the_rebuilt_text_carries_each_branchs_draft_marks():
    """Each token's accepted-draft mark goes with it into the rebuilt text: the detail's
    marks come where its text does (root -> detail -> next), the split tokens' go."""
    tree = BranchTree(TOY)
    tree.extend(0, [1, 2, F], drafted=[True, False, False])
    tree.extend(0, [3], drafted=[True])
    tree.extend(1, [4, 5], drafted=[True, True])
    assert tree.take_final_marked() == ([1, 2, 4, 5], [True, False, True, True])
    tree.finish(1)
    tree.extend(0, [1])  # no marks: none was a draft
    tree.finish(0)
    assert tree.take_final_marked() == ([3, 1], [True, False])
    assert tree.take_final_marked() == ([], [])


def scripted():
    """A toy answer's events as (tree steps, final tokens handed out): the root forks a
    detail, writes the next item beside it, the detail finishes, then the root."""
    tree = BranchTree(TOY)
    steps = [
        lambda: tree.extend(0, [1, 2, F]),
        lambda: (tree.extend(0, [3]), tree.extend(1, [4])),
        lambda: (tree.extend(0, [5]), tree.extend(1, [5]), tree.finish(1)),
        lambda: (tree.extend(0, [1]), tree.finish(0)),
    ]
    for n, step in enumerate(steps, 1):
        step()
        new = tree.take_final()
        yield SimpleNamespace(
            text=letters(new),
            tokens=new,
            branch_pieces=tree.pieces(),
            steps=n,
            branches=len(tree.branches),
        )


def dim_text(shown, body: int) -> list[str]:
    """The dimmed runs of the view's first ``body`` characters (the status line is dim too)."""
    return [
        shown.plain[s.start : s.end] for s in shown.spans if s.style == OPEN_STYLE and s.end <= body
    ]


def test_the_view_grows_in_order_and_settles_into_the_final_text():
    view = BranchView(letters)
    shown = []
    for response in scripted():
        view.update(response)
        shown.append(render_branches(view, width=40))
    lines = [t.plain.split("\n") for t in shown]
    # step 1: the root's item is final up to the fork; there the detail (not begun) and the
    # root (its next item, after the detail) both write: a cursor each
    assert lines[0][0] == "ab" + CURSOR + CURSOR
    # step 2: the detail "d" in place (final: nothing can come before it), a cursor after
    # it, then the root's next item "c", open (dim: the detail may still grow before it)
    assert lines[1][0] == "ab" + "d" + CURSOR + "c" + CURSOR
    assert lines[1][1] == "[2 branches, 2 writing · 2 steps]"
    assert dim_text(shown[1], len(lines[1][0])) == ["c"]
    # step 3: the detail finished: everything up to the root's cursor is final
    assert lines[2][0] == "abdece" + CURSOR and dim_text(shown[2], len(lines[2][0])) == []
    # the end: the final text alone, no cursor
    assert lines[3][0] == "abdecea" and view.final_text == "abdecea"
    assert lines[3][1] == "[2 branches, 0 writing · 4 steps]"


def test_the_view_never_outgrows_the_terminal():
    view = BranchView(letters)
    view.update(SimpleNamespace(text="", tokens=[], branch_pieces=(), steps=1, branches=1))
    view.final_text = "\n".join(f"line {i}" for i in range(30))
    shown = render_branches(view, width=20, height=5).plain.split("\n")
    assert shown[:-1] == ["line 26", "line 27", "line 28", "line 29"]
    assert shown[-1].startswith("[1 branches")


# --------------------------------------------------------------------------- in the chat


@pytest.fixture(scope="module")
def apar_engine(apar_folder):
    return load_engine(ModelPaths(str(apar_folder), None), None)


def chat_loop(engine, terminal: bool, show_accepted: bool = False) -> ChatLoop:
    """A chat on the demo model marked as an APAR model, forks biased up (4094), greedy."""
    console = Console(
        file=io.StringIO(),
        width=100,
        height=20,
        highlight=False,
        soft_wrap=True,
        force_terminal=terminal,
        color_system="standard" if terminal else None,
    )
    plan = plan_from_flags(engine.paths, None, BeamFlags())
    sampler = SamplerConfig(logit_bias=((4094, 40.0),))
    loop = ChatLoop(engine, plan, sampler, 24, console=console, show_accepted=show_accepted)
    loop.branches, loop.adapt = "auto", False
    return loop


def test_chat_on_a_terminal_shows_the_branches_live_then_the_answer(apar_engine):
    loop = chat_loop(apar_engine, terminal=True)
    text = loop.answer("hi")
    out = loop.console.file.getvalue()
    assert loop.last.branches > 1 and text
    assert CURSOR in out and "writing ·" in out  # the live view was drawn
    assert out.rindex(text) > out.rindex(CURSOR)  # then the answer, printed in full
    assert f"{loop.last.branches} branches · {loop.last.steps} steps (" in out  # stats line


def test_chat_off_a_terminal_prints_the_rebuilt_text_once(apar_engine):
    loop = chat_loop(apar_engine, terminal=False)
    text = loop.answer("hi")
    out = loop.console.file.getvalue()
    assert text and CURSOR not in out and "writing ·" not in out
    assert out.startswith(text + "\n") and out.count(text) == 1


def test_ctrl_c_keeps_the_final_text_of_a_branching_answer(apar_engine):
    from tests.support.chat import interrupt_after

    whole = chat_loop(apar_engine, terminal=True).answer("hi")
    loop = chat_loop(apar_engine, terminal=True)
    loop.stream = interrupt_after(12)
    partial = loop.answer("hi")
    assert whole.startswith(partial) and len(partial) < len(whole)
    out = loop.console.file.getvalue()
    assert "[interrupted" in out
    assert partial, "the test needs some final text before the interruption"
    assert loop.messages[-1] == {"role": "assistant", "content": partial}
    assert out.rindex(partial) > out.rindex(CURSOR)


def test_show_accepted_colours_each_branchs_accepted_drafts_in_the_answer(apar_engine):
    """``--show-accepted`` with branches: the settled answer colours the tokens accepted from
    drafts (here from context lookup) as a linear answer does, each mark carried from the
    branch that wrote the token; the text itself is the same."""
    from redrafter_mlx.cli.chat_ui import DRAFTED_STYLE, accepted_chunk
    from redrafter_mlx.engine.base.tokenizer import StreamDecoder
    from redrafter_mlx.engine.loop.generation import stream_generate

    loop = chat_loop(apar_engine, terminal=True, show_accepted=True)
    responses = []

    def recording(*args, **kwargs):
        for response in stream_generate(*args, **kwargs):
            responses.append(response)
            yield response

    loop.stream = recording
    text = loop.answer("hi")
    assert loop.last.branches > 1 and text
    tokens = [t for r in responses for t in r.tokens]
    marks = [m for r in responses for m in r.drafted_tokens]
    assert len(marks) == len(tokens) and 0 < sum(marks) < len(tokens)
    assert sum(marks) <= loop.last.accepted_tokens  # of those, the answer's (not cut off)
    out = loop.console.file.getvalue()
    settled = out[out.rindex(CURSOR) :]  # after the live view: the final text, printed once
    expected = accepted_chunk(StreamDecoder(apar_engine.tokenizer), tokens, marks, True)
    assert expected.plain == text
    assert any(span.style == DRAFTED_STYLE for span in expected.spans)
    ansi = Console(file=io.StringIO(), force_terminal=True, color_system="standard", width=100)
    ansi.print(expected, end="", soft_wrap=True)
    assert ansi.file.getvalue() in settled  # coloured exactly as the marks say
    assert "\x1b[32m" in out[: out.rindex(CURSOR)]  # the live view's final part too
    plain = chat_loop(apar_engine, terminal=True)
    assert plain.answer("hi") == text  # the same answer uncoloured
