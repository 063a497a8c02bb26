"""Platform helpers: the default dtype, and a fast BLAS for MLX's Linux CPU backend.

MLX's Linux CPU wheel links a slow reference BLAS. Debian's OpenBLAS is ~35x faster for
fp32 matmul, but it must be loaded before MLX starts, so the CLI re-executes itself once
with ``LD_PRELOAD`` set when the library is present (docs/design/performance.md, "The Linux
CPU backend").
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)
_HINT_ENV = "REDRAFTER_MLX_BLAS_HINTED"
THREADS_ENV = "REDRAFTER_MLX_BLAS_THREADS"
_AUTO_ENV = "REDRAFTER_MLX_BLAS_AUTO"
_THREADS_WARNED_ENV = "REDRAFTER_MLX_BLAS_THREADS_WARNED"  # once, re-executed process included
LANES_ENV = "REDRAFTER_MLX_ANSWER_LANES"
# A model whose weights take more than this is weight-bound on the CPU backend: each step
# streams every weight, and a core's memory bandwidth, not op dispatch, sets its time.
WEIGHT_BOUND_BYTES = 64 * 2**20


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
    threads = blas_threads()  # first: a warning about $REDRAFTER_MLX_BLAS_THREADS is said once
    env = dict(os.environ)
    env["LD_PRELOAD"] = f"{path}:{preload}" if preload else path
    env["REDRAFTER_MLX_NO_REEXEC"] = "1"
    if "OPENBLAS_NUM_THREADS" not in env:
        env["OPENBLAS_NUM_THREADS"] = str(threads)
        env[_AUTO_ENV] = "1"  # ours, not the user's: fit_blas_threads may change it
    os.execvpe(sys.executable, [sys.executable, "-m", "redrafter_mlx.cli", *sys.argv[1:]], env)


def blas_threads(weight_bytes: int | None = None) -> int:
    """OpenBLAS threads for the engine: ``$REDRAFTER_MLX_BLAS_THREADS``, else by the model.

    A small model's step is bound by op dispatch: MLX's CPU backend runs ops on a stream
    thread while the host thread dispatches the next step, and BLAS threads that take every
    core (and spin) contend with both, so it gets all cores but one (measured on 2 cores: a
    4-16 token verify forward of the 4M demo model 15-40% faster with one BLAS thread). A
    model over ``WEIGHT_BOUND_BYTES`` streams its weights every step, and one core's memory
    bandwidth is the limit, so it gets every core (measured on 2 cores, SmolLM2-135M fp32:
    an AR step 92 ms with two BLAS threads against 130 ms with one; the fastest decoding,
    speculative or not, 10-11 tok/s against 9; distill's answer stage 1.25-1.3x and its
    training step 1.5x faster). ``weight_bytes=None``: not known yet (at start-up), all cores
    but one. A value that is not a count from 1 to the cores is said once on stderr, with
    what is used instead (more than the cores: the cores; otherwise the choice above).
    """
    cores = os.cpu_count() or 2
    value = (os.environ.get(THREADS_ENV) or "").strip()
    if value:
        asked = int(value) if value.isdigit() else 0
        if 1 <= asked <= cores:
            return asked
        if asked > cores:
            _warn_threads(f"{THREADS_ENV}={value} is more than the {cores} cores; using {cores}")
            return cores
        _warn_threads(
            f"{THREADS_ENV}={value!r} is not a thread count from 1 to {cores} (the cores); "
            f"ignoring it: BLAS threads follow the model's size (all cores but one for a small "
            f"model, every core for a large one)"
        )
    if weight_bytes is not None and weight_bytes > WEIGHT_BOUND_BYTES:
        return cores
    return max(1, cores - 1)


def _warn_threads(message: str) -> None:
    """``warning: message`` on stderr, once per run (the re-executed process included)."""
    if not os.environ.get(_THREADS_WARNED_ENV):
        os.environ[_THREADS_WARNED_ENV] = "1"
        print(f"warning: {message}", file=sys.stderr)


def limit_blas_threads(weight_bytes: int | None = None) -> None:
    """Apply ``blas_threads(weight_bytes)`` to the OpenBLAS preloaded for MLX (LD_PRELOAD),
    unless the user set ``OPENBLAS_NUM_THREADS`` themselves. OpenBLAS grows or shrinks its
    pool at run time, so this may be called again once the model is known."""
    user_set = os.environ.get("OPENBLAS_NUM_THREADS") and not os.environ.get(_AUTO_ENV)
    if user_set and not os.environ.get(THREADS_ENV):
        return
    lib = preloaded_openblas()
    if lib is not None:
        lib.openblas_set_num_threads(blas_threads(weight_bytes))


def preloaded_openblas():
    """The OpenBLAS preloaded for MLX (``LD_PRELOAD``) as a ctypes library, or None."""
    preload = os.environ.get("LD_PRELOAD", "")
    for path in OPENBLAS_PATHS:
        if path in preload:
            with contextlib.suppress(OSError):
                lib = ctypes.CDLL(path)
                names = ("openblas_set_num_threads", "openblas_get_num_threads")
                if all(hasattr(lib, name) for name in names):
                    return lib
    return None


def answer_lanes() -> int:
    """Batches ``distill`` decodes at once for its training answers (``selfgen.answers_in_
    lanes``): ``$REDRAFTER_MLX_ANSWER_LANES``, else 2 on the CPU backend with two cores or
    more, 1 on a GPU.

    MLX's CPU backend runs a stream's ops one at a time, and a batched step of a small model
    spends most of its time outside BLAS (attention over the cache, SiLU, norms): two streams
    with one BLAS thread each overlap them. Measured on 2 cores, SmolLM2-135M fp32: a fixed
    window of 192, 48 rows a stream, one stream with two BLAS threads 219 answer tokens/s, two
    streams with one each 336; ``distill``'s answering end to end 158 -> 206 positions/s
    (``docs/bench/distill_throughput.txt``).
    """
    value = os.environ.get(LANES_ENV)
    if value and value.isdigit() and int(value) > 0:
        return int(value)
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return 1
    return 2 if (os.cpu_count() or 1) >= 2 else 1


@contextlib.contextmanager
def lane_threads(lanes: int):
    """Within: the OpenBLAS threads shared out between ``lanes`` streams (``cores // lanes``
    each, at least one: more would oversubscribe the cores); the previous count after."""
    lib = preloaded_openblas() if lanes > 1 else None
    if lib is None:
        yield
        return
    before = lib.openblas_get_num_threads()
    lib.openblas_set_num_threads(max(1, before // lanes))
    try:
        yield
    finally:
        lib.openblas_set_num_threads(before)


def fit_blas_threads(*modules) -> None:
    """Set the BLAS threads for the loaded model(s) (see ``blas_threads``)."""
    from mlx.utils import tree_flatten

    total = sum(v.nbytes for m in modules if m is not None for _, v in tree_flatten(m.parameters()))
    limit_blas_threads(total)


def default_dtype():
    """float16 on a GPU (Metal, or MLX's CUDA backend), float32 on the CPU backend (fp16
    matmul is slow there)."""
    import mlx.core as mx

    return mx.float16 if mx.default_device() == mx.gpu else mx.float32


READ_FIRST_ENV = "REDRAFTER_MLX_READ_FIRST"


def read_first() -> bool:
    """Whether a loop whose shape is chosen per step (``batch_choice.ShapePolicy.each_step``)
    reads step k before it queues step k+1 (the choice sees every token so far, but the
    device waits for the host's read, lookup shadow and choice) instead of queueing first and
    choosing from match states one step stale. ``REDRAFTER_MLX_READ_FIRST=1``/``0`` forces
    either. ``batch.BatchGenerator.step`` applies it, for every loop (generation, the server).

    A measured, per-backend default: on the CPU backend the host's work shares the cores with
    the BLAS threads, so queueing early hides nothing, and the stale choice cost speed
    (SmolLM2, MT-Bench 8 spread x 2 turns, 128 tokens, adaptive default over AR in the same
    run: read first 1.39x / 2.26x, one step stale 1.28x / 1.84x). On a GPU the device would
    wait for the host every step, so there the step is queued first.

    The same rule holds for a loop with branching rows (APAR), whatever its policy: read
    first, each branching step is read before the next is queued; else the next is queued
    first wherever no fork can change it (``BatchGenerator.queue_ahead``). Measured on the
    CPU, same run (SmolLM2-APAR, 6 prompts x 192 tokens, branches on): queueing ahead gave
    0.99x the speed plain and 0.95x pinned W1xL4+K1xL8 on list prompts, 1.00x and 1.01x on
    the other MT-Bench prompts (few forks) (``scripts/experiments/branch_queue_ahead.py``)."""
    import mlx.core as mx

    value = os.environ.get(READ_FIRST_ENV, "").strip()
    if value in ("0", "1"):
        return value == "1"
    return mx.default_device() == mx.cpu
