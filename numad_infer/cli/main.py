"""`numa-infer` command line: argument parsing and dispatch to the commands
(commands.py, daemon_client.py)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from numad_infer import __version__
from numad_infer.cli.commands import (
    cmd_check,
    cmd_doctor,
    cmd_plan,
    cmd_render,
    cmd_run,
    cmd_status,
    cmd_topology,
    cmd_tune,
    setup_logging,
)
from numad_infer.cli.daemon_client import cmd_health, cmd_reload, cmd_restart
from numad_infer.config.defaults import DEFAULT_CONFIG_PATH, DEFAULT_STATE_FILE
from numad_infer.errors import NumaInferError
from numad_infer.systemd.unitnames import DAEMON_UNIT
from numad_infer.util.printable import printable_lines

if TYPE_CHECKING:
    _Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

# Importing the commands here is cheap: they import the config schema (pydantic), planner
# and renderer inside themselves, where they need them (commands.py says why).


def _common_options() -> argparse.ArgumentParser:
    """The options every command (and the top level) takes."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE",
                        help=f"configuration file (default {DEFAULT_CONFIG_PATH})")
    common.add_argument("--fsroot", default=argparse.SUPPRESS, metavar="DIR",
                        help="read DIR/sys and DIR/proc instead of / (like HWLOC_FSROOT)")
    common.add_argument("--state-file", default=argparse.SUPPRESS, metavar="FILE",
                        help=f"daemon status file (default {DEFAULT_STATE_FILE})")
    common.add_argument("--backend", choices=("auto", "systemd", "process"), default=argparse.SUPPRESS,
                        help="where the instances run: systemd units, or child processes where systemd is not PID 1 "
                             "(auto, the default); decides who they run as, which every check honours")
    return common


def _add_plan_commands(sub: _Subparsers, common: argparse.ArgumentParser) -> None:
    """topology, plan, render, check: the configuration and the machine, no daemon."""
    p = sub.add_parser("topology", parents=[common], help="show NUMA nodes, CPUs, cores and distances")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_topology)
    p = sub.add_parser("plan", parents=[common], help="show which instance runs where")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("render", parents=[common], help="write the systemd units of the plan")
    p.add_argument("--output", metavar="DIR", help="directory to write into (default: tuning.unit_dir)")
    p.set_defaults(func=cmd_render)
    p = sub.add_parser("check", parents=[common], help="validate the configuration against this machine")
    p.set_defaults(func=cmd_check)


def _add_daemon_commands(sub: _Subparsers, common: argparse.ArgumentParser) -> None:
    """run and status: the daemon and what it publishes."""
    p = sub.add_parser("run", parents=[common], help=f"run the daemon (what {DAEMON_UNIT} starts)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--instance-logs", choices=("file", "stdout"), default="file",
                   help="process backend: the instances' and HAProxy's output to STATE_DIR/logs/NAME.log, rotated to "
                        "NAME.log.1 at 8 MiB (file, the default), or to the daemon's stdout, each line prefixed with "
                        "NAME: (stdout, for a container)")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("status", parents=[common],
                       help="instances, health and drift (exit 0 healthy, 1 not, 3 daemon down)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)


def _add_host_commands(sub: _Subparsers, common: argparse.ArgumentParser) -> None:
    """tune and doctor: measure and check this machine."""
    p = sub.add_parser("tune", parents=[common],
                       help="measure threads and memory bandwidth with this model; pick the fastest")
    p.add_argument("--nodes", type=lambda v: [int(n) for n in v.split(",")], default=None, metavar="N,...",
                   help="nodes to measure, e.g. 0,1 (default: the first planned node; the grid runs on the first)")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="with [[models]]: the model to measure, on its own cores, and whose threads to write "
                        "(models[k].threads); required when there are several")
    p.add_argument("--quick", action="store_true", help="fewer candidates, samples and tokens")
    p.add_argument("--json", action="store_true", help="print every figure as JSON")
    p.add_argument("--apply", action="store_true",
                   help="write the winner into the config file (a backup is kept) and reload")
    p.add_argument("--stop-instances", action="store_true",
                   help="without a front door: stop each node's instance while it is measured")
    p.add_argument("--layouts", action="store_true",
                   help="also measure layouts (per node, k per node along L3, interleaved) under concurrent clients; "
                        "needs the whole machine")
    p.add_argument("--samples", type=int, default=None, metavar="N",
                   help="repeats of every figure (default 5, --quick 3)")
    p.add_argument("--tokens", type=int, default=None, metavar="N",
                   help="tokens generated per decode sample (default 64, --quick 16)")
    p.set_defaults(func=cmd_tune)
    p = sub.add_parser("doctor", parents=[common],
                       help="check the host settings the instances depend on (exit 0 ok, 1 warnings, 2 failures); "
                            "changes nothing")
    p.add_argument("--json", action="store_true")
    p.add_argument("--sample", type=float, default=1.0, metavar="SECONDS",
                   help="how long to watch the inference CPUs for other busy processes (default 1)")
    p.set_defaults(func=cmd_doctor)


def _add_probe_commands(sub: _Subparsers, common: argparse.ArgumentParser) -> None:
    """health, reload and restart: ask the running daemon."""
    p = sub.add_parser("health", parents=[common], help="for liveness/readiness probes: exit 0 yes, 1 no, 3 no daemon")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--live", action="store_true", help="the daemon's loop is turning (the default)")
    which.add_argument("--ready", action="store_true",
                       help="at least one instance is in rotation behind the front door")
    p.set_defaults(func=cmd_health)
    p = sub.add_parser("reload", parents=[common],
                       help="make the daemon re-read its configuration and wait for the result")
    p.add_argument("--pid", type=int, metavar="PID", help="daemon PID (default: from the state file)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="how long to wait for the daemon's answer (default 300)")
    p.set_defaults(func=cmd_reload)
    p = sub.add_parser("restart", parents=[common],
                       help="restart instances one at a time behind the front door (drained first; the next once the "
                            "last is healthy), e.g. to load a model file changed in place; follows the roll")
    p.add_argument("instances", nargs="*", metavar="INSTANCE",
                   help="instance names as `status` shows them (infer@1), node numbers (1), or with [[models]] "
                   "a model's name (chat) for all of its instances; default: all")
    p.add_argument("--pid", type=int, metavar="PID", help="daemon PID (default: from the state file)")
    p.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                   help="how long to follow the roll before giving up waiting; the daemon goes on (default 900)")
    p.set_defaults(func=cmd_restart)


def build_parser() -> argparse.ArgumentParser:
    common = _common_options()
    parser = argparse.ArgumentParser(prog="numa-infer", parents=[common],
                                     description="One pinned llama.cpp server per NUMA node, under systemd.")
    parser.add_argument("--version", action="version", version=f"numa-infer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # In the order `--help` lists them.
    _add_plan_commands(sub, common)
    _add_daemon_commands(sub, common)
    _add_host_commands(sub, common)
    _add_probe_commands(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.config = getattr(args, "config", DEFAULT_CONFIG_PATH)
    args.fsroot = getattr(args, "fsroot", "/")
    args.state_file = getattr(args, "state_file", os.environ.get("NUMA_INFER_STATE_FILE", DEFAULT_STATE_FILE))
    args.backend = getattr(args, "backend", "auto")
    setup_logging(args)
    code: int | None = None
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, not at exit: a reader gone early is seen while the code is known
        return code
    except NumaInferError as exc:
        # An error may name a file of a tree under --fsroot or quote what a program printed.
        # Several problems of one file (config.load.ConfigProblems): one line each.
        problems = exc.problems or (exc,)
        print(printable_lines(f"numa-infer: {p}" for p in problems), file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader left (`numa-infer status | head -1`): the code of what was being printed
        # (3: daemon down reads as such), or, cut short before it was known, SIGPIPE's 141.
        _drop_stdout()
        return 141 if code is None else code


def _drop_stdout() -> None:
    """What is still buffered for a reader that left goes nowhere, not into an error at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real descriptor (a test's stream): nothing to drop
        pass


if __name__ == "__main__":
    sys.exit(main())
