"""The Vicuna v1.1 chat format (FastChat), used when a tokenizer has no chat template.

``{system} USER: {msg} ASSISTANT: {reply}</s>USER: ... ASSISTANT:`` with BOS at the start; the
literal ``</s>`` is the EOS token. Models with a chat template in their tokenizer files use that
instead (``engine/base/tokenizer.py``).
"""

from __future__ import annotations

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)


def vicuna_prompt(messages: list[dict], system: str | None = None) -> str:
    """The conversation as Vicuna v1.1 text ending with an open assistant turn.

    messages: [{"role": "user"|"assistant", "content": str}, ...]; ``system`` replaces the
    default system prompt.
    """
    return "</s>".join(vicuna_turns(messages, system))


def vicuna_turns(messages: list[dict], system: str | None = None) -> list[str]:
    """The Vicuna text split where each assistant reply's ``</s>`` (the EOS token) goes: a
    tokenizer encodes the pieces as plain text, EOS ids between them, so that ``</s>`` typed
    inside a message stays text."""
    turns, text = [], (VICUNA_SYSTEM if system is None else system) + " "
    for m in messages:
        if m["role"] == "user":
            text += f"USER: {m['content']} "
        else:
            turns.append(text + f"ASSISTANT: {m['content']}")
            text = ""
    return [*turns, text + "ASSISTANT:"]
