"""A third engine, defined here and nowhere in the package: registering it is all it takes
for the config to accept it, the planner and renderer to run it, the front door to size
and probe it, the probe to find it up and the daemon's metrics reader to read it.

The toy server is a real process (Python's http.server) on a real port.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from numad_infer import engines
from numad_infer.units.render import render_units
from numad_infer.config.load import parse_config
from numad_infer.engines import Engine, EngineCounters, engine_of
from numad_infer.engines.keys import check_engine_keys
from numad_infer.errors import ConfigError
from numad_infer.frontdoor.haproxy_config import Paths, render_haproxy
from numad_infer.host.identity import BackendKind
from numad_infer.plan.placement import make_plan
from numad_infer.supervision.health import probe, read_engine_metrics
from numad_infer.topology.sysfs import read_topology
from numad_infer.validate.pipeline import validate
from tests import fakesys
from tests.conftest import searchable_by_others
from tests.daemon_harness import free_port
from tests.unitfiles import directives, systemd_split
from tests.fakes import load_of

TOY_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"/alive": b"up", "/stats": b"generated=1234\\nbusy=2\\n"}.get(self.path)
        self.send_response(200 if body else 404)
        self.end_headers()
        self.wfile.write(body or b"")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class ToyEngine(Engine):
    name = "toy"
    liveness_path = "/alive"
    key_env = "TOY_KEY"
    metrics_path = "/stats"
    def __init__(self, script: Path) -> None:
        self.script = script  # the toy server's code (a unit's command line takes no newline)
        self.checked: list[str] = []

    def argv(self, config, instance, key_from_credential: bool = False) -> list[str]:
        return [sys.executable, str(self.script), str(instance.port), "--threads", str(instance.threads)]

    def slots(self, config) -> int:
        return 3

    def check_host(self, config, source, host) -> list[str]:
        self.checked.append(source)
        return ["toy engine: not for production"]

    def parse_metrics(self, text: str) -> EngineCounters | None:
        fields = dict(line.split("=") for line in text.split())
        return EngineCounters(float(fields["generated"]), int(fields["busy"]))


@pytest.fixture
def toy(tmp_path: Path) -> Iterator[ToyEngine]:
    script = tmp_path / "toy_server.py"
    script.write_text(TOY_SERVER)
    engine = ToyEngine(script)
    engines.register(engine)
    yield engine
    engines.unregister(engine.name)


def toy_config(model: Path, port: int = 8080, extra: str = ""):
    """Parsed, and its engine keys checked as the validation pipeline checks them first."""
    cfg = parse_config(f'[model]\npath = "{model}"\n[server]\nengine = "toy"\nbase_port = {port}\n{extra}'
                       '[frontend]\nlisten = ""\n', "/etc/numa-infer.toml")
    check_engine_keys(cfg, "/etc/numa-infer.toml")
    return cfg


def test_an_unregistered_engine_is_refused_and_a_registered_one_accepted(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r'server.engine = "toy": must be one of'):
        toy_config(tmp_path / "m.gguf")
    engines.register(ToyEngine(tmp_path / "toy_server.py"))
    try:
        assert toy_config(tmp_path / "m.gguf").server.engine == "toy"
        # Another engine's own keys stay refused for it.
        with pytest.raises(ConfigError, match=r'server.parallel = 2: applies to server.engine = "llama-server"'):
            toy_config(tmp_path / "m.gguf", extra="parallel = 2\n")
    finally:
        engines.unregister("toy")


def test_a_plugged_in_engine_is_planned_rendered_probed_and_read(tmp_path: Path, toy: ToyEngine) -> None:
    model = searchable_by_others(tmp_path) / "m.gguf"
    model.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(1016))  # version 3, no tensors, no metadata
    model.chmod(0o644)
    topology = read_topology(fakesys.write_tree(tmp_path / "fs", fakesys.dual_socket_smt()))
    cfg = toy_config(model, free_port())
    # The one pipeline runs the engine's own host check and keeps its warning.
    loaded = validate(cfg, "/etc/numa-infer.toml", topology, BackendKind.PROCESS, unit_dirs=())
    assert toy.checked == ["/etc/numa-infer.toml"] and "toy engine: not for production" in loaded.warnings
    # No server.* key names its program: the model alone is what a roll-out watches, and
    # `check` names the engine without one.
    assert loaded.artifacts.startswith(f"model {model}: ") and "; engine " not in loaded.artifacts
    from numad_infer.cli.present import format_engine
    assert format_engine(cfg, toy) == "engine: toy (server.engine)"
    plan = loaded.plan
    instance = plan.instances[0]
    units = render_units(cfg, plan, served=loaded.served, engine=loaded.engine)
    d = dict(directives(units[f"{instance.unit}.d/50-numa-infer.conf"]))
    assert systemd_split(d["ExecStart"])[-2:] == ["--threads", str(instance.threads)]
    front = cfg.model_copy(update={"frontend": cfg.frontend.model_copy(update={"listen": "127.0.0.1:9000"})})
    served, engine = load_of(front)
    text = render_haproxy(front, make_plan(front, topology, served=served), Paths(Path("/c"), Path("/s"), Path("/k")),
                          served=served, engine=engine)
    assert "option httpchk GET /alive" in text and " maxconn 3 " in text
    server = subprocess.Popen(engine_of(cfg).argv(cfg, instance))
    try:
        deadline = time.monotonic() + 20
        while not (result := probe(cfg.server.host, instance.port, 1.0, toy.liveness_path)).ok:
            assert time.monotonic() < deadline, result
            time.sleep(0.1)
        assert read_engine_metrics(toy, cfg.server.host, instance.port, None, 2.0) == EngineCounters(1234.0, 2)
    finally:
        server.terminate()
        server.wait(10)
