"""Check a safetensors file before loading it: a truncated or corrupt file gets one clear
message (the same for ``generate`` and ``convert``), never a low-level loader error.

Format: ``u64 little-endian header length N``, ``N`` bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
data buffer (offsets relative to its start).
"""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

from .errors import RedrafterError

MAX_HEADER = 100 << 20  # safetensors' own limit


class CorruptFileError(RedrafterError, ValueError):
    """A safetensors file that cannot be read; the message names the file and the fix."""


def unreadable(path: Path) -> str | None:
    """Why a weights file that is listed (or whose name is there) cannot be opened: a symbolic
    link that loops or points nowhere, a folder, no permission; None when it opens."""
    path = Path(path)
    try:
        with open(path, "rb"):
            return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            why = f"a symbolic link in a loop (to {os.readlink(path)!r}, which leads back to it)"
        elif path.is_symlink() and not path.exists():
            why = f"a symbolic link to {os.readlink(path)!r}, which does not exist"
        elif path.is_dir():
            why = "a folder, not a file"
        else:
            why = f"unreadable ({e.strerror})"
    return f"{path} is {why}; replace it with the weights file (re-download or re-convert it)"


def check_readable(path: Path) -> None:
    """Raise :class:`CorruptFileError` with :func:`unreadable`'s reason unless ``path`` opens."""
    problem = unreadable(path)
    if problem:
        raise CorruptFileError(problem)


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
    """The file's header; :class:`CorruptFileError` unless the file opens and every tensor's
    bytes lie inside it."""
    path = Path(path)
    check_readable(path)
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
