"""backends/process.py: instances as the daemon's own children. What its specs are made of
(the launches validation worked out), that it starts nothing it was not synced for, the
environment a started server gets, and where its children's output goes.

The configuration comes from tests/fakes.py `loaded_for` (the pipeline's value without the
machine checks); the servers are real processes: a stand-in script where a model server
would need a model this host does not have."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from numad_infer.backends.childlog import LOG_MAX_BYTES, InstanceLogs
from numad_infer.backends.process import INHERITED_VARIABLES, ProcessBackend
from numad_infer.config.load import parse_config
from numad_infer.host.identity import BackendKind, instances_run_as
from numad_infer.plan.model import Instance, Plan, Policy
from numad_infer.plan.placement import make_plan
from tests.fakes import cfg, loaded_for, private_key, served_of, three_nodes


def test_a_server_started_by_the_process_backend_gets_a_minimal_environment(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-SECRET")
    monkeypatch.setenv("PYTHONPATH", "/root/evil")
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("LANG", "C.UTF-8")
    server = tmp_path / "server"  # stands in for server.python: takes the engine's argv, waits
    server.write_text("#!/usr/bin/python3 -S\nimport time\ntime.sleep(60)\n")  # a shell would add PWD
    server.chmod(0o700)
    key = private_key(tmp_path / "keys", "k-ENV-1")
    # user = "root": the script lives in pytest's 0700 directory, which nobody cannot enter.
    config = parse_config(f'[model]\npath = "/m.gguf"\n[server]\nengine = "llama-cpp-python"\npython = "{server}"\napi_key_file = "{key}"\n'
                          'user = "root"\n', "cfg")
    instance = Instance("infer@0", 0, (0,), ((0,),), (0,), Policy.BIND, 1, 8080)
    backend = ProcessBackend(tmp_path / "logs")
    (tmp_path / "logs").mkdir(mode=0o700)
    backend.sync(loaded_for(config, Plan((instance,)), api_key="k-ENV-1",
                            runs_as=instances_run_as("root", "cfg", BackendKind.PROCESS)))
    backend.start(instance)
    try:
        pid = backend.main_pid("infer@0")
        assert pid is not None
        # Popen returns after exec, so /proc/PID/environ is the server's own.
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        environ = dict(entry.split("=", 1) for entry in raw.decode().split("\0") if entry)
    finally:
        backend.stop("infer@0")
    assert "AWS_SECRET_ACCESS_KEY" not in environ and "PYTHONPATH" not in environ and "NOTIFY_SOCKET" not in environ
    assert "aws-SECRET" not in raw.decode() and "/root/evil" not in raw.decode()
    assert (environ["OMP_NUM_THREADS"], environ["OMP_PROC_BIND"], environ["OMP_PLACES"]) == ("1", "close", "{0}")
    assert environ["API_KEY"] == "k-ENV-1" and environ["LANG"] == "C.UTF-8"
    assert environ["PATH"] == os.environ["PATH"] and environ["HOME"]
    assert set(environ) <= {*INHERITED_VARIABLES, "HOME", "USER", "LOGNAME", "OMP_NUM_THREADS", "OMP_PROC_BIND",
                            "OMP_PLACES", "NUMA_INFER_INSTANCE", "API_KEY"}, sorted(environ)


def test_the_process_backend_sends_its_children_to_rotated_logs_of_the_shipped_size(tmp_path: Path) -> None:
    backend = ProcessBackend(tmp_path / "logs")
    assert backend.output.mode is InstanceLogs.FILE and backend.output.max_bytes == LOG_MAX_BYTES
    assert backend.frontdoor_runner(tmp_path).output is backend.output  # type: ignore[attr-defined]


def one_cpu_plan() -> Plan:
    # CPU 0 and node 0 only: every CI host has them (the three-node stand-in's CPUs 1 and 2 may not exist here).
    return Plan((Instance("infer@0", 0, (0,), ((0,),), (0,), Policy.BIND, 1, 8080),))


def test_the_specs_are_the_launches_validation_worked_out_argv_and_environment() -> None:
    conf = cfg()
    loaded = loaded_for(conf, make_plan(conf, three_nodes(), served=served_of(conf)))
    backend = ProcessBackend(Path("/nonexistent"))
    specs = {name: json.loads(spec) for name, spec in backend.specs(loaded).items()}
    assert sorted(specs) == ["infer@0", "infer@1", "infer@2"]
    for name, spec in specs.items():
        assert spec["argv"] == list(loaded.launches[name].argv) and spec["env"] == loaded.launches[name].env
    # Another launch for infer@1 alone (as validation would carry for other server flags):
    # the spec follows the value handed in, never the configuration worked out again.
    other = dataclasses.replace(loaded.launches["infer@1"], argv=("/opt/other-server", "--port", "8081"),
                                environment=(("OMP_NUM_THREADS", "7"),))
    moved = {name: json.loads(spec) for name, spec in
             backend.specs(dataclasses.replace(loaded, launches={**loaded.launches, "infer@1": other})).items()}
    assert moved["infer@1"]["argv"] == ["/opt/other-server", "--port", "8081"]
    assert moved["infer@1"]["env"] == {"OMP_NUM_THREADS": "7"}
    assert moved["infer@0"] == specs["infer@0"] and moved["infer@2"] == specs["infer@2"]


def test_start_before_sync_refuses_and_starts_nothing(tmp_path: Path) -> None:
    backend = ProcessBackend(tmp_path / "logs")
    (instance,) = one_cpu_plan().instances
    with pytest.raises(ValueError, match=r"infer@0: the process backend was given no configuration \(sync\)"):
        backend.start(instance)
    assert backend.children == {} and backend.main_pid("infer@0") is None
    assert backend.observe(["infer@0"])["infer@0"].description == "inactive"


def test_sync_refuses_a_value_validated_for_systemd_and_keeps_the_last_one(tmp_path: Path) -> None:
    backend = ProcessBackend(tmp_path / "logs")
    mine = loaded_for(cfg(), one_cpu_plan())
    assert backend.sync(mine) is False  # nothing on disk: no daemon-reload to ask for
    with pytest.raises(ValueError, match="validated for systemd"):
        backend.sync(loaded_for(cfg(), one_cpu_plan(), kind=BackendKind.SYSTEMD))
    assert backend.loaded is mine
    assert backend.current_specs(mine) == {}  # children never outlive the daemon: nothing to adopt


def test_start_runs_the_launchs_argv_pinned_to_the_instances_cpus(tmp_path: Path) -> None:
    # A real child; the server is a stand-in (python sleeping), since no model is loaded here.
    import sys

    loaded = loaded_for(cfg(), one_cpu_plan())
    argv = (sys.executable, "-c", "import time; time.sleep(60)", "--stands-in-for", "infer@0")
    launch = dataclasses.replace(loaded.launches["infer@0"], argv=argv)
    backend = ProcessBackend(tmp_path / "logs")
    (tmp_path / "logs").mkdir(mode=0o700)
    backend.sync(dataclasses.replace(loaded, launches={"infer@0": launch}))
    (instance,) = loaded.plan.instances
    backend.start(instance)
    try:
        pid = backend.main_pid("infer@0")
        assert pid is not None and backend.observe(["infer@0"])["infer@0"].description == "active (running)"
        assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1] == [a.encode() for a in argv]
        assert os.sched_getaffinity(pid) == {0}
        backend.start(instance)  # already running: no second child
        assert backend.main_pid("infer@0") == pid
    finally:
        backend.stop("infer@0")
    assert backend.main_pid("infer@0") is None and backend.observe(["infer@0"])["infer@0"].pid is None
