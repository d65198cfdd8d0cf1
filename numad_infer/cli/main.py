"""`numa-infer` command line: argument parsing and presentation only."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from numad_infer import __version__
from numad_infer.config.defaults import DEFAULT_CONFIG_PATH, DEFAULT_STATE_FILE
from numad_infer.errors import NumaInferError
from numad_infer.lifecycle.states import State
from numad_infer.status.statefile import read_status
from numad_infer.systemd.unitnames import DAEMON_UNIT
from numad_infer.util.cpuset import format_list
from numad_infer.util.tables import format_table

if TYPE_CHECKING:
    from collections.abc import Sequence

    from numad_infer.backends.base import Backend
    from numad_infer.config.schema import Config
    from numad_infer.engines import Engine
    from numad_infer.plan.placement import Plan
    from numad_infer.status.records import Status
    from numad_infer.systemd.notify import Notifier
    from numad_infer.topology.cgroup_limits import Allowed
    from numad_infer.topology.model import Topology
    from numad_infer.validate.pipeline import Loaded

# The config schema (pydantic), planner and renderer are imported by the commands that
# need them: `numa-infer status` with the daemon running reads only a JSON file, and an
# operator's status check (or a monitoring script) should not pay ~100 ms for pydantic.


def load_all(args: argparse.Namespace) -> Loaded:
    """The one pipeline (loading.py), for the backend `--backend` names."""
    from numad_infer.host.identity import backend_kind
    from numad_infer.validate.pipeline import load

    return load(args.config, backend_kind(args.backend), args.fsroot)


# -- presentation ------------------------------------------------------------------------

def format_topology(topo: Topology) -> str:
    ids = topo.node_ids
    out = [f"available: {len(ids)} nodes ({format_list(ids)})"]
    for node in topo.nodes:
        out.append(f"node {node.id} cpus: {' '.join(map(str, node.cpus))}")
        threads = {len(c) for c in node.cores}
        smt = f" ({'/'.join(map(str, sorted(threads)))} thread(s) per core)" if node.cores else ""
        out.append(f"node {node.id} cores: {len(node.cores)}{smt}: "
                   + " ".join("[" + ",".join(map(str, c)) + "]" for c in node.cores))
        out.append(f"node {node.id} size: {node.memory_total_bytes // 2**20} MB")
    out.append("node distances:")
    out.append("node " + "".join(f"{i:>4}" for i in ids))
    for node in topo.nodes:
        out.append(f"{node.id:>4}:" + "".join(f"{node.distances.get(i, 0):>4}" for i in ids))
    out += [f"warning: {w}" for w in topo.warnings]
    return "\n".join(out)


def format_plan(plan: Plan, warnings: tuple[str, ...] | None = None) -> str:
    """The plan as a table, then `warnings` (default: the plan's own)."""
    rows = [("INSTANCE", "NODE", "CPUS", "MEMS", "POLICY", "THREADS", "PORT")]
    for i in plan.instances:
        rows.append((i.name, "-" if i.node is None else str(i.node), format_list(i.cpus), format_list(i.mems),
                     i.policy.value, str(i.threads), str(i.port)))
    lines = format_table(rows)
    lines += [f"warning: {w}" for w in (plan.warnings if warnings is None else warnings)]
    return "\n".join(lines)


def format_engine(config: Config, engine: Engine) -> str:
    """Which server every instance runs, and the key that chose it (or that it is the default)."""
    chosen = "server.engine" if "engine" in config.server.model_fields_set else "the default; server.engine"
    return (f"engine: {engine.name} ({chosen}), every instance runs {engine.program(config)} "
            f"(server.{engine.program_key})")


# -- commands -------------------------------------------------------------------------------

def format_allowed(topo: Topology, allowed: Allowed) -> list[str]:
    """What the instances' cgroup allows, and what of the machine that leaves out (nothing
    when it restricts nothing)."""
    from numad_infer.topology.cgroup_limits import left_out

    if allowed.cpus is None and allowed.mems is None and allowed.quota_cpus is None:
        return []
    lines = [f"allowed to the instances: {allowed.describe()}"]
    cpus = left_out(topo, allowed)
    mems = {n.id for n in topo.nodes if n.memory_total_bytes > 0} - set(allowed.mems or {n.id for n in topo.nodes})
    if cpus or mems:
        lines.append("left out: " + ", ".join(([f"CPUs {format_list(cpus)}"] if cpus else [])
                                             + ([f"memory of node(s) {format_list(mems)}"] if mems else [])))
    return lines


def cmd_topology(args: argparse.Namespace) -> int:
    from numad_infer.host.identity import backend_kind
    from numad_infer.topology.sysfs import read_topology
    from numad_infer.validate.pipeline import read_allowed

    topo = read_topology(args.fsroot)
    allowed = read_allowed(backend_kind(args.backend))
    if args.json:
        print(json.dumps({**topo.to_dict(), "allowed": allowed.to_dict()}, indent=2))
    else:
        print("\n".join([format_topology(topo), *format_allowed(topo, allowed)]))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    loaded = load_all(args)
    if args.json:
        print(json.dumps({**loaded.plan.to_dict(), "allowed": loaded.allowed.to_dict()}, indent=2))
    else:
        print("\n".join([format_plan(loaded.plan), *format_allowed(loaded.topology, loaded.allowed)]))
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from numad_infer.backends.units import render_units
    from numad_infer.host.identity import systemd_frontdoor_user
    from numad_infer.systemd.unitdir import write_units

    loaded = load_all(args)
    unit_dir = Path(args.output or loaded.config.systemd.unit_dir)
    result = write_units(unit_dir, render_units(loaded.config, loaded.plan, systemd_frontdoor_user()))
    for rel in result.written:
        print(f"wrote {unit_dir / rel}")
    for rel in result.removed:
        print(f"removed {unit_dir / rel}")
    if not result.changed:
        print(f"{unit_dir}: up to date ({len(result.unchanged)} files)")
    elif unit_dir == Path("/run/systemd/system") or unit_dir == Path("/etc/systemd/system"):
        print("run `systemctl daemon-reload` to load the changes (the daemon does it itself)")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from numad_infer.backends.units import render_units
    from numad_infer.host.identity import systemd_frontdoor_user
    from numad_infer.systemd.unitdir import plan_write

    loaded = load_all(args)
    print(f"{args.config}: valid for this machine")
    print(format_engine(loaded.config, loaded.engine))
    print(format_plan(loaded.plan, loaded.warnings))
    pending = plan_write(Path(loaded.config.systemd.unit_dir),
                         render_units(loaded.config, loaded.plan, systemd_frontdoor_user()))
    if pending.changed:
        print(f"units in {loaded.config.systemd.unit_dir} differ from this plan: "
              f"{len(pending.written)} to write, {len(pending.removed)} to remove")
    return 0


def _make_backend(choice: str, state_file: Path, instance_logs: str = "file",
                  notifier: Notifier | None = None) -> Backend:
    from numad_infer.backends.childlog import InstanceLogs
    from numad_infer.backends.process import ProcessBackend
    from numad_infer.backends.systemd import FrontdoorHandout, SystemdBackend
    from numad_infer.frontdoor.listener import STORE_NAME
    from numad_infer.host.identity import BackendKind, backend_kind, frontdoor_runs_as
    from numad_infer.systemd.notify import inherited_fds
    from numad_infer.systemd.systemctl import Systemctl

    if backend_kind(choice) == BackendKind.SYSTEMD:
        handout = None
        if notifier is not None:
            # What a previous daemon kept in the unit's file descriptor store, and who may
            # take the socket: HAProxy's user (or root, where the package's user is missing).
            kept = inherited_fds().get(STORE_NAME)
            user = frontdoor_runs_as(BackendKind.SYSTEMD)
            uids = frozenset({0} | ({user.uid} if user is not None and user.uid is not None else set()))
            handout = FrontdoorHandout(notifier.store_fd, kept, uids, None if user is None else user.gid)
        # The journal has the instances' output, named by unit.
        return SystemdBackend(Systemctl(progress=None if notifier is None else notifier.keepalive), handout=handout)
    return ProcessBackend(state_file.parent / "logs", InstanceLogs(instance_logs))


def cmd_run(args: argparse.Namespace) -> int:
    from numad_infer.daemon.loop import Daemon
    from numad_infer.systemd.notify import Notifier

    under_journal = bool(os.environ.get("JOURNAL_STREAM"))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format=("%(levelname)s: %(message)s" if under_journal
                                else "%(asctime)s %(levelname)s: %(message)s"))
    notifier = Notifier()  # takes NOTIFY_SOCKET out of the environment before any child starts
    state_file = Path(args.state_file)
    backend = _make_backend(args.backend, state_file, args.instance_logs, notifier)
    daemon = Daemon(args.config, args.fsroot, backend, state_file, notifier)
    return daemon.run()


def _alive(pid: int | None) -> bool:
    from numad_infer.supervision.holds import alive

    return alive(pid)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_status(status: Status) -> str:
    d = status.daemon
    lines = [f"numa-infer: {d.state.value}" + (f" (pid {d.pid}, backend {d.backend})" if d.pid else "")
             + f", config {d.config}"]
    if d.status:
        lines.append(f"status: {d.status}")
    reload = d.last_reload
    if reload is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(reload.at))
        if reload.ok:
            lines.append(f"last {reload.why}: {when} ok (added {len(reload.added)}, changed {len(reload.changed)}, "
                         f"removed {len(reload.removed)})")
        else:
            lines.append(f"last {reload.why}: {when} FAILED: {reload.error}")
    if d.allowed:
        lines.append(f"allowed: {d.allowed}")
    lines += [f"warning: {w}" for w in d.warnings]
    front = status.frontdoor
    if front is not None:
        if front.up:
            lines.append(f"front door: http://{front.listen} up, {front.in_flight} in flight, {front.queued} queued")
        else:
            lines.append(f"front door: http://{front.listen} DOWN" + (f": {front.error}" if front.error else ""))
    # The engine's own columns only where an instance has them (llama-server).
    engine = any(i.slots is not None for i in status.instances)
    rows = [("INSTANCE", "NODE", "CPUS", "PORT", "PID", "STATE", "UPTIME", "RESTARTS", "LOCAL-MEM", "PROBE",
             "ROTATION", "INFLIGHT", "QUEUED") + (("SLOTS", "TOK/S", "BW-EFF") if engine else ())]
    for i in status.instances:
        frac = i.local_memory_fraction
        row: tuple[str, ...] = (i.name, _dash(i.node), format_list(i.cpus), str(i.port), _dash(i.pid),
               i.state.value + (" drifting" if i.drifting else ""), _age(i.uptime_s), str(i.restarts),
               "-" if frac is None else f"{frac:.1%}",
               "-" if i.probe_latency_ms is None else f"{i.probe_latency_ms:.0f}ms",
               _dash(i.rotation), _dash(i.in_flight), _dash(i.queued))
        if engine:
            row += ("-" if i.slots is None else f"{_dash(i.busy_slots)}/{i.slots} busy",
                    "-" if i.decode_tokens_per_s is None else f"{i.decode_tokens_per_s:.1f}",
                    "-" if i.decode_efficiency is None else f"{i.decode_efficiency:.0%}")
        rows.append(row)
    lines += format_table(rows)
    for i in status.instances:
        for label, event in (("last drift", i.last_drift), ("last repair", i.last_repair)):
            if event is not None:
                when = time.strftime("%H:%M:%S", time.localtime(event.at))
                lines.append(f"  {i.name}: {label} {when} [{event.kind}] {event.detail}")
        if i.error:
            lines.append(f"  {i.name}: error: {i.error}")
        if i.unit_state:
            lines.append(f"  {i.name}: unit {i.unit_state}")
    return "\n".join(lines)


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def _offline_status(args: argparse.Namespace) -> Status:
    """The daemon is down: still show the plan and what the units are doing."""
    from numad_infer.status.records import DaemonState, DaemonStatus, InstanceStatus, Status

    try:
        loaded = load_all(args)
    except NumaInferError as exc:
        return Status(DaemonStatus(DaemonState.NOT_RUNNING, args.config, warnings=(str(exc),)), ())
    from numad_infer.backends.base import Observation
    from numad_infer.backends.systemd import SystemdBackend
    from numad_infer.host.identity import BackendKind

    warnings: list[str] = []
    names = [inst.name for inst in loaded.plan.instances]
    no_unit = Observation(None, False, "not running (process backend: instances stop with the daemon)")
    seen = dict.fromkeys(names, no_unit)
    if loaded.kind == BackendKind.SYSTEMD:
        try:
            seen = SystemdBackend().observe(names)
        except NumaInferError as exc:
            warnings.append(str(exc))
            seen = dict.fromkeys(names, Observation(None, False, "unknown"))
    # Nobody supervises them: a running one is UNSUPERVISED, never "healthy".
    instances = tuple(InstanceStatus.planned(i, seen[i.name].pid,
                                             State.UNSUPERVISED if seen[i.name].pid else State.STOPPED,
                                             unit_state=seen[i.name].description)
                      for i in loaded.plan.instances)
    return Status(DaemonStatus(DaemonState.NOT_RUNNING, args.config, warnings=tuple(warnings)), instances)


def _running_daemon(path: Path) -> Status | None:
    """The published status, if its daemon is alive (StatusError for a file of another shape)."""
    status = read_status(path)
    if status is None or not status.daemon.state.live or not _alive(status.daemon.pid):
        return None
    return status


def cmd_status(args: argparse.Namespace) -> int:
    status = _running_daemon(Path(args.state_file))
    running = status is not None
    if status is None:
        status = _offline_status(args)
    print(json.dumps(status.to_json(), indent=2) if args.json else format_status(status))
    if not running:
        return 3
    return 0 if status.healthy else 1


def cmd_health(args: argparse.Namespace) -> int:
    """For liveness and readiness probes (a container's HEALTHCHECK, Kubernetes): one line,
    exit 0 yes, 1 no, 3 no daemon. Reads only the state file: cheap and never blocks."""
    status = _running_daemon(Path(args.state_file))
    if status is None:
        print("not live: the daemon is not running")
        return 3
    live = status.live(time.time())
    if args.ready:
        ok = live and status.ready
        from numad_infer.status.records import in_rotation

        serving = sum(in_rotation(i.rotation) for i in status.instances)
        print(f"{'ready' if ok else 'not ready'}: {serving}/{len(status.instances)} instance(s) in rotation"
              + ("" if live else "; the daemon's loop is not turning"))
        return 0 if ok else 1
    age = time.time() - (status.daemon.updated_at or 0)
    print(f"{'live' if live else 'not live'}: last pass {age:.0f}s ago")
    return 0 if live else 1


def cmd_reload(args: argparse.Namespace) -> int:
    """Signal the daemon and wait until it has applied (or refused) the configuration."""
    path = Path(args.state_file)
    status = read_status(path)
    pid = args.pid if args.pid is not None else (status.daemon.pid if status else None)
    if args.pid is not None and args.pid <= 1:
        print(f"numa-infer: --pid {args.pid} is not a daemon's PID (it must be > 1)", file=sys.stderr)
        return 1
    if not _alive(pid):
        print("numa-infer: the daemon is not running", file=sys.stderr)
        return 3
    assert pid is not None
    # A stale state file (or a mistyped --pid) must never signal an unrelated process.
    if not _is_numa_infer_daemon(pid):
        print(f"numa-infer: process {pid} is not a numa-infer daemon (`numa-infer run`); not signalling it",
              file=sys.stderr)
        return 3 if args.pid is None else 1
    before = status.daemon.generation if status and status.daemon.pid == pid else 0
    try:
        os.kill(pid, signal.SIGHUP)
    except PermissionError:
        print(f"numa-infer: cannot signal the daemon (pid {pid}): permission denied; run as root", file=sys.stderr)
        return 1
    except ProcessLookupError:
        print("numa-infer: the daemon is not running", file=sys.stderr)
        return 3
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = read_status(path)
        if now is not None and now.daemon.pid == pid and now.daemon.generation > before:
            result = now.daemon.last_reload
            if result is not None and result.ok:
                print(f"reloaded: added {_join(result.added)}, changed {_join(result.changed)}, "
                      f"removed {_join(result.removed)}")
                return 0
            error = result.error if result is not None else "unknown"
            print(f"numa-infer: reload failed, still running the previous configuration: {error}", file=sys.stderr)
            return 1
    print(f"numa-infer: the daemon did not finish reloading within {args.timeout:g}s", file=sys.stderr)
    return 1


def cmd_tune(args: argparse.Namespace) -> int:
    """Measure thread counts (and the memory bandwidth) on this machine with this model;
    print the table and the choice; with --apply, write it into the file and reload."""
    from numad_infer.tune import run as tuner
    from numad_infer.tune.choice import format_report

    def progress(text: str) -> None:
        if not args.json:
            print(f"tune: {text}", file=sys.stderr, flush=True)

    from numad_infer.host.identity import backend_kind

    request = tuner.TuneRequest(args.config, args.fsroot, Path(args.state_file), args.nodes, args.quick, args.apply,
                                args.stop_instances, args.samples, args.tokens, args.layouts,
                                backend_kind(args.backend))
    try:
        report, edits = tuner.run(request, progress)
    except tuner.TuneError as exc:
        print(f"numa-infer tune: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("numa-infer tune: interrupted; nothing was changed (held instances were released)", file=sys.stderr)
        return 130
    print(json.dumps(report.to_json(), indent=1) if args.json else format_report(report))
    if not args.apply:
        return 0
    if not edits:
        print(f"{args.config}: unchanged (the current settings are the fastest measured, or within the noise)")
        return 0
    backup = tuner.write_tuned(args.config, args.fsroot, request.kind, edits)
    print(f"{args.config}: " + ", ".join(f"{e.section}.{e.key} = {json.dumps(e.value)}" for e in edits)
          + f" (previous file kept as {backup})")
    status = read_status(Path(args.state_file))
    if status is not None and status.daemon.state.live:
        args.pid, args.timeout = None, 300.0
        return cmd_reload(args)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Check the host settings around the instances; exit 0 all well, 1 a warning, 2 a failure."""
    from numad_infer.doctor.pipeline import checkup
    from numad_infer.doctor.verdicts import exit_status, format_checks, worst

    loaded = load_all(args)
    checks = checkup(loaded, args.fsroot, _running_daemon(Path(args.state_file)), args.sample)
    if args.json:
        print(json.dumps({"checks": [c.to_json() for c in checks], "worst": worst(checks).value}, indent=2))
    else:
        print(format_checks(checks))
    return exit_status(checks)


def _is_numa_infer_daemon(pid: int) -> bool:
    import psutil

    try:
        argv = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return False
    # `numa-infer run ...` (console script) or `python -m numad_infer ... run ...`.
    named = any(Path(a).name == "numa-infer" for a in argv[:2]) or "numad_infer" in argv[:3]
    return named and "run" in argv


def _join(names: Sequence[str]) -> str:
    return ", ".join(names) if names else "none"


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=argparse.SUPPRESS,
                        help=f"configuration file (default {DEFAULT_CONFIG_PATH})")
    common.add_argument("--fsroot", default=argparse.SUPPRESS,
                        help="read DIR/sys and DIR/proc instead of / (like HWLOC_FSROOT)")
    common.add_argument("--state-file", default=argparse.SUPPRESS,
                        help=f"daemon status file (default {DEFAULT_STATE_FILE})")
    common.add_argument("--backend", choices=("auto", "systemd", "process"), default=argparse.SUPPRESS,
                        help="where the instances run: systemd units, or child processes where systemd is not PID 1 "
                             "(auto, the default); decides who they run as, which every check honours")
    parser = argparse.ArgumentParser(prog="numa-infer", parents=[common],
                                     description="One pinned llama.cpp server per NUMA node, under systemd.")
    parser.add_argument("--version", action="version", version=f"numa-infer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("topology", parents=[common], help="show NUMA nodes, CPUs, cores and distances")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_topology)
    p = sub.add_parser("plan", parents=[common], help="show which instance runs where")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("render", parents=[common], help="write the systemd units of the plan")
    p.add_argument("--output", metavar="DIR", help="directory to write into (default: systemd.unit_dir)")
    p.set_defaults(func=cmd_render)
    p = sub.add_parser("check", parents=[common], help="validate the configuration against this machine")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("run", parents=[common], help=f"run the daemon (what {DAEMON_UNIT} starts)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--instance-logs", choices=("file", "stdout"), default="file",
                   help="process backend: the instances' and HAProxy's output to STATE_DIR/logs/NAME.log (file, the "
                        "default), or to the daemon's stdout, each line prefixed with NAME: (stdout, for a container)")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("status", parents=[common],
                       help="instances, health and drift (exit 0 healthy, 1 not, 3 daemon down)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("tune", parents=[common],
                       help="measure threads and memory bandwidth with this model; pick the fastest")
    p.add_argument("--nodes", type=lambda v: [int(n) for n in v.split(",")], default=None,
                   help="nodes to measure, e.g. 0,1 (default: the first planned node; the grid runs on the first)")
    p.add_argument("--quick", action="store_true", help="fewer candidates, samples and tokens")
    p.add_argument("--json", action="store_true", help="print every figure as JSON")
    p.add_argument("--apply", action="store_true",
                   help="write the winner into the config file (a backup is kept) and reload")
    p.add_argument("--stop-instances", action="store_true",
                   help="without a front door: stop each node's instance while it is measured")
    p.add_argument("--layouts", action="store_true",
                   help="also measure layouts (per node, k per node along L3, interleaved) under concurrent clients; "
                        "needs the whole machine")
    p.add_argument("--samples", type=int, default=None, help="repeats of every figure (default 5, --quick 3)")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens generated per decode sample (default 64, --quick 16)")
    p.set_defaults(func=cmd_tune)
    p = sub.add_parser("doctor", parents=[common],
                       help="check the host settings the instances depend on (exit 0 ok, 1 warnings, 2 failures); "
                            "changes nothing")
    p.add_argument("--json", action="store_true")
    p.add_argument("--sample", type=float, default=1.0, metavar="SECONDS",
                   help="how long to watch the inference CPUs for other busy processes (default 1)")
    p.set_defaults(func=cmd_doctor)
    p = sub.add_parser("health", parents=[common], help="for liveness/readiness probes: exit 0 yes, 1 no, 3 no daemon")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--live", action="store_true", help="the daemon's loop is turning (the default)")
    which.add_argument("--ready", action="store_true",
                       help="at least one instance is in rotation behind the front door")
    p.set_defaults(func=cmd_health)
    p = sub.add_parser("reload", parents=[common],
                       help="make the daemon re-read its configuration and wait for the result")
    p.add_argument("--pid", type=int, help="daemon PID (default: from the state file)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.set_defaults(func=cmd_reload)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.config = getattr(args, "config", DEFAULT_CONFIG_PATH)
    args.fsroot = getattr(args, "fsroot", "/")
    args.state_file = getattr(args, "state_file", os.environ.get("NUMA_INFER_STATE_FILE", DEFAULT_STATE_FILE))
    args.backend = getattr(args, "backend", "auto")
    try:
        code: int = args.func(args)
        return code
    except NumaInferError as exc:
        print(f"numa-infer: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
