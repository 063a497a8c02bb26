"""Distillation settings and data shared by the training and CLI tests."""

from __future__ import annotations

from tests.support.models import (
    SHAREGPT_SAMPLE,
)

SHAREGPT = SHAREGPT_SAMPLE


RUN = dict(
    predict_tokens=2,
    steps=4,
    batch_size=32,
    seq_len=128,
    save_every=2,
    quiet=True,
    eval_shapes=(),
)


TOY = [
    "--budget",
    "1500",
    "--own-prompts",
    "4",
    "--val-prompts",
    "3",
    "--gen-batch",
    "16",
    "--answer-tokens",
    "24",
    "--batch-size",
    "32",
    "--predict-tokens",
    "3",
    "--eval-prompts",
    "2",
    "--eval-max-tokens",
    "8",
    "--select-every",
    "5",
]
