"""A fake host as doctor reads it (good_host, changed by a Mutate), the config that serves a
tiny model on it, and doctor run on it: through the pipeline (doctor) or the CLI (run_cli)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from numad_infer.doctor.pipeline import checkup
from numad_infer.doctor.verdicts import Check, Neighbour
from numad_infer.host.identity import BackendKind
from numad_infer.validate.pipeline import load
from tests import fakesys
from tests.conftest import searchable_by_others

GGUF_HEADER = b"GGUF\x03\x00\x00\x00" + b"\x00" * 24  # 32 bytes: the model each node must hold
GOOD_FLAGS = "fpu sse2 avx avx2 avx512f"
Mutate = Callable[[Path], None]


def put(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def fake_process(root: Path, pid: int, argv: list[str]) -> None:
    put(root, f"proc/{pid}/comm", Path(argv[0]).name[:15])
    (root / f"proc/{pid}/cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")


def good_host(root: Path) -> None:
    """A dual-socket host set up as doctor wants it (what the tuned profile gives, plus irqbalance
    keeping IRQ 30 off the inference CPUs)."""
    fakesys.write_tree(root, fakesys.dual_socket_smt())
    put(root, "proc/sys/kernel/numa_balancing", "0")
    put(root, "sys/kernel/mm/transparent_hugepage/enabled", "[always] madvise never")
    put(root, "sys/kernel/mm/transparent_hugepage/defrag", "always defer defer+madvise [madvise] never")
    put(root, "proc/sys/vm/zone_reclaim_mode", "0")
    put(root, "proc/sys/vm/swappiness", "10")
    put(root, "proc/meminfo", "MemTotal: 536870912 kB\nSwapTotal: 0 kB\nSwapFree: 0 kB")
    for cpu in range(128):
        put(root, f"sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_governor", "performance")
        put(root, f"sys/devices/system/cpu/cpu{cpu}/cpufreq/energy_performance_preference", "performance")
        put(root, f"sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id", str(0 if cpu % 64 < 32 else 1))
    for node in (0, 1):
        put(root, f"sys/devices/system/node/node{node}/meminfo",
            f"Node {node} MemTotal: 268435456 kB\nNode {node} MemFree: 200000000 kB\nNode {node} FilePages: 1000 kB")
    # IRQ 30 lands on CPU 64 (an SMT sibling the plan leaves out: smt = false).
    put(root, "proc/irq/30/effective_affinity_list", "64")
    put(root, "proc/irq/30/smp_affinity_list", "0-127")
    (root / "proc/irq/30/eth0-rx-0").mkdir()
    put(root, "proc/interrupts", "           CPU0       CPU1\n  30:          0       5000   PCI-MSI eth0-rx-0\n")
    fake_process(root, 700, ["/usr/sbin/irqbalance", "--foreground"])
    put(root, "proc/cpuinfo", f"processor\t: 0\nflags\t\t: {GOOD_FLAGS}\n")


def fake_llama_server(directory: Path, variant: str | None) -> Path:
    """A stand-in llama-server: passes the engine's check, and `-lv 4 --list-devices` logs the
    libggml-cpu `variant` it loaded as a GGML_BACKEND_DL build does (None: a static build, no log)."""
    script = directory / "llama-server"
    listed = (f'echo "load_backend: loaded CPU backend from {directory}/libggml-cpu-{variant}.so" >&2'
              if variant is not None else "echo 'Available devices:'")
    script.write_text("#!/bin/sh\ncase \"$1\" in\n--version) echo 'version: 1 (fake)' ;;\n--help) echo '--api-key-file' ;;\n"
                      f"-lv) {listed} ;;\n*) exit 1 ;;\nesac\n")
    script.chmod(0o755)
    return script


def setup(tmp_path: Path, mutate: Mutate | None = None, variant: str | None = "skylakex",
          extra: str = "", model_extra: str = "") -> tuple[Path, Path]:
    """(config, fsroot) of the good host changed by `mutate`."""
    root = tmp_path / "fs"
    good_host(root)
    if mutate is not None:
        mutate(root)
    home = tmp_path / "home"
    home.mkdir()
    model = home / "tiny.gguf"
    model.write_bytes(GGUF_HEADER)
    model.chmod(0o644)
    server = fake_llama_server(home, variant)
    searchable_by_others(home)
    config = tmp_path / "numa-infer.toml"
    config.write_text(f'[model]\npath = "{model}"\n{model_extra}[server]\nengine = "llama-server"\nllama_server = "{server}"\n'
                      f'[tuning]\nunit_dir = "{tmp_path / "units"}"\n{extra}')
    return config, root


def doctor(tmp_path: Path, mutate: Mutate | None = None, neighbours: tuple[Neighbour, ...] = (),
           variant: str | None = "skylakex", extra: str = "", model_extra: str = "") -> dict[str, Check]:
    config, root = setup(tmp_path, mutate, variant, extra, model_extra)
    loaded = load(str(config), BackendKind.PROCESS, str(root))
    return {c.name: c for c in checkup(loaded, root, None, 0.0, sampler=lambda seconds: neighbours)}


def run_cli(config: Path, root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "numad_infer", "--config", str(config), "--fsroot", str(root),
                           "--state-file", str(config.parent / "no-state.json"), "doctor", "--sample", "0.1", *extra],
                          capture_output=True, text=True, timeout=120)
