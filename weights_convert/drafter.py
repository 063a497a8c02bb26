"""ReDrafter drafter checkpoints: config checks against the base model, names and shapes.

Reference layout (weights (out, in), no transposition)::

    input_proj.{weight,bias}             (exit_dim, 2H), (exit_dim,)   only if exit_dim != 2H
    lm_head.{i}.linear.{weight,bias}     (exit_dim, exit_dim), (exit_dim,)   i < num_draft_layers
    lm_head.{N}.weight                   (V, exit_dim)                 N = num_draft_layers
    rnn_u.{weight,bias}                  (H, H), (H,)                  only if rnn
    rnn_w.weight                         (H, H)                        only if rnn
    emb_norm.weight                      (H,)   optional, unused by the forward -> dropped

The multi-head layout ``input_projs.0.*`` / ``lm_heads.0.*`` is mapped to the names above;
a second head (``input_projs.1``, ``lm_heads.1``) is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from weights_convert.errors import ConversionError
from weights_convert.tensors import TensorRef

MODEL_TYPE = "recurrent_drafting_drafter"
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "exit_dim", "num_draft_layers")
_ALT_LAYOUT = re.compile(r"^(input_projs|lm_heads)\.(\d+)\.(.+)$")
_DROPPED = ("emb_norm.weight",)


@dataclass(frozen=True)
class DrafterPlan:
    """The drafter tensors to write ((output name, source) pairs) and the names dropped."""

    tensors: list[tuple[str, TensorRef]]
    dropped: list[str]


def check_config(config: dict, base_config: dict, root) -> None:
    """The drafter config must be complete and fit the base model (hidden size, vocabulary)."""
    model_type = config.get("model_type", MODEL_TYPE)
    if model_type != MODEL_TYPE:
        raise ConversionError(
            f"--drafter {root} has model_type {model_type!r}, not {MODEL_TYPE!r}; pass a ReDrafter "
            "drafter checkpoint (config.json with vocab_size, hidden_size, exit_dim, "
            "num_draft_layers, rnn)"
        )
    missing = [k for k in _REQUIRED_KEYS if not isinstance(config.get(k), int) or config[k] <= 0]
    if missing or not isinstance(config.get("rnn"), bool):
        missing += [] if isinstance(config.get("rnn"), bool) else ["rnn (true/false)"]
        raise ConversionError(f"drafter config {root}/config.json lacks valid {', '.join(missing)}")
    for key, what in (("hidden_size", "hidden size"), ("vocab_size", "vocabulary size")):
        if config[key] != base_config[key]:
            raise ConversionError(
                f"drafter/LLM mismatch: the drafter's {key} is {config[key]} but the base "
                "model's is "
                f"{base_config[key]}; a drafter only works with the LLM (same {what}) it was "
                "trained for"
            )


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a drafter config implies -> its shape."""
    h, v, e, n = (
        config["hidden_size"],
        config["vocab_size"],
        config["exit_dim"],
        config["num_draft_layers"],
    )
    shapes: dict[str, tuple[int, ...]] = {}
    if e != 2 * h:
        shapes["input_proj.weight"] = (e, 2 * h)
        shapes["input_proj.bias"] = (e,)
    for i in range(n):
        shapes[f"lm_head.{i}.linear.weight"] = (e, e)
        shapes[f"lm_head.{i}.linear.bias"] = (e,)
    shapes[f"lm_head.{n}.weight"] = (v, e)
    if config["rnn"]:
        shapes["rnn_u.weight"] = (h, h)
        shapes["rnn_u.bias"] = (h,)
        shapes["rnn_w.weight"] = (h, h)
    return shapes


def canonical_name(name: str, root) -> str:
    """Map the ``input_projs.0.* / lm_heads.0.*`` layout to reference names; refuse other heads."""
    match = _ALT_LAYOUT.match(name)
    if match is None:
        return name
    group, head, rest = match.groups()
    if head != "0":
        raise ConversionError(
            f"drafter {root} has several heads ({name}); only single-head drafters "
            "(input_projs.0 / lm_heads.0) are supported"
        )
    return f"{group[:-1]}.{rest}"


def plan_tensors(refs: list[TensorRef], config: dict, root) -> DrafterPlan:
    """Match drafter tensors to its config: keep (renamed), drop, or refuse with a clear error."""
    shapes = expected_shapes(config)
    kept, dropped = [], []
    for ref in refs:
        name = canonical_name(ref.name, root)
        if name in _DROPPED:
            dropped.append(ref.name)
            continue
        if name not in shapes:
            raise ConversionError(
                f"drafter tensor {ref.name} in {ref.path.name} does not belong to a drafter with "
                f"exit_dim={config['exit_dim']}, num_draft_layers={config['num_draft_layers']}, "
                f"rnn={config['rnn']}; check {root}/config.json"
            )
        keep(kept, "drafter", name, ref, shapes, root)
    return complete(kept, dropped, "drafter", shapes, root)


def keep(kept: list, what: str, name: str, ref: TensorRef, shapes: dict, root) -> None:
    """Add ``ref`` as ``name`` to ``kept`` once its shape is the one its config implies."""
    if ref.shape != shapes[name]:
        raise ConversionError(
            f"{what} tensor {ref.name} has shape {list(ref.shape)} but {root}/config.json "
            f"implies {list(shapes[name])}; the config does not match the weights"
        )
    if any(n == name for n, _ in kept):
        raise ConversionError(f"{what} {root} holds {name} twice (two namings); keep one")
    kept.append((name, ref))


def complete(kept: list, dropped: list, what: str, shapes: dict, root) -> DrafterPlan:
    """The plan, once every tensor the config implies is kept."""
    missing = sorted(set(shapes) - {n for n, _ in kept})
    if missing:
        raise ConversionError(
            f"{what} checkpoint {root} lacks {', '.join(missing)}, which its config implies"
        )
    return DrafterPlan(kept, dropped)


def output_config(config: dict, dtype: str, quantization: dict | None) -> dict:
    """The drafter's config.json in the output (reference keys kept, dtype/quantization added)."""
    out = dict(config)
    out.pop("_name_or_path", None)
    out.setdefault("model_type", MODEL_TYPE)
    out["torch_dtype"] = dtype
    out.pop("quantization", None)
    out.pop("quantization_config", None)
    if quantization is not None:
        out["quantization"] = dict(quantization)
        out["quantization_config"] = dict(quantization)
    return dict(sorted(out.items()))
