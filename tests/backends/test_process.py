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
from tests.fakes import cfg, loaded_for, private_key, three_nodes


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
