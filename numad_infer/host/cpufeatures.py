"""Which CPU kernels an engine runs, and what of the CPU it leaves idle. Pure.

The one path for both questions: `Engine.cpu` reads the engine (an `EngineCpuReport`),
`idle_units` is the verdict that `check`'s warning and `doctor`'s "engine vector ISA"
check both give.

llama.cpp built with GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS (scripts/build-llama-server)
loads one libggml-cpu-<variant>.so at start and logs which; a build with one CPU backend
(llama-cpp-python's wheel) reports the ISA it was compiled for in its system_info
("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | ..."). The host's side is /proc/cpuinfo's flags,
which Linux lists only for state it saves (no avx512f when XCR0 leaves AVX-512 out; amx_tile
but not the permission to use tile data, which the engine's own check covers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# ggml's x86 variants and what each is compiled for (ggml/src/CMakeLists.txt,
# ggml_add_cpu_backend_variant), in system_info's names.
VARIANT_FEATURES: dict[str, frozenset[str]] = {
    "x64": frozenset(),
    "sse42": frozenset({"SSE42"}),
    "sandybridge": frozenset({"SSE42", "AVX"}),
    "ivybridge": frozenset({"SSE42", "AVX", "F16C"}),
    "piledriver": frozenset({"SSE42", "AVX", "F16C", "FMA"}),
    "haswell": frozenset({"SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2"}),
    "skylakex": frozenset({"SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512"}),
    "cannonlake": frozenset({"SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI"}),
    "cascadelake": frozenset({"SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VNNI"}),
    "icelake": frozenset({"SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI"}),
    "cooperlake": frozenset({"SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VNNI", "AVX512_BF16"}),
    "zen4": frozenset({"SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI",
                       "AVX512_BF16"}),
    "alderlake": frozenset({"SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX_VNNI"}),
    "sapphirerapids": frozenset({"SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI",
                                 "AVX512_VNNI", "AVX512_BF16", "AMX_INT8"}),
}

_LOADED = re.compile(r"loaded CPU backend from \S*libggml-cpu-([A-Za-z0-9_.]+)\.so")
_SYSTEM_INFO_CPU = re.compile(r"CPU\s*:\s*((?:[A-Z0-9_]+\s*=\s*\d+\s*\|\s*)+)")

# What the verdict is about: the wide units, widest first, where prompt processing gains
# most (bench/README.md, "Builds"). system_info feature -> the /proc/cpuinfo flags
# that offer it (AMX: the tiles and the int8 unit that uses them).
WIDE_UNITS: dict[str, tuple[str, ...]] = {"AMX_INT8": ("amx_tile", "amx_int8"), "AVX512": ("avx512f",),
                                          "AVX2": ("avx2",)}


@dataclass(frozen=True)
class EngineCpu:
    """The CPU kernels an engine runs on this host."""

    variant: str | None  # the libggml-cpu variant it loaded; None for a single-backend build
    features: frozenset[str]  # system_info names: AVX2, AVX512, AVX512_VNNI, AMX_INT8, ...
    # Units the engine's own check found this host cannot run although cpuinfo may list
    # them: a wider variant was built beside the one it loaded, and ggml (patched to check
    # XCR0 and to run a tile instruction) declined it. Not idle by the engine's fault: no
    # rebuild would use them (e.g. AMX on hypervisors that fault at the first tilezero).
    declined: frozenset[str] = frozenset()

    def describe(self) -> str:
        wide = sorted(self.features & {"AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI", "AMX_INT8"})
        isa = "+".join(wide) or "no AVX2"
        return f"{self.variant} ({isa})" if self.variant else isa


@dataclass(frozen=True)
class EngineCpuReport:
    """What `Engine.cpu` found: the kernels, or why the engine cannot tell (doctor shows it)."""

    cpu: EngineCpu | None  # None: the engine does not say
    source: str  # the command that said, or why it said nothing
    fix: str  # how to get kernels for this CPU's wide units with this engine


def from_backend_log(text: str) -> EngineCpu | None:
    """What `load_backend: loaded CPU backend from .../libggml-cpu-<variant>.so` names."""
    found = _LOADED.findall(text)
    if not found:
        return None
    variant = found[-1]
    return EngineCpu(variant, VARIANT_FEATURES.get(variant, frozenset()))


def declined_by(loaded: EngineCpu, built: list[str]) -> EngineCpu:
    """`loaded` with the units of the `built` variants wider than it, which ggml passed over
    because this host cannot run them (it loads the widest variant that runs)."""
    wider = [VARIANT_FEATURES[name] for name in built
             if name in VARIANT_FEATURES and VARIANT_FEATURES[name] > loaded.features]
    declined = frozenset().union(*wider) - loaded.features
    return EngineCpu(loaded.variant, loaded.features, declined)


def from_system_info(text: str) -> EngineCpu | None:
    """The features a "CPU : AVX = 1 | AVX2 = 1 | ..." system_info line sets to 1."""
    match = _SYSTEM_INFO_CPU.search(text)
    if match is None:
        return None
    features = frozenset(name.strip() for name, _, value in
                         (part.partition("=") for part in match.group(1).split("|") if "=" in part)
                         if value.strip() == "1")
    return EngineCpu(None, features)


def cpuinfo_flags(text: str) -> frozenset[str]:
    """The flags of the first processor in /proc/cpuinfo's text."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


# /proc/cpuinfo flag -> the feature name VARIANT_FEATURES uses.
_CPUINFO_FEATURES: dict[str, str] = {
    "sse4_2": "SSE42", "avx": "AVX", "f16c": "F16C", "fma": "FMA", "avx2": "AVX2", "bmi2": "BMI2",
    "avx512f": "AVX512", "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI",
    "avx512_bf16": "AVX512_BF16", "avx_vnni": "AVX_VNNI", "amx_int8": "AMX_INT8"}


def _best_variant(offered: frozenset[str]) -> str:
    fitting = [name for name, needs in VARIANT_FEATURES.items() if needs <= offered]
    return max(fitting, key=lambda name: len(VARIANT_FEATURES[name]))


def host_variants(host_flags: frozenset[str]) -> tuple[str, ...]:
    """The variants a build for this host needs (scripts/build-llama-server's default): x64,
    the fallback for any x86-64, and the one ggml would load here. Where the best needs AMX,
    the best without it too: cpuinfo lists amx_* even where the kernel keeps tile data out
    of XCR0 (many VMs), and ggml (patched to check XCR0) then falls back to that one."""
    offered = frozenset(feature for flag, feature in _CPUINFO_FEATURES.items() if flag in host_flags)
    chosen = ["x64", _best_variant(offered)]
    if "AMX_INT8" in VARIANT_FEATURES[chosen[-1]]:
        chosen.append(_best_variant(offered - {"AMX_INT8"}))
    return tuple(dict.fromkeys(chosen))


def offered_units(host_flags: frozenset[str]) -> tuple[str, ...]:
    """The wide units this CPU and OS offer, widest first."""
    return tuple(unit for unit, flags in WIDE_UNITS.items() if all(flag in host_flags for flag in flags))


def idle_units(host_flags: frozenset[str], engine: EngineCpu) -> tuple[str, ...]:
    """The wide units this CPU and OS offer that the engine's kernels do not use, widest first
    (not those its own check found this host cannot run)."""
    return tuple(unit for unit in offered_units(host_flags) if unit not in engine.features | engine.declined)


if __name__ == "__main__":
    # scripts/build-llama-server asks which variants this host needs, before any venv exists.
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
        print(" ".join(host_variants(cpuinfo_flags(cpuinfo.read()))))
