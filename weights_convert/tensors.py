"""Lazy references to tensors inside checkpoint files, and the dtype tables they share.

A :class:`TensorRef` knows a tensor's name, dtype and shape from the file's metadata alone
(a safetensors header, a ``.bin`` pickle); its bytes are read only by :meth:`TensorRef.load`,
one tensor at a time, so a conversion never holds a whole shard in memory.

Dtypes are named with the safetensors codes (``"F32"``, ``"F16"``, ``"BF16"``, ...). numpy has
no bfloat16, so ``BF16`` data travels as raw ``uint16`` bit patterns and becomes an MLX array
through a bit view (:func:`to_mx`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# safetensors dtype code -> numpy dtype holding the raw bytes (bf16 as its uint16 bit pattern).
NUMPY_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "U32": np.dtype("<u4"),
    "BOOL": np.dtype("?"),
}
FLOAT_CODES = frozenset({"F64", "F32", "F16", "BF16"})

# --dtype choices -> safetensors code.
DTYPE_CODES: dict[str, str] = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


@dataclass(frozen=True)
class TensorRef:
    """One tensor in a checkpoint file, not yet read.

    Attributes:
        name: the key in the checkpoint (e.g. ``model.layers.0.mlp.up_proj.weight``).
        dtype: safetensors dtype code of the stored data.
        shape: logical shape, e.g. ``(intermediate, hidden)``.
        path: the file holding the bytes (for error messages).
        loader: returns the tensor as a C-contiguous numpy array of ``shape`` and
            ``NUMPY_DTYPES[dtype]`` (often a read-only memory map of the file).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    loader: Callable[[], np.ndarray] = field(repr=False, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * NUMPY_DTYPES[self.dtype].itemsize

    def load(self) -> np.ndarray:
        """Read the bytes: array of ``shape``, numpy dtype ``NUMPY_DTYPES[dtype]``."""
        return self.loader()

    def renamed(self, name: str) -> TensorRef:
        return TensorRef(name, self.dtype, self.shape, self.path, self.loader)


def to_mx(raw: np.ndarray, code: str):
    """numpy array holding ``code`` data -> ``mx.array`` of the matching MLX dtype (a copy)."""
    import mlx.core as mx

    if code == "BF16":
        return mx.array(raw).view(mx.bfloat16)
    return mx.array(raw)


def mx_dtype(code: str):
    """safetensors float code -> MLX dtype."""
    import mlx.core as mx

    return {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16, "F64": mx.float32}[code]


def mx_to_numpy(array) -> tuple[np.ndarray, str]:
    """``mx.array`` -> (numpy array with the same bytes, safetensors code). Evaluates the array."""
    import mlx.core as mx

    if array.dtype == mx.bfloat16:
        return np.asarray(array.view(mx.uint16)), "BF16"
    codes = {mx.float32: "F32", mx.float16: "F16", mx.uint32: "U32"}
    if array.dtype not in codes:
        raise TypeError(f"unexpected MLX dtype {array.dtype} in converted output")
    return np.asarray(array), codes[array.dtype]
