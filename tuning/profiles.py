"""Tuned profiles: the best shape per chip + model + drafter + dtype + package version.

One JSON file holds every profile::

    {"format": 1, "profiles": {"<key>": {"key": {...}, "shape": {...}, ...}}}

It lives in the home folder (``redrafter_mlx.engine.base.bundled.home()``: ``$REDRAFTER_MLX_HOME``,
else ``$XDG_CACHE_HOME/redrafter-mlx/``, else ``~/.cache/redrafter-mlx/``). Writes are atomic
(temp file in the same folder, fsync, ``os.replace``) so an interrupted write leaves the
old file intact. A file that cannot be read, is not UTF-8 or is not a profiles object is
reported in one warning line naming it and treated as empty; ``tune --clear`` removes it
whatever it holds. :meth:`ProfileStore.check_writable` tells, before a long measurement,
whether the result can be saved at all.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from redrafter_mlx.engine.base.bundled import home
from redrafter_mlx.engine.base.errors import RedrafterError
from redrafter_mlx.engine.core.shape import BeamShape

FORMAT = 1
FILE_NAME = "profiles.json"


def default_warn(message: str) -> None:
    """Print a one-line warning to stderr."""
    print(f"warning: {message}", file=sys.stderr)


def profiles_path() -> Path:
    """Where profiles are stored: ``profiles.json`` in the home folder."""
    return home() / FILE_NAME


def package_version() -> str:
    """The installed redrafter-mlx version (profiles are keyed by it)."""
    from redrafter_mlx import __version__

    return __version__


# --------------------------------------------------------------------------- keys


def _config_fingerprint(directory: Path) -> str:
    """First 12 hex digits of the sha256 of ``directory/config.json`` ("noconfig" if absent)."""
    try:
        return hashlib.sha256((directory / "config.json").read_bytes()).hexdigest()[:12]
    except OSError:
        return "noconfig"


def describe_model(path: str | os.PathLike | None) -> tuple[str, str]:
    """(identity, fingerprint) of a model or drafter.

    A local directory is identified by its resolved path and the hash of its config.json;
    anything else (a hub id such as ``mlx-community/...``) by its name, fingerprint ``hub``;
    ``None`` (no drafter) by ``("none", "-")``.
    """
    if path is None:
        return "none", "-"
    local = Path(path).expanduser()
    if local.is_dir():
        return str(local.resolve()), _config_fingerprint(local)
    return str(path), "hub"


def describe_quantization(path: str | os.PathLike | None) -> str:
    """``"q4g64"`` from config.json's quantization block, ``"none"`` without one."""
    if path is None:
        return "none"
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return "unknown"
    quant = config.get("quantization") if isinstance(config, dict) else None
    if not isinstance(quant, dict):
        return "none"
    return f"q{quant.get('bits', '?')}g{quant.get('group_size', '?')}"


@dataclass(frozen=True)
class ProfileKey:
    """Everything a tuned shape depends on; two runs share a profile only if all match."""

    chip_id: str
    model: str
    model_fingerprint: str
    drafter: str
    drafter_fingerprint: str
    dtype: str
    quantization: str
    version: str
    draft_model: str = "none"  # ``tune --draft-model``: its shapes were measured with it
    draft_model_fingerprint: str = "-"

    @classmethod
    def build(
        cls,
        chip_id: str,
        model_path,
        drafter_path,
        dtype,
        version: str | None = None,
        draft_model_path=None,
    ):
        """The key for a chip, model/drafter paths (or hub ids), dtype (any printable) and
        the draft slot tuned with (None: none; a path; or a (draft model, early-exit
        adapter) pair: both, joined by ``+``)."""
        model, model_fp = describe_model(model_path)
        drafter, drafter_fp = describe_model(drafter_path)
        if isinstance(draft_model_path, (tuple, list)):
            parts = [describe_model(p) for p in draft_model_path]
            draft, draft_fp = ("+".join(part[i] for part in parts) for i in (0, 1))
        else:
            draft, draft_fp = describe_model(draft_model_path)
        return cls(
            chip_id=chip_id,
            model=model,
            model_fingerprint=model_fp,
            drafter=drafter,
            drafter_fingerprint=drafter_fp,
            dtype=_dtype_name(dtype),
            quantization=describe_quantization(model_path),
            version=version or package_version(),
            draft_model=draft,
            draft_model_fingerprint=draft_fp,
        )

    @property
    def text(self) -> str:
        """The string the profile is stored under (without a draft model: as before there
        was one, so older profiles keep their keys)."""
        fields = asdict(self)
        if self.draft_model == "none":
            del fields["draft_model"], fields["draft_model_fingerprint"]
        return "|".join(fields.values())


def _dtype_name(dtype: Any) -> str:
    """``mx.float16`` -> ``"float16"``; strings unchanged; ``None`` -> the platform default
    (what the engine loads with), so ``tune`` and ``chat`` agree on the key."""
    if dtype is None:
        try:
            from redrafter_mlx.engine.base.platform import default_dtype

            dtype = default_dtype()
        except Exception:
            return "default"
    return str(dtype).rsplit(".", 1)[-1]


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Profile:
    """A saved tuning result."""

    key: ProfileKey
    shape: BeamShape
    speculative: bool
    speedup: float | None
    tokens_per_s: float | None
    created: str  # ISO date-time, UTC
    summary: dict
    lookup_searched: bool = False  # the search tried context lookup: the shape's lookup
    # fields (none included) were measured, so commands must not add the default chain
    sources: tuple[str, ...] = ()  # the draft sources the shape runs (``grid.shape_sources``)

    @property
    def date(self) -> str:
        """The creation day, ``YYYY-MM-DD``."""
        return self.created[:10]

    def to_json(self) -> dict:
        """The JSON record."""
        return {
            "key": asdict(self.key),
            "shape": self.shape.to_dict(),
            "speculative": self.speculative,
            "speedup": self.speedup,
            "tokens_per_s": self.tokens_per_s,
            "created": self.created,
            "summary": self.summary,
            "lookup_searched": self.lookup_searched,
            "sources": list(self.sources),
        }

    @classmethod
    def from_json(cls, record: dict) -> Profile:
        """Parse one record; raises KeyError/TypeError/ValueError when malformed. A record
        written before context lookup (no ``lookup`` keys) loads without lookup."""
        return cls(
            key=ProfileKey(**record["key"]),
            shape=shape_from_dict(record["shape"]),
            speculative=bool(record["speculative"]),
            speedup=record.get("speedup"),
            tokens_per_s=record.get("tokens_per_s"),
            created=str(record["created"]),
            summary=dict(record.get("summary") or {}),
            lookup_searched=bool(record.get("lookup_searched", False)),
            sources=tuple(str(name) for name in record.get("sources") or ()),
        )


def shape_from_dict(shape: dict) -> BeamShape:
    """The inverse of ``BeamShape.to_dict``; absent ``lookup``/``lookup_length`` (or
    ``model_length``) mean none.
    Raises KeyError/TypeError/ValueError when malformed."""
    capacity = shape.get("capacity")
    chains = int(shape.get("lookup") or 0)
    return BeamShape(
        int(shape["width"]),
        int(shape["length"]),
        None if capacity is None else int(capacity),
        chains,
        int(shape.get("lookup_length") or 0) if chains else 0,
        int(shape.get("model_length") or 0),
    )


def now_iso() -> str:
    """Current UTC time, ISO format, seconds precision."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


# --------------------------------------------------------------------------- store


class ProfileStore:
    """Load, query and atomically save the profiles file."""

    def __init__(
        self, path: str | os.PathLike | None = None, warn: Callable[[str], None] = default_warn
    ):
        self.path = Path(path) if path is not None else profiles_path()
        self.warn = warn

    def load(self) -> dict[str, Profile]:
        """Every valid profile by key text; a missing file is empty, an unreadable or corrupt
        one (not UTF-8, not JSON, not profiles) warns once, naming it."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as e:
            self.warn(
                f"cannot read tuned profiles {self.path} ({e.strerror or e}); using presets "
                f"(check REDRAFTER_MLX_HOME, or run 'redrafter-mlx tune --clear')"
            )
            return {}
        try:
            data = json.loads(raw.decode("utf-8"))
            if not isinstance(data, dict) or not isinstance(data.get("profiles"), dict):
                raise ValueError("no 'profiles' object")
            profiles = {k: Profile.from_json(v) for k, v in data["profiles"].items()}
        except (ValueError, KeyError, TypeError) as e:
            detail = str(e)
            if isinstance(e, UnicodeDecodeError):
                detail = f"not UTF-8 text: byte 0x{e.object[e.start]:02x} at offset {e.start}"
            self.warn(
                f"ignoring corrupt tuned-profile file {self.path} ({detail}); "
                f"re-run 'redrafter-mlx tune' or 'redrafter-mlx tune --clear'"
            )
            return {}
        return profiles

    def get(self, key: ProfileKey) -> Profile | None:
        """The profile for exactly this key, or None."""
        return self.load().get(key.text)

    def put(self, profile: Profile) -> None:
        """Add or replace one profile and save atomically."""
        profiles = self.load()
        profiles[profile.key.text] = profile
        self.save(profiles)

    def save(self, profiles: dict[str, Profile]) -> None:
        """Write every profile: temp file in the same folder, fsync, then ``os.replace``;
        :class:`ProfileWriteError` when the folder cannot hold it."""
        payload = {"format": FORMAT, "profiles": {k: p.to_json() for k, p in profiles.items()}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".profiles-", suffix=".tmp", dir=self.path.parent)
        except OSError as e:
            raise ProfileWriteError(self.path.parent, e) from None
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(payload, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def clear(self) -> int:
        """Delete the profiles file, whatever it holds; returns how many profiles it held (0
        if none, unreadable or corrupt, or when the home folder is not a folder)."""
        count = len(ProfileStore(self.path, warn=lambda _msg: None).load())
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            self.path.unlink()
        return count

    def check_writable(self) -> None:
        """Raise :class:`ProfileWriteError` (one line naming the folder) unless a profile can
        be saved here: the folder exists or can be made, and a file can be written in it."""
        folder = self.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".profiles-", suffix=".probe", dir=folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise ProfileWriteError(folder, e) from None


class ProfileWriteError(RedrafterError, OSError):
    """Tuned profiles cannot be saved in the home folder; the message names it and the fix."""

    def __init__(self, folder: Path, cause: OSError):
        home_env = os.environ.get("REDRAFTER_MLX_HOME")
        where = f"REDRAFTER_MLX_HOME={home_env}" if home_env else "REDRAFTER_MLX_HOME is unset"
        why = cause.strerror or str(cause)
        if folder.exists() and not folder.is_dir():
            why = "it is a file, not a folder"
        super().__init__(
            f"cannot save tuned profiles in {folder} ({why}; {where}); "
            f"point REDRAFTER_MLX_HOME at a writable folder"
        )
