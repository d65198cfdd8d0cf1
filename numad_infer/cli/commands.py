"""The commands: one `cmd_*` per sub-command but `reload` (daemon_client.py), each taking
the parsed arguments and returning the exit status, and the log every command writes.

What a command prints is escaped (`printable`): the presenters escape their lines, and
the lines here that name a path or quote an error escape theirs."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from numad_infer.cli.daemon_client import cmd_reload, running_daemon
from numad_infer.cli.offline_status import offline_status
from numad_infer.cli.present import (
    format_allowed,
    format_engine,
    format_memory,
    format_plan,
    format_status,
    format_topology,
)
from numad_infer.cli.wiring import load_all, make_backend
from numad_infer.errors import NumaInferError
from numad_infer.status.statefile import read_status
from numad_infer.util.printable import EscapingFormatter, printable

if TYPE_CHECKING:
    from numad_infer.host.identity import BackendKind
    from numad_infer.plan.memory_fit import InstanceMemory
    from numad_infer.util.runlock import RunLock
    from numad_infer.validate.loaded import Loaded

# The config schema (pydantic), planner and renderer are imported by the commands that
# need them: `numa-infer status` with the daemon running reads only a JSON file, and an
# operator's status check (or a monitoring script) should not pay ~100 ms for pydantic.


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
        each = {m.served.name: {"weights": m.memory.weights, "kv_cache": m.memory.kv_cache,
                                "overhead": m.memory.overhead, "total": m.memory.total,
                                "kv_cache_counted": m.memory.dims_known,
                                # Not in total: what use may add (null: no limit).
                                "prompt_cache": m.memory.prompt_cache} for m in loaded.models}
        # One model: its instance's figures; several: per model name.
        per = {"per_instance": next(iter(each.values()))} if len(each) == 1 and not loaded.models[0].served.own_table \
            else {"per_model": each}
        memory = {**per, "nodes": [{"node": f.node, "need": f.need, "available": f.available, "total": f.total,
                                    "instances": list(f.instances), "prompt_cache": f.growth}
                                   for f in loaded.fits()]}
        print(json.dumps({**loaded.plan.to_dict(), "allowed": loaded.allowed.to_dict(), "memory": memory}, indent=2))
    else:
        print("\n".join([format_plan(loaded.plan), *format_memory(_needs(loaded), loaded.fits()),
                         *format_allowed(loaded.topology, loaded.allowed)]))
    return 0


def _needs(loaded: Loaded) -> list[InstanceMemory]:
    """What one instance of each model holds."""
    return [loaded.memory_of(m.served.ident) for m in loaded.models]


def cmd_render(args: argparse.Namespace) -> int:
    from numad_infer.systemd.unitdir import write_units

    loaded = load_all(args)
    unit_dir = Path(args.output or loaded.config.systemd.unit_dir)
    result = write_units(unit_dir, loaded.units)
    for rel in result.written:
        print(printable(f"wrote {unit_dir / rel}"))
    for rel in result.removed:
        print(printable(f"removed {unit_dir / rel}"))
    if not result.changed:
        print(printable(f"{unit_dir}: up to date ({len(result.unchanged)} files)"))
    elif unit_dir == Path("/run/systemd/system") or unit_dir == Path("/etc/systemd/system"):
        print("run `systemctl daemon-reload` to load the changes (the daemon does it itself)")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from numad_infer.host.identity import backend_kind

    loaded = load_all(args)
    print(printable(f"{args.config}: valid for this machine"))
    print(format_engine(loaded.config, loaded.engine))
    print(format_plan(loaded.plan, loaded.warnings))
    print("\n".join(format_memory(_needs(loaded), loaded.fits())))
    pending = pending_line(loaded, backend_kind(args.backend))
    if pending:
        print(printable(pending))
    return 0


def pending_line(loaded: Loaded, kind: BackendKind) -> str:
    """What the backend `check` was asked about will do with this plan: under systemd, the
    unit files that differ from it (empty: none); under the process backend, the processes
    `numa-infer run` starts (it writes no unit files)."""
    from numad_infer.host.identity import BackendKind
    from numad_infer.systemd.unitdir import plan_write

    if kind == BackendKind.PROCESS:
        names = [i.name for i in loaded.plan.instances]
        door = " and HAProxy (the front door)" if loaded.haproxy_cfg is not None else ""
        return (f"process backend: `numa-infer run` starts {len(names)} server process(es) ({', '.join(names)})"
                f"{door} as its own children; processes: {len(names)} to start")
    pending = plan_write(Path(loaded.config.systemd.unit_dir), loaded.units)
    if not pending.changed:
        return ""
    return (f"units in {loaded.config.systemd.unit_dir} differ from this plan: "
            f"{len(pending.written)} to write, {len(pending.removed)} to remove")


def cmd_run(args: argparse.Namespace) -> int:
    from numad_infer.daemon.loop import Daemon
    from numad_infer.systemd.notify import Notifier

    state_file = Path(args.state_file)
    # Before anything is bound, created or removed: a second daemon on this state file
    # would take over the first one's sockets and files (requests.sock, haproxy.cfg).
    try:
        lock = _run_lock(state_file)
    except NumaInferError as exc:
        print(printable(f"numa-infer: {exc}"), file=sys.stderr)
        return 1
    notifier = Notifier()  # takes NOTIFY_SOCKET out of the environment before any child starts
    backend = make_backend(args.backend, state_file, args.instance_logs, notifier)
    daemon = Daemon(args.config, args.fsroot, backend, state_file, notifier)
    try:
        return daemon.run()
    finally:
        if lock is not None:
            lock.close()


def _run_lock(state_file: Path) -> RunLock | None:
    """The lock beside the state file (util/runlock.py), or None where its directory cannot
    be made or written: the daemon then refuses to start, saying why (check_state_dir)."""
    from numad_infer.status.statefile import check_state_dir
    from numad_infer.util.runlock import RunLock, lock_path

    try:
        check_state_dir(state_file)  # made if missing, as the daemon does: the lock lives there
    except NumaInferError:
        return None
    path = lock_path(state_file)
    try:
        return RunLock.take(path)
    except OSError as exc:
        raise NumaInferError(f"cannot lock {path}: {exc.strerror}") from None


def cmd_status(args: argparse.Namespace) -> int:
    status = running_daemon(Path(args.state_file))
    running = status is not None
    if status is None:
        status = offline_status(args)
    print(json.dumps(status.to_json(), indent=2) if args.json else format_status(status))
    if not running:
        return 3
    return 0 if status.healthy else 1


def cmd_tune(args: argparse.Namespace) -> int:
    """Measure thread counts (and the memory bandwidth) on this machine with this model;
    print the table and the choice; with --apply, write it into the file and reload."""
    from numad_infer.tune import run as tuner
    from numad_infer.tune.choice import format_report
    from numad_infer.tune.errors import TuneError

    def progress(text: str) -> None:
        if not args.json:
            print(printable(f"tune: {text}"), file=sys.stderr, flush=True)

    from numad_infer.host.identity import backend_kind

    request = tuner.TuneRequest(args.config, args.fsroot, Path(args.state_file), args.nodes, args.quick, args.apply,
                                args.stop_instances, args.samples, args.tokens, args.layouts,
                                backend_kind(args.backend), args.model)
    try:
        report, edits = tuner.run(request, progress)
    except TuneError as exc:
        print(printable(f"numa-infer tune: {exc}"), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("numa-infer tune: interrupted; nothing was changed (held instances were released)", file=sys.stderr)
        return 130
    print(json.dumps(report.to_json(), indent=1) if args.json else format_report(report))
    if not args.apply:
        return 0
    if not edits:
        print(printable(f"{args.config}: unchanged (the current settings are the fastest measured, or within the "
                        "noise)"))
        return 0
    backup = tuner.write_tuned(args.config, args.fsroot, request.kind, edits)
    print(printable(f"{args.config}: " + ", ".join(f"{e.name} = {json.dumps(e.value)}" for e in edits)
                    + f" (previous file kept as {backup})"))
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
    checks = checkup(loaded, args.fsroot, running_daemon(Path(args.state_file)), args.sample)
    if args.json:
        print(json.dumps({"checks": [c.to_json() for c in checks], "worst": worst(checks).value}, indent=2))
    else:
        print(format_checks(checks))
    return exit_status(checks)


def log_handler(fmt: str, stream: TextIO | None = None) -> logging.Handler:
    """A handler writing each record as one escaped line (`EscapingFormatter`) to `stream`
    (stderr by default)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(EscapingFormatter(fmt))
    return handler


def setup_logging(args: argparse.Namespace) -> None:
    """Every command's log on stderr, each record one escaped line: the daemon's from INFO
    (the time first, unless the journal adds its own), the other commands' warnings as
    Python would print them without a handler (the bare message), but escaped."""
    if args.func is cmd_run:
        under_journal = bool(os.environ.get("JOURNAL_STREAM"))
        fmt = "%(levelname)s: %(message)s" if under_journal else "%(asctime)s %(levelname)s: %(message)s"
        level = logging.DEBUG if args.verbose else logging.INFO
    else:
        fmt, level = "%(message)s", logging.WARNING
    logging.basicConfig(level=level, handlers=[log_handler(fmt)])
