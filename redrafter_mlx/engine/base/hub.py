"""One rule for ``--model``/``--drafter`` values: a local path, or a Hugging Face repo id.

A value is a **path** when it exists, starts with ``.``, ``/`` or ``~``, names a folder whose
parent exists (``models/vicuna`` while ``models/`` is there) or is not shaped ``owner/name``; a
missing path is reported as "not found" at once. Anything else is a **repo id**: found in the
Hugging Face cache, else (unless ``HF_HUB_OFFLINE`` is set) downloaded after a quick
reachability check, so that no network fails in seconds instead of minutes of retries.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlparse

from .errors import RedrafterError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
REACH_TIMEOUT_S = 3.0

# Picks the files to download from a repo's listing (all by default).
FileChooser = Callable[[list[str]], list[str]]


class ResolveError(RedrafterError):
    """A model/drafter location that cannot be found; the message says what to do."""


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` forbids network access."""
    env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return env in {"1", "ON", "YES", "TRUE"}


def is_path(spec: str) -> bool:
    """Whether ``spec`` names a local path (see the module docstring) rather than a repo id."""
    path = Path(spec).expanduser()
    if path.exists() or spec.startswith((".", "/", "~")) or not REPO_ID.match(spec):
        return True
    return path.parent.is_dir()


def download_command(repo_id: str, patterns: Sequence[str]) -> str:
    """The ``hf download`` command that fetches what we need from ``repo_id``."""
    include = " ".join(f"'{p}'" for p in patterns)
    return f"hf download {repo_id}" + (f" --include {include}" if include else "")


def _hub_reachable() -> bool:
    """A TCP connection to the Hub's host within a few seconds (no retries)."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=REACH_TIMEOUT_S):
            return True
    except OSError:
        return False


def hub_cache_dir() -> str | None:
    """The hub cache the environment points to now (huggingface_hub reads it at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def _from_cache(repo_id: str) -> Path | None:
    """The repo's cached snapshot when it holds a config.json."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, cache_dir=hub_cache_dir(), local_files_only=True))
    except Exception:  # not cached (huggingface_hub raises several types)
        return None
    return path if (path / "config.json").is_file() else None


def resolve(
    spec: str | os.PathLike,
    what: str = "model",
    patterns: Sequence[str] = ("*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"),
    choose: FileChooser | None = None,
) -> Path:
    """A local folder for ``spec``: the path itself, or the repo's snapshot in the HF cache.

    ``patterns``: the files a repo download needs; ``choose`` (optional) picks files from the
    repo's listing instead. Raises :class:`ResolveError` with the fix in its message.
    """
    text = str(spec)
    path = Path(text).expanduser()
    if is_path(text):
        if path.is_dir():
            return path
        if path.exists() and path.suffix.lower() == ".gguf":
            raise ResolveError(
                f"{what} {text} is a GGUF file, which does not load as it is: convert it to a "
                f"folder first, redrafter-mlx convert --model {text} --out <dir>, and pass that "
                "folder"
            )
        if path.exists():
            raise ResolveError(f"{what} {text} is a file; pass the folder that holds config.json")
        raise ResolveError(f"{what} directory not found: {path} (no such folder)")
    cached = _from_cache(text)
    if cached is not None:
        return cached
    hint = (
        f"if {text!r} is a local folder, check the path; if it is a Hugging Face repo, get it "
        f"with network access: {download_command(text, patterns)}"
    )
    if hub_offline():
        raise ResolveError(
            f"{what} {text!r}: no such folder, and not in the Hugging Face cache "
            f"({hub_cache_dir() or 'default cache'}); HF_HUB_OFFLINE is set, so nothing is "
            f"downloaded; {hint}"
        )
    if not _hub_reachable():
        raise ResolveError(f"{what} {text!r}: no such folder, and the Hub is unreachable; {hint}")
    return _download(text, what, patterns, choose, hint)


def _download(
    repo_id: str, what: str, patterns: Sequence[str], choose: FileChooser | None, hint: str
) -> Path:
    from huggingface_hub import HfApi, snapshot_download

    try:
        if choose is not None:
            patterns = choose(HfApi().list_repo_files(repo_id))
        return Path(
            snapshot_download(repo_id, allow_patterns=list(patterns), cache_dir=hub_cache_dir())
        )
    except ResolveError:
        raise
    except Exception as e:
        name = type(e).__name__
        if name in {"RepositoryNotFoundError", "GatedRepoError"}:
            raise ResolveError(
                f"{what} {repo_id!r}: no such folder, and the Hugging Face repo was not found or "
                f"is gated ({name}); check the id, accept its license on the Hub and log in with "
                f"'hf auth login', or pass a local folder"
            ) from None
        raise ResolveError(f"{what} {repo_id!r}: download failed ({name}: {e}); {hint}") from None
