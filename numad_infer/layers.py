"""Every module of numa-infer, its layer and its job: the one map that the README's "Layout"
section is generated from (tools/layout_reference.py) and that tests/test_layers.py holds
the imports to.

Layers, lowest first; a module may import from its own layer and the ones below it:

- core: pure, no I/O: values in, values out, tested with tables of inputs;
- edge: talks to one thing outside the process (a file, /sys, /proc, systemctl, a socket,
  a syscall, a child process), small and replaceable;
- orchestration: decides what to do and when, using the two below: the loop, the
  commands.

Every import counts, also one inside a function and one under `if TYPE_CHECKING:`. A
function-level import only delays a dependency, it does not remove it; and a type from
a higher layer in a lower one means the lower one knows the higher one's shapes, which
is what the layering forbids (the guard is there for start-up time, not for direction).

Adding a module is one line in `MODULES` (the test fails until it is there). A key is the
module's path under numad_infer/ without `.py`, so a sub-package's modules are
`engines/llama_server` and `engines/__init__`.
"""

from __future__ import annotations

from dataclasses import dataclass

CORE, EDGE, ORCHESTRATION = "core", "edge", "orchestration"
ORDER = (CORE, EDGE, ORCHESTRATION)

MODULES: dict[str, tuple[str, str]] = {
    # -- core ---------------------------------------------------------------------------------
    "__init__": (CORE, "the version"),
    "allowed": (CORE, "what the instances' cgroup lets them use (cpuset, CPU quota) and the topology within it"),
    "addresses": (CORE, "where a local client reaches a listen address (wildcard -> loopback)"),
    "config": (CORE, "the schema of /etc/numa-infer.toml, parsing and validation"),
    "configref": (CORE, "the key reference (README, man page) generated from the schema"),
    "cpufeatures": (CORE, "which CPU kernels an engine runs (ggml variant, system_info) and the wide units it "
                          "leaves idle"),
    "cpuset": (CORE, "CPU lists: parse and format `0-3,8`"),
    "defaults": (CORE, "default paths, apart so `status` need not import the schema"),
    "doctor": (CORE, "`doctor`'s verdicts: host facts + the plan's needs -> ok/info/warn/fail checks, "
                     "each with its fix"),
    "drift": (CORE, "expected vs observed -> drift verdicts"),
    "engines/__init__": (CORE, "the engine registry with the built-in engines registered"),
    "engines/base": (CORE, "`Engine`: everything that differs between engines (argv, probe and key routes, key "
                           "variables, slots, own config keys, host check, metrics); the registry"),
    "engines/llama_cpp_python": (CORE, "llama-cpp-python's OpenAI server as an `Engine`"),
    "engines/llama_server": (CORE, "llama.cpp's llama-server as an `Engine`"),
    "errors": (CORE, "the one error hierarchy an operator sees (`NumaInferError`, `ConfigError`)"),
    "haproxycfg": (CORE, "haproxy.cfg from the plan"),
    "layers": (CORE, "this map: every module, its layer and its job"),
    "observed": (CORE, "what the monitor reads of a process (threads, memory per node) as types"),
    "planner": (CORE, "config + topology -> the plan; plan diffs; the reserved-core rule"),
    "render": (CORE, "the plan -> systemd unit text"),
    "states": (CORE, "the one lifecycle state machine of an instance"),
    "status": (CORE, "the typed status the daemon publishes and `status`/metrics read"),
    "tables": (CORE, "plain-text tables for every command's output"),
    "topology": (CORE, "the NUMA topology model and its builder"),
    "typedjson": (CORE, "JSON read back from a file -> typed dataclasses, every field checked"),
    "tune": (CORE, "tune's grid, layouts, the choice and its noise verdict, the report"),
    "unitnames": (CORE, "systemd unit and drop-in names, built and taken apart"),
    # -- edges --------------------------------------------------------------------------------
    "apikey": (EDGE, "the API key file"),
    "childlog": (EDGE, "a child's output (process backend): a log file, or stdout prefixed with its name"),
    "cgroups": (EDGE, "reads a cgroup's cpuset and CPU quota (the daemon's own, or the instances' slice)"),
    "atomicfile": (EDGE, "replace a file atomically (temp file + rename); read only a regular file, "
                         "never a link or FIFO"),
    "backends": (EDGE, "where instances run: systemd units or child processes, behind one `Backend`"),
    "bandwidth": (EDGE, "the memory read-bandwidth measurement"),
    "bandwidthfile": (EDGE, "the bandwidth tune measured, kept for the daemon"),
    "configedit": (EDGE, "`tune --apply`'s round-trip edit of the TOML file"),
    "frontdoor": (EDGE, "the daemon's handle on the running HAProxy: apply, observe, rotation"),
    "listener": (EDGE, "the front door's listening socket, held by the daemon across HAProxy's death and reloads, "
                       "handed to HAProxy's unit, kept in the daemon's file descriptor store"),
    "frontdoor_exec": (EDGE, "what HAProxy's unit runs: takes the daemon's socket, then executes HAProxy"),
    "ggufheader": (EDGE, "the GGUF header: tensor table (bytes a decoded token reads) and end-of-sequence ids"),
    "haproxy": (EDGE, "the HAProxy binary (version, `-c`) and its runtime API socket"),
    "health": (EDGE, "HTTP probe, API-key check, the engine's own counters"),
    "holds": (EDGE, "another process asks the daemon to keep an instance stopped"),
    "hostfacts": (EDGE, "reads what `doctor` judges (sysctls, THP, cpufreq, IRQs, swap, processes) from a root"),
    "hostcheck": (EDGE, "the host as the instances meet it: programs run with their privilege (an engine's "
                        "check), host warnings"),
    "identity": (EDGE, "the backend kind (asked once), who the instances and the front door run as: DynamicUser, "
                 "`server.user`, the packaged users"),
    "metrics": (EDGE, "the Prometheus endpoint"),
    "modelfile": (EDGE, "the model file: readable, GGUF, its size"),
    "notify": (EDGE, "sd_notify"),
    "pinning": (EDGE, "affinity and memory-policy syscalls"),
    "privdrop": (EDGE, "a child switched to another user with no capability, dying with the daemon"),
    "portowner": (EDGE, "whose process listens on an instance's port (before it gets the key or requests)"),
    "procfs": (EDGE, "/proc reader rooted at a directory"),
    "statefile": (EDGE, "the state file the daemon writes and the commands read"),
    "sysfs": (EDGE, "/sys reader rooted at a directory"),
    "systemctl": (EDGE, "systemctl calls and their parsed answers"),
    "unitdir": (EDGE, "writing units: atomic, only our own files, unit-name and directory-ownership checks"),
    # -- orchestration ------------------------------------------------------------------------
    "__main__": (ORCHESTRATION, "`python -m numad_infer`"),
    "checkup": (ORCHESTRATION, "`doctor`'s pipeline: the plan's needs, the host's facts, the engine's build, verdicts"),
    "cli": (ORCHESTRATION, "argument parsing and presentation"),
    "daemon": (ORCHESTRATION, "the loop: signals, passes, publishing, shutdown"),
    "driftchecks": (ORCHESTRATION, "one drift check per kind (affinity, memory), each with its own per-process "
                                   "state, registered in `CHECKS`"),
    "keycheck": (ORCHESTRATION, "does an instance take the configured API key (once per process)"),
    "loading": (ORCHESTRATION, "the one loading and validation pipeline: config, topology, runs-as, model, "
                               "engine, front door, key, plan"),
    "planstate": (ORCHESTRATION, "the plan the daemon runs: load, apply, reload, re-plan on hotplug; the "
                                 "reload bookkeeping status reports"),
    "reconcile": (ORCHESTRATION, "one pass: the coordinator of rollout, supervision and drift checks"),
    "rollout": (ORCHESTRATION, "apply a plan: start, stop, adopt; restarts one at a time behind the front door"),
    "runtime": (ORCHESTRATION, "what the daemon knows of one instance's current process"),
    "snapshot": (ORCHESTRATION, "what the daemon publishes each pass: runtimes -> status types, the status line"),
    "supervise": (ORCHESTRATION, "probe results and exits -> lifecycle transitions: restart, drain, hold, backoff"),
    "tuner": (ORCHESTRATION, "tune's measuring servers and fleet holds"),
}

README_BEGIN = "<!-- layout: generated by tools/layout_reference.py from numad_infer/layers.py; do not edit -->"
README_END = "<!-- end of layout -->"


@dataclass(frozen=True)
class Module:
    name: str
    layer: str
    job: str

    @property
    def rank(self) -> int:
        return ORDER.index(self.layer)


def modules() -> list[Module]:
    return [Module(name, layer, job) for name, (layer, job) in MODULES.items()]


def markdown() -> str:
    """The README's module table: layer by layer, lowest first, modules in alphabetical order."""
    lines = [README_BEGIN,
             "A module imports only from its own layer or a lower one: core (pure, no I/O) < edge (talks to one "
             "thing outside the process) < orchestration (decides what to do and when). `tests/test_layers.py` "
             "checks every import, also those inside functions and under `TYPE_CHECKING`.", "",
             "| layer | module (`numad_infer/`) | job |", "|---|---|---|"]
    for module in sorted(modules(), key=lambda m: (m.rank, m.name)):
        lines.append(f"| {module.layer} | `{module.name}.py` | {module.job} |")
    lines.append(README_END)
    return "\n".join(lines)
