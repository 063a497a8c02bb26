"""Where the repository and the committed test data are, for every test module and helper."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
FIXTURES = ROOT / "tests" / "fixtures"  # committed test data (tokenizers, small checkpoints)
CONVERT = FIXTURES / "convert"  # the converter's checkpoints in miniature
