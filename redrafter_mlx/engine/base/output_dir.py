"""The one rule for a command's output folder (``convert --out``, ``distill --out``).

A folder that already holds something (a model, a drafter, any file) is replaced only when the
user says so (``--force``, ``--overwrite``); a folder holding one of the command's own inputs is
never replaced. A replacement is built in a hidden folder beside ``out`` and renamed into place
at the end (:func:`install`), so a failed or interrupted run leaves the old folder as it was.

The rule returns a message (:func:`refusal`) and each caller raises its own error type with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

DRAFTER_MODEL_TYPE = "recurrent_drafting_drafter"


def holds(out: Path) -> str | None:
    """What a non-empty folder holds, for messages: 'a model', 'a drafter' or 'files'.

    None when ``out`` does not exist or is an empty folder.
    """
    if not out.is_dir() or not any(out.iterdir()):
        return None
    try:
        config = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return "files"
    if not isinstance(config, dict):
        return "files"
    return "a drafter" if config.get("model_type") == DRAFTER_MODEL_TYPE else "a model"


def refusal(out: Path, replace: bool, sources: Iterable[Path], flag: str) -> str | None:
    """Why ``out`` may not be written, or None when it may.

    Refused: ``out`` is a file; ``out`` is (or contains) a source; ``out`` is non-empty and
    ``replace`` is false (the message names ``flag``, the option that allows it).
    """
    where = out.expanduser().resolve()
    for src in sources:
        src = Path(src).expanduser().resolve()
        if src == where or where in src.parents:
            return f"--out {out} would overwrite the source {src}; choose another folder"
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file; choose a folder path"
    what = holds(out)
    if what is not None and not replace:
        held = "files" if what == "files" else f"it holds {what}"
        return (
            f"--out {out} exists and is not empty ({held}); choose another folder or pass "
            f"{flag} to replace it (after the new one is complete)"
        )
    return None


def install(tmp: Path, out: Path) -> None:
    """Move the finished folder ``tmp`` to ``out``; a replaced ``out`` is removed only after."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        os.replace(tmp, out)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
    os.replace(out, backup / out.name)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(backup / out.name, out)
        raise
    finally:
        shutil.rmtree(backup, ignore_errors=True)


def _missing_parents(path: Path) -> list[Path]:
    """Ancestors of ``path`` that do not exist yet, outermost first."""
    missing = []
    for parent in [path, *path.parents]:
        if parent.exists():
            break
        missing.append(parent)
    return missing[::-1]


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def make_sibling(out: Path, tag: str) -> Path:
    """A new hidden folder beside ``out`` (``.NAME.TAG-xxxx``), with the usual permissions."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{tag}-", dir=out.parent))
    os.chmod(tmp, 0o777 & ~_current_umask())  # mkdtemp makes 0700; give out the usual mode
    return tmp


@contextlib.contextmanager
def staging_dir(out: Path, tag: str = "converting") -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; install it as ``out`` on success.

    On any exception (Ctrl-C included) the temporary folder, and any parent folder created for
    ``out``, are removed and the exception propagates.
    """
    created = _missing_parents(out.parent)
    tmp = None
    try:
        tmp = make_sibling(out, tag)
        yield tmp
        install(tmp, out)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
