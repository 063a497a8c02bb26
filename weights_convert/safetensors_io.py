"""Read safetensors headers lazily, and write safetensors files one tensor at a time.

Format: ``u64 little-endian header length N``, ``N`` bytes of JSON
``{name: {"dtype": "F16", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}``
(padded with spaces), then the data buffer; offsets are relative to the buffer start.

Reading returns :class:`~weights_convert.tensors.TensorRef` whose loader memory-maps just that
tensor, so nothing is read until a tensor is needed. Writing is streamed: the header is
planned from the output specs up front, then each tensor's bytes are appended as they are
produced, so a shard never has to sit in memory whole.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from redrafter_mlx.engine.base.safetensors_check import CorruptFileError, corrupt, read_header
from weights_convert.errors import ConversionError
from weights_convert.tensors import NUMPY_DTYPES, TensorRef


def _corrupt(path: Path, why: str) -> ConversionError:
    return ConversionError(str(corrupt(path, why)))


def _read_header(path: Path) -> tuple[dict, int]:
    """Parse the JSON header -> (header dict, byte offset of the data buffer)."""
    try:
        return read_header(path)
    except CorruptFileError as e:
        raise ConversionError(str(e)) from None


def _parse_entry(
    path: Path, name: str, entry, data_start: int, file_size: int
) -> tuple[str, tuple[int, ...], int]:
    """Validate one header entry -> (dtype code, shape, absolute byte offset)."""
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise _corrupt(path, f"entry {name!r} lacks dtype/shape/data_offsets") from None
    if dtype not in NUMPY_DTYPES:
        raise ConversionError(
            f"{path}: tensor {name} has dtype {dtype}, which is not supported (use F32/F16/BF16)"
        )
    if not all(isinstance(d, int) and d >= 0 for d in shape) or not (
        isinstance(begin, int) and isinstance(end, int)
    ):
        raise _corrupt(path, f"entry {name!r} has a malformed shape or offsets")
    nbytes = math.prod(shape) * NUMPY_DTYPES[dtype].itemsize
    if end - begin != nbytes or begin < 0:
        raise _corrupt(
            path,
            f"tensor {name} spans {end - begin} bytes but dtype {dtype} shape {list(shape)} "
            f"needs {nbytes}",
        )
    if data_start + end > file_size:
        raise _corrupt(path, f"tensor {name} ends past the end of the file (truncated download?)")
    return dtype, shape, data_start + begin


def _make_loader(path: Path, dtype: str, shape: tuple[int, ...], offset: int):
    np_dtype = NUMPY_DTYPES[dtype]

    def load() -> np.ndarray:
        if math.prod(shape) == 0:
            return np.zeros(shape, np_dtype)
        return np.memmap(path, dtype=np_dtype, mode="r", offset=offset, shape=shape)

    return load


def read_safetensors(path: Path) -> list[TensorRef]:
    """List a safetensors file's tensors without reading their data.

    Returns:
        one :class:`TensorRef` per tensor, in data-offset order; ``load()`` memory-maps it
        (``BF16`` as uint16 bits).

    Raises:
        ConversionError: corrupt header (bad length, bad JSON, offsets inconsistent with
            dtype × shape, data past the end of the file) or an unsupported dtype.
    """
    path = Path(path)
    header, data_start = _read_header(path)
    file_size = path.stat().st_size
    refs = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, offset = _parse_entry(path, name, entry, data_start, file_size)
        refs.append(
            (offset, TensorRef(name, dtype, shape, path, _make_loader(path, dtype, shape, offset)))
        )
    return [ref for _, ref in sorted(refs, key=lambda item: item[0])]


@dataclass(frozen=True)
class TensorSpec:
    """An output tensor announced in a header before its bytes are produced."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * NUMPY_DTYPES[self.dtype].itemsize


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor, in the order of ``specs``.

    Usage::

        with SafetensorsWriter(path, specs, {"format": "mlx"}) as w:
            for spec in specs:
                w.write(spec.name, array)   # numpy array, dtype/shape as announced
    """

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.specs = list(specs)
        self._next = 0
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for spec in self.specs:
            header[spec.name] = {
                "dtype": spec.dtype,
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        blob += b" " * (-len(blob) % 8)
        self._file = open(self.path, "wb")  # noqa: SIM115 (the writer owns it until close())
        self._file.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, name: str, array: np.ndarray) -> None:
        """Append the next tensor; its name, dtype and shape must match the announced spec."""
        spec = self.specs[self._next]
        expected = NUMPY_DTYPES[spec.dtype]
        if name != spec.name or tuple(array.shape) != spec.shape or array.dtype != expected:
            raise RuntimeError(
                f"writer expected {spec.name} {spec.dtype}{list(spec.shape)}, got {name} "
                f"{array.dtype}{list(array.shape)}"
            )
        self._file.write(np.ascontiguousarray(array).data)
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self.specs):
            raise RuntimeError(f"{self.path}: wrote {self._next} of {len(self.specs)} tensors")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()
