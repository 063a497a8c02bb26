"""Which head kind a folder's config.json describes, and the module each kind builds.

One table (``KINDS``): kind -> (how its config is recognised, its builder). The keys read
are the published ones: ``speculators_model_type`` (EAGLE-3's speculators format),
``architectures`` (``LlamaForCausalLMEagle3``: the original EAGLE-3 layout;
``DFlashDraftModel``), ``model_type`` (``qwen3_5_mtp``: an MTP sidecar; a Qwen3.5 /
Qwen3-Next target whose text config declares ``mtp_num_hidden_layers``: its own MTP layers).
"""

from __future__ import annotations

from .block import ARCHITECTURE as BLOCK_ARCHITECTURE
from .block import KIND as BLOCK
from .block import BlockConfig, BlockHead
from .common import HeadMismatch
from .eagle3 import KIND as EAGLE3
from .eagle3 import ORIGINAL_ARCHITECTURE, Eagle3Config, Eagle3Head
from .mtp import KIND as MTP
from .mtp import SIDECAR_MODEL_TYPE, TARGET_MODEL_TYPES, MtpHead, mtp_layers


def _architectures(config: dict) -> list:
    archs = config.get("architectures")
    return archs if isinstance(archs, list) else []


def is_eagle3(config: dict) -> bool:
    return (
        config.get("speculators_model_type") == EAGLE3
        or config.get("model_type") == EAGLE3
        or ORIGINAL_ARCHITECTURE in _architectures(config)
    )


def is_block(config: dict) -> bool:
    return BLOCK_ARCHITECTURE in _architectures(config) or "dflash_config" in config


def is_mtp(config: dict) -> bool:
    """An MTP sidecar, or a target checkpoint of a family whose MTP layers we read that
    declares some."""
    if config.get("model_type") == SIDECAR_MODEL_TYPE:
        return True
    text = config.get("text_config")
    text_type = (text if isinstance(text, dict) else config).get("model_type")
    text_type = text_type if isinstance(text_type, str) else ""
    family = config.get("model_type") in TARGET_MODEL_TYPES or any(
        text_type.startswith(t) for t in TARGET_MODEL_TYPES
    )
    return family and mtp_layers(config) > 0


KINDS = {
    EAGLE3: (
        is_eagle3,
        lambda c, names: Eagle3Head(
            Eagle3Config.from_config(c), own_embedding="embed_tokens.weight" in names
        ),
    ),
    BLOCK: (is_block, lambda c, names: BlockHead(BlockConfig.from_config(c))),
    MTP: (is_mtp, lambda c, names: MtpHead(c)),
}
CLASSES = {EAGLE3: Eagle3Head, BLOCK: BlockHead, MTP: MtpHead}


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
