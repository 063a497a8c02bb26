"""``pytorch_model.bin`` files built byte by byte (no torch): state dicts and malicious pickles."""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import zipfile
from pathlib import Path


def _global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def _str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _int(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


def _tuple(items: list[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"


def _call(func: bytes, args: list[bytes]) -> bytes:
    return func + _tuple(args) + b"R"


def _storage(key: str, numel: int, storage_type: bytes = _global("torch", "FloatStorage")) -> bytes:
    return _tuple([_str("storage"), storage_type, _str(key), _str("cpu"), _int(numel)]) + b"Q"


def _tensor(
    storage: bytes, offset: bytes, shape: tuple[int, ...], stride: tuple[int, ...]
) -> bytes:
    hooks = _call(_global("collections", "OrderedDict"), [])
    args = [
        storage,
        offset,
        _tuple([_int(s) for s in shape]),
        _tuple([_int(s) for s in stride]),
        b"\x89",
        hooks,
    ]
    return _call(_global("torch._utils", "_rebuild_tensor_v2"), args)


def _state_dict(items: dict[str, bytes]) -> bytes:
    body = b"".join(_str(k) + v for k, v in items.items())
    return b"\x80\x02" + _call(_global("collections", "OrderedDict"), []) + b"(" + body + b"u."


def _torch_zip(path: Path, pkl: bytes, storages: dict[str, bytes]) -> Path:
    """A zip with torch's layout: archive/data.pkl, archive/byteorder, archive/data/<key>."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pkl)
        zf.writestr("archive/byteorder", "little")
        for key, data in storages.items():
            zf.writestr(f"archive/data/{key}", data)
        zf.writestr("archive/version", "3\n")
    return path


def _system(cmd: str) -> bytes:
    return _call(_global("os", "system"), [_str(cmd)])


class _Reduce:
    """Pickles as ``func(*args)``: the classic malicious-pickle payload."""

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _payloads(marker: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (pickle bytes, the global the error must name)."""
    touch = f"touch {marker}"
    open_marker = f"open({str(marker)!r}, 'w')"
    return {
        "os.system": (pickle.dumps({"w": _Reduce(os.system, (touch,))}, protocol=2), "system"),
        "os.system protocol 4 (STACK_GLOBAL)": (
            pickle.dumps({"w": _Reduce(os.system, (touch,))}, protocol=4),
            "system",
        ),
        "builtins.eval": (pickle.dumps(_Reduce(eval, (open_marker,)), protocol=2), "builtins.eval"),
        "builtins.exec": (pickle.dumps(_Reduce(exec, (open_marker,)), protocol=2), "builtins.exec"),
        "subprocess.Popen": (
            pickle.dumps(_Reduce(subprocess.Popen, (["touch", str(marker)],)), protocol=2),
            "subprocess.Popen",
        ),
        "INST opcode": (f"(S'{touch}'\nios\nsystem\n.".encode(), "os.system"),
        "nested __reduce__ inside tensor args": (
            _state_dict({"w": _tensor(_storage("0", 4), _system(touch), (2, 2), (2, 1))}),
            "os.system",
        ),
        "evil storage type in persistent id": (
            _state_dict(
                {
                    "w": _tensor(
                        _storage("0", 4, _call(_global("builtins", "eval"), [_str(open_marker)])),
                        _int(0),
                        (2, 2),
                        (2, 1),
                    )
                }
            ),
            "builtins.eval",
        ),
        "getattr gadget": (
            _call(_global("builtins", "getattr"), [_global("os", "path"), _str("join")]) + b".",
            "builtins.getattr",
        ),
        "numpy reconstruct": (
            _call(_global("numpy.core.multiarray", "_reconstruct"), []) + b".",
            "numpy.core.multiarray._reconstruct",
        ),
        "torch module that is not allowed": (
            _call(_global("torch.nn.modules.linear", "Linear"), []) + b".",
            "torch.nn.modules.linear.Linear",
        ),
        "legacy _rebuild_tensor": (
            _call(_global("torch._utils", "_rebuild_tensor"), []) + b".",
            "torch._utils._rebuild_tensor",
        ),
    }
