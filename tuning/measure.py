"""The engine-backed measure function.

``EngineMeasure(model, drafter, tokenizer, prompts)`` is a ``measure(shape, n_tokens)``
for :func:`tuning.search.successive_halving`: it decodes each prompt greedily for
``n_tokens`` tokens with ``redrafter_mlx.measure.throughput.measure_generation`` (the same as
``redrafter-mlx bench``: decode tokens/s, prompt processing excluded), one sample per prompt.
The autoregressive shape and the lookup-only shapes (no drafter beam) run with
``drafter=None`` through the same API; ``drafter`` itself may be None (a model tuned for
context lookup alone); shapes with a draft model's chain (``D1×Ld``) run with
``draft_model``.
Warm-up is the search's job (it discards a short first run of every shape).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redrafter_mlx.engine.base.errors import RedrafterError
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from tuning.search import Measurement

GREEDY = SamplerConfig(temperature=0.0)


class TuneError(RedrafterError):
    """A problem the user can fix; the message names it and the fix."""


# --------------------------------------------------------------------------- engine


def encode_prompt(tokenizer: Any, question: str) -> Any:
    """A user question as the model's chat prompt (token ids), or the raw text."""
    chat_prompt = getattr(tokenizer, "chat_prompt", None)
    if callable(chat_prompt):
        return chat_prompt([{"role": "user", "content": question}])
    return question


@dataclass
class EngineMeasure:
    """``measure(shape, n_tokens)`` backed by the one tokens/s measurement (``throughput``)."""

    model: Any
    drafter: Any
    tokenizer: Any
    prompts: Sequence[str]
    draft_model: Any = None  # ``tune --draft-model``: the chain of shapes with ``D1×Ld``

    def __post_init__(self) -> None:
        self._encoded = [encode_prompt(self.tokenizer, p) for p in self.prompts]
        self._runs: dict = {}  # (the shape a step runs, n_tokens) -> its measurement

    def __call__(self, shape: BeamShape, n_tokens: int) -> Measurement:
        """One greedy tokens/s sample per prompt, plus tokens per step and mean packed
        tokens. Shapes the model runs as one (a hybrid's W2-W4 all run as its one chain:
        ``step.narrowed``) are measured once, and share that measurement."""
        from redrafter_mlx.engine.decoding.step import narrowed

        key = (narrowed(self.model, shape), n_tokens)
        if key not in self._runs:
            self._runs[key] = self._measured(shape, n_tokens)
        return self._runs[key]

    def _measured(self, shape: BeamShape, n_tokens: int) -> Measurement:
        from redrafter_mlx.measure.throughput import measure_generation

        drafter = self.drafter if shape.drafts else None
        draft = self.draft_model if shape.model_length else None
        tps, per_step, packed = [], [], []
        for prompt in self._encoded:
            run = measure_generation(
                self.model,
                drafter,
                self.tokenizer,
                prompt,
                shape,
                n_tokens,
                sampler=GREEDY,
                draft_model=draft,
            )
            tps.append(run.tokens_per_s)
            per_step.append(run.tokens_per_step)
            packed.append(run.mean_packed)
        return Measurement(tuple(tps), tuple(per_step), sum(packed) / len(packed))
