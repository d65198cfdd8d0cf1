"""Who the front door and the servers run as: the daemon's front door code (frontdoor/control.py)
over a real HAProxy, as its own user.

HAProxy runs as its own unprivileged user under both backends, its admin socket in a
directory only it and the daemon reach. Under the process backend that is checked on a
real HAProxy started by the daemon's own code (`Frontdoor` over `ProcessFrontdoorRunner`),
reading the processes' credentials from /proc; under systemd on the rendered unit, with
`systemd-analyze security`. The users come from the package's sysusers.d file, run
through the real `systemd-sysusers` into a scratch root. Where this host lacks them (no
.deb, `scripts/setup` not run as root), the process backend falls back to `nobody`, and
the tests expect whichever applies. Who runs as whom, decided in host/identity.py, is
tested alone in tests/host/test_identity.py.
"""

from __future__ import annotations

import os
import pwd
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from numad_infer.backends.process import SOCKET_DIR_NAME
from numad_infer.units.render import render_frontdoor_unit, render_units
from numad_infer.config.load import parse_config
from numad_infer.daemon.publish import frontdoor_status
from numad_infer.frontdoor.haproxy import HaproxyError
from numad_infer.frontdoor.haproxy_config import render_haproxy, write_config
from numad_infer.host.identity import (
    FALLBACK_USER,
    FRONTDOOR_USER,
    INSTANCE_USER,
)
from tests.daemon_harness import wait_for
from tests.fakes import load_of
from tests.frontdoor.harness import plan_for
from tests.unitfiles import score
from tests.frontdoor.harness import as_root, children_of, HAPROXY, with_haproxy

ROOT = Path(__file__).resolve().parents[2]
MISSING = "numa-infer-no-such-user"


def expected_frontdoor_uid() -> int:
    try:
        return pwd.getpwnam(FRONTDOOR_USER).pw_uid
    except KeyError:
        return pwd.getpwnam(FALLBACK_USER).pw_uid


def status_of(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, v in (line.split(":", 1) for line in lines)}


def free_privileged_port() -> int:
    for port in range(700, 1000):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip("no free port below 1024")


@as_root
@with_haproxy
def test_the_process_backend_runs_haproxy_as_its_own_user_master_and_workers_alike(doors, monkeypatch) -> None:
    # Before: haproxy ran as the root daemon's child, as root, with every capability, and
    # with the daemon's whole environment.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "daemon-secret")
    door = doors()
    door.start()
    environ = Path(f"/proc/{door.master}/environ").read_bytes().split(b"\0")
    assert not [e for e in environ if b"daemon-secret" in e or e.startswith(b"NOTIFY_SOCKET=")]
    assert any(e.startswith(b"PATH=") for e in environ)
    uid = expected_frontdoor_uid()
    assert uid != 0
    for pid in door.processes():
        status = status_of(pid)
        assert status["Uid"].split() == [str(uid)] * 4, (pid, status["Uid"])
        assert status["Gid"].split() == [str(pwd.getpwuid(uid).pw_gid)] * 4
        assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
    # A reload re-executes the master: it stays unprivileged, and the daemon still drives it.
    old = set(children_of(door.master))
    door.door.reloads.ask()
    # Generous bounds: a reload on a loaded 2-core machine (CI, a VM guest beside it) takes
    # seconds. Each pass (observe) asks again for a reload HAProxy dropped (the test below).
    wait_for(lambda: door.door.observe() is not None and set(children_of(door.master)) - old,
             "a new worker after the reload", 60, detail=door.log)
    for pid in door.processes():
        try:
            uids = status_of(pid)["Uid"].split()
        except FileNotFoundError:
            continue  # an old worker that finished its work and left in between
        assert uids == [str(uid)] * 4
    # The runtime API answers again once the new worker has taken the socket over.
    wait_for(lambda: door.door.observe() is not None, "the runtime API after the reload", 60,
             detail=lambda: door.door.error)


@with_haproxy
def test_a_reload_haproxy_drops_while_it_starts_is_asked_for_again_until_taken(doors) -> None:
    # HAProxy's master drops a SIGUSR2 that comes while it is still starting, though its
    # worker already answers the runtime API (CI lost one so; 63 of 100 under load, measured).
    # The daemon sees a reload taken when another worker answers, and asks again until then.
    # Ten starts, each reloaded at once: without asking again, most of them lose it.
    door = doors()
    for attempt in range(10):
        door.start()
        before = door.door.api.worker_pid()
        door.door.reloads.ask()
        assert door.door.reloads.pending is not None and door.door.reloads.pending.worker_pid == before
        status = frontdoor_status(door.door, {})  # the status says so until the reload shows taken
        assert status is not None and status.reloading
        wait_for(lambda: door.door.observe() is not None and door.door.reloads.pending is None,
                 f"reload {attempt} taken", 60, detail=door.log)
        assert door.door.api.worker_pid() != before
        status = frontdoor_status(door.door, {})
        assert status is not None and not status.reloading
        door.stop()


@as_root
@with_haproxy
def test_the_admin_socket_lies_in_a_directory_only_haproxy_and_the_daemon_reach(doors) -> None:
    door = doors()
    door.start()
    socket_dir = door.run_dir / SOCKET_DIR_NAME
    assert door.door.runner.socket_path.parent == socket_dir
    info = os.lstat(socket_dir)
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == expected_frontdoor_uid()
    sock = os.lstat(door.door.runner.socket_path)
    assert stat.S_ISSOCK(sock.st_mode) and sock.st_uid == expected_frontdoor_uid()
    # Another unprivileged user is stopped at the directory, socket mode or not.
    other = pwd.getpwnam(FALLBACK_USER if expected_frontdoor_uid() != pwd.getpwnam(FALLBACK_USER).pw_uid else "daemon")
    probe = subprocess.run(["python3", "-c", f"import socket; socket.socket(socket.AF_UNIX).connect({str(door.door.runner.socket_path)!r})"],
                           user=other.pw_uid, group=other.pw_gid, extra_groups=[], capture_output=True, text=True)
    assert probe.returncode != 0 and "PermissionError" in probe.stderr, probe.stderr


@as_root
@with_haproxy
def test_a_port_below_1024_is_served_with_no_capability_the_daemon_holds_the_socket(doors) -> None:
    # Before the daemon held the listening socket (numad_infer/frontdoor/listener.py), HAProxy bound
    # it and kept CAP_NET_BIND_SERVICE for that; it is handed the bound socket now.
    door = doors(listen_port=free_privileged_port())
    door.start()
    with socket.create_connection(("127.0.0.1", door.port), timeout=5):
        pass
    for pid in door.processes():
        status = status_of(pid)
        assert status["Uid"].split()[0] != "0"
        assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0, status["CapEff"]


@as_root
@with_haproxy
def test_without_the_capability_an_unprivileged_haproxy_cannot_bind_below_1024(doors) -> None:
    # The test above is not vacuous: HAProxy started without the held socket, binding the
    # port itself with no capability, fails.
    door = doors(listen_port=free_privileged_port())
    door.run_dir.mkdir(parents=True, exist_ok=True)
    served, engine = load_of(door.config)
    write_config(door.door.paths, render_haproxy(door.config, door.plan, door.door.paths, served=served, engine=engine))
    door.door.paths.state.write_text("1\n")
    door.door.runner.start(HAPROXY, door.door.paths.config)  # holds no socket: HAProxy binds
    child = door.door.runner.child
    assert child.wait(20) != 0
    assert "Permission denied" in door.log() or "cannot bind" in door.log(), door.log()


@as_root
@with_haproxy
def test_a_link_planted_as_the_socket_directory_is_refused_not_followed(doors, tmp_path: Path) -> None:
    door = doors()
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o755)
    door.run_dir.mkdir(parents=True, exist_ok=True)
    (door.run_dir / SOCKET_DIR_NAME).symlink_to(target)
    with pytest.raises(HaproxyError, match="socket directory.* is not a directory"):
        door.apply()
    info = os.stat(target)
    assert info.st_uid == 0 and stat.S_IMODE(info.st_mode) == 0o755


@as_root
@with_haproxy
def test_a_run_directory_haproxys_user_cannot_reach_is_named_with_the_fix(doors, tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    door = doors(directory=private / "run")
    with pytest.raises(HaproxyError, match=r"haproxy runs as .*, who cannot read .*haproxy.cfg: directory .* is not "
                                           r"searchable by .*chmod o\+x"):
        door.apply()


def _directives(text: str) -> list[str]:
    return [line for line in text.splitlines() if "=" in line and not line.startswith("#")]


def test_the_rendered_front_door_unit_runs_as_its_user_with_a_group_only_directory() -> None:
    config = parse_config('[model]\npath = "/m.gguf"\n[frontend]\nlisten = "127.0.0.1:8000"\n')
    lines = _directives(render_frontdoor_unit(config))
    assert f"User={FRONTDOOR_USER}" in lines and f"Group={FRONTDOOR_USER}" in lines
    assert "RuntimeDirectory=numa-infer-frontdoor" in lines and "RuntimeDirectoryMode=0750" in lines
    assert "DynamicUser=yes" not in lines  # the daemon could not join a DynamicUser's group
    # The daemon reaches the socket through that group, and has no DAC override to do otherwise.
    daemon = _directives((ROOT / "packaging/systemd/numa-infer.service").read_text())
    groups = next(line for line in daemon if line.startswith("SupplementaryGroups=")).split("=", 1)[1].split()
    assert FRONTDOOR_USER in groups
    assert "CapabilityBoundingSet=CAP_SYS_NICE CAP_NET_BIND_SERVICE" in daemon  # it binds the front door's port
    # Its sockets from numa-infer-port.socket, or its own kept across its restarts (with the twin).
    assert "Sockets=numa-infer-port.socket" in daemon and "FileDescriptorStoreMax=4" in daemon
    # Without the user: root with no capability, the unit still starts.
    fallback = _directives(render_frontdoor_unit(config, None))
    assert not [l for l in fallback if l.startswith(("User=", "Group="))]
    assert "CapabilityBoundingSet=" in fallback and "RuntimeDirectoryMode=0750" in fallback
    # Not even for port 80: the daemon binds it and HAProxy starts on its socket.
    low = _directives(render_frontdoor_unit(parse_config('[model]\npath = "/m.gguf"\n[frontend]\nlisten = "0.0.0.0:80"\n')))
    assert "CapabilityBoundingSet=" in low and "AmbientCapabilities=" in low
    assert not [l for l in low if l.startswith(("CapabilityBoundingSet=C", "AmbientCapabilities=C"))]
    assert all("numad_infer.frontdoor_exec" in l for l in low if l.startswith(("ExecStart=", "ExecStartPre=")))


@pytest.mark.parametrize("listen", ["127.0.0.1:8000", "0.0.0.0:80"])
def test_the_front_door_unit_with_its_user_scores_better_than_root(tmp_path: Path, listen: str) -> None:
    config = parse_config(f'[model]\npath = "/m.gguf"\n[frontend]\nlisten = "{listen}"\n')
    plan = plan_for(tmp_path / "plan", config)
    served, engine = load_of(config)
    own = score(tmp_path / "own", render_units(config, plan, served=served, engine=engine),
                "numa-infer-frontdoor.service", 2.0)
    root = score(tmp_path / "root", render_units(config, plan, None, served=served, engine=engine),
                 "numa-infer-frontdoor.service", 2.5)
    print(f"exposure ({listen}): front door as {FRONTDOOR_USER} {own}, as root {root}")
    assert own < root


def test_the_package_sysusers_file_makes_both_users(tmp_path: Path) -> None:
    # The real systemd-sysusers, in a scratch root: what the package's postinst runs.
    sysusers = ROOT / "debian/numa-infer.sysusers"
    (tmp_path / "etc").mkdir()
    proc = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(sysusers)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    users = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()}
    groups = {line.split(":")[0] for line in (tmp_path / "etc/group").read_text().splitlines()}
    for name in (INSTANCE_USER, FRONTDOOR_USER):
        assert name in users and name in groups
        uid, shell = int(users[name][2]), users[name][6]
        assert 0 < uid < 1000 and shell.endswith("nologin")
    assert users[INSTANCE_USER][2] != users[FRONTDOOR_USER][2]
