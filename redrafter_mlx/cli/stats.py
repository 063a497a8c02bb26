"""The dim one-line stats summary printed after an answer, and the stats as JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redrafter_mlx.engine.loop.plan import ShapeChoice


FINISH_TEXT = {
    "stop": None,
    "length": "stopped at --max-tokens",
    "context": "stopped: the context is full (the model's, or --max-kv-size)",
}


def format_hist(hist: list[int], steps: str = "steps") -> str:
    """``steps emitting 1/2/3/4 tokens: 12/5/2/1`` (accepted drafts + the bonus token);
    ``steps``: what a step is called (``branch steps``: one branch row's step)."""
    if not hist or not any(hist):
        return ""
    sizes = "/".join(str(i) for i in range(1, len(hist) + 1))
    return f"{steps} emitting {sizes} tokens: " + "/".join(str(n) for n in hist)


def source_share(source_tokens: dict) -> str:
    """``accepted drafts: 12 drafter + 30 lookup + 5 draft model``: where the accepted tokens
    came from, per draft source (``engine.drafting.sources.SOURCE_NAMES``) that had any accepted."""
    parts = [f"{n} {name.replace('_', ' ')}" for name, n in source_tokens.items() if n]
    return "accepted drafts: " + (" + ".join(parts) if parts else "0")


def generation_rate(response) -> float | None:
    """The answer's decoding speed, tokens/s after the first token (the stats'
    ``generation_tps``); None when the answer ended at its first token: no decoding step was
    timed, so a rate would divide by a near-zero interval."""
    return response.generation_tps if response.steps > 0 else None


def rate_text(response) -> str:
    """``12.3 tok/s``, or ``no decoding step`` for an answer that ended at its first token."""
    rate = generation_rate(response)
    return "no decoding step" if rate is None else f"{rate:.1f} tok/s"


def stats_line(response, plan: ShapeChoice, answer_tokens: int | None = None) -> str:
    """The one-line summary after an answer: tokens, speed, acceptance, why it ended, shape.

    With APAR branches (``response.branches``) the tokens and the speed are the answer's,
    the rebuilt text's ``answer_tokens`` (required then; the stats' ``generation_tokens``
    count every branch's, split tokens and tokens past the answer's end included), then the
    branches and the sequential steps with the answer's tokens per step
    (:func:`answer_branch_stats`, what ``generate --json`` reports); the acceptance
    histogram counts branch steps (one branch row's step)."""
    branched = answer_branch_stats(response, answer_tokens)
    if branched is None:
        parts = [f"{response.generation_tokens} tokens", rate_text(response)]
    else:
        parts = [
            f"{branched['answer_tokens']} tokens",
            f"{branched['answer_tps']:.1f} tok/s",
            f"{response.branches} branches",
            f"{branched['steps']} steps ({branched['answer_tokens_per_step']:.2f} tok/step)",
        ]
    if plan.speculative and response.steps:
        if branched is None:
            parts.append(f"{response.tokens_per_step:.2f} tok/step")
        hist = format_hist(response.accept_hist, "steps" if branched is None else "branch steps")
        if hist:
            parts.append(hist)
        shape = plan.shape
        if shape.drafts + bool(shape.lookup) + bool(shape.model_length) > 1:  # their shares
            parts.append(source_share(response.source_tokens))
    parts.append(f"TTFT {response.time_to_first_token * 1e3:.0f} ms")
    finish = FINISH_TEXT.get(response.finish_reason)
    if finish:
        parts.append(finish)
    parts.append(f"{plan.label} ({plan.source})")
    return " · ".join(parts)


def branch_stats(
    branches: int, steps: int, answer_tokens: int, decode_s: float | None = None
) -> dict | None:
    """One answer's APAR numbers, None with branching off (``branches`` 0): its forks (the
    branches beyond the root), sequential steps, tokens (the rebuilt text's; the stats'
    ``generation_tokens`` count every branch's, split tokens included) and tokens per
    sequential step, and with ``decode_s`` (the decoding's seconds, after the first token)
    the answer's tokens per second."""
    if not branches:
        return None
    out = {
        "forks": branches - 1,
        "steps": steps,
        "answer_tokens": answer_tokens,
        "answer_tokens_per_step": answer_tokens / max(steps, 1),
    }
    if decode_s is not None:
        out["answer_tps"] = answer_tokens / decode_s if decode_s > 0 else 0.0
    return out


def answer_branch_stats(response, answer_tokens: int | None) -> dict | None:
    """:func:`branch_stats` of a final GenerationResponse whose answer (the rebuilt text)
    holds ``answer_tokens`` tokens, its speed over the same decoding time as the stats'
    ``generation_tps`` (their ``generation_tokens`` over it); None with branching off. The
    one place the chat's and ``generate``'s stats line and ``generate --json`` take them."""
    branches = getattr(response, "branches", 0)
    if not branches:
        return None
    if answer_tokens is None:
        raise ValueError("an answer with branches needs its rebuilt text's token count")
    tps = response.generation_tps
    decode_s = response.generation_tokens / tps if tps > 0 else 0.0
    return branch_stats(branches, response.steps, answer_tokens, decode_s)


def response_stats(response) -> dict:
    """All statistics of a final GenerationResponse as a JSON-ready dict; ``generation_tps``
    is null for an answer that ended at its first token (``generation_rate``)."""
    return {**response.stats.to_dict(), "generation_tps": generation_rate(response)}
