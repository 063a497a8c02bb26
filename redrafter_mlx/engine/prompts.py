"""Prompt sets: the built-in ones (MT-Bench, Vicuna-bench, the demo model's held-out prompts)
or a user's file, read the same way by ``bench``, ``tune`` and the build scripts.

A file is JSONL (each line ``{"turns": [str, ...]}``, ``{"prompt": str}`` or ``{"text": str}``;
the first turn is used) or plain text with one prompt per line.
"""

from __future__ import annotations

import json
from pathlib import Path

from .bundled import PACKAGE_ROOT, heldout_prompts_path

PACKAGE_DATA = PACKAGE_ROOT / "data"
PROMPT_SETS = {
    "mt-bench": PACKAGE_DATA / "mt_bench_questions.jsonl",
    "vicuna-bench": PACKAGE_DATA / "vicuna_bench_questions.jsonl",
    "demo": heldout_prompts_path(),
}


class PromptSetError(ValueError):
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


def parse_prompts(text: str, source: str) -> list[str]:
    """Prompts of a JSONL text (first turn, ``prompt`` or ``text``) or one per line.

    The text is JSONL when ``source`` ends in ``.jsonl`` or its first line is a JSON object.
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not (source.endswith(".jsonl") or (lines and lines[0].startswith("{"))):
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError as e:
            raise PromptSetError(
                f"{source}:{number} is not valid JSON ({e}); each line must be an object "
                f'with "turns": [str, ...], "prompt" or "text"'
            ) from None
        turns = record.get("turns") if isinstance(record, dict) else None
        prompt = turns[0] if turns else (record.get("prompt") or record.get("text"))
        if not isinstance(prompt, str):
            raise PromptSetError(f"{source}:{number} has no 'turns', 'prompt' or 'text' string")
        prompts.append(prompt)
    return prompts


def load_prompts(spec: str, limit: int | None = None) -> list[str]:
    """The first ``limit`` prompts (all when None) of a prompt set or file."""
    source = prompt_source(spec)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as e:
        raise PromptSetError(f"prompt set {spec!r} cannot be read ({e})") from None
    prompts = parse_prompts(text, str(source))
    if not prompts:
        raise PromptSetError(f"{source} holds no prompts")
    return prompts if limit is None else prompts[:limit]
