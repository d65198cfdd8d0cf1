"""Bad input and planted files: one line, never a traceback,
and nothing a local user leaves in a directory is trusted.

Each test reproduces what a review did by hand: a hold naming a root PID, a FIFO where a
hold or the state file belongs, a link where the candidate haproxy.cfg is written, a
symlinked config under `tune --apply`, hostile numbers and nesting in the config, a state
file with a string for a PID.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from numad_infer.config.load import parse_config
from numad_infer.errors import ConfigError, NumaInferError
from numad_infer.frontdoor.listener import HeldListener
from numad_infer.status.records import Status, StatusError
from numad_infer.supervision import holds
from numad_infer.tune.config_edit import Edit, apply_edits
from tests.fakes import served_of

ROOT = Path(__file__).resolve().parents[1]
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="ownership and privilege checks need root")
MINIMAL = '[model]\npath = "/srv/model.gguf"\n'


# -- the config: hostile numbers and nesting ---------------------------------------------------
def test_a_cpu_range_beyond_what_linux_allows_is_one_config_error() -> None:
    started = time.monotonic()
    with pytest.raises(ConfigError, match="reserve_cpus.*fewer than 8192"):
        parse_config(MINIMAL + '[placement]\nreserve_cpus = "0-4294967295"\n')
    # Before: a set of 4 billion ints, MemoryError after a long while.
    assert time.monotonic() - started < 5


def test_deeply_nested_toml_is_one_config_error() -> None:
    # Before: RecursionError out of tomllib.
    with pytest.raises(ConfigError, match="nested too deeply"):
        parse_config(MINIMAL + "x = " + "[" * 3000 + "]" * 3000 + "\n")


# -- the state file ------------------------------------------------------------------------------
def status_cli(state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "numad_infer", "--state-file", str(state), "status"],
                          capture_output=True, text=True, cwd=ROOT, timeout=30)


def a_state(**instance: object) -> dict:
    row = {"name": "infer@0", "node": 0, "cpus": [0, 1], "mems": [0], "threads": 2, "port": 8080, "pid": 4242,
           "state": "healthy", **instance}
    return {"schema": 2, "daemon": {"state": "running", "config": "/etc/numa-infer.toml", "pid": os.getpid()},
            "instances": [row]}


@pytest.mark.parametrize("field, value", [("pid", "1"), ("cpus", "0-1"), ("threads", True), ("state", "fine"),
                                          ("drift_events", {"affinity": "x"}), ("surprise", 1)])
def test_a_state_file_field_of_the_wrong_type_is_one_line(tmp_path: Path, field: str, value: object) -> None:
    state = tmp_path / "state.json"
    state.write_text(json.dumps(a_state(**{field: value})))
    proc = status_cli(state)
    # Before, `"pid": "1"`: TypeError in `status` (a traceback).
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "instances[0]" in proc.stderr and field in proc.stderr


def test_the_checked_state_file_still_reads_a_good_one(tmp_path: Path) -> None:
    status = Status.from_json(a_state(rotation="UP", drift_events={"affinity": 2}))
    assert status.instances[0].pid == 4242 and status.instances[0].drift_events == {"affinity": 2}


def test_a_fifo_or_link_as_the_state_file_is_one_line_not_a_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    proc = status_cli(fifo)  # before: blocked forever in open()
    assert proc.returncode == 1 and "is not a regular file" in proc.stderr and "Traceback" not in proc.stderr
    real = tmp_path / "real.json"
    real.write_text(json.dumps(a_state()))
    link = tmp_path / "link.json"
    link.symlink_to(real)
    proc = status_cli(link)
    assert proc.returncode == 1 and "is a symbolic link" in proc.stderr, proc.stderr


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20)


def mutated_state(data: st.DataObject) -> dict:
    """A valid state with one field anywhere replaced by any JSON value."""
    state = a_state()
    where = data.draw(st.sampled_from(["daemon", "instance"]))
    target = state["daemon"] if where == "daemon" else state["instances"][0]
    key = data.draw(st.sampled_from(sorted(target) + ["extra"]))
    target[key] = data.draw(JSON)
    return state


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_state_file_is_read_or_refused_with_a_status_error(data: st.DataObject) -> None:
    document = data.draw(st.one_of(JSON, st.builds(mutated_state, st.data())))
    try:
        status = Status.from_json(document)
    except StatusError:
        return
    # What is accepted is typed all the way down: what `status` formats never surprises it.
    for instance in status.instances:
        assert isinstance(instance.pid, (int, type(None))) and not isinstance(instance.pid, bool)
        assert all(isinstance(c, int) for c in instance.cpus)


# -- holds -------------------------------------------------------------------------------------------
def write_hold(directory: Path, name: str, **fields: object) -> Path:
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / f"{name}{holds.SUFFIX}"
    path.write_text(json.dumps({"pid": os.getpid(), "started": psutil.Process().create_time(), "by": "test",
                                "since": time.time(), **fields}))
    return path


def test_a_hold_taken_by_a_live_process_is_honoured_and_released_with_it(tmp_path: Path) -> None:
    directory = tmp_path / "holds"
    path = holds.acquire(directory, "infer@0", "numa-infer tune")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert set(holds.active(directory)) == {"infer@0"}
    holds.release(path)
    assert holds.active(directory) == {}


def test_a_recycled_pid_holds_nothing(tmp_path: Path) -> None:
    # The PID is alive, but it is not the process that took the hold (another start time):
    # before, a PID was enough, so any long-lived process "held" an instance forever.
    directory = tmp_path / "holds"
    parent = psutil.Process(os.getppid())
    stale = write_hold(directory, "infer@0", pid=parent.pid, started=parent.create_time() + 3600)
    assert holds.active(directory) == {}
    assert not stale.exists()


@AS_ROOT
def test_a_hold_planted_by_another_user_is_ignored(tmp_path: Path) -> None:
    # Before: a hold naming a long-lived root process stopped the instance.
    directory = tmp_path / "holds"
    parent = psutil.Process(os.getppid())
    planted = write_hold(directory, "infer@0", pid=parent.pid, started=parent.create_time())
    os.chown(planted, 65534, 65534)
    assert holds.active(directory) == {}


def test_a_fifo_or_link_named_like_a_hold_neither_blocks_nor_counts(tmp_path: Path) -> None:
    directory = tmp_path / "holds"
    directory.mkdir()
    os.mkfifo(directory / "infer@0.hold")  # before: read_text() blocked the daemon's loop
    real = write_hold(tmp_path / "elsewhere", "x")
    (directory / "infer@1.hold").symlink_to(real)
    started = time.monotonic()
    assert holds.active(directory) == {}
    assert time.monotonic() - started < 5
    assert real.exists()  # a link is ignored, and what it points to is not removed


@AS_ROOT
def test_a_non_root_tune_cannot_hold_and_says_so_in_one_line(tmp_path: Path) -> None:
    directory = tmp_path / "run" / "holds"
    directory.mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path, 0o755)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child drops to nobody, as a non-root `numa-infer tune` runs
        try:
            os.setgid(65534)
            os.setuid(65534)
            holds.acquire(directory, "infer@0", "numa-infer tune")
            os.write(write, b"acquired")
        except holds.HoldError as exc:
            os.write(write, f"HoldError: {exc}".encode())
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails
            os.write(write, f"{type(exc).__name__}: {exc}".encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    said = os.read(read, 4096).decode()
    # Before: PermissionError with a traceback.
    assert said.startswith("HoldError:") and "not writable by this user" in said, said


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_any_hold_file_is_a_hold_or_ignored(tmp_path_factory: pytest.TempPathFactory, document: object) -> None:
    directory = tmp_path_factory.mktemp("holds")
    (directory / "infer@0.hold").write_text(json.dumps(document))
    found = holds.active(directory)
    assert found == {} or isinstance(found["infer@0"].pid, int)


# -- directories and files the daemon writes ---------------------------------------------------------
@AS_ROOT
def test_a_sticky_world_writable_directory_is_refused_for_the_daemons_files(tmp_path: Path) -> None:
    from numad_infer.systemd.unitdir import check_private_dir

    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o1777)  # like /tmp: before, the sticky bit exempted it
    with pytest.raises(NumaInferError, match="writable by others"):
        check_private_dir(run)
    inside = tmp_path / "sticky" / "numa-infer"  # a private directory under a sticky one is fine
    inside.parent.mkdir()
    inside.parent.chmod(0o1777)
    check_private_dir(inside)


class IdleRunner:
    restarted_by_manager = False
    haproxy_uids = frozenset({0})
    haproxy_gid = None

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.socket_path = run_dir, run_dir / "admin.sock"
        self.listener = HeldListener()

    def running(self) -> bool:
        return False

    def start(self, binary: str, config_path: Path) -> None: ...
    def reload(self) -> None: ...
    def stop(self) -> None: ...


@pytest.mark.skipif(not Path("/usr/sbin/haproxy").exists(), reason="needs haproxy (apt-get install haproxy)")
def test_haproxy_cfg_and_its_lua_file_replace_planted_links_instead_of_writing_through_them(tmp_path: Path) -> None:
    from numad_infer.config.models import served_models
    from numad_infer.engines import engine_of
    from numad_infer.frontdoor.checked_config import render_checked
    from numad_infer.frontdoor.control import Frontdoor
    from numad_infer.plan.placement import make_plan
    from numad_infer.topology.sysfs import read_topology
    from tests import fakesys

    secret = tmp_path / "root-only"
    secret.write_text("untouched\n")
    secret.chmod(0o600)
    run_dir = tmp_path / "frontdoor"
    run_dir.mkdir()
    front = Frontdoor(IdleRunner(run_dir))
    for planted in (front.paths.config, front.paths.lua):
        planted.symlink_to(secret)
    from tests.daemon_harness import free_port_block

    listen = f"127.0.0.1:{free_port_block(1)}"
    config = parse_config(MINIMAL + f'[frontend]\nlisten = "{listen}"\nhaproxy = "/usr/sbin/haproxy"\n')
    plan = make_plan(config, read_topology(fakesys.write_tree(tmp_path / "fs", fakesys.dual_socket_smt())),
                     served=served_of(config))
    served = served_models(config)
    # Validation puts the Lua file in place to check the text; the front door writes both.
    assert front.apply(config, plan, served, render_checked(config, plan, served, engine_of(config), front.paths))
    # Before: the daemon wrote haproxy.cfg into the link's target and chmod-ed it 0644.
    assert secret.read_text() == "untouched\n" and stat.S_IMODE(secret.stat().st_mode) == 0o600
    for written in (front.paths.config, front.paths.lua):
        assert not written.is_symlink() and written.read_text()
    front.runner.listener.release()


# -- tune --apply on the operator's file ---------------------------------------------------------
def test_tune_apply_edits_the_target_of_a_symlinked_config_and_keeps_the_link(tmp_path: Path) -> None:
    real = tmp_path / "srv" / "numa-infer.toml"
    real.parent.mkdir()
    real.write_text("# the operator's comment\n" + MINIMAL)
    real.chmod(0o640)
    link = tmp_path / "numa-infer.toml"
    link.symlink_to(real)
    backup = apply_edits(link, [Edit("placement", "threads", 3)], lambda config: None)
    # Before: the link became a regular file and the real file kept its old text.
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert "threads = 3" in real.read_text() and "# the operator's comment" in real.read_text()
    assert stat.S_IMODE(real.stat().st_mode) == 0o640
    assert backup.parent == real.parent and "threads" not in backup.read_text()


def test_tune_apply_refuses_a_file_that_changed_between_its_read_and_its_write(tmp_path: Path) -> None:
    path = tmp_path / "numa-infer.toml"
    path.write_text(MINIMAL)

    def operator_edits_meanwhile(config: object) -> None:
        path.write_text(MINIMAL + "# edited by hand meanwhile\n")

    with pytest.raises(ConfigError, match="changed while it was being edited; nothing written"):
        apply_edits(path, [Edit("placement", "threads", 3)], operator_edits_meanwhile)
    assert path.read_text().endswith("# edited by hand meanwhile\n")
    assert not list(tmp_path.glob("*.bak"))
