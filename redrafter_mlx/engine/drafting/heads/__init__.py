"""Draft heads people download: DFlash block drafters (``block``), EAGLE-3 heads
(``eagle3``) and a model's own MTP layers (``mtp``), as MLX modules that load the
published formats (``formats``, ``loading``) and compute what mlx-vlm 0.7.10's drafter
classes compute (tests/test_heads_formats.py).

Each kind's ``propose`` is a pure function of arrays: the target's features of newly
committed positions and the tokens in, greedy drafts and their float32 logits out, the
head's own K/V state passed in and returned (``common``: slot p holds position p's entry).
"""

from .common import HeadMismatch, Target, TargetDims
from .formats import head_kind
from .loading import check_fit, load_head, target_dims

__all__ = [
    "HeadMismatch",
    "Target",
    "TargetDims",
    "check_fit",
    "head_kind",
    "load_head",
    "target_dims",
]
