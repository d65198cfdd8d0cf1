"""The commands as an operator runs them: real processes, exit codes, nothing half-written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests import fakesys
from tests.conftest import searchable_by_others
from tests.daemon_harness import llama_server_binary, with_server_keys

GGUF_HEADER = b"GGUF\x03\x00\x00\x00" + b"\x00" * 24


def run(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "numad_infer", *args], capture_output=True, text=True)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture
def fs(tmp_path: Path) -> Path:
    return fakesys.write_tree(tmp_path / "fs", fakesys.dual_socket_smt())


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model dir" / "tiny.gguf"
    path.parent.mkdir()
    path.write_bytes(GGUF_HEADER)
    path.chmod(0o644)
    searchable_by_others(path.parent)
    return path


def write_config(tmp_path: Path, model: Path, extra: str = "") -> Path:
    """A config naming no engine (the default, llama-server), with this tree's build of it."""
    path = tmp_path / "numa-infer.toml"
    text = f'[model]\npath = "{model}"\n[tuning]\nunit_dir = "{tmp_path / "units"}"\n{extra}'
    path.write_text(with_server_keys(text, f'llama_server = "{llama_server_binary()}"\n'))
    return path


def test_topology_json_from_a_real_capture(captures) -> None:
    data = json.loads(run("--fsroot", str(captures["32intel64-2p8co2t+8ve"]), "topology", "--json", check=True).stdout)
    assert [n["cpus"][:2] for n in data["nodes"]] == [[0, 1], [8, 9]]
    assert data["nodes"][0]["cores"][0] == [0, 16]


def test_topology_text_reads_like_numactl_hardware(fs: Path) -> None:
    out = run("topology", "--fsroot", str(fs), check=True).stdout
    assert out.startswith("available: 2 nodes (0-1)\nnode 0 cpus: 0 1 2")
    assert "node 0 cores: 32 (2 thread(s) per core): [0,64] [1,65]" in out
    assert "node 0 size: 262144 MB" in out and "   0:  10  21" in out


def test_plan_render_check_happy_path(tmp_path: Path, fs: Path, model: Path) -> None:
    config = write_config(tmp_path, model)
    plan = json.loads(run("--config", str(config), "--fsroot", str(fs), "plan", "--json", check=True).stdout)
    assert [(i["name"], i["threads"], i["port"]) for i in plan["instances"]] == [("infer@0", 32, 8080), ("infer@1", 32, 8081)]
    # What one instance holds (a header with no tensors and no dimensions: the engine's own
    # overhead alone), and per node the sum against the node's memory.
    assert plan["memory"]["per_instance"] == {"weights": 0, "kv_cache": 0, "overhead": 28 << 20, "total": 28 << 20,
                                              "kv_cache_counted": False, "prompt_cache": 8192 << 20}
    assert [(n["node"], n["need"], n["instances"], n["prompt_cache"]) for n in plan["memory"]["nodes"]] == [
        (0, 28 << 20, ["infer@0"], 8192 << 20), (1, 28 << 20, ["infer@1"], 8192 << 20)]
    text = run("--config", str(config), "--fsroot", str(fs), "plan", check=True).stdout
    assert ("memory per instance (tiny.gguf): weights 0 MiB + overhead 28 MiB = 28 MiB, KV cache not counted: no "
            "attention shape in the header, and a prompt cache sized to its node (per instance)\nnode 0: 1 instance(s) need "
            "28 MiB of 230.4 GiB (256.0 GiB less 10%); with use, prompt caches up to 8.0 GiB more\n"
            "node 1: 1 instance(s) need 28 MiB of 230.4 GiB (256.0 GiB less 10%); with use, prompt caches up to 8.0 GiB "
            "more") in text
    out = run("--config", str(config), "--fsroot", str(fs), "check", "--backend", "process", check=True).stdout
    assert "valid for this machine" in out and "processes: 2 to start" in out
    # Under systemd, the unit files that differ (a host here may not run the engine as
    # systemd's DynamicUser: the plan loaded for the process backend, judged for systemd).
    from numad_infer.cli.commands import pending_line
    from numad_infer.host.identity import BackendKind
    from numad_infer.validate.pipeline import load
    loaded = load(str(config), BackendKind.PROCESS, str(fs))
    line = pending_line(loaded, BackendKind.SYSTEMD)
    assert f"units in {tmp_path / 'units'} differ from this plan" in line and "4 to write" in line, line
    assert "node 1: 1 instance(s) need 28 MiB of 230.4 GiB" in out
    # Which engine and binary every instance runs, and that it is the default.
    assert f"engine: llama-server (the default; server.engine), every instance runs {llama_server_binary()} " \
           "(server.llama_server)" in out
    assert "wrote" in run("--config", str(config), "--fsroot", str(fs), "render", check=True).stdout
    assert "up to date (4 files)" in run("--config", str(config), "--fsroot", str(fs), "render", check=True).stdout


def test_check_under_the_process_backend_says_what_starts_never_units(tmp_path: Path, fs: Path, model: Path) -> None:
    """Before: `check --backend process` said "units in /run/systemd/system differ from this
    plan: 4 to write", which that backend never writes."""
    config = write_config(tmp_path, model, '[frontend]\nlisten = "127.0.0.1:9000"\n')
    out = run("--config", str(config), "--fsroot", str(fs), "check", "--backend", "process", check=True).stdout
    assert "unit" not in out.lower() and "systemd" not in out.lower(), out
    assert "processes: 2 to start" in out and "(infer@0, infer@1) and HAProxy" in out
    assert not (tmp_path / "units").exists()


@pytest.mark.parametrize("extra, fragment", [
    ("[placement]\nnodes = [0, 5]\n", "placement.nodes = [0, 5]: node 5 does not exist"),
    ("[placement]\nnodes = [0, 1]\nreserve_cpus = \"0-31,64-95\"\n", "placement.reserve_cpus"),
    ("[server]\nbase_port = 65535\n", "server.base_port = 65535"),
    ("[server]\nbase_prot = 1\n", 'did you mean "base_port"'),
    ("[placement\n", "invalid TOML"),
    ("[frontend]\nlisten = \"localhost:80\"\n", "frontend.listen = \"localhost:80\": 'localhost' is not an IP address"),
    ("[frontend]\nlisten = \"127.0.0.1:8081\"\n", "frontend.listen = \"127.0.0.1:8081\": port 8081 is infer@1's"),
    ("[frontend]\nlisten = \"127.0.0.1:9000\"\n[metrics]\nlisten = \"127.0.0.1:9000\"\n", "also metrics.listen's"),
    ("[metrics]\nlisten = \"127.0.0.1:8080\"\n", "metrics.listen = \"127.0.0.1:8080\": port 8080 is infer@0's"),
    ("[frontend]\naffinity = \"cookie\"\n", "frontend.affinity = \"cookie\": must be one of 'none', 'prefix', 'header' or 'user'"),
    ("[frontend]\nqueue_size = -1\n", "frontend.queue_size = -1: must be at least"),
])
def test_bad_input_exits_1_without_traceback_and_writes_nothing(tmp_path: Path, fs: Path, model: Path, extra: str, fragment: str) -> None:
    config = write_config(tmp_path, model, extra)
    for command in ("render", "plan", "check"):
        proc = run("--config", str(config), "--fsroot", str(fs), command)
        assert proc.returncode == 1 and proc.stdout == ""
        assert proc.stderr.startswith(f"numa-infer: {config}") and fragment in proc.stderr
        assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "units").exists()


def test_haproxy_missing_or_too_old_is_one_line_naming_the_key(tmp_path: Path, fs: Path, model: Path) -> None:
    old = tmp_path / "old-haproxy"
    old.write_text("#!/bin/sh\necho 'HAProxy version 2.4.22-0ubuntu0.22.04.1 2023/02/04'\n")
    old.chmod(0o755)
    not_haproxy = tmp_path / "nginx"
    not_haproxy.write_text("#!/bin/sh\necho 'nginx version: nginx/1.22.1'\n")
    not_haproxy.chmod(0o755)
    for binary, fragment in ((tmp_path / "absent", "not found; install it (apt-get install haproxy)"),
                             (old, "is HAProxy 2.4, older than 2.6"), (not_haproxy, "is not haproxy")):
        config = write_config(tmp_path, model, f'[frontend]\nhaproxy = "{binary}"\n')
        proc = run("--config", str(config), "--fsroot", str(fs), "check")
        assert proc.returncode == 1 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
        assert f'frontend.haproxy = "{binary}": {fragment}' in proc.stderr and 'frontend.listen = ""' in proc.stderr


def test_a_missing_default_engine_is_one_line_naming_the_key_to_set(tmp_path: Path, fs: Path, model: Path) -> None:
    """No engine named and no llama-server where the default looks (/usr/bin/llama-server on
    a host without Debian's llama.cpp): refused in one line that says how to choose."""
    config = tmp_path / "numa-infer.toml"
    absent = tmp_path / "no" / "llama-server"
    config.write_text(f'[model]\npath = "{model}"\n[server]\nllama_server = "{absent}"\n'
                      f'[tuning]\nunit_dir = "{tmp_path / "units"}"\n')
    done = run("--config", str(config), "--fsroot", str(fs), "check")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f'numa-infer: {config}: server.llama_server = "{absent}": no such file; build it with '
        "scripts/build-llama-server or install Debian's llama.cpp package, and point here; server.engine is not "
        "set, and the default engine is llama-server: set server.llama_server to its binary, or server.engine = "
        '"llama-cpp-python" with server.python']


def test_missing_model_file(tmp_path: Path, fs: Path) -> None:
    config = write_config(tmp_path, tmp_path / "absent.gguf")
    proc = run("--config", str(config), "--fsroot", str(fs), "check")
    assert proc.returncode == 1 and f'model.path = "{tmp_path}/absent.gguf": file not found' in proc.stderr


def test_not_a_gguf_model(tmp_path: Path, fs: Path) -> None:
    bogus = tmp_path / "model.bin"
    bogus.write_bytes(b"PK\x03\x04")
    searchable_by_others(tmp_path)
    proc = run("--config", str(write_config(tmp_path, bogus)), "--fsroot", str(fs), "check")
    assert proc.returncode == 1 and "is not a GGUF model file" in proc.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to drop to another user")
def test_unreadable_model_file() -> None:
    # pytest's tmp dirs are private to root; this one must be traversable by "nobody".
    base = Path(tempfile.mkdtemp(prefix="numa-infer-cli-"))
    try:
        base.chmod(0o755)
        fs = fakesys.write_tree(base / "fs", fakesys.dual_socket_smt())
        model = base / "model.gguf"
        model.write_bytes(GGUF_HEADER)
        model.chmod(0o600)
        config = write_config(base, model)
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                               "numad_infer", "--config", str(config), "--fsroot", str(fs), "check"],
                              capture_output=True, text=True, env=env)
        assert proc.returncode == 1 and "model.path" in proc.stderr and "cannot be read by this user" in proc.stderr, proc.stderr
    finally:
        shutil.rmtree(base)


def test_missing_config_file_names_it(tmp_path: Path) -> None:
    proc = run("--config", str(tmp_path / "none.toml"), "plan")
    assert proc.returncode == 1 and f"{tmp_path}/none.toml: file not found" in proc.stderr
