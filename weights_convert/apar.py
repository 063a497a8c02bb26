"""APAR checkpoints (``THUDM/apar-7b``, ``-13b``): a Llama with two added tokens, the fork
``[SplitMask]`` and the child ``[SplitSop]`` (``added_tokens.json`` and/or ``tokenizer.json``'s
``added_tokens``; vocab_size 32002, embedding and lm_head with 32002 rows), and Medusa heads
beside it.

The weights convert as any Llama (the config's vocab_size already counts the two tokens).
What this module adds: the output config's ``branches`` block, ``{"fork": "[SplitMask]",
"child": "[SplitSop]"}``, which marks a branching model (``engine.core.branches.branch_rules``
turns branching on for it by default), and a note for the Medusa heads left out.
"""

from __future__ import annotations

from pathlib import Path

from redrafter_mlx.engine.core.branches import CHILD_TOKEN, FORK_TOKEN, find_token_id
from weights_convert.errors import ConversionError

MEDUSA_PREFIX = "medusa"  # a medusa/ folder, medusa_lm_head.pt / .safetensors, ...


def branches_block(root: Path, config: dict) -> dict | None:
    """The ``branches`` config block when the tokenizer files in ``root`` name both split
    tokens (within the model's vocabulary), None when they name neither."""
    ids = {name: find_token_id(root, name) for name in (FORK_TOKEN, CHILD_TOKEN)}
    found = {name: i for name, i in ids.items() if i is not None}
    if not found:
        return None
    if len(found) == 1:
        (name,) = found
        (other,) = set(ids) - {name}
        raise ConversionError(
            f"{root}'s tokenizer names the APAR token {name} but not {other}; an APAR model "
            "needs both: re-download the tokenizer files (added_tokens.json, tokenizer.json)"
        )
    if found[FORK_TOKEN] == found[CHILD_TOKEN]:
        raise ConversionError(
            f"{root}'s tokenizer gives both APAR tokens ({FORK_TOKEN}, {CHILD_TOKEN}) the id "
            f"{found[FORK_TOKEN]}; they are two tokens: re-download the tokenizer files "
            "(added_tokens.json, tokenizer.json)"
        )
    vocab = int(config.get("vocab_size", 0))
    for name, i in found.items():
        if not 0 <= i < vocab:
            raise ConversionError(
                f"{root}'s tokenizer gives {name} the id {i}, outside the model's vocabulary "
                f"(vocab_size {vocab} in config.json): the embedding lacks its row; "
                "re-download config.json and the weights of the same checkpoint"
            )
    return {"fork": FORK_TOKEN, "child": CHILD_TOKEN}


def medusa_notes(root: Path, branching: bool = True) -> list[str]:
    """A note for each Medusa head file or folder beside the model (not converted); beside
    a model whose tokenizer names no split token (``branching`` False), one more: an APAR
    checkpoint's tokenizer files are missing, so it converts as a plain model."""
    found = sorted(p.name for p in root.iterdir() if p.name.lower().startswith(MEDUSA_PREFIX))
    why = "branching runs on the model alone" if branching else "decoding runs on the model"
    notes = [
        f"{name} left out: Medusa heads are not used here ({why}; a drafter can be distilled "
        "for it)"
        for name in found
    ]
    if found and not branching:
        notes.append(
            f"no APAR split tokens ({FORK_TOKEN}, {CHILD_TOKEN}) in {root}'s tokenizer files: "
            "converted as a plain model (branching off); for an APAR checkpoint, copy its "
            "added_tokens.json / tokenizer.json beside the weights and convert again"
        )
    return notes
