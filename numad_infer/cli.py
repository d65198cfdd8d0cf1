"""`numa-infer` command line: argument parsing and presentation only."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from numad_infer import __version__
from numad_infer.config import DEFAULT_CONFIG_PATH, Config, load_config
from numad_infer.cpuset import format_list
from numad_infer.errors import NumaInferError
from numad_infer.modelfile import model_size
from numad_infer.planner import Plan, make_plan
from numad_infer.render import render_units
from numad_infer.sysfs import read_topology
from numad_infer.topology import Topology
from numad_infer.unitdir import plan_write, write_units


@dataclass(frozen=True)
class Loaded:
    config: Config
    topology: Topology
    plan: Plan


def load_all(config_path: str, fsroot: str) -> Loaded:
    config = load_config(config_path)
    topology = read_topology(fsroot)
    size = model_size(config.model.path, config_path)
    return Loaded(config, topology, make_plan(config, topology, size, source=config_path))


# -- presentation ------------------------------------------------------------------------

def format_topology(topo: Topology) -> str:
    ids = topo.node_ids
    out = [f"available: {len(ids)} nodes ({format_list(ids)})"]
    for node in topo.nodes:
        out.append(f"node {node.id} cpus: {' '.join(map(str, node.cpus))}")
        threads = {len(c) for c in node.cores}
        smt = f" ({'/'.join(map(str, sorted(threads)))} thread(s) per core)" if node.cores else ""
        out.append(f"node {node.id} cores: {len(node.cores)}{smt}: " + " ".join("[" + ",".join(map(str, c)) + "]" for c in node.cores))
        out.append(f"node {node.id} size: {node.memory_total_bytes // 2**20} MB")
    out.append("node distances:")
    out.append("node " + "".join(f"{i:>4}" for i in ids))
    for node in topo.nodes:
        out.append(f"{node.id:>4}:" + "".join(f"{node.distances.get(i, 0):>4}" for i in ids))
    out += [f"warning: {w}" for w in topo.warnings]
    return "\n".join(out)


def format_plan(plan: Plan) -> str:
    rows = [("INSTANCE", "NODE", "CPUS", "MEMS", "POLICY", "THREADS", "PORT")]
    for i in plan.instances:
        rows.append((i.name, "-" if i.node is None else str(i.node), format_list(i.cpus), format_list(i.mems),
                     i.policy, str(i.threads), str(i.port)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


# -- commands -------------------------------------------------------------------------------

def cmd_topology(args: argparse.Namespace) -> int:
    topo = read_topology(args.fsroot)
    print(json.dumps(topo.to_dict(), indent=2) if args.json else format_topology(topo))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    loaded = load_all(args.config, args.fsroot)
    print(json.dumps(loaded.plan.to_dict(), indent=2) if args.json else format_plan(loaded.plan))
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    loaded = load_all(args.config, args.fsroot)
    unit_dir = Path(args.output or loaded.config.systemd.unit_dir)
    result = write_units(unit_dir, render_units(loaded.config, loaded.plan))
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
    loaded = load_all(args.config, args.fsroot)
    print(f"{args.config}: valid for this machine")
    print(format_plan(loaded.plan))
    pending = plan_write(Path(loaded.config.systemd.unit_dir), render_units(loaded.config, loaded.plan))
    if pending.changed:
        print(f"units in {loaded.config.systemd.unit_dir} differ from this plan: "
              f"{len(pending.written)} to write, {len(pending.removed)} to remove")
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=argparse.SUPPRESS, help=f"configuration file (default {DEFAULT_CONFIG_PATH})")
    common.add_argument("--fsroot", default=argparse.SUPPRESS, help="read DIR/sys and DIR/proc instead of / (like HWLOC_FSROOT)")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.config = getattr(args, "config", DEFAULT_CONFIG_PATH)
    args.fsroot = getattr(args, "fsroot", "/")
    try:
        return args.func(args)
    except NumaInferError as exc:
        print(f"numa-infer: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
