"""The engine-backed measure function, and the prompts and models it runs on.

``EngineMeasure(model, drafter, tokenizer, prompts)`` is a ``measure(shape, n_tokens)``
for :func:`tuning.search.successive_halving`: it decodes each prompt greedily for
``n_tokens`` tokens with ``redrafter_mlx.stream_generate`` and reports the engine's
generation tokens/s (prompt processing excluded), one sample per prompt. The
autoregressive shape (L == 1) runs with ``drafter=None`` through the same API.
Warm-up is the search's job (it discards a short first run of every shape).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tuning.grid import BeamShape
from tuning.search import Measurement

BUILTIN_PROMPT_SETS = {
    "mt-bench": "mt_bench_questions.jsonl",
    "vicuna-bench": "vicuna_bench_questions.jsonl",
}


class TuneError(Exception):
    """A problem the user can fix; the message names it and the fix."""


# --------------------------------------------------------------------------- prompts


def _read_builtin(file_name: str) -> str:
    """Text of a prompt set shipped in ``redrafter_mlx/data``."""
    try:
        return resources.files("redrafter_mlx").joinpath("data", file_name).read_text("utf-8")
    except (FileNotFoundError, ModuleNotFoundError, OSError) as e:
        raise TuneError(
            f"the built-in prompt set {file_name} is not installed ({e}); "
            f"pass a prompt file with --prompts FILE"
        ) from None


def parse_prompts(text: str, source: str) -> list[str]:
    """Prompts from a JSONL text (each line ``{"turns": [...]}``, ``{"prompt": ..}`` or
    ``{"text": ..}``; the first turn is used) or, failing that, one prompt per line."""
    prompts: list[str] = []
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and lines[0].startswith("{"):
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except ValueError as e:
                raise TuneError(f"{source}:{number} is not valid JSON ({e})") from None
            turns = record.get("turns") if isinstance(record, dict) else None
            prompt = turns[0] if turns else (record.get("prompt") or record.get("text"))
            if not isinstance(prompt, str):
                raise TuneError(f"{source}:{number} has no 'turns', 'prompt' or 'text' string")
            prompts.append(prompt)
    else:
        prompts = lines
    if not prompts:
        raise TuneError(f"{source} holds no prompts")
    return prompts


def load_prompts(spec: str, num_prompts: int) -> list[str]:
    """The first ``num_prompts`` prompts of ``mt-bench``, ``vicuna-bench``, ``demo`` (the demo
    model's held-out prompts) or a file."""
    if num_prompts < 1:
        raise TuneError("--num-prompts must be at least 1")
    if spec == "demo":
        from redrafter_mlx.engine.bundled import heldout_prompts_path

        spec = str(heldout_prompts_path())
    if spec in BUILTIN_PROMPT_SETS:
        prompts = parse_prompts(_read_builtin(BUILTIN_PROMPT_SETS[spec]), spec)
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise TuneError(
                f"--prompts {spec!r}: not a file; use mt-bench, vicuna-bench, demo or a path to a "
                f".jsonl (with 'turns') or .txt (one prompt per line) file"
            )
        prompts = parse_prompts(path.read_text("utf-8"), str(path))
    return prompts[:num_prompts]


# --------------------------------------------------------------------------- engine


def engine_missing_reason() -> str | None:
    """Why the engine cannot be used (a sentence), or None when it can."""
    try:
        import redrafter_mlx
    except Exception as e:
        return f"redrafter_mlx cannot be imported ({type(e).__name__}: {e})"
    for name in ("load", "stream_generate"):
        if not hasattr(redrafter_mlx, name):
            return f"this redrafter_mlx build has no {name}()"
    return None


def demo_paths() -> tuple[str, str]:
    """(model_dir, drafter_dir) of the demo pair shipped with the package.

    Raises :class:`TuneError` when the demo model or its drafter is not there yet.
    """
    try:
        from redrafter_mlx.engine.bundled import demo_paths as _demo_paths

        model_dir, drafter_dir = _demo_paths()
    except (ImportError, AttributeError, FileNotFoundError, OSError) as e:
        raise TuneError(
            f"no --model given and the demo model is not available ({e}); "
            f"pass --model DIR --drafter DIR, or build the demo with 'make demo-model'"
        ) from None
    if not (Path(model_dir) / "config.json").is_file():
        raise TuneError(
            f"no --model given and the demo model is not built ({model_dir} has no config.json); "
            f"pass --model DIR --drafter DIR, or build it with 'make demo-model'"
        )
    if drafter_dir is None:
        raise TuneError(
            "no --model given and the demo model has no drafter yet, so there is nothing to "
            "speculate with; pass --model DIR --drafter DIR"
        )
    return str(model_dir), str(drafter_dir)


def load_engine(model_path: str, drafter_path: str, dtype: str | None):
    """``redrafter_mlx.load`` with errors turned into :class:`TuneError`."""
    reason = engine_missing_reason()
    if reason:
        raise TuneError(f"cannot measure: {reason}; presets still work with --chip NAME")
    import redrafter_mlx

    try:
        return redrafter_mlx.load(model_path, drafter_path, dtype=dtype)
    except getattr(redrafter_mlx, "LoadError", OSError) as e:
        raise TuneError(str(e)) from None


def encode_prompt(tokenizer: Any, question: str) -> Any:
    """A user question as the model's chat prompt (token ids), or the raw text."""
    chat_prompt = getattr(tokenizer, "chat_prompt", None)
    if callable(chat_prompt):
        return chat_prompt([{"role": "user", "content": question}])
    return question


@dataclass
class EngineMeasure:
    """``measure(shape, n_tokens)`` backed by ``redrafter_mlx.stream_generate``."""

    model: Any
    drafter: Any
    tokenizer: Any
    prompts: Sequence[str]

    def __post_init__(self) -> None:
        self._encoded = [encode_prompt(self.tokenizer, p) for p in self.prompts]

    def _decode_kwargs(self, shape: BeamShape) -> dict:
        """Arguments selecting ``shape`` (plain decoding for the autoregressive shape)."""
        if shape.is_autoregressive:
            return {"drafter": None}
        return {
            "drafter": self.drafter,
            "beam_width": shape.width,
            "beam_length": shape.length,
            "capacity": shape.capacity,
        }

    def run_one(self, prompt: Any, shape: BeamShape, n_tokens: int):
        """Decode one prompt greedily; the last response carries the final stats."""
        import redrafter_mlx

        kwargs = self._decode_kwargs(shape)
        drafter = kwargs.pop("drafter")
        last = None
        for last in redrafter_mlx.stream_generate(
            self.model,
            drafter,
            self.tokenizer,
            prompt,
            max_tokens=n_tokens,
            temperature=0.0,
            **kwargs,
        ):
            pass
        if last is None:
            raise RuntimeError(f"{shape.label}: the engine produced no output")
        return last

    def __call__(self, shape: BeamShape, n_tokens: int) -> Measurement:
        """One tokens/s sample per prompt, plus tokens per step and mean packed tokens."""
        tps, per_step, packed = [], [], []
        for prompt in self._encoded:
            last = self.run_one(prompt, shape, n_tokens)
            tps.append(float(last.generation_tps))
            per_step.append(float(getattr(last, "tokens_per_step", 1.0)))
            packed.append(float(getattr(last, "mean_packed", 1.0)))
        return Measurement(tuple(tps), tuple(per_step), sum(packed) / len(packed))
