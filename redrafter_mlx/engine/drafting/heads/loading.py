"""Load a head folder (its config.json and safetensors, quantized or not) and check that
it fits a target: one-line refusals (``HeadMismatch``) naming the mismatch and the fix.

An MTP head is read from the target's own checkpoint (only the shards that hold ``mtp.*``
tensors, by the safetensors index) or from a sidecar folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .block import KIND as BLOCK
from .common import HeadMismatch, TargetDims
from .eagle3 import KIND as EAGLE3
from .formats import CLASSES, build, head_kind
from .mtp import KIND as MTP
from .mtp import mtp_key

QUANT_BITS = (2, 3, 4, 5, 6, 8)


def read_config(folder) -> dict:
    """A head folder's config.json; HeadMismatch naming the folder when it has none."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HeadMismatch(
            f"{path}: cannot read a head's config ({e}): pass a head's folder"
        ) from None
    if not isinstance(config, dict):
        raise HeadMismatch(f"{path} is not a JSON object: pass a head's folder")
    return config


def _files(folder: Path, kind: str) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if kind == MTP and index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        shards = sorted({f for k, f in weight_map.items() if mtp_key(k) is not None})
        if shards:
            return [folder / f for f in shards]
    return sorted(folder.glob("*.safetensors"))


def read_weights(folder, kind: str) -> dict:
    """The kind's tensors of a folder, sanitized to module names."""
    folder = Path(folder)
    files = _files(folder, kind)
    if not files:
        raise HeadMismatch(f"{folder} has no .safetensors weights: re-download the head")
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return CLASSES[kind].sanitize(weights)


def quantize_like(head: nn.Module, config: dict, weights: dict) -> None:
    """Quantize ``head``'s layers the checkpoint stores quantized (``quantization`` in the
    config: group_size, bits, mode), as mlx-lm does; a setting mlx lacks is refused."""
    q = config.get("quantization") or config.get("quantization_config")
    if not q:
        return
    bits, group = q.get("bits"), q.get("group_size", 64)
    mode = q.get("mode", "affine")
    if bits not in QUANT_BITS:
        raise HeadMismatch(
            f"the head is quantized to {bits} bits, which mlx does not run "
            f"(bits {', '.join(map(str, QUANT_BITS))}): pick another quantization of the head"
        )
    try:
        nn.quantize(
            head,
            group_size=group,
            bits=bits,
            mode=mode,
            class_predicate=lambda path, m: f"{path}.scales" in weights,
        )
    except (ValueError, TypeError) as e:
        raise HeadMismatch(
            f"the head's quantization ({bits} bits, group size {group}, {mode}) cannot be "
            f"applied here ({str(e).splitlines()[0]}): pick another quantization of the head"
        ) from None


def load_head(folder, dtype=None) -> nn.Module:
    """The head in ``folder`` (any kind ``formats`` knows), its weights loaded (quantized
    layers as stored; float ones cast to ``dtype`` when given)."""
    config = read_config(folder)
    kind = head_kind(config)
    if kind is None:
        build(config, ())  # the one-line refusal
    weights = read_weights(folder, kind)
    head = build(config, set(weights))
    quantize_like(head, config, weights)
    if dtype is not None:
        weights = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()
        }
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise HeadMismatch(
            f"{folder}: the {kind} head's tensors do not match its config.json "
            f"({str(e).splitlines()[0]}): re-download the head"
        ) from None
    mx.eval(head.parameters())
    return head


def target_dims(model) -> TargetDims:
    """A target's sizes (a verifier: ``hidden_size``, ``vocab_size``, ``layers``)."""
    return TargetDims(int(model.hidden_size), int(model.vocab_size), len(model.layers))


def check_fit(head: nn.Module, dims: TargetDims) -> None:
    """Refuse a head that cannot pair with a target of ``dims``, in one line."""
    kind = head.kind
    if kind == EAGLE3:
        c = head.config
        hidden, vocab = c.target_hidden_size, c.vocab_size
        taps = c.aux_layer_ids or ()
        past = [i for i in taps if not 0 <= i <= dims.num_layers]
        what = "hidden-state index (eagle_aux_hidden_state_layer_ids)"
    elif kind == BLOCK:
        c = head.config
        hidden, vocab = c.hidden_size, c.vocab_size
        past = [i for i in c.target_layer_ids if not 0 <= i < dims.num_layers]
        what = "layer (dflash_config.target_layer_ids)"
    else:
        hidden, vocab = head.args.hidden_size, head.args.vocab_size
        past, what = [], ""
    name = {EAGLE3: "EAGLE-3", BLOCK: "DFlash", MTP: "MTP"}[kind]
    fix = "use the head published for this model"
    if hidden != dims.hidden_size:
        raise HeadMismatch(
            f"the {name} head reads hidden size {hidden}, the model's is {dims.hidden_size}: {fix}"
        )
    if vocab != dims.vocab_size:
        raise HeadMismatch(
            f"the {name} head's vocabulary has {vocab} ids, the model's {dims.vocab_size}: {fix}"
        )
    if past:
        raise HeadMismatch(
            f"the {name} head taps {what} {past[0]}, past the model's {dims.num_layers} "
            f"layers: {fix}"
        )
    if kind == BLOCK:
        c = head.config
        if not 0 <= c.mask_token_id < dims.vocab_size:
            raise HeadMismatch(
                f"the DFlash head's mask token {c.mask_token_id} is outside the model's "
                f"vocabulary ({dims.vocab_size} ids): {fix}"
            )
        if c.num_target_layers != dims.num_layers:
            raise HeadMismatch(
                f"the DFlash head was trained on a {c.num_target_layers}-layer model, this "
                f"one has {dims.num_layers} layers: {fix}"
            )
