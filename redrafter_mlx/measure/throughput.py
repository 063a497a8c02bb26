"""One tokens/s measurement, shared by ``redrafter-mlx bench`` and the tuner.

A run is timed from its first token to its last, so prompt processing (prefill) is excluded
and reported apart as time to first token. Decode throughput is the tokens after the first
divided by that time: the figure speculation changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.loop.generation import stream_generate


@dataclass
class Run:
    """One timed generation: its tokens (with APAR branches: the rebuilt text's) and
    measurements."""

    tokens: list[int]
    decode_tokens: int  # tokens after the first (those the decode loop produced)
    decode_s: float  # time from the first token to the last
    steps: int  # sequential steps (with branches: of all its branches side by side)
    tokens_per_step: float
    mean_packed: float
    ttft_s: float
    peak_memory_gb: float
    accepted_tokens: int = 0  # draft tokens the verifier accepted
    source_tokens: dict = field(default_factory=dict)  # of those, per draft source name
    branches: int = 0  # APAR branches decoded, the root counted (0: branching off)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput (0 when fewer than two tokens were generated)."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


def measure_generation(
    model,
    drafter,
    tokenizer,
    prompt_ids: list[int],
    shape: BeamShape,
    max_tokens: int,
    adapt=False,
    sampler: SamplerConfig = SamplerConfig(),
    seed: int | None = None,
    draft_model=None,
    branches="auto",
) -> Run:
    """Generate ``prompt_ids``' continuation at ``shape`` (AR: plain decoding) and time it.

    ``adapt``: pinned to ``shape`` by default (a measurement of that shape); True or an
    ``Adaptive`` measures adaptive decoding starting from ``shape``.

    ``sampler``, ``seed``, ``draft_model``, ``branches``: as ``stream_generate`` (greedy by
    default; APAR branches on for a model marked as one).
    """
    mx.reset_peak_memory()
    tokens, first_at, last_at, final = [], None, None, None
    start = time.perf_counter()
    for response in stream_generate(
        model,
        drafter,
        tokenizer,
        prompt_ids,
        max_tokens=max_tokens,
        shape=shape,
        sampler=sampler,
        seed=seed,
        adapt=adapt,
        draft_model=draft_model,
        branches=branches,
    ):
        last_at = time.perf_counter()
        first_at = first_at or last_at
        tokens += response.tokens
        final = response
    # without a drafter: the lookup chains (and a draft model's chain), or AR
    runs = shape.runnable(drafter is not None, draft_model is not None)
    speculative = not runs.is_autoregressive or (drafter is not None and bool(adapt))
    return Run(
        tokens,
        max(len(tokens) - 1, 0),
        last_at - first_at,
        final.steps,
        final.tokens_per_step if speculative else 1.0,
        final.mean_packed if speculative else 1.0,
        first_at - start,
        mx.get_peak_memory() / 1e9,
        final.accepted_tokens,
        dict(final.source_tokens),
        final.branches,
    )
