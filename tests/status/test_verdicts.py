"""One verdict of "serving", "ready" and "config ok" for the status line, the tables,
`health --ready` and the metrics; the causes the daemon knows or can read, said."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from numad_infer.backends.childlog import ChildOutput, InstanceLogs
from numad_infer.backends.process import ProcessFrontdoorRunner
from numad_infer.cli.main import main
from numad_infer.cli.present import format_status
from numad_infer.daemon import publish
from numad_infer.lifecycle.states import State, Supervision
from numad_infer.plan.model import Instance, Policy
from numad_infer.status import metrics
from numad_infer.status.records import (
    DaemonState,
    DaemonStatus,
    FrontdoorStatus,
    InstanceStatus,
    ReloadResult,
    Status,
    group_models,
)
from numad_infer.status.statefile import read_status, write_status
from numad_infer.supervision.instance import Runtime

SERVED = (("tiny", "tiny", ()), ("chat", "chat", ()))
DOOR = FrontdoorStatus("127.0.0.1:8000", True, 0, 0)


def _inst(name: str, model: str, state: State = State.HEALTHY, rotation: str | None = "UP",
          copy_rotation: str | None = None) -> InstanceStatus:
    return InstanceStatus(name=name, node=0, cpus=(0,), mems=(0,), threads=1, port=8080, pid=1, state=state,
                          model=model, rotation=rotation, copy_rotation=copy_rotation)


def _daemon(**kwargs: Any) -> DaemonStatus:
    # status="": a daemon's snapshot (its line is made from the rest of it)
    return DaemonStatus(DaemonState.RUNNING, "/etc/numa-infer.toml", pid=os.getpid(), updated_at=time.time(),
                        interval_s=5.0, status="", **kwargs)


def summary_line(status: Status) -> str:
    from numad_infer.status.verdicts import summary_line as line  # new with the fix: each test fails alone

    return line(status)


def _model_metric(status: Status, model: str) -> float:
    collector = metrics.SnapshotCollector(lambda: status)
    family = next(f for f in collector.collect() if f.name == "numa_infer_model_healthy")
    return next(s.value for s in family.samples if s.labels["model"] == model)


def test_a_surge_copy_in_rotation_serves_its_model_in_the_line_the_tables_health_and_metrics(tmp_path: Path) -> None:
    # `numa-infer restart tiny`: its only instance restarts, out of rotation, while its copy
    # serves on the model's spare server (surge-<backend>): /healthz answers 200.
    instances = (_inst("infer@tiny-0", "tiny", State.RESTARTING, "MAINT", copy_rotation="UP"),
                 _inst("infer@chat-0", "chat"))
    status = Status(_daemon(), instances, DOOR, group_models(SERVED, instances, True))
    assert summary_line(status) == "1/2 instances healthy (1 restarting); 2/2 models serving"
    state = tmp_path / "state.json"
    write_status(state, status)
    text = format_status(read_status(state) or status)
    assert "status: 1/2 instances healthy (1 restarting); 2/2 models serving" in text
    assert "model tiny: healthy" in text.splitlines()
    assert status.ready and _model_metric(status, "tiny") == 1.0

def test_the_state_file_carries_the_line_made_from_the_rest_of_it(tmp_path: Path) -> None:
    instances = (_inst("infer@tiny-0", "tiny", State.RESTARTING, "MAINT", copy_rotation="UP"),
                 _inst("infer@chat-0", "chat"))
    state = tmp_path / "state.json"
    write_status(state, Status(replace(_daemon(), status="1/2 instances healthy; 1/2 models serving (tiny not)"),
                               instances, DOOR, group_models(SERVED, instances, True)))
    written = read_status(state)
    assert written is not None and written.daemon.status == "1/2 instances healthy (1 restarting); 2/2 models serving"


def test_a_model_is_not_served_once_its_servers_leave_rotation_whatever_the_instance_says() -> None:
    instances = (_inst("infer@tiny-0", "tiny", State.HEALTHY, "MAINT"), _inst("infer@chat-0", "chat"))
    status = Status(_daemon(), instances, DOOR, group_models(SERVED, instances, True))
    assert summary_line(status) == "2/2 instances healthy; 1/2 models serving (tiny not)"
    assert _model_metric(status, "tiny") == 0.0 and not status.healthy


def test_a_front_door_refused_at_start_serves_nothing_and_nothing_was_applied_before(tmp_path: Path,
                                                                                   capsys: Any) -> None:
    refusal = 'the front door refused the plan: cannot listen on frontend.listen = "127.0.0.1:8000": in use'
    fd: Any = SimpleNamespace(listen="", error=refusal)
    front = publish.frontdoor_status(fd, {})
    assert front is not None and not front.up
    instances = (_inst("infer@tiny-0", "tiny", rotation=None), _inst("infer@chat-0", "chat", rotation=None))
    started = ReloadResult(time.time(), False, "start", refusal)
    status = Status(_daemon(last_reload=started), instances, front, group_models(SERVED, instances, True))
    assert summary_line(status) == f"2/2 instances healthy; 0/2 models serving (tiny, chat not); not applied: {refusal}"
    assert "running previous plan" not in format_status(status) and not status.ready and not status.healthy
    # `health --ready` exits with what it prints.
    state = tmp_path / "state.json"
    write_status(state, status)
    assert main(["--state-file", str(state), "health", "--ready"]) == 1
    assert capsys.readouterr().out.startswith("not ready: 0/2 instance(s) in rotation; front door down")
    # A later reload refused with a plan running says so, as before.
    reloaded = replace(status.daemon, last_reload=replace(started, why="reload"))
    assert "config error, running previous plan" in summary_line(Status(reloaded, instances, DOOR))


def test_health_ready_without_a_front_door_counts_healthy_instances(tmp_path: Path, capsys: Any) -> None:
    instances = (_inst("infer@0", "", rotation=None), _inst("infer@1", "", State.FAILED, rotation=None))
    state = tmp_path / "state.json"
    write_status(state, Status(_daemon(), instances))
    assert main(["--state-file", str(state), "health", "--ready"]) == 0
    assert capsys.readouterr().out == "ready: 1/2 instance(s) healthy (no front door)\n"


def test_a_metrics_port_in_use_is_said_by_status_and_status_exits_degraded() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    endpoint = metrics.Endpoint(lambda: None)
    try:
        endpoint.listen_on(f"127.0.0.1:{port}")
    finally:
        taken.close()
    assert endpoint.listen.startswith(f"cannot listen on 127.0.0.1:{port}: ")
    status = Status(_daemon(metrics=endpoint.listen or None), (_inst("infer@0", "", rotation=None),))
    assert f"metrics: cannot listen on 127.0.0.1:{port}: " in format_status(status)
    assert not status.healthy  # `status` exits 1: degraded
    endpoint.listen_on(f"127.0.0.1:{port}")  # tried again at the next apply: free now
    try:
        assert endpoint.listen == f"127.0.0.1:{port}"
    finally:
        endpoint.listen_on("")


def test_the_cause_in_a_failing_instances_log_is_named_and_escaped(tmp_path: Path) -> None:
    from numad_infer.backends.childlog import last_error_line

    log = tmp_path / "infer@0.log"
    log.write_bytes(b"main: loading model\n"
                    b"main: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 28080\x1b[2J\n"
                    b"srv    operator(): cleaning up before exit...\n")
    cause = "main: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 28080\\x1b[2J"
    assert last_error_line(log) == cause
    assert last_error_line(tmp_path / "none.log") is None
    instance = Instance("infer@0", 0, (0,), ((0,),), (0,), Policy.BIND, 1, 28080)
    # The process backend's runner: the one whose children's output the daemon writes itself.
    fd: Any = SimpleNamespace(runner=ProcessFrontdoorRunner(tmp_path, ChildOutput(InstanceLogs.FILE, tmp_path), None))
    failed = Runtime(instance, Supervision(state=State.FAILED))
    assert publish._log_error(failed, fd) == cause
    assert publish._log_error(Runtime(instance, Supervision(state=State.HEALTHY)), fd) is None
    assert publish._log_error(failed, SimpleNamespace(runner=object())) is None  # e.g. systemd's: the journal has it
    shown = replace(_inst("infer@0", "", State.FAILED, None), log_error=cause)
    assert f"  infer@0: failed: its log says: {cause}" in format_status(Status(_daemon(), (shown,))).splitlines()
