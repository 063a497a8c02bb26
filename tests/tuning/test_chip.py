"""Chip detection: pure parsing over recorded probe outputs, every M1-M4 variant."""

from __future__ import annotations

import pytest

from tuning.chip import (
    ChipInfo,
    chip_from_facts,
    detect_chip,
    normalise_cpu_model,
    parse_apple_brand,
    parse_apple_gpu_arch,
    parse_cpuinfo_model,
    parse_gpu_core_count,
)
from tuning.presets import PRESETS, get_preset, preset_for

# (brand string, Metal architecture, a GPU core count of that chip)
APPLE_CHIPS = [
    ("Apple M1", "applegpu_g13g", 8),
    ("Apple M1 Pro", "applegpu_g13s", 16),
    ("Apple M1 Max", "applegpu_g13c", 32),
    ("Apple M1 Ultra", "applegpu_g13d", 64),
    ("Apple M2", "applegpu_g14g", 10),
    ("Apple M2 Pro", "applegpu_g14s", 19),
    ("Apple M2 Max", "applegpu_g14c", 38),
    ("Apple M2 Ultra", "applegpu_g14d", 76),
    ("Apple M3", "applegpu_g15g", 10),
    ("Apple M3 Pro", "applegpu_g15s", 18),
    ("Apple M3 Max", "applegpu_g15c", 40),
    ("Apple M3 Ultra", "applegpu_g15d", 80),
    ("Apple M4", "applegpu_g16g", 10),
    ("Apple M4 Pro", "applegpu_g16s", 20),
    ("Apple M4 Max", "applegpu_g16c", 40),
]

IOREG = """+-o AGXAcceleratorG14X  <class AGXAcceleratorG14X, id 0x1000003a1>
    {
      "IOClass" = "AGXAcceleratorG14X"
      "gpu-core-count" = {cores}
      "model" = "{brand}"
    }
"""

SYSTEM_PROFILER = """Graphics/Displays:

    {brand}:

      Chipset Model: {brand}
      Type: GPU
      Bus: Built-In
      Total Number of Cores: {cores}
      Vendor: Apple (0x106b)
      Metal Support: Metal 3
"""


def _slug(brand: str) -> tuple[str, str]:
    """("m2", "max") from "Apple M2 Max" the slow, obvious way."""
    words = brand.lower().split()[1:]
    return words[0], (words[1] if len(words) > 1 else "base")


@pytest.mark.parametrize("brand,arch,cores", APPLE_CHIPS)
def test_every_apple_variant_from_sysctl_and_ioreg(brand, arch, cores):
    family, tier = _slug(brand)
    facts = {
        "system": "Darwin",
        "machine": "arm64",
        "backend": "metal",
        "cpu_count": 12,
        "brand_string": brand + "\n",
        "memsize": "68719476736\n",
        "gpu_cores_text": IOREG.replace("{cores}", str(cores)).replace("{brand}", brand),
        "device_info": {"architecture": arch, "memory_size": 68719476736},
    }
    chip = chip_from_facts(facts)
    assert chip.chip_id == f"apple-{family}-{tier}-{cores}c"
    assert (chip.family, chip.tier, chip.gpu_cores) == (family, tier, cores)
    assert chip.memory_bytes == 64 * 2**30
    assert chip.platform == "macos" and chip.backend == "metal"
    assert chip.name == brand
    assert chip.preset == (family if tier == "base" else f"{family}-{tier}")
    assert get_preset(chip.preset) is not None


@pytest.mark.parametrize("brand,arch,cores", APPLE_CHIPS)
def test_every_apple_variant_from_device_info_alone(brand, arch, cores):
    """No sysctl brand (sandboxed): the Metal architecture still identifies the chip."""
    family, tier = _slug(brand)
    chip = chip_from_facts(
        {"system": "Darwin", "backend": "metal", "device_info": {"architecture": arch}}
    )
    assert (chip.family, chip.tier) == (family, tier)
    assert chip.chip_id == f"apple-{family}-{tier}"


@pytest.mark.parametrize("brand,arch,cores", APPLE_CHIPS)
def test_gpu_cores_from_system_profiler(brand, arch, cores):
    text = SYSTEM_PROFILER.format(brand=brand, cores=cores)
    assert parse_gpu_core_count(text) == cores


def test_device_name_from_newer_mlx_is_used():
    chip = chip_from_facts(
        {
            "system": "Darwin",
            "backend": "metal",
            "device_info": {"device_name": "Apple M3 Max", "architecture": "applegpu_g15c"},
        }
    )
    assert chip.preset == "m3-max"


def test_brand_parsing_edge_cases():
    assert parse_apple_brand("Apple M2 Max") == ("m2", "max")
    assert parse_apple_brand("apple m4 pro") == ("m4", "pro")
    assert parse_apple_brand("Apple M5") == ("m5", "base")
    assert parse_apple_brand("VirtualApple @ 2.50GHz processor") is None
    assert parse_apple_brand("Intel(R) Core(TM) i9-9880H CPU @ 2.30GHz") is None
    assert parse_apple_brand("") is None
    assert parse_apple_gpu_arch("applegpu_g99x") is None
    assert parse_apple_gpu_arch("x86_64") is None
    assert parse_gpu_core_count("nothing here") is None


def test_future_apple_family_falls_back_to_default_preset():
    chip = chip_from_facts(
        {
            "system": "Darwin",
            "brand_string": "Apple M5 Max",
            "gpu_cores_text": '"gpu-core-count" = 40',
        }
    )
    assert chip.chip_id == "apple-m5-max-40c"
    preset, matched = preset_for(chip.preset)
    assert not matched and preset.name == "default"


def test_rosetta_and_intel_macs_are_cpu_chips_without_preset():
    rosetta = chip_from_facts(
        {
            "system": "Darwin",
            "backend": "cpu",
            "metal": False,
            "brand_string": "VirtualApple @ 2.50GHz processor",
            "cpu_count": 8,
        }
    )
    assert rosetta.backend == "cpu" and rosetta.preset is None
    assert rosetta.chip_id == "macos-cpu-virtualapple-8c"
    intel = chip_from_facts(
        {
            "system": "Darwin",
            "backend": "metal",
            "brand_string": "Intel(R) Core(TM) i9-9880H CPU @ 2.30GHz",
            "cpu_count": 16,
        }
    )
    assert intel.chip_id == "macos-cpu-intel-core-i9-9880h-16c"


@pytest.mark.parametrize(
    "model,slug",
    [
        ("AMD EPYC 7B13", "amd-epyc-7b13"),
        ("AMD EPYC", "amd-epyc"),
        ("Intel(R) Xeon(R) CPU @ 2.20GHz", "intel-xeon"),
        ("Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz", "intel-xeon-platinum-8375c"),
        ("AMD Ryzen 9 5950X 16-Core Processor", "amd-ryzen-9-5950x"),
        ("13th Gen Intel(R) Core(TM) i7-13700K", "13th-gen-intel-core-i7-13700k"),
        ("AMD EPYC 7763 64-Core Processor", "amd-epyc-7763"),
        ("", "unknown"),
    ],
)
def test_cpu_model_normalisation(model, slug):
    assert normalise_cpu_model(model) == slug


def test_linux_cpu_from_cpuinfo():
    cpuinfo = (
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
        "model name\t: AMD EPYC 7B13\nstepping\t: 1\n\nprocessor\t: 1\n"
        "model name\t: AMD EPYC 7B13\n"
    )
    chip = chip_from_facts(
        {
            "system": "Linux",
            "machine": "x86_64",
            "backend": "cpu",
            "cpuinfo": cpuinfo,
            "cpu_count": 2,
            "device_info": {"architecture": "x86_64", "device_name": "AMD EPYC"},
        }
    )
    assert chip.chip_id == "linux-cpu-amd-epyc-7b13-2c"
    assert chip.preset == "linux-cpu" and chip.cpu_cores == 2


def test_linux_arm_without_model_name_uses_machine():
    cpuinfo = "processor\t: 0\nBogoMIPS\t: 243.75\nCPU implementer\t: 0x41\n"
    assert parse_cpuinfo_model(cpuinfo) is None
    chip = chip_from_facts(
        {"system": "Linux", "machine": "aarch64", "cpuinfo": cpuinfo, "cpu_count": 64}
    )
    assert chip.chip_id == "linux-cpu-aarch64-64c"


def test_unknown_everything_still_gives_an_id():
    chip = chip_from_facts({})
    assert chip.chip_id == "unknown-cpu-unknown"
    assert chip.preset is None
    assert preset_for(chip.preset)[0].name == "default"


def test_cuda_device():
    chip = chip_from_facts(
        {
            "system": "Linux",
            "backend": "cuda",
            "cpu_count": 16,
            "device_info": {
                "device_name": "NVIDIA H100 80GB HBM3",
                "architecture": "sm_90",
                "total_memory": 85899345920,
            },
        }
    )
    assert chip.chip_id == "cuda-nvidia-h100-80gb-hbm3"
    assert chip.preset == "cuda" and chip.memory_bytes == 85899345920


def test_detect_chip_on_this_machine():
    chip = detect_chip()
    assert isinstance(chip, ChipInfo)
    assert chip.chip_id and chip.chip_id == chip.chip_id.lower()
    assert " " not in chip.chip_id


def test_reference_presets_match_the_paper():
    assert PRESETS["m1-max"].shape.label == "W1×L5"
    assert PRESETS["m2"].shape.label == "W2×L5"
    assert PRESETS["m2-ultra"].shape.label == "W3×L4"
    for name in ("m1", "m1-pro", "m1-ultra", "m3", "m3-max", "m4", "m4-pro", "m4-max"):
        assert get_preset(name) is not None, name
    apple = [p for n, p in PRESETS.items() if n.startswith("m")]
    assert all(p.shape.width * p.shape.length < 16 for p in apple)  # below the step-time knee
    assert get_preset("Apple M2 Max") is PRESETS["m2-max"]
