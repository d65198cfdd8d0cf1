"""Every module of numa-infer: its package, its layer and its job. The one map that
CONTRIBUTING.md's "Layout" section is generated from (tools/layout_reference.py) and that
tests/test_layers.py holds the imports to.

A feature is a folder: `PACKAGES` lists them, lowest first, and a module imports only
from its own package and the ones before it (the top level's version, errors and this
map come first; the entry points `__main__` and `frontdoor_exec` last). No two modules
import each other, directly or around a circle.

Within and across packages, every module also has a layer; a module may import from its
own layer and the ones below it:

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
module's path under numad_infer/ without `.py`: `config/schema`, `engines/__init__`.
"""

from __future__ import annotations

from dataclasses import dataclass

CORE, EDGE, ORCHESTRATION = "core", "edge", "orchestration"
ORDER = (CORE, EDGE, ORCHESTRATION)

# The packages, lowest first, with what each holds ("" is the top level).
PACKAGES: tuple[tuple[str, str], ...] = (
    ("", "the version, the error hierarchy, this map"),
    ("util", "small helpers every package uses: CPU lists, tables, typed JSON, addresses, atomic files, "
              "calls to peers"),
    ("config", "the TOML file: its schema, defaults, key reference and the API key file it names"),
    ("systemd", "systemd's interfaces: sd_notify, systemctl, unit names, the unit directory"),
    ("topology", "the machine's NUMA topology and the part of it the cgroup allows (sysfs, cgroups)"),
    ("plan", "config + topology -> the plan: instances, cores, memory policy, ports"),
    ("host", "the running host: /proc, CPU features, pinning syscalls, users, port owners"),
    ("model", "the model file: readable, GGUF, its header; what an instance of it holds in memory"),
    ("engines", "the inference servers numa-infer runs: one `Engine` per program"),
    ("frontdoor", "HAProxy in front of the instances: its config, binary, runtime API, listening socket"),
    ("units", "the plan rendered as systemd unit text: the instances' template and drop-ins, the front door's unit"),
    ("validate", "the one validation pipeline: config, host, model, engine, key, plan"),
    ("backends", "where the instances run: systemd units or child processes"),
    ("lifecycle", "an instance's lifecycle: states, transitions, drift verdicts"),
    ("status", "what the daemon publishes: status records, the state file, Prometheus metrics"),
    ("supervision", "one reconcile pass: health, drift checks, restarts, roll-outs"),
    ("doctor", "`numa-infer doctor`: host facts, verdicts, the pipeline"),
    ("tune", "`numa-infer tune`: measure layouts, choose one, apply it"),
    ("daemon", "the daemon's loop: the desired plan, reloads, publishing"),
    ("cli", "the `numa-infer` command"),
)
ENTRY_POINTS = ("__main__", "frontdoor_exec")  # run by name; may import from any package
PACKAGE_INIT = "the package (its docstring says what it holds)"

MODULES: dict[str, tuple[str, str]] = {
    # -- top level ---------------------------------------------------------------------------------
    "__init__": (CORE, "the version"),
    "errors": (CORE, "the one error hierarchy an operator sees (`NumaInferError`, `ConfigError`)"),
    "layers": (CORE, "this map: every module, its layer and its job"),
    # -- util --------------------------------------------------------------------------------------
    "util/__init__": (CORE, PACKAGE_INIT),
    "util/addresses": (CORE, "where a local client reaches a listen address (wildcard -> loopback)"),
    "util/cpuset": (CORE, "CPU lists: parse and format `0-3,8`"),
    "util/tables": (CORE, "plain-text tables for every command's output"),
    "util/histogram": (CORE, "Prometheus-style histograms: the request timings the front door logs"),
    "util/printable": (CORE, "text others named (threads, paths, /proc, peers' answers) escaped for a terminal or a "
                             "log line; the log formatter that escapes every record"),
    "util/typedjson": (CORE, "JSON read back from a file -> typed dataclasses, every field checked"),
    "util/atomicfile": (EDGE, "replace a file atomically (temp file + rename); read only a regular file, never a link"
                              " or FIFO"),
    "util/peer": (EDGE, "one call to a peer over a socket (an HTTP GET, a line command): one deadline for all of"
                        " it, a cap on the answer"),
    "util/runlock": (EDGE, "one daemon per state file: an exclusive flock on `<state file>.lock`, close-on-exec"),
    "util/fsroot": (EDGE, "files read inside a filesystem root (/ or --fsroot): links only within it, regular files"
                          " only, bounded"),
    # -- config ------------------------------------------------------------------------------------
    "config/__init__": (CORE, PACKAGE_INIT),
    "config/defaults": (CORE, "default paths, apart so `status` need not import the schema"),
    "config/reference": (CORE, "the key reference (the man page) generated from the schema"),
    "config/example": (CORE, "the shipped etc/numa-infer.toml generated from the schema: the everyday keys, its "
                             "description, its default or the listed override and why"),
    "config/frontend": (CORE, "the [frontend] table: the front door's address, queue, timeouts, affinity, limits"),
    "config/tuning": (CORE, "the [tuning] table: knobs an operator should not need, and where each used to be"),
    "config/tenants": (CORE, "a [[tenants]] table: a front-door client's key file, limits and models"),
    "config/model_tables": (CORE, "one [[models]] table: the model's file, names, placement and engine keys"),
    "config/models": (CORE, "the served models, each with its view of the configuration; checks across tables"),
    "config/load": (CORE, "TOML text -> a validated `Config`, each error one line naming the file, key and fix"),
    "config/schema": (CORE, "the schema of /etc/numa-infer.toml, table by table, and `Config`"),
    "config/server": (CORE, "the [server] table: engine, program, ports, slots, user, key file, extra arguments"),
    "config/values": (CORE, "the value types the tables share (safe text, nodes, threads, paths, addresses) "
                            "and the base of every table"),
    "config/apikey": (EDGE, "the API key file"),
    # -- systemd -----------------------------------------------------------------------------------
    "systemd/__init__": (CORE, PACKAGE_INIT),
    "systemd/unitnames": (CORE, "systemd unit and drop-in names, built and taken apart"),
    "systemd/notify": (EDGE, "sd_notify"),
    "systemd/systemctl": (EDGE, "systemctl calls and their parsed answers"),
    "systemd/unitdir": (EDGE, "writing units: atomic, only our own files, unit-name and directory-ownership checks"),
    # -- topology ----------------------------------------------------------------------------------
    "topology/__init__": (CORE, PACKAGE_INIT),
    "topology/cgroup_limits": (CORE, "what the instances' cgroup lets them use (cpuset, CPU quota) and the topology "
                                     "within it"),
    "topology/model": (CORE, "the NUMA topology model and its builder"),
    "topology/cgroups": (EDGE, "reads a cgroup's cpuset and CPU quota (the daemon's own, or the instances' slice)"),
    "topology/sysfs": (EDGE, "/sys reader rooted at a directory"),
    # -- plan --------------------------------------------------------------------------------------
    "plan/__init__": (CORE, PACKAGE_INIT),
    "plan/model": (CORE, "the plan's data: instances (CPUs, memory, policy, port, threads), the plan, plan diffs"),
    "plan/memory_fit": (CORE, "do the instances fit in their nodes' memory: per node, the sum of what each "
                               "instance bound there holds against the node's memory less a reserve"),
    "plan/placement": (CORE, "config + topology -> the plan: nodes, cores, instances, threads; the reserved-core rule"),
    "plan/multi": (CORE, "several models on a node: its cores split between their instances, along L3"),
    "plan/ports": (CORE, "the plan's ports: base_port + k, the front door's and metrics' apart, exposure warnings"),
    # -- host --------------------------------------------------------------------------------------
    "host/__init__": (CORE, PACKAGE_INIT),
    "host/cpufeatures": (CORE, "which CPU kernels an engine runs (ggml variant, system_info) and the wide units it "
                               "leaves idle"),
    "host/proc_types": (CORE, "what the monitor reads of a process (threads, memory per node) as types"),
    "host/identity": (EDGE, "the backend kind (asked once), who the instances and the front door run as: DynamicUser,"
                            " `server.user`, the packaged users"),
    "host/pinning": (EDGE, "affinity and memory-policy syscalls"),
    "host/portowner": (EDGE, "whose process listens on an instance's port (before it gets the key or requests)"),
    "host/privdrop": (EDGE, "a child switched to another user with no capability, dying with the daemon"),
    "host/procfs": (EDGE, "/proc reader rooted at a directory"),
    # -- model -------------------------------------------------------------------------------------
    "model/__init__": (CORE, PACKAGE_INIT),
    "model/identity": (CORE, "which file a path named when it was read (device, inode, size, times): the one "
                             "identity the roll-out's artifact id and the kept prompt caches compare"),
    "model/ggml": (CORE, "ggml's data types: bytes per block by type id, the KV cache's type names"),
    "model/memory": (CORE, "what one instance holds once loaded: weights, KV cache (from the header's "
                           "dimensions), the engine's measured overhead"),
    "model/file": (EDGE, "the model file, opened once: a readable regular file, GGUF, whole; its size and identity"),
    "model/gguf": (EDGE, "the GGUF header, every length bounded: tensor table (bytes a decoded token reads, "
                         "weights), end-of-sequence ids, the dimensions that size the KV cache"),
    # -- engines -----------------------------------------------------------------------------------
    "engines/__init__": (CORE, "the engine registry with the built-in engines registered"),
    "engines/base": (CORE, "`Engine`: everything that differs between engines (argv, probe and key routes, key "
                           "variables, slots, own config keys, host check, metrics); the registry"),
    "engines/llama_cpp_python": (CORE, "llama-cpp-python's OpenAI server as an `Engine`"),
    "engines/keys": (CORE, "a configuration's engine keys checked against the registry: name, key flags, other "
                           "engines' keys"),
    "engines/llama_server": (CORE, "llama.cpp's llama-server as an `Engine`"),
    "engines/slot_names": (CORE, "where an instance's saved prompt caches live: its directory, its slots' files"),
    "engines/slot_cache": (EDGE, "llama-server's slot routes: /slots, save, restore, erase, a probe that reports "
                                 "cached tokens"),
    "engines/launch": (CORE, "each instance's launch (argv, unit argv, OpenMP environment), worked out once by "
                       "validation"),
    # -- frontdoor ---------------------------------------------------------------------------------
    "frontdoor/__init__": (CORE, PACKAGE_INIT),
    "frontdoor/spare": (EDGE, "each model's spare server: where a surge's copy serves while the only instance "
                              "restarts"),
    "frontdoor/routing": (CORE, "several models behind one front door: a backend per model, routing by the "
                                "body's `model`, GET /v1/models"),
    "frontdoor/affinity": (CORE, "which instance of a model a request goes to: least busy, a stick table, or a "
                                 "hash of the prompt's start within a load bound (a Lua fetch)"),
    "frontdoor/haproxy_config": (CORE, "haproxy.cfg from the plan"),
    "frontdoor/phases": (CORE, "haproxy.cfg as data: each section's phases in the order a request meets them, "
                              "the rules each feature gives them, one renderer"),
    "frontdoor/answers": (CORE, "every answer HAProxy gives itself: JSON bodies, statuses, Retry-After, "
                               "their lines"),
    "frontdoor/names": (CORE, "every txn.* variable, stick table and Lua entry point the rules and the Lua "
                             "share; the Lua's names in its data file"),
    "frontdoor/api_paths": (CORE, "the paths the front door forwards (the inference API); any other is a 404"),
    "frontdoor/client_limits": (CORE, "what a client without a request holds: its headers' wait, a cap per address"),
    "frontdoor/reload_watch": (CORE, "whether HAProxy took the reload asked for (another worker answers)"),
    "frontdoor/hold": (CORE, "requests for a model with no instance in rotation wait for one (HAProxy Lua action)"),
    "frontdoor/batch_wait": (CORE, "a batch request's own queue deadline: it waits for room before the queue "
                                   "(HAProxy Lua action)"),
    "frontdoor/token_count": (CORE, "an answer's token counts as the engine reported them, for each tenant's usage "
                              "(HAProxy Lua filter)"),
    "frontdoor/lua": (CORE, "the Lua HAProxy runs, the package's .lua files (lua/: the hold, the prefix pick, the "
                      "batch wait, the token counts) written as they are, and the data file of names and limits"),
    "frontdoor/tenants": (CORE, "tenants at the front door: keys, limits and models as HAProxy rules and key files"),
    "frontdoor/abandoned": (CORE, "requests whose client has left: which of HAProxy's streams to end"),
    "frontdoor/abandon_watch": (EDGE, "twice a second: half-closed client connections (/proc/net/tcp), their streams "
                                      "ended through the runtime API"),
    "frontdoor/control": (EDGE, "the daemon's handle on the running HAProxy: apply, observe, rotation"),
    "frontdoor/handover": (EDGE, "what HAProxy's unit runs: takes the daemon's socket, then executes HAProxy"),
    "frontdoor/checked_config": (EDGE, "haproxy.cfg rendered once per plan for the front door's directory, and "
                                        "`haproxy -c` on exactly that text (stand-in sockets)"),
    "frontdoor/haproxy": (EDGE, "the HAProxy binary (version, `-c`) and its runtime API socket"),
    "frontdoor/request_log": (EDGE, "HAProxy's timing line per request, received by the daemon: time to first "
                                    "token and duration per instance"),
    "frontdoor/listener": (EDGE, "the front door's listening sockets (its address, the loopback twin), held by the "
                                 "daemon across HAProxy's death and reloads, taken from numa-infer-port.socket or "
                                 "bound, handed to HAProxy's unit, kept in the daemon's file descriptor store"),
    # -- units --------------------------------------------------------------------------------------
    "units/__init__": (CORE, PACKAGE_INIT),
    "units/render": (CORE, "the plan -> systemd unit text"),
    # -- validate ----------------------------------------------------------------------------------
    "validate/__init__": (CORE, PACKAGE_INIT),
    "validate/loaded": (EDGE, "`Loaded`: the one validated value (config, plan, engine, users, key, units) that "
                              "the rollout, backends and tune take (pure data; edge for identity's types)"),
    "validate/host_check": (EDGE, "the host as the instances meet it: programs run with their privilege (an engine's "
                                  "check), host warnings"),
    "validate/pipeline": (ORCHESTRATION, "the one loading and validation pipeline: config, topology, runs-as, model, "
                                         "engine, front door, key, plan"),
    # -- backends ----------------------------------------------------------------------------------
    "backends/__init__": (CORE, PACKAGE_INIT),
    "backends/base": (EDGE, "the `Backend` interface the reconcile loop drives, and `Observation`, what it reads "
                            "back"),
    "backends/systemd": (EDGE, "the systemd backend: instances as units through systemctl; HAProxy's unit, the "
                               "daemon holding and handing out its socket"),
    "backends/process": (EDGE, "the process backend: instances as the daemon's children, pinned between fork and "
                               "exec, with their environment; HAProxy as a child in master-worker mode"),
    "backends/childlog": (EDGE, "a child's output (process backend): a log file, or stdout prefixed with its name"),
    "backends/portunit": (EDGE, "numa-infer-port.socket, which holds the front door's port from boot: its drop-in "
                                "kept in step with frontend.listen, the daemon's own socket handed back on a stop"),
    # -- lifecycle ---------------------------------------------------------------------------------
    "lifecycle/__init__": (CORE, PACKAGE_INIT),
    "lifecycle/drift": (CORE, "expected vs observed -> drift verdicts"),
    "lifecycle/states": (CORE, "the one lifecycle state machine of an instance"),
    "lifecycle/surge": (CORE, "a surge's rules: surge or hold for a restart (`choose`), its phases and the moves "
                              "between them"),
    # -- status ------------------------------------------------------------------------------------
    "status/__init__": (CORE, PACKAGE_INIT),
    "status/records": (CORE, "the typed status the daemon publishes and `status`/metrics read"),
    "status/verdicts": (CORE, "the status line, made from the status with the verdicts the tables use"),
    "status/metrics": (EDGE, "the Prometheus endpoint"),
    "status/httpserver": (EDGE, "the metrics endpoint's HTTP server: one thread, connections capped, deadlines"),
    "status/statefile": (EDGE, "the state file the daemon writes and the commands read"),
    # -- supervision -------------------------------------------------------------------------------
    "supervision/__init__": (CORE, PACKAGE_INIT),
    "supervision/health": (EDGE, "HTTP probe, API-key check, the engine's own counters"),
    "supervision/kept_slots": (CORE, "prompt caches kept across a restart: which slots to save, which files a new "
                                     "process may restore, whether a restore counts"),
    "supervision/slot_keeper": (ORCHESTRATION, "save each slot holding a prompt before a restart; restore and "
                                               "verify it by a probe after, or serve cold"),
    "supervision/holds": (EDGE, "another process asks the daemon to keep an instance stopped"),
    "supervision/restart_request": (EDGE, "`numa-infer restart` asks the daemon to roll instances: the request file"),
    "supervision/drift_checks": (ORCHESTRATION, "one drift check per kind (affinity, memory), each with its own per-"
                                                "process state, registered in `CHECKS`"),
    "supervision/instance": (ORCHESTRATION, "what the daemon knows of one instance's current process"),
    "supervision/keycheck": (ORCHESTRATION, "does an instance take the configured API key (once per process)"),
    "supervision/reconcile": (ORCHESTRATION, "one pass: the coordinator of rollout, supervision and drift checks"),
    "supervision/rollout": (ORCHESTRATION, "apply a plan: start, stop, adopt; restarts one at a time behind the front"
                                           " door"),
    "supervision/surge": (ORCHESTRATION, "surge or hold: a copy of a model's only instance serves while it restarts, "
                                         "or its requests wait"),
    "supervision/supervisor": (ORCHESTRATION, "probe results and exits -> lifecycle transitions: restart, drain, "
                                              "hold, backoff"),
    # -- doctor ------------------------------------------------------------------------------------
    "doctor/__init__": (CORE, PACKAGE_INIT),
    "doctor/verdicts": (CORE, "`doctor`'s verdicts: host facts + the plan's needs -> ok/info/warn/fail checks, each "
                              "with its fix"),
    "doctor/host_facts": (EDGE, "reads what `doctor` judges (sysctls, THP, cpufreq, IRQs, swap, processes) from a "
                                "root"),
    "doctor/pipeline": (ORCHESTRATION, "`doctor`'s pipeline: the plan's needs, the host's facts, the engine's build, "
                                       "verdicts"),
    # -- tune --------------------------------------------------------------------------------------
    "tune/__init__": (CORE, PACKAGE_INIT),
    "tune/choice": (CORE, "tune's grid, layouts, the choice and its noise verdict, the report"),
    "tune/bandwidth": (EDGE, "the memory read-bandwidth measurement"),
    "tune/bandwidth_file": (EDGE, "the bandwidth tune measured, kept for the daemon"),
    "tune/config_edit": (EDGE, "`tune --apply`'s round-trip edit of the TOML file"),
    "tune/errors": (CORE, "tune's one error: a measurement that could not be made"),
    "tune/client": (EDGE, "the HTTP client that times completions against one measuring server"),
    "tune/measure": (ORCHESTRATION, "the measurer: tune's measuring servers, timed, and the bandwidth matrix"),
    "tune/fleet": (ORCHESTRATION, "holding the daemon's instances while tune measures, and releasing them"),
    "tune/run": (ORCHESTRATION, "the flow of `numa-infer tune` and `--apply`"),
    # -- daemon ------------------------------------------------------------------------------------
    "daemon/__init__": (CORE, PACKAGE_INIT),
    "daemon/desired": (ORCHESTRATION, "the plan the daemon runs: load, apply, reload, re-plan on hotplug (a failed "
                                      "one keeps the running plan); the reload bookkeeping status reports"),
    "daemon/restarts": (ORCHESTRATION, "`numa-infer restart` on the daemon's side: take the request, start the roll, "
                                       "report how far it is"),
    "daemon/loop": (ORCHESTRATION, "the loop: signals, passes, publishing, shutdown"),
    "daemon/publish": (ORCHESTRATION, "what the daemon publishes each pass: runtimes -> status types, the status line"),
    # -- cli ---------------------------------------------------------------------------------------
    "cli/__init__": (CORE, PACKAGE_INIT),
    "cli/reference": (CORE, "the man page's SYNOPSIS and the bash completion, from the parser"),
    "cli/present": (CORE, "what the commands print: topology, plan, engine line, cgroup limits, the status table"),
    "cli/wiring": (ORCHESTRATION, "what a command runs on: the loaded configuration, the backend (fd store, uids)"),
    "cli/offline_status": (ORCHESTRATION, "`status` with the daemon down: the plan and what its units are doing"),
    "cli/daemon_client": (ORCHESTRATION, "the running daemon: alive and ours, its status, the reload protocol "
                                         "(SIGHUP, wait for the generation) and restart's (a request, SIGUSR1)"),
    "cli/commands": (ORCHESTRATION, "the `cmd_*` of every sub-command but `reload`"),
    "cli/main": (ORCHESTRATION, "argument parsing and dispatch (`main`, the entry point)"),
    # -- entry points (may import any package) -------------------------------------------------
    "__main__": (ORCHESTRATION, "`python -m numad_infer`"),
    "frontdoor_exec": (ORCHESTRATION, "HAProxy's unit's entry point (`python3 -m numad_infer.frontdoor_exec`), kept "
                                      "for the units rendered so far; the code is `frontdoor/handover`"),
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

    @property
    def package(self) -> str:
        return self.name.rpartition("/")[0]

    @property
    def package_rank(self) -> int:
        """Its package's place in `PACKAGES`; the entry points come after every package."""
        if self.name in ENTRY_POINTS:
            return len(PACKAGES)
        return [name for name, _ in PACKAGES].index(self.package)


def modules() -> list[Module]:
    return [Module(name, layer, job) for name, (layer, job) in MODULES.items()]


def markdown() -> str:
    """CONTRIBUTING.md's layout: one table per package, in import order, its modules by layer."""
    lines = [README_BEGIN,
             "One folder per feature. A module imports only from its own package or an earlier one in this "
             "list, and only from its own layer or a lower one: core (pure, no I/O) < edge (talks to one thing "
             "outside the process) < orchestration (decides what to do and when). No two modules import each "
             "other, directly or around a circle. `tests/test_layers.py` checks every import, also those inside "
             "functions and under `TYPE_CHECKING`.", ""]
    every = modules()
    for package, job in PACKAGES:
        inside = [m for m in every if m.package == package and m.job != PACKAGE_INIT and m.name not in ENTRY_POINTS]
        lines += [f"**`numad_infer/{package + '/' if package else ''}`**: {job}", "",
                  "| module | layer | job |", "|---|---|---|"]
        lines += [f"| `{m.name.rpartition('/')[2]}.py` | {m.layer} | {m.job} |"
                  for m in sorted(inside, key=lambda m: (m.rank, m.name))]
        lines.append("")
    lines += ["**Entry points** (run by name):", "", "| module | layer | job |", "|---|---|---|"]
    lines += [f"| `{m.name}.py` | {m.layer} | {m.job} |" for m in every if m.name in ENTRY_POINTS]
    lines.append(README_END)
    return "\n".join(lines)
