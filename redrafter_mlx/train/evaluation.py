"""How good a drafter is: greedy ReDrafter decoding, and a teacher-forced held-out score.

Shapes: P positions, H hidden, T drafter steps.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..engine.drafting.drafter import Drafter
from ..engine.verifier.protocol import Verifier

DEFAULT_EVAL_SHAPES = ((1, 3), (2, 4), (4, 5))


def eval_shapes(shapes, predict_tokens: int) -> list[tuple[int, int]]:
    """Beam shapes (W, L) with L capped at T+1 (the drafter predicts T tokens), deduplicated."""
    out = []
    for w, length in shapes:
        shape = (int(w), min(int(length), predict_tokens + 1))
        if shape[1] >= 2 and shape not in out:
            out.append(shape)
    return out


def evaluate(
    model: Verifier,
    drafter: Drafter,
    prompts: list[list[int]],
    shapes,
    max_tokens: int,
    eos_token_ids=(),
) -> list[dict]:
    """Greedy ReDrafter on all prompts (one batch) per beam shape: mean accepted tokens per step.

    The compiled step reads the drafter's weights at every call, so a drafter trained in place
    since an earlier evaluation is evaluated with its current weights.
    """
    from ..engine.core.shape import BeamShape
    from ..engine.loop.generation import generate_steps

    results = []
    for w, length in shapes:
        stats = None
        for ev in generate_steps(
            model,
            drafter,
            prompts,
            max_tokens=max_tokens,
            shape=BeamShape(w, length),
            eos_token_ids=eos_token_ids,
            seed=0,
        ):
            stats = ev.stats
        results.append(
            dict(
                beam_width=w,
                beam_length=length,
                tokens_per_step=round(stats.tokens_per_step, 4),
                steps=stats.steps,
                generated=stats.generation_tokens,
            )
        )
    return results


def chain_score(drafter, model: Verifier, val: dict, index: np.ndarray | None, length: int = 4):
    """Teacher-forced acceptance on held-out answers, one batched pass (no decoding).

    val: hidden (P, H) (or wider: ``Drafter.features``), tokens (P, T+1), valid (P, T) of
    answers the model wrote; index: the shortlist's head index per id (or None). Returns
    per-step top-1 accuracy (T,) and the mean accepted run + 1 with ``length - 1`` draft
    tokens: an estimate of W=1 tokens/step.
    """
    tokens = np.asarray(val["tokens"])
    targets = tokens[:, 1:] if index is None else index[tokens[:, 1:]]
    ok = np.asarray(val["valid"]) & (targets >= 0)
    hidden = mx.array(np.asarray(val["hidden"])).astype(mx.float32)
    emb = model.embed(mx.array(tokens[:, :-1])).astype(mx.float32)
    state = mx.zeros(emb.shape[::2], dtype=mx.float32)  # (P, H)
    part = drafter.hidden_part(hidden)  # hidden may be wider: feature layers
    hits = []
    for k in range(tokens.shape[1] - 1):
        state = drafter.next_state(state, emb[:, k])
        pred = np.array(mx.argmax(drafter.head(part, state), axis=-1))
        hits.append((pred == np.maximum(targets[:, k], 0)) & ok[:, k])
    hits = np.stack(hits, axis=1)
    run = np.cumprod(hits, axis=1)[:, : length - 1].sum(axis=1)
    return dict(acc=hits.mean(axis=0).round(3).tolist(), score=round(1 + float(run.mean()), 4))
