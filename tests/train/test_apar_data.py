"""APAR training data (train/apar_data.py): paragraph trees by rule from hand-written answers,
each rejection rule, and the per-branch causal sequences with their loss start."""

from __future__ import annotations

import pytest

from redrafter_mlx.train.apar_data import (
    SplitIds,
    Stream,
    branch_sequences,
    mixed_samples,
    paragraph_tree,
    rule_counts,
    trim_cut,
)

LIST_ANSWER = """Here are some tips for better sleep:

1. Keep a schedule: go to bed and wake up at the same time every day.
2. **Limit screens**: avoid phones and laptops for an hour before bed.
3. Watch your diet: skip caffeine and heavy meals late in the evening.

Sleep well!"""

PARAGRAPH_ANSWER = """Exercise helps the heart in many ways. It strengthens the muscle and lowers \
the resting pulse over time.

Regular walking is a gentle place to start. Even twenty minutes a day improves circulation and mood.

Strength training matters as people age. It keeps bones dense and makes falls less likely.

Rest days are part of the plan too."""


def test_list_answer_puts_each_items_details_in_a_child():
    result = paragraph_tree(LIST_ANSWER)
    assert result.rule == "list"
    tree = result.tree
    assert tree.text() == LIST_ANSWER  # rebuilt root -> detail -> next
    assert [c.text() for c in tree.children()] == [
        " go to bed and wake up at the same time every day.",
        " avoid phones and laptops for an hour before bed.",
        " skip caffeine and heavy meals late in the evening.",
    ]
    assert tree.marked("<F>") == (
        "Here are some tips for better sleep:\n\n1. Keep a schedule:<F>\n"
        "2. **Limit screens**:<F>\n3. Watch your diet:<F>\n\nSleep well!"
    )


DASH_LIST = """Tips for calm:

1. **Breathe slowly** - Count to four on each breath in and out.

2. **Sit still** - Keep your back straight and your hands resting.

3. **Start small** - Five minutes a day is enough at first - really."""


def test_dash_separated_titles_are_list_items_too():
    """SmolLM2's own list form, ``N. **Title** - details``: the first dash ends the title."""
    result = paragraph_tree(DASH_LIST)
    assert result.rule == "list"
    assert result.tree.text() == DASH_LIST
    assert [c.text() for c in result.tree.children()] == [
        " Count to four on each breath in and out.",
        " Keep your back straight and your hands resting.",
        " Five minutes a day is enough at first - really.",
    ]
    assert "**Breathe slowly** -<F>\n\n2." in result.tree.marked("<F>")


def test_paragraph_answer_keeps_first_sentences_in_the_parent():
    result = paragraph_tree(PARAGRAPH_ANSWER)
    assert result.rule == "paragraphs"
    tree = result.tree
    assert tree.text() == PARAGRAPH_ANSWER
    assert len(tree.children()) == 3  # the last paragraph has one sentence: no fork
    assert tree.marked("<F>").startswith("Exercise helps the heart in many ways.<F>\n\nRegular")
    assert tree.children()[1].text() == " Even twenty minutes a day improves circulation and mood."


@pytest.mark.parametrize(
    "answer, rule",
    [
        (LIST_ANSWER + "\n\n```python\nprint(1)\n```", "code"),
        (LIST_ANSWER.replace("every day", "when x^2 grows"), "maths"),
        (LIST_ANSWER + "\n\n$E = mc^2$", "maths"),
        (LIST_ANSWER.replace("Sleep well!", "<b>Sleep well!</b>"), "markup"),
        ("# Tips\n\n" + LIST_ANSWER, "markup"),
        (LIST_ANSWER + "\nSee https://example.com for more.", "link"),
        (LIST_ANSWER + "\n睡眠很重要。", "cjk"),
        (
            LIST_ANSWER.replace(" skip caffeine and heavy meals late in the evening.", " no tea."),
            "short stream",
        ),
        (PARAGRAPH_ANSWER.split("\n\nStrength")[0] + "\n\nShort one.", "few forks"),
        ("One paragraph only. It has two sentences.", "no structure"),
        ("1. A: first item details here.\n2. B: second item details here.", "no structure"),
    ],
)
def test_rejection_rules(answer, rule):
    result = paragraph_tree(answer)
    assert (result.tree, result.rule) == (None, rule)


def test_list_items_must_be_one_run_of_one_kind():
    mixed = (
        "Intro line here.\n\n1. A: details number one.\n- B: details number two.\n"
        "3. C: details three."
    )
    assert paragraph_tree(mixed).rule != "list"


def test_branch_sequences_are_the_rows_decoding_sees_with_loss_after_the_last_child():
    ids = SplitIds(fork=100, child=101, eos=0)
    encode = lambda text: [ord(c) for c in text]  # one id per character
    tree = Stream(["A:", Stream([" aa"]), "\nB:", Stream([" bb", Stream(["x"]), "!"]), "\nend"])
    prompt = [1, 2]
    seqs = branch_sequences(prompt, tree, encode, ids)
    root = [1, 2, *encode("A:"), 100, *encode("\nB:"), 100, *encode("\nend"), 0]
    first = [1, 2, *encode("A:"), 100, 101, *encode(" aa"), 0]
    second_head = [1, 2, *encode("A:"), 100, *encode("\nB:"), 100, 101]
    second = second_head + [*encode(" bb"), 100, *encode("!"), 0]
    nested = second_head + [*encode(" bb"), 100, 101, *encode("x"), 0]
    assert seqs == [
        (root, 2),
        (first, len(first) - 4),
        (second, len(second_head)),
        (nested, len(nested) - 2),
    ]
    for tokens, loss_from in seqs[1:]:
        assert tokens[loss_from - 1] == ids.child  # the loss starts after the last child token


def test_mixed_samples_half_and_half_and_rule_counts():
    answers = [
        LIST_ANSWER,
        PARAGRAPH_ANSWER,
        "Just one line.",
        "Another plain answer.",
        "def f(x):\n    return x",
    ]
    results = [paragraph_tree(a) for a in answers]
    assert rule_counts(results) == {"list": 1, "paragraphs": 1, "no structure": 2, "code": 1}
    mixed = mixed_samples(results, answers, seed=3)
    forked = [i for i, t in mixed if t.children()]
    unforked = [i for i, t in mixed if not t.children()]
    assert sorted(forked) == [0, 1] and len(unforked) == 2 and not set(unforked) & {0, 1}
    assert all(t.text() == answers[i] for i, t in mixed)
    assert mixed == mixed_samples(results, answers, seed=3)


def test_trim_cut_drops_the_unfinished_paragraph():
    assert trim_cut("First paragraph.\n\nSecond one.\n\nThird, cut in the mid") == (
        "First paragraph.\n\nSecond one."
    )
    assert trim_cut("One paragraph cut in the mid") is None
