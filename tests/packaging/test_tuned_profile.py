"""packaging/tuned/numa-infer/tuned.conf, read by tuned's own profile loader (Debian's
`tuned` package), and what it sets judged by `doctor`'s checks.

tuned's daemon cannot run here (no systemd as PID 1, no D-Bus), so `tuned-adm verify`
cannot either: the test loads the profile with the classes the daemon uses
(tuned.profiles.Locator/Loader/Merger, the include of throughput-performance resolved
from /usr/lib/tuned) under the interpreter tuned is installed for, and checks every
option against its plugin's own option list, as the daemon does at start.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from numad_infer.doctor.verdicts import (
    HostFacts,
    Level,
    Needs,
    check_numa_balancing,
    check_swap,
    check_thp,
    check_zone_reclaim,
)
from numad_infer.host.cpufeatures import EngineCpuReport

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "packaging/tuned"
TUNED = Path("/usr/lib/python3/dist-packages/tuned")

# Run by tuned's interpreter: load the profile as tuned's daemon does and print its units.
_LOAD = """
import importlib, json, sys
from tuned import profiles
from tuned.utils.global_config import GlobalConfig
loader = profiles.Loader(profiles.Locator(["/usr/lib/tuned", sys.argv[1]]), profiles.Factory(), profiles.Merger(),
                         GlobalConfig(), profiles.variables.Variables())
profile = loader.load([sys.argv[2]])
units, unknown = {}, []
for name, unit in profile.units.items():
    module = importlib.import_module("tuned.plugins.plugin_" + unit.type)
    (plugin,) = [v for k, v in vars(module).items() if k.endswith("Plugin") and k != "Plugin" and isinstance(v, type)
                 and v.__module__ == module.__name__]
    known = plugin._get_config_options()
    # The sysctl plugin takes any key (its "dynamic options"); the others only their own.
    if unit.type != "sysctl":
        unknown += [name + "." + k for k in unit.options if k not in known]
    units[name] = {"type": unit.type, "options": dict(unit.options)}
print(json.dumps({"name": profile.name, "units": units, "unknown": unknown}))
"""


@pytest.fixture(scope="module")
def profile() -> dict:
    if not TUNED.is_dir():
        pytest.skip("Debian's tuned is not installed (scripts/setup installs it)")
    return _load("numa-infer")


def _load(name: str) -> dict:
    if not TUNED.is_dir():
        pytest.skip("Debian's tuned is not installed (scripts/setup installs it)")
    done = subprocess.run(["/usr/bin/python3", "-c", _LOAD, str(PROFILES), name], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_tuned_loads_the_profile_with_throughput_performance_included(profile: dict) -> None:
    assert profile["name"] == "numa-infer"
    cpu = profile["units"]["cpu"]["options"]
    # From throughput-performance (the include), merged with our own [cpu].
    assert cpu["governor"] == "performance" and cpu["energy_perf_bias"] == "performance"
    assert cpu["energy_performance_preference"] == "performance"


def test_every_option_is_one_its_tuned_plugin_knows(profile: dict) -> None:
    assert profile["unknown"] == []


def test_what_the_profile_sets_is_what_doctor_wants(profile: dict) -> None:
    sysctl = profile["units"]["sysctl"]["options"]
    vm = profile["units"]["vm"]["options"]
    facts = HostFacts(numa_balancing=int(sysctl["kernel.numa_balancing"]), thp_enabled=vm["transparent_hugepages"],
                      thp_defrag="madvise", cpufreq={}, zone_reclaim_mode=int(sysctl["vm.zone_reclaim_mode"]),
                      swap_total_bytes=2**33, swappiness=int(sysctl["vm.swappiness"]), nodes={}, irqs=(),
                      irqbalance=True, neighbours=(), sample_s=1.0, managers=(), cpu_flags=frozenset(),
                      engine_cpu=EngineCpuReport(None, "", ""), nodes_per_package={})
    plan = Needs(frozenset({1}), frozenset({0, 1}), {}, "model.gguf", mlock=False, engine="llama-server")
    checks = [check_numa_balancing(facts), *check_thp(facts), check_zone_reclaim(facts), check_swap(facts, plan)]
    assert [(c.name, c.level) for c in checks if c.level != Level.OK] == []


def test_the_deb_installs_the_profile_where_tuned_looks_and_suggests_tuned() -> None:
    install = (ROOT / "debian/numa-infer.install").read_text().split("\n")
    assert "packaging/tuned/numa-infer/tuned.conf usr/lib/tuned/numa-infer/" in install
    control = (ROOT / "debian/control").read_text()
    assert "tuned" in control[control.index("Suggests:"):].split("\nDescription:")[0]


def test_the_madvise_variant_is_the_profile_but_thp_and_doctor_says_what_it_costs() -> None:
    shared = _load("numa-infer-madvise")
    assert shared["name"] == "numa-infer-madvise" and shared["unknown"] == []
    assert shared["units"]["vm"]["options"]["transparent_hugepages"] == "madvise"
    full = _load("numa-infer")
    assert shared["units"]["sysctl"] == full["units"]["sysctl"]  # everything else as numa-infer
    assert shared["units"]["cpu"] == full["units"]["cpu"]
    sysctl = shared["units"]["sysctl"]["options"]
    facts = HostFacts(numa_balancing=int(sysctl["kernel.numa_balancing"]),
                      thp_enabled=shared["units"]["vm"]["options"]["transparent_hugepages"], thp_defrag="madvise",
                      cpufreq={}, zone_reclaim_mode=int(sysctl["vm.zone_reclaim_mode"]), swap_total_bytes=2**33,
                      swappiness=int(sysctl["vm.swappiness"]), nodes={}, irqs=(), irqbalance=True, neighbours=(),
                      sample_s=1.0, managers=(), cpu_flags=frozenset(), engine_cpu=EngineCpuReport(None, "", ""),
                      nodes_per_package={})
    # The cost the profile's comment states: doctor warns that the weights get 4 KiB pages.
    assert [(c.name, c.level) for c in check_thp(facts) if c.level != Level.OK] == [(check_thp(facts)[0].name,
                                                                                     Level.WARN)]
    install = (ROOT / "debian/numa-infer.install").read_text().split("\n")
    assert "packaging/tuned/numa-infer-madvise/tuned.conf usr/lib/tuned/numa-infer-madvise/" in install
