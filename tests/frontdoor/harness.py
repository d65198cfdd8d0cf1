"""What the front door's tests share: a plan on a fake machine, a real HAProxy over the
daemon's own front door code (Door) or over the rendered haproxy.cfg with stub instances
(FrontDoor), the sockets a socket unit would pass, and the markers the stubs act on."""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from numad_infer.backends.process import ProcessBackend
from numad_infer.config.tenants import TenantKey
from numad_infer.config.load import parse_config
from numad_infer.config.schema import Config
from numad_infer.frontdoor.checked_config import render_checked
from numad_infer.frontdoor.control import Frontdoor
from numad_infer.frontdoor.haproxy import RuntimeAPI
from numad_infer.frontdoor.haproxy_config import BACKEND, paths_in, render_haproxy, write_config
from numad_infer.plan.placement import make_plan
from numad_infer.topology.sysfs import read_topology
from tests import fakesys
from tests.daemon_harness import free_port_block, run_dir, wait_for
from tests.fakes import load_of, served_of


def plan_for(tmp_path: Path, cfg):
    return make_plan(cfg, read_topology(fakesys.write_tree(tmp_path / "fs", fakesys.dual_socket_smt())),
                     served=served_of(cfg))


def binds_beside(host: str, port: int, reuse_port: bool = False) -> bool:
    """Can another socket take host:port now? With SO_REUSEADDR on, as a squatter would set it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            other.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            other.bind((host, port))
            other.listen(1)
        except OSError as exc:
            assert exc.errno == errno.EADDRINUSE, exc
            return False
        return True


def systemd_socket(host: str, port: int) -> socket.socket:
    """What numa-infer-port.socket binds (SO_REUSEADDR as systemd sets it, ReusePort=yes)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if ":" in host:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind((host, port))
    sock.listen(16)
    return sock


HAPROXY = "/usr/sbin/haproxy"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
with_haproxy = pytest.mark.skipif(not os.access(HAPROXY, os.X_OK), reason="haproxy not installed")


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


class Door:
    """The daemon's own front door code over a real HAProxy, in a run directory HAProxy's
    user can reach (as /run/numa-infer is)."""

    def __init__(self, tmp: Path, listen_port: int | None = None, directory: Path | None = None,
                 models: str = '[model]\npath = "/m.gguf"\n', server: str = "", extra: str = "") -> None:
        """`models`, `server`, `extra`: the model tables, more [server] keys, tables after [frontend]."""
        base = free_port_block(3)
        port = listen_port or base
        self.config = parse_config(f'{models}[server]\nbase_port = {base + 1}\n{server}'
                                   f'[frontend]\nlisten = "127.0.0.1:{port}"\nhaproxy = "{HAPROXY}"\n{extra}')
        self.plan = plan_for(tmp / "plan", self.config)
        self.run_dir = directory or run_dir(tmp)
        backend = ProcessBackend(self.run_dir / "logs")
        self.door = Frontdoor(backend.frontdoor_runner(self.run_dir))
        self.port = port

    @property
    def master(self) -> int:
        child = self.door.runner.child  # type: ignore[attr-defined]
        assert child is not None and child.poll() is None, self.log()
        return child.pid

    def log(self) -> str:
        path = self.run_dir / "logs" / "frontdoor.log"
        return path.read_text() if path.exists() else ""

    def apply(self, keys: tuple[TenantKey, ...] = (), api_key: str | None = None) -> bool:
        """What the daemon does with a load: haproxy.cfg rendered and checked for this front
        door's directory (validation's step), then applied. `keys`, `api_key`: as validation
        read the tenants' and the instances' key files."""
        served, engine = load_of(self.config)
        checked = render_checked(self.config, self.plan, served, engine, self.door.paths, keys, api_key)
        return self.door.apply(self.config, self.plan, served, checked)

    def start(self) -> None:
        assert self.apply()
        wait_for(lambda: self.door.api.command("show info").startswith("Name: HAProxy"), f"the admin socket\n{self.log()}")

    def processes(self) -> list[int]:
        master = self.master
        wait_for(lambda: children_of(master), "a worker")
        return [master, *children_of(master)]

    def stop(self) -> None:
        self.door.stop()


CRASH_MARKER = "please-crash-the-server"
SLOW_MARKER = "please-answer-late"


# A stand-in for an instance: GET (the health check) answers 200; POST logs the request's
# X-Test-Id, then answers {"served_by": NAME}, or dies before answering when the body
# carries the crash marker (a prompt that crashes llama.cpp), or after 3 s for the slow one.
# For its first LOADING seconds it answers everything as llama-server does while its model
# loads: 503 "Loading model" (it listens before it loads).
STUB = f"""
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

name, port, log, loading = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
ready_at = time.monotonic() + loading

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self, doc):
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _loading(self):
        if time.monotonic() >= ready_at:
            return False
        body = json.dumps({{"error": {{"code": 503, "message": "Loading model", "type": "unavailable_error"}}}}).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return True

    def do_GET(self):
        if not self._loading():
            self._answer({{"ok": True}})

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self._loading():
            return
        with open(log, "a") as out:
            out.write(self.headers.get("X-Test-Id", "-") + "\\n")
            out.flush()
            os.fsync(out.fileno())
        if b"{CRASH_MARKER}" in body:
            time.sleep(0.5)  # other requests arrive meanwhile
            os._exit(1)
        if b"{SLOW_MARKER}" in body:
            time.sleep(3)
        self._answer({{"served_by": name}})

ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes

    def served_by(self) -> str:
        return json.loads(self.body)["served_by"]

    def error(self) -> dict:
        assert self.content_type == "application/json", self
        return json.loads(self.body)["error"]


@dataclass
class FrontDoor:
    """A real HAProxy on the rendered haproxy.cfg, and one stub per planned instance."""

    tmp: Path
    config: Config
    run_dir: Path
    ports: list[int]
    haproxy: subprocess.Popen | None = None
    stubs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def port(self) -> int:
        return self.config.frontend.address[1]

    def log(self, name: str) -> list[str]:
        path = self.tmp / f"{name}.log"
        return path.read_text().split() if path.exists() else []

    def start_stub(self, index: int, loading_s: float = 0.0) -> None:
        """Stub `index` on its port; `loading_s`: answering 503 "Loading model" that long first."""
        name = f"stub{index}"
        script = self.tmp / "stub.py"
        script.write_text(STUB)
        port = self.ports[index]
        stub = self.stubs[name] = subprocess.Popen([sys.executable, str(script), name, str(port),
                                                    str(self.tmp / f"{name}.log"), str(loading_s)])
        # A stub that exits (its port taken by another process) is said so, not waited for.
        wait_for(lambda: stub.poll() is None and _accepts(port), f"{name} listening on {port}",
                 detail=lambda: f"the stub's exit status: {stub.poll()}")

    def start_haproxy(self) -> None:
        plan = plan_for(self.tmp / "plan", self.config)
        assert [i.port for i in plan.instances] == self.ports
        paths = paths_in(self.run_dir, self.run_dir / "haproxy.sock")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        served, engine = load_of(self.config)
        write_config(paths, render_haproxy(self.config, plan, paths, served=served, engine=engine))
        paths.state.write_text("1\n")
        self.haproxy = subprocess.Popen([HAPROXY, "-db", "-f", str(paths.config)], stdout=subprocess.DEVNULL,
                                        stderr=open(self.tmp / "haproxy.err", "w"))
        haproxy = self.haproxy
        wait_for(lambda: haproxy.poll() is None and _accepts(self.port), f"haproxy on {self.port}")

    def servers_up(self) -> None:
        api = RuntimeAPI(str(self.run_dir / "haproxy.sock"))
        wait_for(lambda: all(s.status == "UP" for s in api.backend(BACKEND).instances.values()), "every server UP")

    def servers_up_count(self, count: int) -> None:
        api = RuntimeAPI(str(self.run_dir / "haproxy.sock"))
        wait_for(lambda: [s.status for s in api.backend(BACKEND).instances.values()].count("UP") == count,
                 f"{count} server(s) UP")

    def backend_counter(self, column: str) -> int:
        text = RuntimeAPI(str(self.run_dir / "haproxy.sock")).command("show stat")
        rows = csv.DictReader(io.StringIO(text[2:]))
        return sum(int(r[column] or 0) for r in rows if r["pxname"] == BACKEND and r["svname"] == "BACKEND")

    def post(self, test_id: str, body: dict) -> Answer:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions", method="POST",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "X-Test-Id": test_id})
        try:
            with urllib.request.urlopen(req, timeout=30) as response:
                return Answer(response.status, response.headers.get_content_type(), response.read())
        except urllib.error.HTTPError as exc:
            return Answer(exc.code, exc.headers.get_content_type(), exc.read())

    def stop(self) -> None:
        for proc in [*self.stubs.values(), *([self.haproxy] if self.haproxy else [])]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _get(port: int, path: str) -> tuple[int, dict, float]:
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, json.loads(response.read()), time.monotonic() - started
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), time.monotonic() - started
