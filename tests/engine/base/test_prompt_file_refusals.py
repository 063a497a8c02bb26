"""A prompts file (JSON lines of turns) with an empty turn is refused, naming its line and turn."""

from __future__ import annotations

import pytest


def test_a_prompts_line_with_an_empty_turn_is_refused(tmp_path):
    from redrafter_mlx.engine.base.prompts import PromptSetError, parse_records

    text = '{"turns": ["hi", "there"]}\n{"turns": ["first", "  "]}\n'
    with pytest.raises(PromptSetError, match=r"p.jsonl:2's turn 2 is empty"):
        parse_records(text, "p.jsonl")
