"""The dim one-line stats summary printed after an answer, and the stats as JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redrafter_mlx.engine.plan import ShapeChoice


FINISH_TEXT = {
    "stop": None,
    "length": "stopped at --max-tokens",
    "context": "stopped: the context is full (the model's, or --max-kv-size)",
}


def format_hist(hist: list[int]) -> str:
    """``steps emitting 1/2/3/4 tokens: 12/5/2/1`` (accepted drafts + the bonus token)."""
    if not hist or not any(hist):
        return ""
    sizes = "/".join(str(i) for i in range(1, len(hist) + 1))
    return f"steps emitting {sizes} tokens: " + "/".join(str(n) for n in hist)


def source_share(source_tokens: dict) -> str:
    """``accepted drafts: 12 drafter + 30 lookup + 5 draft model``: where the accepted tokens
    came from, per draft source (``engine.sources.SOURCE_NAMES``) that had any accepted."""
    parts = [f"{n} {name.replace('_', ' ')}" for name, n in source_tokens.items() if n]
    return "accepted drafts: " + (" + ".join(parts) if parts else "0")


def stats_line(response, plan: ShapeChoice) -> str:
    """The one-line summary after an answer: tokens, speed, acceptance, why it ended, shape."""
    parts = [f"{response.generation_tokens} tokens", f"{response.generation_tps:.1f} tok/s"]
    if plan.speculative:
        parts.append(f"{response.tokens_per_step:.2f} tok/step")
        hist = format_hist(response.accept_hist)
        if hist:
            parts.append(hist)
        shape = plan.shape
        if shape.drafts + bool(shape.lookup) + bool(shape.model_length) > 1:  # their shares
            parts.append(source_share(response.source_tokens))
    if getattr(response, "branches", 0):  # APAR: branches decoded side by side
        parts.append(f"{response.branches} branches in {response.steps} steps")
    parts.append(f"TTFT {response.time_to_first_token * 1e3:.0f} ms")
    finish = FINISH_TEXT.get(response.finish_reason)
    if finish:
        parts.append(finish)
    parts.append(f"{plan.label} ({plan.source})")
    return " · ".join(parts)


def branch_stats(branches: int, steps: int, answer_tokens: int) -> dict | None:
    """One answer's APAR numbers, None with branching off (``branches`` 0): its forks (the
    branches beyond the root), sequential steps, and tokens (the rebuilt text's; the stats'
    ``generation_tokens`` count every branch's, split tokens included)."""
    if not branches:
        return None
    return {"forks": branches - 1, "steps": steps, "answer_tokens": answer_tokens}


def response_stats(response) -> dict:
    """All statistics of a final GenerationResponse as a JSON-ready dict."""
    return response.stats.to_dict()


__all__ = [
    "FINISH_TEXT",
    "branch_stats",
    "format_hist",
    "response_stats",
    "source_share",
    "stats_line",
]
