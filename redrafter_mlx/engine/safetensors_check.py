"""Check a safetensors file before loading it: a truncated or corrupt file gets one clear
message (the same for ``generate`` and ``convert``), never a low-level loader error.

Format: ``u64 little-endian header length N``, ``N`` bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
data buffer (offsets relative to its start).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

MAX_HEADER = 100 << 20  # safetensors' own limit


class CorruptFileError(ValueError):
    """A safetensors file that cannot be read; the message names the file and the fix."""


def corrupt(path: Path, why: str) -> CorruptFileError:
    """The one message for a damaged file."""
    return CorruptFileError(
        f"{path} has a corrupt safetensors header ({why}); re-download or re-export it"
    )


def read_header(path: Path) -> tuple[dict, int]:
    """Parse the JSON header -> (header dict, byte offset of the data buffer)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise corrupt(path, "file shorter than 8 bytes")
        (n,) = struct.unpack("<Q", raw_len)
        if n > MAX_HEADER or 8 + n > size:
            raise corrupt(path, f"header length {n} does not fit a {size}-byte file")
        blob = f.read(n)
    try:
        header = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise corrupt(path, f"invalid JSON: {e}") from None
    if not isinstance(header, dict):
        raise corrupt(path, "header is not a JSON object")
    return header, 8 + n


def check_file(path: Path) -> dict:
    """The file's header; :class:`CorruptFileError` unless every tensor's bytes lie inside it."""
    path = Path(path)
    header, data_start = read_header(path)
    size = path.stat().st_size
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            _, end = entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise corrupt(path, f"entry {name!r} lacks data_offsets") from None
        if not isinstance(end, int) or data_start + end > size:
            raise corrupt(
                path, f"tensor {name} ends past the end of the file (truncated download?)"
            )
    return header
