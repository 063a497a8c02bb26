"""Read PyTorch zip-format ``.bin`` checkpoints without torch and without running pickled code.

A ``torch.save`` file (torch >= 1.6) is an uncompressed zip::

    <archive>/data.pkl          pickle of the state dict
    <archive>/byteorder         "little" (absent in older files: little-endian)
    <archive>/data/<key>        raw bytes of storage <key>

The pickle only ever needs ``collections.OrderedDict``, ``torch._utils._rebuild_tensor_v2``
(and ``_rebuild_parameter``), and the ``torch.*Storage`` classes, with persistent ids
``('storage', StorageType, key, location, numel)``. :class:`RestrictedUnpickler` maps exactly
those globals to harmless local stand-ins and refuses every other one (``os.system``,
``builtins.eval``, ``subprocess.Popen``, ...) before anything is called, so no code from the
file can run. Tensors come back as :class:`~weights_convert.tensors.TensorRef` whose loader is
a read-only numpy memory map of the storage bytes inside the zip (views with offset/stride
included).
"""

from __future__ import annotations

import _compat_pickle
import collections
import io
import math
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from weights_convert.errors import ConversionError, UnsafePickleError
from weights_convert.tensors import NUMPY_DTYPES, TensorRef

# torch storage class name -> safetensors dtype code.
STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "F64",
    "FloatStorage": "F32",
    "HalfStorage": "F16",
    "BFloat16Storage": "BF16",
    "LongStorage": "I64",
    "IntStorage": "I32",
    "ShortStorage": "I16",
    "CharStorage": "I8",
    "ByteStorage": "U8",
    "BoolStorage": "BOOL",
}

_RESAVE_HINT = (
    "re-save it with a current torch (`torch.save(torch.load(path, weights_only=True), new_path)`) "
    "or as safetensors"
)


@dataclass(frozen=True)
class _StorageType:
    """Stand-in for a ``torch.<X>Storage`` class: only its dtype matters."""

    name: str
    dtype: str


@dataclass(frozen=True)
class _Storage:
    """A persistent-id reference to ``<archive>/data/<key>``: ``numel`` elements of ``dtype``."""

    dtype: str
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorRecord:
    """What ``_rebuild_tensor_v2`` would build: a strided view into a storage."""

    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _as_int_tuple(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise UnsafePickleError(f"malformed tensor {what} {value!r} in the pickle")
    return tuple(value)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, *_ignored) -> _TensorRecord:
    """Local stand-in for ``torch._utils._rebuild_tensor_v2``: records the view, builds nothing."""
    if not isinstance(storage, _Storage):
        raise UnsafePickleError("_rebuild_tensor_v2 called without a storage from the archive")
    if (
        not isinstance(storage_offset, int)
        or isinstance(storage_offset, bool)
        or storage_offset < 0
    ):
        raise UnsafePickleError(f"malformed tensor offset {storage_offset!r} in the pickle")
    shape = _as_int_tuple(size, "size")
    strides = _as_int_tuple(stride, "stride")
    if len(shape) != len(strides):
        raise UnsafePickleError(f"tensor size {shape} and stride {strides} differ in length")
    return _TensorRecord(storage, storage_offset, shape, strides)


def _rebuild_parameter(data, *_ignored) -> _TensorRecord:
    """Local stand-in for ``torch._utils._rebuild_parameter(data, requires_grad, hooks[, "
    "state])``."""
    if not isinstance(data, _TensorRecord):
        raise UnsafePickleError("_rebuild_parameter called on something that is not a tensor")
    return data


_ALLOWED_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,  # builds a dict, runs nothing
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals a PyTorch state dict needs.

    Every other global (any module, any name) raises :class:`UnsafePickleError` naming it,
    before it could be called. Persistent ids must be well-formed storage references.
    """

    def find_class(self, module: str, name: str):
        # Python 2 names (``__builtin__.eval``) mean what pickle's fix_imports maps them to.
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) in _ALLOWED_GLOBALS:
            return _ALLOWED_GLOBALS[(module, name)]
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(name, STORAGE_DTYPES[name])
        raise UnsafePickleError(
            f"refused to load: the pickle asks for the global '{module}.{name}', which a "
            "PyTorch state dict never needs (the file may be malicious). Only "
            "collections.OrderedDict, torch._utils._rebuild_tensor_v2/_rebuild_parameter and "
            "torch.*Storage are allowed; get the weights as safetensors or from a trusted source"
        )

    def persistent_load(self, pid) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafePickleError(f"refused to load: unexpected persistent id {pid!r:.80}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise UnsafePickleError(
                f"refused to load: storage type {storage_type!r:.80} is not a torch Storage"
            )
        if not isinstance(key, str) or not key.isalnum():
            raise UnsafePickleError(f"refused to load: malformed storage key {key!r:.80}")
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise UnsafePickleError(f"refused to load: malformed storage size {numel!r:.80}")
        return _Storage(storage_type.dtype, key, numel)


def _check_is_zip(path: Path) -> None:
    """Raise a clear error for legacy (pre-zip) torch files and truncated/corrupt zips."""
    with open(path, "rb") as f:
        head = f.read(4)
    if zipfile.is_zipfile(path):
        return
    if head.startswith(b"PK"):
        raise ConversionError(
            f"{path} is truncated or corrupt (a zip archive without its central directory); "
            "re-download it"
        )
    if (
        head[:1] == b"\x80"
        or head[:4] == b"\x1f\x8b\x08\x00"
        or path.suffix in {".bin", ".pt", ".pth"}
    ):
        raise ConversionError(
            f"{path} is a legacy (pre-zip, torch < 1.6) PyTorch checkpoint, which cannot be read "
            f"safely without torch; {_RESAVE_HINT}"
        )
    raise ConversionError(f"{path} is not a PyTorch zip checkpoint; {_RESAVE_HINT}")


def _archive_prefix(names: list[str], path: Path) -> str:
    """The folder inside the zip that holds ``data.pkl`` (``archive/``, ``<stem>/``, ...)."""
    candidates = [n for n in names if n.endswith("data.pkl") and n.count("/") <= 1]
    if len(candidates) != 1:
        raise ConversionError(
            f"{path} is a zip but not a PyTorch checkpoint (no single '<archive>/data.pkl'); "
            "pass the original pytorch_model*.bin files"
        )
    return candidates[0][: -len("data.pkl")]


def _entry_data_offset(path: Path, info: zipfile.ZipInfo) -> int:
    """Byte offset in the file where an uncompressed zip entry's data starts."""
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise ConversionError(
            f"{path} is corrupt (bad zip entry header for {info.filename}); re-download it"
        )
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _unpickle_state_dict(zf: zipfile.ZipFile, pkl_name: str, path: Path) -> dict:
    """Unpickle ``data.pkl`` with :class:`RestrictedUnpickler` -> ``{name: _TensorRecord}``."""
    try:
        data = zf.read(pkl_name)
        obj = RestrictedUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError as e:
        raise UnsafePickleError(f"{path}: {e}") from None
    except (
        zipfile.BadZipFile,
        EOFError,
        pickle.UnpicklingError,
        ValueError,
        TypeError,
        KeyError,
    ) as e:
        raise ConversionError(
            f"{path} is corrupt ({type(e).__name__}: {e}); re-download it"
        ) from None
    if isinstance(obj, dict) and len(obj) == 1 and next(iter(obj)) in ("state_dict", "model"):
        obj = next(iter(obj.values()))
    if not isinstance(obj, dict):
        raise ConversionError(
            f"{path} holds a {type(obj).__name__}, not a state dict of tensors; {_RESAVE_HINT}"
        )
    for name, value in obj.items():
        if not isinstance(name, str) or not isinstance(value, _TensorRecord):
            raise ConversionError(
                f"{path}: entry {name!r} is not a tensor; pass a plain state dict "
                "(`torch.save(model.state_dict(), path)`)"
            )
    return obj


def _make_loader(path: Path, data_start: int, record: _TensorRecord):
    """A loader returning ``record``'s tensor as a numpy view of the memory-mapped storage."""
    dtype = NUMPY_DTYPES[record.storage.dtype]

    def load() -> np.ndarray:
        if math.prod(record.shape) == 0:
            return np.zeros(record.shape, dtype)
        extent = 1 + sum((s - 1) * st for s, st in zip(record.shape, record.stride))
        mm = np.memmap(
            path,
            dtype=dtype,
            mode="r",
            offset=data_start + record.offset * dtype.itemsize,
            shape=(extent,),
        )
        view = np.lib.stride_tricks.as_strided(
            mm,
            shape=record.shape,
            strides=[st * dtype.itemsize for st in record.stride],
            writeable=False,
        )
        return np.ascontiguousarray(view)

    return load


def _check_record(name: str, record: _TensorRecord, entry_size: int, path: Path) -> None:
    """The view must lie inside its storage, and the storage inside its zip entry."""
    itemsize = NUMPY_DTYPES[record.storage.dtype].itemsize
    if record.storage.numel * itemsize > entry_size:
        raise ConversionError(
            f"{path}: storage {record.storage.key} of tensor {name} claims {record.storage.numel} "
            f"elements but holds {entry_size} bytes; the file is corrupt, re-download it"
        )
    if math.prod(record.shape) == 0:
        return
    end = record.offset + 1 + sum((s - 1) * st for s, st in zip(record.shape, record.stride))
    if end > record.storage.numel:
        raise ConversionError(
            f"{path}: tensor {name} (shape {record.shape}, stride {record.stride}, offset "
            f"{record.offset}) reaches past its storage of {record.storage.numel} elements; "
            "the file is corrupt, re-download it"
        )


def read_torch_bin(path: Path) -> list[TensorRef]:
    """List the tensors of a PyTorch zip checkpoint without reading their data.

    Args:
        path: a ``torch.save`` zip file (``pytorch_model*.bin``).

    Returns:
        one :class:`TensorRef` per state-dict entry, in file order; ``load()`` gives a
        C-contiguous numpy array (``BF16`` as uint16 bits).

    Raises:
        UnsafePickleError: the pickle names a global outside the allow-list.
        ConversionError: legacy format, truncated/corrupt file, big-endian data, compressed
            entries, or views outside their storage.
    """
    path = Path(path)
    _check_is_zip(path)
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            prefix = _archive_prefix(names, path)
            if f"{prefix}byteorder" in names and zf.read(f"{prefix}byteorder").strip() != b"little":
                raise ConversionError(
                    f"{path} stores big-endian data, which is not supported; {_RESAVE_HINT}"
                )
            records = _unpickle_state_dict(zf, f"{prefix}data.pkl", path)
            infos = {}
            for record in records.values():
                key = record.storage.key
                if key not in infos:
                    try:
                        infos[key] = zf.getinfo(f"{prefix}data/{key}")
                    except KeyError:
                        raise ConversionError(
                            f"{path} is corrupt: storage '{key}' is missing from the archive; "
                            "re-download it"
                        ) from None
    except zipfile.BadZipFile as e:
        raise ConversionError(f"{path} is truncated or corrupt ({e}); re-download it") from None
    file_size = path.stat().st_size
    starts = {}
    for key, info in infos.items():
        if info.compress_type != zipfile.ZIP_STORED:
            raise ConversionError(
                f"{path}: storage '{key}' is compressed, which torch never writes; {_RESAVE_HINT}"
            )
        starts[key] = _entry_data_offset(path, info)
        if starts[key] + info.file_size > file_size:
            raise ConversionError(
                f"{path} is truncated (storage '{key}' ends past the end of the file); "
                "re-download it"
            )
    refs = []
    for name, record in records.items():
        info = infos[record.storage.key]
        _check_record(name, record, info.file_size, path)
        loader = _make_loader(path, starts[record.storage.key], record)
        refs.append(TensorRef(name, record.storage.dtype, record.shape, path, loader))
    return refs
