"""Which head kind a folder's config.json describes, and the module each kind builds.

One table (``KINDS``): kind -> (how its config is recognised, its builder). The keys read
are the published ones: ``speculators_model_type`` (EAGLE-3's speculators format),
``architectures`` (``LlamaForCausalLMEagle3``: the original EAGLE-3 layout;
``DFlashDraftModel``), ``model_type`` (``qwen3_5_mtp``: an MTP sidecar; a Qwen3.5 /
Qwen3-Next target whose text config declares ``mtp_num_hidden_layers``: its own MTP layers).
"""

from __future__ import annotations

from . import block, eagle3, mtp
from .common import HeadMismatch


def _architectures(config: dict) -> list:
    archs = config.get("architectures")
    return archs if isinstance(archs, list) else []


def is_eagle3(config: dict) -> bool:
    return (
        config.get("speculators_model_type") == eagle3.KIND
        or config.get("model_type") == eagle3.KIND
        or eagle3.ORIGINAL_ARCHITECTURE in _architectures(config)
    )


def is_block(config: dict) -> bool:
    return block.ARCHITECTURE in _architectures(config) or "dflash_config" in config


def is_mtp(config: dict) -> bool:
    """An MTP sidecar, or a target checkpoint of a family whose MTP layers we read that
    declares some."""
    if config.get("model_type") == mtp.SIDECAR_MODEL_TYPE:
        return True
    text_type = mtp.text_config(config).get("model_type", "")
    family = config.get("model_type") in mtp.TARGET_MODEL_TYPES or any(
        text_type.startswith(t) for t in mtp.TARGET_MODEL_TYPES
    )
    return family and mtp.mtp_layers(config) > 0


KINDS = {
    eagle3.KIND: (
        is_eagle3,
        lambda c, names: eagle3.Eagle3Head(
            eagle3.Eagle3Config.from_config(c), own_embedding="embed_tokens.weight" in names
        ),
    ),
    block.KIND: (is_block, lambda c, names: block.BlockHead(block.BlockConfig.from_config(c))),
    mtp.KIND: (is_mtp, lambda c, names: mtp.MtpHead(c)),
}
CLASSES = {eagle3.KIND: eagle3.Eagle3Head, block.KIND: block.BlockHead, mtp.KIND: mtp.MtpHead}


def head_kind(config: dict) -> str | None:
    """The head kind ``config`` (a config.json, read) describes, else None."""
    if not isinstance(config, dict):
        return None
    for kind, (recognise, _) in KINDS.items():
        if recognise(config):
            return kind
    return None


def build(config: dict, names) -> object:
    """The (randomly initialised) head ``config`` describes; ``names``: the checkpoint's
    tensor names, after the kind's ``sanitize``."""
    kind = head_kind(config)
    if kind is None:
        raise HeadMismatch(
            "config.json describes no draft head this engine reads (EAGLE-3: "
            "speculators_model_type 'eagle3' or architectures LlamaForCausalLMEagle3; "
            "DFlash: architectures DFlashDraftModel; MTP: model_type qwen3_5_mtp or "
            "mtp_num_hidden_layers): pass a head's folder"
        )
    return KINDS[kind][1](config, names)
