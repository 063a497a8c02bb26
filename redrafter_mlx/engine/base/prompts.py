"""Prompt sets: the built-in ones (MT-Bench, Vicuna-bench, the edit set, the list requests,
the demo model's held-out prompts) or a user's file, read the same way by ``bench``, ``tune``
and the build scripts.

A file is JSONL (each line ``{"turns": [str, ...]}``, ``{"prompt": str}`` or ``{"text": str}``,
with an optional ``"category"``) or plain text with one prompt per line. :func:`load_prompts`
gives the first turn of each; :func:`load_records` keeps every turn and the category.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .bundled import PACKAGE_ROOT, heldout_prompts_path
from .errors import RedrafterError

PACKAGE_DATA = PACKAGE_ROOT / "data"
PROMPT_SETS = {
    "mt-bench": PACKAGE_DATA / "mt_bench_questions.jsonl",
    "vicuna-bench": PACKAGE_DATA / "vicuna_bench_questions.jsonl",
    "edit": PACKAGE_DATA / "edit_prompts.jsonl",
    # requests answered with lists: MT-Bench writing and humanities (first turns) and asks for
    # tips or steps on topics the APAR training prompts leave out (scripts.build_smollm2_apar)
    "lists": PACKAGE_DATA / "list_prompts.jsonl",
    "demo": heldout_prompts_path(),
}


class PromptSetError(RedrafterError, ValueError):
    """A prompt set that cannot be read; the message names the file and the fix."""


def prompt_source(spec: str) -> Path:
    """The file behind a prompt-set name or a path."""
    if spec in PROMPT_SETS:
        return PROMPT_SETS[spec]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise PromptSetError(
            f"{spec!r} is not a file and neither a prompt set ({', '.join(PROMPT_SETS)}); pass "
            f"a .jsonl file (with 'turns', 'prompt' or 'text') or a .txt file (one per line)"
        )
    return path


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a set: its user turns (the first is the prompt) and its category."""

    turns: tuple[str, ...]
    category: str | None = None

    @property
    def prompt(self) -> str:
        """The first turn."""
        return self.turns[0]


def parse_records(text: str, source: str) -> list[PromptRecord]:
    """Records of a JSONL text (``turns``, ``prompt`` or ``text``; ``category``) or one
    single-turn prompt per line.

    The text is JSONL when ``source`` ends in ``.jsonl`` or its first line is a JSON object.
    A record's turns are its leading string turns (at least the first).
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not (source.endswith(".jsonl") or (lines and lines[0].startswith("{"))):
        return [PromptRecord((line,)) for line in lines]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError as e:
            raise PromptSetError(
                f"{source}:{number} is not valid JSON ({e}); each line must be an object "
                f'with "turns": [str, ...], "prompt" or "text"'
            ) from None
        record = record if isinstance(record, dict) else {}
        turns = record.get("turns")
        if turns and isinstance(turns, list):
            kept: list = []
            for turn in turns:
                if not isinstance(turn, str):
                    break
                kept.append(turn)
            turns = kept or [turns[0]]
        else:
            turns = [record.get("prompt") or record.get("text")]
        if not isinstance(turns[0], str):
            raise PromptSetError(f"{source}:{number} has no 'turns', 'prompt' or 'text' string")
        empty = next((i for i, turn in enumerate(turns, 1) if not turn.strip()), None)
        if empty is not None:
            raise PromptSetError(
                f"{source}:{number}'s turn {empty} is empty; give every turn some text (or "
                "remove the line)"
            )
        category = record.get("category")
        records.append(PromptRecord(tuple(turns), category if isinstance(category, str) else None))
    return records


def parse_prompts(text: str, source: str) -> list[str]:
    """Prompts of a JSONL text (first turn, ``prompt`` or ``text``) or one per line."""
    return [record.prompt for record in parse_records(text, source)]


def spread(records: list[PromptRecord], count: int) -> list[PromptRecord]:
    """``count`` records spread over the categories: round-robin over the categories in file
    order (the first of each, then the second of each, ...), returned in file order.

    Records without a category count as one more category; a file without categories gives
    its first ``count``.
    """
    groups: dict[str | None, list[int]] = {}
    for index, record in enumerate(records):
        groups.setdefault(record.category, []).append(index)
    chosen: list[int] = []
    depth = 0
    while len(chosen) < min(count, len(records)):
        for members in groups.values():
            if depth < len(members) and len(chosen) < count:
                chosen.append(members[depth])
        depth += 1
    return [records[i] for i in sorted(chosen)]


def load_records(
    spec: str, limit: int | None = None, spread_categories: bool = False
) -> list[PromptRecord]:
    """``limit`` records (all when None) of a prompt set or file: the first ones, or with
    ``spread_categories`` spread over its categories (:func:`spread`)."""
    source = prompt_source(spec)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as e:
        raise PromptSetError(f"prompt set {spec!r} cannot be read ({e})") from None
    except UnicodeDecodeError as e:
        raise PromptSetError(
            f"{source} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
            f"pass a UTF-8 .jsonl file (with 'turns', 'prompt' or 'text') or a .txt file "
            f"(one prompt per line)"
        ) from None
    records = parse_records(text, str(source))
    if not records:
        raise PromptSetError(f"{source} holds no prompts")
    if limit is None:
        return records
    return spread(records, limit) if spread_categories else records[:limit]


def load_prompts(spec: str, limit: int | None = None) -> list[str]:
    """The first ``limit`` prompts (all when None) of a prompt set or file."""
    return [record.prompt for record in load_records(spec, limit)]
