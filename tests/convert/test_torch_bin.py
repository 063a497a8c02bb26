"""The torch-free ``.bin`` reader and the safetensors reader: exact values, and refusals.

Malicious pickles are built here byte by byte (no torch needed): each must be refused with an
error naming the offending global, and its payload (creating a marker file) must never run.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.support.paths import CONVERT as FIXTURES
from tests.support.torch_pickles import (
    _global,
    _int,
    _payloads,
    _state_dict,
    _storage,
    _str,
    _tensor,
    _torch_zip,
    _tuple,
)
from weights_convert.errors import ConversionError, UnsafePickleError
from weights_convert.safetensors_io import SafetensorsWriter, TensorSpec, read_safetensors
from weights_convert.torch_bin import read_torch_bin

# --- a tiny pickle assembler (protocol 2 opcodes) --------------------------------------------


# --- reading real torch.save files ------------------------------------------------------------


def _expected() -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / "llama_expected.npz"))


def test_reads_fp32_bin_with_shared_storage_views_exactly():
    expected = _expected()
    refs = {r.name: r for r in read_torch_bin(FIXTURES / "llama_bin" / "pytorch_model.bin")}
    weights = [n for n in refs if not n.endswith("inv_freq")]
    assert set(weights) == {k for k in expected if k not in ("prompt", "logits", "logits_tied")}
    for name in weights:
        ref = refs[name]
        assert ref.dtype == "F32" and ref.shape == expected[name].shape
        np.testing.assert_array_equal(ref.load(), expected[name])
    # the fixture really holds views: q/k/v share one storage, o_proj has transposed strides
    assert refs["model.layers.0.self_attn.v_proj.weight"].load().flags.c_contiguous
    assert refs["model.layers.0.self_attn.rotary_emb.inv_freq"].shape == (8,)


def test_reads_fp16_shards_exactly():
    expected = _expected()
    folder = FIXTURES / "llama_bin_sharded"
    refs = read_torch_bin(folder / "pytorch_model-00001-of-00002.bin") + read_torch_bin(
        folder / "pytorch_model-00002-of-00002.bin"
    )
    assert len(refs) == len(expected) - 3
    for ref in refs:
        assert ref.dtype == "F16"
        np.testing.assert_array_equal(
            ref.load().view(np.uint16), expected[ref.name].astype(np.float16).view(np.uint16)
        )


def test_hand_built_zip_with_offset_and_stride_views(tmp_path):
    data = np.arange(24, dtype=np.float32)
    pkl = _state_dict(
        {
            "whole": _tensor(_storage("0", 24), _int(0), (4, 6), (6, 1)),
            "rows": _tensor(_storage("0", 24), _int(6), (2, 6), (6, 1)),
            "transposed": _tensor(_storage("0", 24), _int(0), (6, 4), (1, 6)),
            "strided": _tensor(_storage("0", 24), _int(1), (3,), (5,)),
        }
    )
    path = _torch_zip(tmp_path / "m.bin", pkl, {"0": data.tobytes()})
    got = {r.name: r.load() for r in read_torch_bin(path)}
    whole = data.reshape(4, 6)
    np.testing.assert_array_equal(got["whole"], whole)
    np.testing.assert_array_equal(got["rows"], whole[1:3])
    np.testing.assert_array_equal(got["transposed"], whole.T)
    np.testing.assert_array_equal(got["strided"], data[1:16:5])


def test_bf16_storage_is_kept_as_raw_bits(tmp_path):
    import mlx.core as mx

    from weights_convert.tensors import to_mx

    bits = np.array([0x3F80, 0xC000, 0x3EAB, 0x0000], dtype=np.uint16)  # 1.0, -2.0, ~0.334, 0
    pkl = _state_dict(
        {
            "b": _tensor(
                _storage("0", 4, _global("torch", "BFloat16Storage")), _int(0), (2, 2), (2, 1)
            )
        }
    )
    (ref,) = read_torch_bin(_torch_zip(tmp_path / "b.bin", pkl, {"0": bits.tobytes()}))
    assert ref.dtype == "BF16"
    array = to_mx(ref.load(), ref.dtype)
    assert array.dtype == mx.bfloat16
    np.testing.assert_array_equal(np.array(array.view(mx.uint16)).ravel(), bits)
    np.testing.assert_allclose(
        np.array(array.astype(mx.float32)).ravel(), [1.0, -2.0, 0.333984375, 0.0]
    )


# --- refusals ------------------------------------------------------------------------------------


def test_plain_pickle_would_run_the_payload(tmp_path):
    """Sanity check of the test itself: the payload is live under an unrestricted unpickler."""
    marker = tmp_path / "pwned"
    pickle.loads(_payloads(marker)["os.system"][0])
    assert marker.exists()


@pytest.mark.parametrize("case", list(_payloads(Path("/x"))))
def test_malicious_pickles_are_refused_and_never_run(tmp_path, case):
    marker = tmp_path / "pwned"
    pkl, offender = _payloads(marker)[case]
    path = _torch_zip(tmp_path / "evil.bin", pkl, {"0": np.zeros(4, np.float32).tobytes()})
    with pytest.raises(UnsafePickleError) as err:
        read_torch_bin(path)
    assert offender in str(err.value) and "refused" in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    "pid, why",
    [
        (
            _tuple(
                [_str("module"), _global("torch", "FloatStorage"), _str("0"), _str("cpu"), _int(4)]
            ),
            "persistent id",
        ),
        (
            _tuple(
                [
                    _str("storage"),
                    _global("torch", "FloatStorage"),
                    _str("../../etc/passwd"),
                    _str("cpu"),
                    _int(4),
                ]
            ),
            "storage key",
        ),
        (
            _tuple([_str("storage"), _str("FloatStorage"), _str("0"), _str("cpu"), _int(4)]),
            "storage type",
        ),
    ],
)
def test_malformed_persistent_ids_are_refused(tmp_path, pid, why):
    pkl = _state_dict({"w": _tensor(pid + b"Q", _int(0), (2, 2), (2, 1))})
    path = _torch_zip(tmp_path / "bad.bin", pkl, {"0": np.zeros(4, np.float32).tobytes()})
    with pytest.raises(UnsafePickleError, match=why):
        read_torch_bin(path)


def test_view_past_the_end_of_its_storage_is_refused(tmp_path):
    pkl = _state_dict({"w": _tensor(_storage("0", 4), _int(2), (2, 2), (2, 1))})
    path = _torch_zip(tmp_path / "oob.bin", pkl, {"0": np.zeros(4, np.float32).tobytes()})
    with pytest.raises(ConversionError, match="reaches past its storage"):
        read_torch_bin(path)


def test_storage_larger_than_its_entry_is_refused(tmp_path):
    pkl = _state_dict({"w": _tensor(_storage("0", 400), _int(0), (2, 2), (2, 1))})
    path = _torch_zip(tmp_path / "short.bin", pkl, {"0": np.zeros(4, np.float32).tobytes()})
    with pytest.raises(ConversionError, match="claims 400 elements"):
        read_torch_bin(path)


def test_legacy_torch_format_is_refused_with_the_fix():
    with pytest.raises(ConversionError) as err:
        read_torch_bin(FIXTURES / "legacy" / "pytorch_model.bin")
    assert "legacy (pre-zip" in str(err.value) and "torch.save" in str(err.value)


def test_truncated_zip_is_refused(tmp_path):
    src = (FIXTURES / "llama_bin" / "pytorch_model.bin").read_bytes()
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(src[: len(src) // 2])
    with pytest.raises(ConversionError, match="truncated or corrupt.*re-download"):
        read_torch_bin(path)


def test_non_dict_pickle_is_refused(tmp_path):
    path = _torch_zip(tmp_path / "list.bin", b"\x80\x02]q\x00.", {})
    with pytest.raises(ConversionError, match="not a state dict"):
        read_torch_bin(path)


# --- safetensors -------------------------------------------------------------------------------


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """torch's fp32 -> bf16 rounding, from the fixture script (which checked it against torch)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.bf16_bits(x)


def test_safetensors_bf16_reads_exact_bits():
    expected = _expected()
    refs = read_safetensors(FIXTURES / "llama_st_bf16" / "model.safetensors")
    assert len(refs) == len(expected) - 3
    for ref in refs:
        assert ref.dtype == "BF16" and ref.load().dtype == np.uint16
        np.testing.assert_array_equal(ref.load(), _bf16_bits(expected[ref.name]))


def test_corrupt_safetensors_headers_are_refused(tmp_path):
    good = (FIXTURES / "llama_st_bf16" / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", good[:8])
    cases = {
        "huge length": struct.pack("<Q", 1 << 40) + good[8:],
        "bad json": good[:8] + b"{not json" + good[17:],
        "wrong offsets": good[:8]
        + good[8 : 8 + n].replace(b'"data_offsets":[0,', b'"data_offsets":[2,', 1)
        + good[8 + n :],
        "truncated data": good[: len(good) - 100],
    }
    for what, blob in cases.items():
        path = tmp_path / f"{what.replace(' ', '_')}.safetensors"
        path.write_bytes(blob)
        with pytest.raises(ConversionError, match="corrupt safetensors header") as err:
            read_safetensors(path)
        assert "re-download" in str(err.value), what


def test_safetensors_writer_round_trips_through_mx_load(tmp_path):
    import mlx.core as mx

    arrays = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.arange(4, dtype=np.float16),
        "c": np.array([7, 9], np.uint32),
    }
    specs = [
        TensorSpec("a", "F32", (2, 3)),
        TensorSpec("b", "F16", (4,)),
        TensorSpec("c", "U32", (2,)),
    ]
    with SafetensorsWriter(tmp_path / "x.safetensors", specs, {"format": "mlx"}) as writer:
        for spec in specs:
            writer.write(spec.name, arrays[spec.name])
    loaded, metadata = mx.load(str(tmp_path / "x.safetensors"), return_metadata=True)
    assert metadata == {"format": "mlx"}
    for name, array in arrays.items():
        np.testing.assert_array_equal(np.array(loaded[name]), array)
    assert [r.name for r in read_safetensors(tmp_path / "x.safetensors")] == ["a", "b", "c"]
