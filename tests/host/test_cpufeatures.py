"""numad_infer.host.cpufeatures and Engine.cpu: which CPU kernels an engine runs, and the verdict
(`check`'s warning, `doctor`'s check) when it leaves AVX2/AVX-512/AMX idle: wide units idle cost up to
1.76x in prompt processing."""

from __future__ import annotations

from pathlib import Path

import pytest

from numad_infer.host.cpufeatures import (
    VARIANT_FEATURES,
    EngineCpu,
    cpuinfo_flags,
    from_backend_log,
    from_system_info,
    host_variants,
    idle_units,
)

# What llama-server (GGML_BACKEND_DL build) logs before anything else.
LOG = """load_backend: loaded CPU backend from /opt/llama/libggml-cpu-icelake.so
version: 0.5.0-dev (build 1, commit 0c1e570)
"""


def test_the_loaded_variant_and_its_features_come_from_the_backend_log() -> None:
    cpu = from_backend_log(LOG)
    assert cpu == EngineCpu("icelake", VARIANT_FEATURES["icelake"])
    assert cpu.describe() == "icelake (AVX2+AVX512+AVX512_VNNI)"
    assert from_backend_log("version: 0.5.0-dev (build 1)\n") is None  # a static build names none


def test_a_single_backend_build_is_read_from_its_system_info() -> None:
    cpu = from_system_info("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 0 | AMX_INT8 = 0 | REPACK = 1 | ")
    assert cpu is not None and cpu.variant is None
    assert {"AVX", "AVX2", "REPACK"} <= cpu.features and "AVX512" not in cpu.features
    assert cpu.describe() == "AVX2"


@pytest.mark.parametrize("flags, engine, idle", [
    ("fpu avx2 avx512f avx512bw amx_tile amx_int8", "haswell", ("AMX_INT8", "AVX512")),
    ("fpu avx2 avx512f avx512bw amx_tile amx_int8", "icelake", ("AMX_INT8",)),
    ("fpu avx2 avx512f avx512bw amx_tile amx_int8", "sapphirerapids", ()),
    ("fpu avx2 avx512f avx512bw", "zen4", ()),
    ("fpu avx2", "haswell", ()),  # an AVX2-only CPU (or an OS without AVX-512 state): nothing idle
    ("fpu avx2", "sse42", ("AVX2",)),
    ("fpu sse4_2 avx", "sse42", ()),  # no wide unit on the CPU: nothing to leave idle
    ("fpu avx2 avx512f amx_int8", "skylakex", ()),  # AMX needs its tiles too
])
def test_idle_units_are_the_wide_ones_the_cpu_has_and_the_engine_does_not_use(flags: str, engine: str,
                                                                              idle: tuple[str, ...]) -> None:
    host = cpuinfo_flags(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert idle_units(host, EngineCpu(engine, VARIANT_FEATURES[engine])) == idle


def test_llama_cpp_python_reports_what_its_libggml_cpu_was_compiled_for() -> None:
    # The real wheel of this venv (scripts/setup builds it with AVX2 flags).
    pytest.importorskip("llama_cpp")
    import sys

    from numad_infer.config.load import parse_config
    from numad_infer.engines import engine_of
    from numad_infer.validate.host_check import InstanceHost

    config = parse_config(f'[model]\npath = "/m.gguf"\n[server]\nengine = "llama-cpp-python"\npython = "{sys.executable}"\n', "/etc/x.toml")
    report = engine_of(config).cpu(config, InstanceHost(None))
    cpu = report.cpu
    assert cpu is not None and cpu.variant is None and "AVX2" in cpu.features, report
    assert sys.executable in report.source


def test_an_engine_that_cannot_tell_says_why(tmp_path: Path) -> None:
    """doctor shows the reason; `check` stays silent rather than guess."""
    from numad_infer.config.load import parse_config
    from numad_infer.engines import engine_of
    from numad_infer.validate.host_check import InstanceHost

    static = tmp_path / "llama-server"  # a static build: --list-devices names no variant
    static.write_text("#!/bin/sh\necho 'Available devices:'\n")
    static.chmod(0o755)
    config = parse_config(f'[model]\npath = "/m.gguf"\n[server]\nengine = "llama-server"\nllama_server = "{static}"\n',
                          "/etc/x.toml")
    report = engine_of(config).cpu(config, InstanceHost(None))
    assert report.cpu is None and "named no libggml-cpu variant" in report.source and str(static) in report.source
    assert "scripts/build-llama-server" in report.fix
    config = parse_config(f'[model]\npath = "/m.gguf"\n[server]\nengine = "llama-cpp-python"\npython = "{tmp_path / "absent"}"\n', "/etc/x.toml")
    report = engine_of(config).cpu(config, InstanceHost(None))
    assert report.cpu is None and "cannot load llama_cpp" in report.source


def test_llama_server_names_the_variant_it_loaded_on_this_host() -> None:
    # scripts/build-llama-server's build on this machine: a variant this CPU and OS can run
    # (cpuid and XCR0 both), never one that would die with SIGILL.
    from numad_infer.config.load import parse_config
    from numad_infer.engines import engine_of
    from numad_infer.validate.host_check import InstanceHost
    from tests.daemon_harness import llama_server_binary

    binary = llama_server_binary()
    config = parse_config(f'[model]\npath = "/m.gguf"\n[server]\nengine = "llama-server"\nllama_server = "{binary}"\n',
                          "/etc/x.toml")
    report = engine_of(config).cpu(config, InstanceHost(None))
    cpu = report.cpu
    assert cpu is not None and cpu.variant in VARIANT_FEATURES, report
    host = cpuinfo_flags(Path("/proc/cpuinfo").read_text())
    # Every wide unit the variant uses is one the OS enabled (cpuinfo lists only those).
    needs = {"AVX2": "avx2", "AVX512": "avx512f", "AVX512_VNNI": "avx512_vnni", "AMX_INT8": "amx_int8"}
    assert all(needs[f] in host for f in cpu.features if f in needs), (cpu, sorted(host))
    assert not idle_units(host, cpu)  # the best variant for this host: nothing wide left idle


@pytest.mark.parametrize(("flags", "wanted"), [
    ("sse2", ("x64",)),
    ("sse4_2 avx f16c fma avx2 bmi2", ("x64", "haswell")),  # this EPYC host, and the TCG guest at best
    ("sse4_2 avx f16c fma avx2 bmi2 avx512f avx512_vnni", ("x64", "cascadelake")),
    ("sse4_2 avx f16c fma avx2 bmi2 avx512f avx512vbmi avx512_vnni avx512_bf16", ("x64", "zen4")),
    # Sapphire Rapids: cpuinfo lists amx_* even where the kernel keeps tile data out of XCR0,
    # and the patched ggml then loads the best variant without AMX: that one is built too.
    ("sse4_2 avx f16c fma avx2 bmi2 avx512f avx512vbmi avx512_vnni avx512_bf16 amx_tile amx_int8",
     ("x64", "sapphirerapids", "zen4")),
])
def test_a_build_for_this_host_holds_x64_and_the_variant_this_cpu_loads(flags: str, wanted: tuple[str, ...]) -> None:
    # scripts/build-llama-server's default variant list (NUMA_INFER_CPU_VARIANTS=host).
    assert host_variants(frozenset(flags.split())) == wanted


def test_a_wider_variant_built_but_not_loaded_is_declined_by_the_host_not_idle() -> None:
    """A Xeon whose hypervisor lists AMX and faults at the first tile instruction: ggml
    (patched) loads zen4 although sapphirerapids sits beside it. AMX is then not the
    engine's to use, and no rebuild would help: no idle-unit warning."""
    from numad_infer.host.cpufeatures import declined_by

    host = frozenset("sse4_2 avx f16c fma avx2 bmi2 avx512f avx512vbmi avx512_vnni avx512_bf16 amx_tile amx_int8".split())
    loaded = EngineCpu("zen4", VARIANT_FEATURES["zen4"])
    assert idle_units(host, loaded) == ("AMX_INT8",)
    declined = declined_by(loaded, ["x64", "zen4", "sapphirerapids"])
    assert declined.declined == {"AMX_INT8"} and idle_units(host, declined) == ()
    # Built without the AMX variant: the build leaves AMX idle, and a rebuild is the fix.
    assert idle_units(host, declined_by(loaded, ["x64", "zen4"])) == ("AMX_INT8",)


def test_a_variant_line_lost_by_the_engines_log_thread_is_asked_for_again(tmp_path: Path) -> None:
    """llama-server's log thread may lose the line when `--list-devices` exits at once (seen
    under load): the check asks again, and keeps only the answer that names the variant."""
    from numad_infer.config.load import parse_config
    from numad_infer.engines import engine_of
    from numad_infer.validate.host_check import InstanceHost

    runs = tmp_path / "runs"
    flaky = tmp_path / "llama-server"  # the line on the third run only
    flaky.write_text(f"#!/bin/sh\necho x >> {runs}\n[ $(wc -l < {runs}) -ge 3 ] && "
                     f"echo 'load_backend: loaded CPU backend from {tmp_path}/libggml-cpu-haswell.so' >&2\nexit 0\n")
    flaky.chmod(0o755)
    config = parse_config(f'[model]\npath = "/m.gguf"\n[server]\nengine = "llama-server"\nllama_server = "{flaky}"\n',
                          "/etc/x.toml")
    report = engine_of(config).cpu(config, InstanceHost(None))
    assert report.cpu is not None and report.cpu.variant == "haswell", report
    assert runs.read_text().count("x") == 3
    engine_of(config).cpu(config, InstanceHost(None))
    assert runs.read_text().count("x") == 3  # kept once it named one
