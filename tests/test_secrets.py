"""The API key and the daemon's environment reach only the instances' own processes.

Real processes on real ports: a server started by the process backend, and a squatter (a
process that is not the instance's) listening on an instance's port.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from numad_infer.backends import INHERITED_VARIABLES, ProcessBackend
from numad_infer.config import parse_config
from numad_infer.planner import Instance, Plan, Policy


def private_key(directory: Path, key: str) -> Path:
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / "api-key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


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
    config = parse_config(f'[model]\npath = "/m.gguf"\n[server]\npython = "{server}"\napi_key_file = "{key}"\n'
                          'user = "root"\n', "cfg")
    instance = Instance("infer@0", 0, (0,), ((0,),), (0,), Policy.BIND, 1, 8080)
    backend = ProcessBackend(tmp_path / "logs")
    (tmp_path / "logs").mkdir(mode=0o700)
    backend.sync(config, Plan((instance,)))
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
