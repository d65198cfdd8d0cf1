"""The golden haproxy.cfg files (tests/golden_haproxy/): each rendered from the TOML beside
it on the fake dual-socket machine (harness.plan_for), with the run directory's path written
as RUN_DIR so that a file does not depend on where a test ran. Shared by the golden test and
tools/request_path.py. `NUMA_INFER_UPDATE_GOLDEN=1` (or `tools/request_path.py --update-golden`)
rewrites them from the current code."""

from __future__ import annotations

from pathlib import Path

from numad_infer.config.load import parse_config
from numad_infer.frontdoor.haproxy_config import Paths, paths_in, render_haproxy
from numad_infer.plan.placement import make_plan
from numad_infer.topology.sysfs import read_topology
from tests import fakesys
from tests.fakes import load_of

GOLDEN = Path(__file__).resolve().parents[1] / "golden_haproxy"
RUN_DIR = "/run/numa-infer"  # what the rendering directory reads as in a golden file
UPDATE_VARIABLE = "NUMA_INFER_UPDATE_GOLDEN"


def cases() -> list[str]:
    """Every golden's name: a TOML file in GOLDEN."""
    return sorted(p.stem for p in GOLDEN.glob("*.toml"))


def paths_for(directory: Path) -> Paths:
    return paths_in(directory, directory / "admin.sock")


def render(name: str, directory: Path) -> str:
    """`name`.toml's haproxy.cfg for a front door whose files are in `directory` (the fake
    machine's tree is written under it too), as the daemon renders it: HAProxy binds."""
    config = parse_config((GOLDEN / f"{name}.toml").read_text(encoding="utf-8"), f"{name}.toml")
    served, engine = load_of(config)
    plan = make_plan(config, read_topology(fakesys.write_tree(directory / "fs", fakesys.dual_socket_smt())),
                     served=served)
    return render_haproxy(config, plan, paths_for(directory), served=served, engine=engine)


def normalised(text: str, directory: Path) -> str:
    return text.replace(str(directory), RUN_DIR)


def golden_path(name: str) -> Path:
    return GOLDEN / f"{name}.cfg"


def update(directory: Path) -> list[Path]:
    """Rewrite every golden from the current code (`directory`: a scratch one)."""
    written = []
    for name in cases():
        where = directory / name
        where.mkdir(parents=True, exist_ok=True)
        golden_path(name).write_text(normalised(render(name, where), where), encoding="utf-8")
        written.append(golden_path(name))
    return written
