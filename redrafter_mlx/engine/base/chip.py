"""Chip detection: which machine are we tuning for?

Detection is split in two halves so every chip variant can be tested on any machine:

* :func:`gather_facts` runs the probes (``sysctl``, ``ioreg``, ``system_profiler``,
  ``/proc/cpuinfo``, ``mx.device_info()``) and returns their raw outputs as a dict;
* :func:`chip_from_facts` and the ``parse_*`` helpers are pure functions over those
  recorded strings and produce a :class:`ChipInfo` with a normalised id such as
  ``apple-m2-max-38c`` or ``linux-cpu-amd-epyc-7b13-2c``.

Only the standard library is imported at module level; MLX is imported inside the probe.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

APPLE_TIERS = ("base", "pro", "max", "ultra")

# Metal GPU architecture strings (``mx.device_info()["architecture"]``) look like
# ``applegpu_g14s``: the number is the GPU generation, the letter the die tier.
_ARCH_GENERATION = {13: "m1", 14: "m2", 15: "m3", 16: "m4", 17: "m5"}
_ARCH_TIER = {"g": "base", "s": "pro", "c": "max", "d": "ultra"}

_PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ChipInfo:
    """What the tuner needs to know about the machine.

    ``chip_id`` keys tuned profiles; ``preset`` names the built-in preset that applies
    (``m2-max``, ``linux-cpu``, ``cuda`` ...) or is ``None`` when no preset fits.
    """

    chip_id: str
    name: str
    platform: str  # "macos", "linux", or sys.platform for anything else
    backend: str  # "metal", "cuda" or "cpu"
    family: str | None = None  # "m1".."m5" on Apple silicon
    tier: str | None = None  # "base", "pro", "max", "ultra"
    gpu_cores: int | None = None
    cpu_cores: int | None = None
    memory_bytes: int | None = None
    preset: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)


# --------------------------------------------------------------------------- parsing


def parse_apple_brand(brand: str) -> tuple[str, str] | None:
    """``"Apple M2 Max"`` -> ``("m2", "max")``; ``"Apple M3"`` -> ``("m3", "base")``.

    Returns ``None`` for anything that is not an Apple M-series brand string
    (Intel Macs, Rosetta's ``VirtualApple``, empty output).
    """
    match = re.search(r"\bApple\s+M(\d+)(?:\s+(Pro|Max|Ultra))?\b", brand or "", re.IGNORECASE)
    if not match:
        return None
    tier = (match.group(2) or "base").lower()
    return f"m{int(match.group(1))}", tier


def parse_apple_gpu_arch(architecture: str) -> tuple[str, str] | None:
    """``"applegpu_g14s"`` -> ``("m2", "pro")``; ``None`` when the string is not recognised."""
    match = re.fullmatch(r"applegpu_g(\d+)([a-z])", (architecture or "").strip().lower())
    if not match:
        return None
    family = _ARCH_GENERATION.get(int(match.group(1)))
    tier = _ARCH_TIER.get(match.group(2))
    if family is None or tier is None:
        return None
    return family, tier


def parse_gpu_core_count(text: str) -> int | None:
    """GPU core count from ``ioreg`` (``"gpu-core-count" = 38``) or ``system_profiler``
    (``Total Number of Cores: 38``) output; ``None`` when neither appears."""
    for pattern in (r'"gpu-core-count"\s*=\s*(\d+)', r"Total Number of Cores:\s*(\d+)"):
        match = re.search(pattern, text or "")
        if match:
            return int(match.group(1))
    return None


def parse_int(text: Any) -> int | None:
    """An int from ``sysctl`` output or a device_info value; ``None`` when not a number."""
    try:
        return int(str(text).strip())
    except (TypeError, ValueError):
        return None


def parse_cpuinfo_model(cpuinfo: str) -> str | None:
    """The first ``model name`` (x86) or ``Model``/``Hardware`` (ARM boards) in /proc/cpuinfo."""
    for key in ("model name", "Model", "Hardware"):
        match = re.search(rf"^{key}\s*:\s*(.+?)\s*$", cpuinfo or "", re.MULTILINE)
        if match and match.group(1):
            return match.group(1)
    return None


_CPU_NOISE = re.compile(
    r"\((?:R|TM|C)\)|®|™|\bCPU\b|\bProcessor\b|\b\d+-Core\b|@\s*[\d.]+\s*[GM]Hz|\bwith\b.*$",
    re.IGNORECASE,
)


def slugify(text: str) -> str:
    """Lower-case, ASCII, words joined by ``-``: ``"AMD EPYC 7B13"`` -> ``"amd-epyc-7b13"``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def normalise_cpu_model(model: str) -> str:
    """Drop trademarks, clock speeds and core-count words from a CPU model string.

    ``"Intel(R) Xeon(R) CPU @ 2.20GHz"`` -> ``"intel-xeon"``,
    ``"AMD Ryzen 9 5950X 16-Core Processor"`` -> ``"amd-ryzen-9-5950x"``.
    """
    return slugify(_CPU_NOISE.sub(" ", model or "")) or "unknown"


def apple_chip_id(family: str, tier: str, gpu_cores: int | None) -> str:
    """``apple-m2-max-38c``; the ``-base`` tier is spelled out so ids never collide."""
    suffix = f"-{gpu_cores}c" if gpu_cores else ""
    return f"apple-{family}-{tier}{suffix}"


def apple_preset_name(family: str, tier: str) -> str:
    """The preset for an Apple chip: ``m2`` for the base M2, ``m2-max`` for the M2 Max."""
    return family if tier == "base" else f"{family}-{tier}"


# --------------------------------------------------------------------------- facts -> chip


def _apple_chip(facts: dict[str, Any]) -> ChipInfo | None:
    """A ChipInfo for Apple silicon, from the brand string or else the Metal architecture."""
    info = facts.get("device_info") or {}
    parsed = (
        parse_apple_brand(facts.get("brand_string", ""))
        or parse_apple_brand(str(info.get("device_name", "")))
        or parse_apple_gpu_arch(str(info.get("architecture", "")))
    )
    if parsed is None:
        return None
    family, tier = parsed
    gpu_cores = parse_gpu_core_count(facts.get("gpu_cores_text", ""))
    memory = parse_int(facts.get("memsize")) or parse_int(info.get("memory_size"))
    return ChipInfo(
        chip_id=apple_chip_id(family, tier, gpu_cores),
        name=f"Apple {family.upper()}" + ("" if tier == "base" else f" {tier.capitalize()}"),
        platform="macos",
        backend="metal" if facts.get("metal", True) else "cpu",
        family=family,
        tier=tier,
        gpu_cores=gpu_cores,
        cpu_cores=facts.get("cpu_count"),
        memory_bytes=memory,
        preset=apple_preset_name(family, tier),
    )


def _cuda_chip(facts: dict[str, Any]) -> ChipInfo:
    """A ChipInfo for MLX's CUDA backend, named after the GPU."""
    info = facts.get("device_info") or {}
    name = str(info.get("device_name") or "unknown GPU")
    return ChipInfo(
        chip_id=f"cuda-{slugify(name) or 'unknown'}",
        name=name,
        platform=_platform_name(facts.get("system", "")),
        backend="cuda",
        cpu_cores=facts.get("cpu_count"),
        memory_bytes=parse_int(info.get("total_memory") or info.get("memory_size")),
        preset="cuda",
    )


def _cpu_chip(facts: dict[str, Any]) -> ChipInfo:
    """A ChipInfo for a CPU-only machine (Linux CI, Intel Macs, anything else)."""
    system = _platform_name(facts.get("system", ""))
    info = facts.get("device_info") or {}
    model = (
        facts.get("brand_string")
        or parse_cpuinfo_model(facts.get("cpuinfo", ""))
        or str(info.get("device_name") or "")
        or facts.get("machine")
        or "unknown"
    )
    cores = facts.get("cpu_count")
    prefix = "linux-cpu" if system == "linux" else f"{system}-cpu"
    return ChipInfo(
        chip_id=f"{prefix}-{normalise_cpu_model(model)}" + (f"-{cores}c" if cores else ""),
        name=model.strip(),
        platform=system,
        backend="cpu",
        cpu_cores=cores,
        memory_bytes=parse_int(facts.get("memsize")),
        preset="linux-cpu" if system == "linux" else None,
    )


def _platform_name(system: str) -> str:
    """``Darwin`` -> ``macos``; ``Linux`` -> ``linux``; anything else lower-cased."""
    system = (system or "").lower()
    return "macos" if system == "darwin" else (system or "unknown")


def chip_from_facts(facts: dict[str, Any]) -> ChipInfo:
    """Turn recorded probe outputs (see :func:`gather_facts`) into a :class:`ChipInfo`.

    Recognised keys: ``system`` (``platform.system()``), ``machine``, ``brand_string``
    (``sysctl -n machdep.cpu.brand_string``), ``memsize`` (``sysctl -n hw.memsize``),
    ``gpu_cores_text`` (ioreg or system_profiler output), ``device_info`` (MLX dict),
    ``backend`` (``metal``/``cuda``/``cpu``), ``metal`` (bool), ``cpuinfo``, ``cpu_count``.
    """
    backend = facts.get("backend", "cpu")
    if backend == "cuda":
        return _cuda_chip(facts)
    if _platform_name(facts.get("system", "")) == "macos":
        apple = _apple_chip(facts)
        if apple is not None:
            return apple
    return _cpu_chip(facts)


# --------------------------------------------------------------------------- probes


def _run(cmd: list[str]) -> str:
    """stdout of a probe command, or ``""`` when it is missing, fails or hangs."""
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def _cpu_count() -> int | None:
    """CPUs this process may run on (respects taskset/cgroups where the OS tells us)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def _mlx_facts() -> dict[str, Any]:
    """The MLX backend and ``device_info()`` of its default device; empty if MLX fails."""
    try:
        import mlx.core as mx
    except Exception:
        return {}
    facts: dict[str, Any] = {"metal": bool(mx.metal.is_available())}
    cuda = getattr(mx, "cuda", None)
    if facts["metal"]:
        facts["backend"] = "metal"
    elif cuda is not None and cuda.is_available():
        facts["backend"] = "cuda"
    else:
        facts["backend"] = "cpu"
    try:
        facts["device_info"] = dict(mx.device_info())
    except Exception:
        try:
            facts["device_info"] = dict(mx.metal.device_info()) if facts["metal"] else {}
        except Exception:
            facts["device_info"] = {}
    return facts


def gather_facts() -> dict[str, Any]:
    """Run the probes for this machine; the result feeds :func:`chip_from_facts`."""
    facts: dict[str, Any] = {
        "system": platform.system(),
        "machine": platform.machine(),
        "cpu_count": _cpu_count(),
    }
    facts.update(_mlx_facts())
    if sys.platform == "darwin":
        facts["brand_string"] = _run(["sysctl", "-n", "machdep.cpu.brand_string"]).strip()
        facts["memsize"] = _run(["sysctl", "-n", "hw.memsize"]).strip()
        gpu_text = _run(["ioreg", "-rc", "AGXAccelerator", "-d", "1"])
        if parse_gpu_core_count(gpu_text) is None:
            gpu_text = _run(["system_profiler", "SPDisplaysDataType"])
        facts["gpu_cores_text"] = gpu_text
    elif os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            facts["cpuinfo"] = f.read()
    return facts


@lru_cache(maxsize=1)
def detect_chip() -> ChipInfo:
    """The :class:`ChipInfo` of this machine (probed once per process)."""
    return chip_from_facts(gather_facts())
