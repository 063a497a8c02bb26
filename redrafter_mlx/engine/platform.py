"""Platform helpers: the default dtype, and a fast BLAS for MLX's Linux CPU backend.

MLX's Linux CPU wheel links a slow reference BLAS. Debian's OpenBLAS is ~35x faster for
fp32 matmul, but it must be loaded before MLX starts, so the CLI re-executes itself once
with ``LD_PRELOAD`` set when the library is present (docs/design.md, "Performance").
"""

from __future__ import annotations

import contextlib
import os
import sys

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)
_HINT_ENV = "REDRAFTER_MLX_BLAS_HINTED"
THREADS_ENV = "REDRAFTER_MLX_BLAS_THREADS"


def find_openblas() -> str | None:
    for path in OPENBLAS_PATHS:
        if os.path.exists(path):
            return path
    return None


def ensure_fast_blas() -> None:
    """On Linux, re-exec with OpenBLAS preloaded, or print a one-time hint with the fix."""
    if not sys.platform.startswith("linux") or os.environ.get("REDRAFTER_MLX_NO_REEXEC"):
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if "openblas" in preload or "libblas" in preload:
        limit_blas_threads()
        return
    path = find_openblas()
    if path is None:
        if not os.environ.get(_HINT_ENV):
            os.environ[_HINT_ENV] = "1"
            print(
                "hint: MLX is using its slow bundled BLAS. For ~35x faster fp32 matmul run "
                "'sudo apt-get install libopenblas0-pthread' (the CLI then uses it automatically).",
                file=sys.stderr,
            )
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = f"{path}:{preload}" if preload else path
    env["REDRAFTER_MLX_NO_REEXEC"] = "1"
    env.setdefault("OPENBLAS_NUM_THREADS", str(blas_threads()))
    os.execvpe(sys.executable, [sys.executable, "-m", "redrafter_mlx.cli", *sys.argv[1:]], env)


def blas_threads() -> int:
    """OpenBLAS threads for the engine: ``$REDRAFTER_MLX_BLAS_THREADS``, else all cores but
    one. MLX's CPU backend runs ops on a stream thread while the host thread dispatches the
    next step; BLAS threads that take every core (and spin) contend with both. Measured on 2
    cores: a 4-16 token verify forward 15-40% faster with one BLAS thread, the AR step equal.
    """
    value = os.environ.get(THREADS_ENV)
    if value and value.isdigit() and int(value) > 0:
        return int(value)
    return max(1, (os.cpu_count() or 2) - 1)


def limit_blas_threads() -> None:
    """Apply ``blas_threads()`` to an OpenBLAS already loaded (LD_PRELOAD), unless the user
    set ``OPENBLAS_NUM_THREADS``."""
    if os.environ.get("OPENBLAS_NUM_THREADS") and not os.environ.get(THREADS_ENV):
        return
    import ctypes

    for path in OPENBLAS_PATHS:
        if os.path.exists(path):
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(path).openblas_set_num_threads(blas_threads())
            return


def default_dtype():
    """float16 on Metal, float32 on the CPU backend (fp16 matmul is slow there)."""
    import mlx.core as mx

    return mx.float16 if mx.metal.is_available() else mx.float32
