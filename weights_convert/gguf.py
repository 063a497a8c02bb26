"""GGUF input (llama.cpp, Ollama, LM Studio files) -> mlx-lm folder.

Architectures (``general.architecture``): ``llama``, ``qwen2``, ``qwen3``, ``gemma2`` and
``gemma3`` (the text model: model_type ``gemma3_text``). Per family, llama.cpp's
conventions are undone here: Llama's Q/K row permutation (below), and the ``+1`` that
``convert_hf_to_gguf.py`` adds to every Gemma ``*norm.weight`` (Gemma's RMSNorm scales by
``1 + w``; llama.cpp bakes the 1 in), subtracted again in float32. Gemma hyperparameters
llama.cpp does not store are set as llama.cpp sets them: the attention scale (head_dim,
but hidden / heads for the 27B models), Gemma 3's sliding pattern (every 6th layer global)
and local rope base (10000), Gemma 2's soft caps (50, 30) when absent.

The file is parsed here with bounds checks on every read (no ``mx.load``: MLX's GGUF reader
crashes on a corrupt header, turns BF16 into float16 and silently dequantizes K-quants). Tensor
data is memory-mapped and read one tensor at a time.

Tensor types: every type llama.cpp writes for weights, i.e. every one the ``gguf`` package
(llama.cpp's own Python package, a runtime dependency) dequantizes: F32, F16, BF16, Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, the K-quants Q2_K to Q6_K, the i-quants (IQ1_S to IQ4_XS), TQ1_0, TQ2_0,
MXFP4. A quantized tensor is dequantized with the package's own arithmetic
(``gguf.quants.dequantize``, bit for bit), or, where MLX's affine format (``x = scale * q + bias``
per group of 32 values along a row) holds it exactly, kept quantized (:func:`packed_triple`):

    Q8_0   d: f16, q: int8                        -> 8-bit  q + 128, scale d,      bias -128 d
    Q4_0   d: f16, q: 4-bit                       -> 4-bit  q,       scale d,      bias -8 d
    Q4_1   d, m: f16, q: 4-bit                    -> 4-bit  q,       scale d,      bias m
    Q5_0   d: f16, q: 5-bit                       -> 5-bit  q,       scale d,      bias -16 d
    Q5_1   d, m: f16, q: 5-bit                    -> 5-bit  q,       scale d,      bias m
    Q4_K   d, dmin: f16 per 256 values;           -> 4-bit  q,       scale d sc,   bias -dmin m
           6-bit sc, m per 32; q: 4-bit
    Q5_K   the same with 5-bit q                  -> 5-bit

``scale * q`` is exact in float32 for all of them (at most 22 significant bits), so MLX's
``scale * q + bias`` rounds once where gguf's ``d * q + m`` does, and gives the same float32.
The 32-block types' scales and biases are exact in float16. A K-quant's ``d * sc`` and
``dmin * m`` have up to 17 significant bits: exact in float32, not in float16, so K-quant
scales and biases are written in float32 when the other floats are float32, and rounded once to
float16 (relative error at most 2^-11, the precision a float16 model computes in) otherwise.
Q2_K, Q3_K and Q6_K scale sub-blocks of 16 values (MLX's smallest group is 32), and the
i-quants and MXFP4 use codebooks or float grids: those are dequantized, and so are the rare
ternary TQ1_0 and TQ2_0.

llama.cpp's converter permutes the rows of Q and K for its interleaved rope; they are
un-permuted here (:func:`unpermute_rows`) so the output uses the Hugging Face layout.
"""

from __future__ import annotations

import functools
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from weights_convert.errors import ConversionError
from weights_convert.tensors import TensorRef

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
GROUP = 32  # MLX group size of the tensors kept quantized
MAX_DIMS = 4
PACK_CHUNK_VALUES = 1 << 20  # values repacked at a time (bounds the temporaries)

# Float tensor types -> numpy dtype of their data (BF16 as uint16 bits).
FLOAT_TYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}
# Quantized types MLX's affine format holds exactly (group size 32) -> bits.
KEPT_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5}
K_QUANTS = ("Q4_K", "Q5_K")  # kept types whose scales need float32 to stay exact
K_SCALES = slice(4, 16)  # Q4_K/Q5_K: the 12 bytes of packed 6-bit sub-block scales and mins

# GGUF metadata value types: id -> struct format of a scalar.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9

# general.architecture -> config model_type.
MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
}
GEMMA_ARCHS = ("gemma2", "gemma3")
ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's 27B rule for the attention scale

# GGUF tensor name -> Hugging Face name ({i} = layer); Gemma renames the norms below.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")

CONVERT_HINT = (
    "re-export it with llama.cpp (convert_hf_to_gguf.py, or llama-quantize to a Q*_K or Q8_0 "
    "type), or convert the original Hugging Face checkpoint instead"
)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file.

    Attributes:
        name: GGUF name (``blk.0.attn_q.weight``).
        type_name: ggml type (``"Q4_1"``).
        shape: numpy order (rows, columns), i.e. ggml's dims reversed.
        offset: absolute byte offset of the data in the file.
        nbytes: size of the data in the file.
    """

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def quantized(self) -> bool:
        return self.type_name not in FLOAT_TYPES

    @property
    def keepable(self) -> bool:
        """MLX's affine format holds this 2-D tensor exactly (see the module docstring)."""
        return self.type_name in KEPT_BITS and len(self.shape) == 2


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF header: metadata and the tensor table (data is not read)."""

    path: Path
    version: int
    metadata: dict
    tensors: dict[str, GGUFTensor]

    def raw(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array of shape (rows, bytes per row)."""
        data = np.memmap(
            self.path, dtype=np.uint8, mode="r", offset=tensor.offset, shape=(tensor.nbytes,)
        )
        return data.reshape(*tensor.shape[:-1], -1)


# --- header parsing ------------------------------------------------------------------------------


class _Cursor:
    """Bounds-checked little-endian reads over the file's bytes."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def corrupt(self, what: str) -> ConversionError:
        return ConversionError(
            f"{self.path} is truncated or corrupt ({what}, at byte {self.pos} of {len(self.buf)}); "
            "re-download the file"
        )

    def take(self, n: int, what: str) -> bytes:
        """The next ``n`` bytes (a copy, so no view outlives the memory map)."""
        if n < 0 or self.pos + n > len(self.buf):
            raise self.corrupt(f"{what} extends past the end of the file")
        data = self.buf[self.pos : self.pos + n]
        self.pos += n
        return data

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        length = self.scalar("<Q", what)
        try:
            return str(self.take(length, what), "utf-8")
        except UnicodeDecodeError:
            raise self.corrupt(f"{what} is not valid UTF-8") from None

    def count(self, min_item_bytes: int, what: str) -> int:
        """A uint64 element count, refused when the rest of the file cannot hold that many."""
        n = self.scalar("<Q", what)
        if n * min_item_bytes > len(self.buf) - self.pos:
            raise self.corrupt(f"{what} claims {n} entries")
        return n

    def value(self, kind: int, what: str):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY:
            return self.array(what)
        raise self.corrupt(f"{what} has unknown value type {kind}")

    def array(self, what: str):
        kind = self.scalar("<I", what)
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            n = self.count(struct.calcsize(fmt), what)
            return np.frombuffer(
                self.take(n * struct.calcsize(fmt), what), dtype=np.dtype(fmt)
            ).copy()
        n = self.count(8 if kind == _STRING else 4, what)
        return [self.value(kind, what) for _ in range(n)]


def _read_metadata(cur: _Cursor) -> tuple[int, int, dict]:
    """Header and key/value metadata -> (version, tensor count, metadata)."""
    if bytes(cur.take(4, "magic")) != GGUF_MAGIC:
        raise ConversionError(f"{cur.path} is not a GGUF file (it does not start with 'GGUF')")
    version = cur.scalar("<I", "version")
    if version not in GGUF_VERSIONS:
        raise ConversionError(
            f"{cur.path} is GGUF version {version}; only versions 2 and 3 (little-endian) are "
            f"supported; {CONVERT_HINT}"
        )
    n_tensors = cur.count(24, "tensor count")
    n_kv = cur.count(12, "metadata count")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        metadata[key] = cur.value(cur.scalar("<I", key), key)
    return version, n_tensors, metadata


def gguf_package():
    """The ``gguf`` package (llama.cpp's reader and dequantizer), or a ConversionError saying
    how to install it."""
    try:
        import gguf
    except ImportError:
        raise ConversionError(
            "converting a GGUF file needs the gguf package (llama.cpp's own Python package): "
            "pip install gguf"
        ) from None
    return gguf


@functools.cache
def dequantizable(type_name: str) -> bool:
    """Whether the installed gguf package dequantizes ggml type ``type_name`` (all weight types
    llama.cpp writes; not Q8_K, Q8_1, the integer types or F64)."""
    if type_name in FLOAT_TYPES:
        return True
    gguf = gguf_package()
    qtype = gguf.GGMLQuantizationType[type_name]
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, block_bytes), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _type_of(name: str, type_id: int, path: Path) -> tuple[str, int, int]:
    """A tensor's ggml type id -> (type name, values per block, bytes per block).

    Raises:
        ConversionError: a type the gguf package does not know or cannot dequantize, naming
            the type and the tensor.
    """
    from importlib.metadata import version

    gguf = gguf_package()
    try:
        qtype = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        raise ConversionError(
            f"{path.name}: tensor {name} has ggml type {type_id}, which the installed gguf "
            f"package ({version('gguf')}) does not know; upgrade it (pip install -U gguf), or "
            f"{CONVERT_HINT}"
        ) from None
    if not dequantizable(qtype.name):
        raise ConversionError(
            f"{path.name}: tensor {name} is {qtype.name} (ggml type {type_id}), which is not a "
            "weight type llama.cpp writes (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, "
            f"Q8_0, Q2_K to Q6_K, the IQ types, TQ1_0, TQ2_0, MXFP4); {CONVERT_HINT}"
        )
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    return qtype.name, block, block_bytes


def _read_tensor_info(cur: _Cursor) -> tuple[str, int, tuple[int, ...], int]:
    """One tensor-table entry -> (name, ggml type id, numpy shape, offset in the data section)."""
    name = cur.string("tensor name")
    n_dims = cur.scalar("<I", f"tensor {name}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.corrupt(f"tensor {name} has {n_dims} dimensions")
    dims = struct.unpack(f"<{n_dims}Q", cur.take(8 * n_dims, f"tensor {name}"))
    type_id = cur.scalar("<I", f"tensor {name}")
    offset = cur.scalar("<Q", f"tensor {name}")
    return name, type_id, tuple(reversed(dims)), offset


def read_gguf(path: Path) -> GGUFFile:
    """Parse a GGUF header; every tensor must be of a supported type and lie inside the file.

    Raises:
        ConversionError: not GGUF, unsupported version or tensor type, truncated or corrupt.
    """
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ConversionError(
                f"{path} is truncated or corrupt ({size} bytes); re-download the file"
            )
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cur = _Cursor(buf, path)
            version, n_tensors, metadata = _read_metadata(cur)
            infos = [_read_tensor_info(cur) for _ in range(n_tensors)]
            header_end = cur.pos
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ConversionError(
            f"{path} is corrupt (general.alignment = {alignment!r}); re-download the file"
        )
    data_start = -(-header_end // alignment) * alignment
    tensors = {}
    for name, type_id, shape, offset in infos:
        type_name, block, block_bytes = _type_of(name, type_id, path)
        if shape[-1] % block or offset % alignment:
            raise ConversionError(
                f"{path} is corrupt (tensor {name} has shape {list(shape)}); re-download the file"
            )
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * block_bytes
        start = data_start + offset
        if start + nbytes > size:
            raise ConversionError(
                f"{path} is truncated: tensor {name} needs bytes up to {start + nbytes:,} but "
                "the file "
                f"has {size:,}; the download is incomplete, re-download it"
            )
        if name in tensors:
            raise ConversionError(
                f"{path} is corrupt (tensor {name} appears twice); re-download the file"
            )
        tensors[name] = GGUFTensor(name, type_name, shape, start, nbytes)
    return GGUFFile(path, version, metadata, tensors)


# --- tensor data ---------------------------------------------------------------------------------


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """(rows, row bytes) -> (rows, blocks per row, block bytes)."""
    return raw.reshape(*raw.shape[:-1], -1, block_bytes)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of every block, as float32: (rows, blocks, bytes) -> (rows,
    blocks)."""
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., n) packed bytes -> (..., 2n) 4-bit values in ggml order (low nibbles, then high)."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """(..., 4) bytes of a little-endian uint32 -> (..., 32) its bits, bit j at j."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_quant_values(blocks: np.ndarray, type_name: str) -> np.ndarray:
    """Q4_K/Q5_K blocks (rows, n, bytes) -> (rows, n, 8, 32) unsigned q per sub-block.

    The 128 bytes of low nibbles hold sub-blocks 2i and 2i+1 in the low and high nibbles of
    bytes 32i..32i+31; Q5_K's 32 bytes of high bits hold sub-block i's fifth bits at bit i.
    """
    qs = blocks[..., -128:].reshape(*blocks.shape[:-1], 4, 1, 32)
    q = ((qs >> np.array([0, 4], np.uint8)[:, None]) & np.uint8(0x0F)).reshape(
        *blocks.shape[:-1], 8, 32
    )
    if type_name == "Q5_K":
        qh = blocks[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]
        q |= (qh & np.uint8(1)) << np.uint8(4)
    return q


def affine_form(blocks: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks of a kept type -> (q, scale, bias) with ``x = scale * q + bias`` per 32 values.

    Shapes: blocks (rows, n, block bytes) -> q (rows, columns) uint8 unsigned, scale and bias
    (rows, columns / 32) float32, exact (products of a float16 and a small integer).
    """
    rows = blocks.shape[0]
    if type_name in K_QUANTS:
        from gguf.quants import Q4_K

        d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., K_SCALES]).reshape(-1, 12))
        scale = d * sc.reshape(*blocks.shape[:-1], 8).astype(np.float32)
        bias = -(dmin * m.reshape(*blocks.shape[:-1], 8).astype(np.float32))
        q = _k_quant_values(blocks, type_name)
        return q.reshape(rows, -1), scale.reshape(rows, -1), bias.reshape(rows, -1)
    d = _f16(blocks, 0)
    if type_name == "Q8_0":
        q, bias = blocks[..., 2:] ^ np.uint8(0x80), -128 * d  # int8 v -> v + 128
    elif type_name == "Q4_0":
        q, bias = _nibbles(blocks[..., 2:]), -8 * d
    elif type_name == "Q4_1":
        q, bias = _nibbles(blocks[..., 4:]), _f16(blocks, 2)
    elif type_name == "Q5_0":
        q = _nibbles(blocks[..., 6:]) | (_bits32(blocks[..., 2:6]) << np.uint8(4))
        bias = -16 * d
    else:  # Q5_1
        q = _nibbles(blocks[..., 8:]) | (_bits32(blocks[..., 4:8]) << np.uint8(4))
        bias = _f16(blocks, 2)
    return q.reshape(rows, -1), d, bias


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """(rows, columns) values below 2**bits -> (rows, columns * bits / 32) uint32 in MLX's
    layout: value i at bits [bits * i, bits * (i + 1)) of the row's little-endian bit stream."""
    groups = q.reshape(q.shape[0], -1, 8).astype("<u8")  # 8 values = ``bits`` whole bytes
    word = np.zeros(groups.shape[:-1], "<u8")
    for j in range(8):
        word |= groups[..., j] << np.uint64(bits * j)
    packed = word[..., None].view(np.uint8)[..., :bits]
    return np.ascontiguousarray(packed).reshape(q.shape[0], -1).view("<u4")


def dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    """Quantized rows -> float32 with the ``gguf`` package's own arithmetic.

    Shapes: raw (rows, row bytes) -> (rows, columns).
    """
    gguf = gguf_package()
    qtype = gguf.GGMLQuantizationType[type_name]
    return gguf.quants.dequantize(raw, qtype).astype(np.float32, copy=False)


def packed_triple(
    raw: np.ndarray, type_name: str, scale_dtype=np.float16
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of a kept type -> MLX affine (weight uint32, scales, biases), group size 32.

    ``scale_dtype`` float16 is exact for the 32-block types; K-quants need float32 to be
    (see the module docstring). ``mx.dequantize`` of a float32 triple equals
    :func:`dequantize` bit for bit. Rows are repacked a chunk at a time.
    Shapes: raw (rows, row bytes) -> (rows, columns * bits / 32), (rows, columns / 32) twice.
    """
    gguf = gguf_package()
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    bits = KEPT_BITS[type_name]
    rows, cols = raw.shape[0], raw.shape[1] // block_bytes * block
    weight = np.empty((rows, cols * bits // 32), "<u4")
    scales = np.empty((rows, cols // GROUP), scale_dtype)
    biases = np.empty((rows, cols // GROUP), scale_dtype)
    step = max(1, PACK_CHUNK_VALUES // cols)
    for start in range(0, rows, step):
        part = slice(start, start + step)
        q, scale, bias = affine_form(_blocks(raw[part], block_bytes), type_name)
        weight[part] = pack(q, bits)
        with np.errstate(over="ignore"):
            scales[part], biases[part] = scale, bias
    return weight, scales, biases


def float_values(gguf: GGUFFile, tensor: GGUFTensor) -> tuple[np.ndarray, str]:
    """A float tensor's data -> (array, safetensors code); BF16 comes as its uint16 bits."""
    raw = gguf.raw(tensor)
    return raw.view(FLOAT_TYPES[tensor.type_name]).reshape(tensor.shape), tensor.type_name


def unpermute_rows(x: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rope -> rotate-half rope).

    Works on any array whose first axis is the output rows (weights, packed weights, scales,
    biases, bias vectors): whole rows move. Shape (rows, ...) -> same.
    """
    head_dim = x.shape[0] // n_heads
    return x.reshape(n_heads, head_dim // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


# --- model structure -----------------------------------------------------------------------------


def hf_name(name: str, arch: str = "llama") -> str | None:
    """GGUF tensor name -> Hugging Face name, or None when it has no counterpart."""
    if m := _LAYER_RE.match(name):
        layer, part, kind = m.groups()
        names = _GEMMA_LAYER_NAMES if arch in GEMMA_ARCHS else _LAYER_NAMES
        return f"model.layers.{layer}.{names[part]}.{kind}" if part in names else None
    if (m := _GLOBAL_RE.match(name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def _meta(gguf: GGUFFile, key: str, default=None, required: bool = False):
    value = gguf.metadata.get(key, default)
    if required and value is None:
        raise ConversionError(f"{gguf.path.name} lacks metadata {key}; {CONVERT_HINT}")
    return value


def architecture(gguf: GGUFFile) -> str:
    """``general.architecture``, refused unless it is one we map to Hugging Face."""
    arch = _meta(gguf, "general.architecture")
    if arch not in MODEL_TYPES:
        raise ConversionError(
            f"{gguf.path.name} has architecture {arch!r}; supported GGUF architectures: "
            f"{', '.join(MODEL_TYPES)} (Llama 1/2, Vicuna, SmolLM, TinyLlama, Qwen2/2.5, "
            f"Qwen3, Gemma 2, Gemma 3); {original(gguf, arch)}"
        )
    return arch


def check_llama(gguf: GGUFFile) -> None:
    """Refuse files that are not a plain model of a supported architecture we can map to
    Hugging Face names (no unknown tensors, no experts)."""
    arch = architecture(gguf)
    unknown = sorted(n for n in gguf.tensors if hf_name(n, arch) is None)
    if unknown:
        extra = (
            " (Llama 3.1-style rope scaling is not supported)"
            if "rope_freqs.weight" in unknown
            else ""
        )
        raise ConversionError(
            f"{gguf.path.name} holds tensors a {arch} model does not have: {', '.join(unknown[:5])}"
            f"{extra}; {original(gguf, None)}"
        )
    if _meta(gguf, f"{arch}.expert_count", 0):
        raise ConversionError(
            f"{gguf.path.name} is a mixture-of-experts model, which the GGUF converter does "
            f"not take; {original(gguf, arch + 'moe')}"
        )


# GGUF architectures -> mlx-lm's model_type, where the names differ (the hint's command)
GGUF_FAMILIES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}


def original(gguf: GGUFFile, arch: str | None) -> str:
    """Where to go instead: the command that converts the original Hugging Face checkpoint
    of a GGUF of ``arch`` (None: the family is not known)."""
    from redrafter_mlx.engine.verifier.config import convert_command

    model_type = GGUF_FAMILIES.get(arch, arch) if arch else None
    return (
        "convert the original Hugging Face checkpoint (a folder or repo id, not the GGUF): "
        + convert_command(model_type, "<checkpoint>")
    )


def _float32_repr(x) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(str(np.float32(x)))


def _rope_scaling(gguf: GGUFFile, arch: str) -> dict | None:
    kind = _meta(gguf, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {
            "rope_type": "linear",
            "factor": _float32_repr(_meta(gguf, f"{arch}.rope.scaling.factor", required=True)),
        }
    raise ConversionError(
        f"{gguf.path.name} uses rope scaling {kind!r}, which is not supported; {CONVERT_HINT}"
    )


def llama_config(gguf: GGUFFile, eos_ids: list[int]) -> dict:
    """A Hugging Face config.json from the metadata (shapes are checked against it later).

    A GGUF says nothing about tying: ``output.weight`` present or not decides, by the engine's
    rule for a silent config (``redrafter_mlx.engine.verifier.config.ties_head``)."""
    from redrafter_mlx.engine.verifier.config import ties_head

    arch = architecture(gguf)
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise ConversionError(f"{gguf.path.name} has no token_embd.weight; {CONVERT_HINT}")
    hidden = int(_meta(gguf, f"{arch}.embedding_length", required=True))
    heads = int(_meta(gguf, f"{arch}.attention.head_count", required=True))
    head_dim = int(_meta(gguf, f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(_meta(gguf, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ConversionError(
            f"{gguf.path.name} uses partial rope ({rope_dim} of {head_dim}), which {arch} does not"
        )
    names = set(gguf.tensors)
    config = {
        "architectures": [ARCH_CLASSES[arch]],
        "model_type": MODEL_TYPES[arch],
        "hidden_act": "gelu_pytorch_tanh" if arch in GEMMA_ARCHS else "silu",
        "hidden_size": hidden,
        "intermediate_size": int(_meta(gguf, f"{arch}.feed_forward_length", required=True)),
        "num_hidden_layers": int(_meta(gguf, f"{arch}.block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(gguf, f"{arch}.attention.head_count_kv", heads)),
        "rms_norm_eps": _float32_repr(
            _meta(gguf, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
        ),
        "rope_theta": _float32_repr(_meta(gguf, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(gguf, arch),
        "max_position_embeddings": int(_meta(gguf, f"{arch}.context_length", 4096)),
        "vocab_size": int(embed.shape[0]),
        "tie_word_embeddings": ties_head({}, {hf_name(n, arch) for n in names}, gguf.path),
        "bos_token_id": _meta(gguf, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids,
    }
    if arch == "llama":
        config["attention_bias"] = any(n.endswith(("attn_q.bias", "attn_k.bias")) for n in names)
        config["mlp_bias"] = any(n.endswith(("ffn_up.bias", "ffn_down.bias")) for n in names)
    if arch in GEMMA_ARCHS:
        config.update(_gemma_config(gguf, arch, config, head_dim))
    config["head_dim"] = head_dim  # written even at hidden / heads: no family default applies
    return config


def _gemma_config(gguf: GGUFFile, arch: str, config: dict, head_dim: int) -> dict:
    """Gemma's settings, from the metadata or as llama.cpp sets them when it stores none."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    big = layers == GEMMA_27B_LAYERS[arch]  # llama.cpp: 27B scales by hidden / heads
    out = {"query_pre_attn_scalar": config["hidden_size"] // heads if big else head_dim}
    window = _meta(gguf, f"{arch}.attention.sliding_window", 4096 if arch == "gemma2" else None)
    pattern = _meta(gguf, f"{arch}.attention.sliding_window_pattern")
    if window:
        out["sliding_window"] = int(window)
        if pattern is not None and not isinstance(pattern, (int, np.integer)):
            out["layer_types"] = [
                "sliding_attention" if bool(p) else "full_attention" for p in pattern
            ]
        elif arch == "gemma3":
            out["sliding_window_pattern"] = int(pattern) if pattern is not None else 6
    if arch == "gemma2":
        soft = _meta(gguf, "gemma2.attn_logit_softcapping", 50.0)
        final = _meta(gguf, "gemma2.final_logit_softcapping", 30.0)
        out["attn_logit_softcapping"] = _float32_repr(soft)
        out["final_logit_softcapping"] = _float32_repr(final)
    else:
        out["rope_local_base_freq"] = _float32_repr(
            _meta(gguf, "gemma3.rope.freq_base_swa", 10000.0)
        )
        final = _meta(gguf, "gemma3.final_logit_softcapping")
        if final:
            out["final_logit_softcapping"] = _float32_repr(final)
    return out


def _qk_heads(name: str, config: dict) -> int | None:
    """How many heads to un-permute over for a Q/K tensor (Llama only: llama.cpp permutes no
    other family's rows), None for other tensors."""
    if config["model_type"] != "llama":
        return None
    if ".attn_q." in name:
        return config["num_attention_heads"]
    if ".attn_k." in name:
        return config["num_key_value_heads"]
    return None


def _norm_shift(name: str, config: dict) -> bool:
    """Whether llama.cpp stored this tensor as ``w + 1`` (every Gemma ``*norm.weight``)."""
    return config["model_type"] in ("gemma2", "gemma3_text") and name.endswith("norm.weight")


def _as_float32(x: np.ndarray, code: str) -> np.ndarray:
    """Float data of safetensors ``code`` (BF16 as uint16 bits) -> float32 values."""
    if code == "BF16":
        return (x.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return x.astype(np.float32)


def float_ref(gguf: GGUFFile, tensor: GGUFTensor, config: dict) -> TensorRef:
    """A lazy Hugging Face-named tensor: floats pass as stored, quantized ones dequantize to F32
    (and Gemma's norms, ``w + 1`` in the file, become ``w`` in float32)."""
    heads = _qk_heads(tensor.name, config)
    shift = _norm_shift(tensor.name, config)
    code = "F32" if tensor.quantized or shift else tensor.type_name

    def load() -> np.ndarray:
        if tensor.quantized:
            x = dequantize(gguf.raw(tensor), tensor.type_name)
        else:
            x = float_values(gguf, tensor)[0]
        if shift:
            x = _as_float32(x, tensor.type_name) - np.float32(1.0)
        return np.ascontiguousarray(unpermute_rows(x, heads) if heads else x)

    name = hf_name(tensor.name, architecture(gguf))
    return TensorRef(name, code, tensor.shape, gguf.path, load)


def scale_code(tensor: GGUFTensor, dtype_code: str) -> str:
    """Safetensors code of a kept tensor's scales and biases: float16, which holds the 32-block
    types' exactly; a K-quant's in float32 when the other floats are (see the module
    docstring)."""
    return "F32" if tensor.type_name in K_QUANTS and dtype_code == "F32" else "F16"


def quantized_triple(
    gguf: GGUFFile, tensor: GGUFTensor, config: dict, code: str = "F16"
) -> list[np.ndarray]:
    """A kept tensor as MLX (weight, scales, biases), scales and biases of safetensors ``code``,
    Q/K rows un-permuted."""
    heads = _qk_heads(tensor.name, config)
    dtype = np.float32 if code == "F32" else np.float16
    triple = packed_triple(gguf.raw(tensor), tensor.type_name, dtype)
    if not (np.isfinite(triple[1]).all() and np.isfinite(triple[2]).all()):
        raise ConversionError(  # e.g. -8 d, or a K-quant's d * sc, beyond float16's 65504
            f"{gguf.path.name}: {tensor.name} has values too large to keep in MLX's float16 "
            "quantization; convert with --dtype float32"
        )
    return [np.ascontiguousarray(unpermute_rows(a, heads) if heads else a) for a in triple]


# --- conversion plan -----------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFPlan:
    """What a GGUF conversion writes.

    Attributes:
        source: the parsed file.
        eos_ids: metadata EOS plus the chat template's end-of-turn token.
        config: the Hugging Face config the metadata describes.
        jobs: one per output tensor group, in file order.
        tied: no ``output.weight``: lm_head is the embedding.
        quantization: config block for quantized tensors, kept or re-quantized (per-layer
            overrides where a tensor's settings differ from the most common), or None.
    """

    source: GGUFFile
    eos_ids: list[int]
    config: dict
    jobs: list
    tied: bool
    quantization: dict | None


def _kept_job(gguf: GGUFFile, tensor: GGUFTensor, ref: TensorRef, config: dict, dtype_code: str):
    """A job writing a kept tensor as MLX's affine triple, the same values as stored."""
    from weights_convert.safetensors_io import TensorSpec
    from weights_convert.writer import Job, Quantization

    bits = KEPT_BITS[tensor.type_name]
    code = scale_code(tensor, dtype_code)
    rows, cols = tensor.shape
    prefix = ref.name[: -len(".weight")]
    specs = (
        TensorSpec(ref.name, "U32", (rows, cols * bits // 32)),
        TensorSpec(f"{prefix}.scales", code, (rows, cols // GROUP)),
        TensorSpec(f"{prefix}.biases", code, (rows, cols // GROUP)),
    )
    produce = lambda: quantized_triple(gguf, tensor, config, code)
    return Job(ref, specs, Quantization(GROUP, bits), produce)


def _quantization_block(jobs: list) -> dict | None:
    """mlx-lm's ``quantization`` block: the most common settings, plus per-layer overrides."""
    quantized = [job for job in jobs if job.quant is not None]
    if not quantized:
        return None
    counts: dict = {}
    for job in quantized:
        counts[job.quant] = counts.get(job.quant, 0) + 1
    common = max(counts, key=lambda q: (counts[q], q.bits))
    block = common.as_config()
    for job in quantized:
        if job.quant != common:
            block[job.source.name[: -len(".weight")]] = {
                "group_size": job.quant.group_size,
                "bits": job.quant.bits,
            }
    return block


def plan_gguf(
    gguf: GGUFFile, eos_ids: list[int], dtype_code: str, quant, keep_quantized: bool
) -> GGUFPlan:
    """Check the file (already through :func:`check_llama`) against its config and plan
    every output tensor.

    Args:
        eos_ids: the EOS ids for config.json.
        dtype_code: safetensors code of float outputs (and of dequantized tensors).
        quant: :class:`~weights_convert.writer.Quantization` to (re)quantize with, or None.
        keep_quantized: write the tensors MLX's affine format holds exactly (:data:`KEPT_BITS`)
            as MLX affine triples; others are dequantized to ``dtype_code`` all the same.
    """
    from weights_convert import llama
    from weights_convert.writer import make_job

    config = llama_config(gguf, eos_ids)
    llama.check_config(config, gguf.path)
    arch = architecture(gguf)
    by_hf = {hf_name(t.name, arch): t for t in gguf.tensors.values()}
    refs = [float_ref(gguf, t, config) for t in gguf.tensors.values()]
    plan = llama.plan_tensors(refs, config, gguf.path.name)
    jobs = []
    for name, ref in plan.tensors:
        tensor = by_hf[name]
        if keep_quantized and tensor.keepable:
            jobs.append(_kept_job(gguf, tensor, ref, config, dtype_code))
        else:
            jobs.append(make_job(name, ref, dtype_code, quant))
    return GGUFPlan(gguf, eos_ids, config, jobs, plan.tied, _quantization_block(jobs))


# Set to 1 to keep a GGUF's quantized tensors that MLX holds exactly (Q8_0, Q4_0, Q4_1, Q5_0,
# Q5_1, Q4_K, Q5_K) quantized on the CPU backend too (other floats float32 there), as Metal does
# by default: to measure the Mac install on Linux.
KEEP_QUANTIZED_ENV = "REDRAFTER_MLX_GGUF_KEEP_QUANTIZED"


def resolve_dtype(dtype: str | None, quantize: bool) -> tuple[str, bool]:
    """``--dtype`` for GGUF input -> (dtype, keep quantized tensors as they are).

    An explicit dtype dequantizes. Without one: on Metal, the quantized tensors MLX holds
    exactly stay quantized (other tensors float16) unless ``--quantize`` asks for new
    settings; on the CPU backend, everything becomes float32 (MLX's CPU quantized and
    half-precision matmuls are slow), unless ``$REDRAFTER_MLX_GGUF_KEEP_QUANTIZED=1`` keeps
    those tensors quantized as on Metal.
    """
    import os

    if dtype is not None:
        return dtype, False
    import mlx.core as mx

    on_metal = mx.metal.is_available()
    if on_metal:
        return "float16", not quantize
    return "float32", os.environ.get(KEEP_QUANTIZED_ENV) == "1" and not quantize


def open_gguf(path: Path, dtype: str | None, quant) -> tuple[GGUFPlan, str]:
    """Parse and check a GGUF file and plan its conversion -> (plan, resolved dtype).

    Args:
        dtype: ``--dtype`` or None (see :func:`resolve_dtype`).
        quant: ``--quantize`` settings or None.
    """
    from weights_convert import gguf_tokenizer
    from weights_convert.tensors import DTYPE_CODES

    dtype, keep = resolve_dtype(dtype, quant is not None)
    gguf = read_gguf(path)
    check_llama(gguf)
    gguf_tokenizer.check_tokenizer(gguf.metadata, path.name)
    eos_ids = gguf_tokenizer.eos_token_ids(gguf.metadata)
    return plan_gguf(gguf, eos_ids, DTYPE_CODES[dtype], quant, keep), dtype


def write_side_files(plan: GGUFPlan, out_dir: Path) -> list[str]:
    """Tokenizer files and generation_config.json from the metadata -> names written."""
    from weights_convert import gguf_tokenizer

    return gguf_tokenizer.write_tokenizer(plan.source.metadata, plan.eos_ids, out_dir)
