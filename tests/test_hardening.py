"""Least privilege and bad input across the daemon: who the instances run as, what reaches
argv, units and logs, and input that must be refused in one line. Each test here failed
before its fix."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from numad_infer.errors import ConfigError
from numad_infer.model.file import read_model
from tests.unitfiles import score
from tests.fakes import load_of, served_of

GGUF = b"GGUF\x03\x00\x00\x00" + b"\0" * 56  # version 3, no tensors, no metadata
ROOT = Path(__file__).resolve().parents[1]


def test_a_fifo_as_model_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    # Before: open() blocked forever waiting for a writer.
    proc = subprocess.run([sys.executable, "-c", "from numad_infer.model.file import read_model; "
                           f"read_model({str(fifo)!r}, 'cfg')"], capture_output=True, text=True, timeout=10, cwd=ROOT)
    assert proc.returncode == 1 and "is not a regular file" in proc.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="root reads every file: only then is the check needed")
def test_as_root_the_model_must_be_readable_by_the_unprivileged_instances(tmp_path: Path) -> None:
    from numad_infer.host.identity import DYNAMIC_USER, lookup

    tmp_path.chmod(0o755)
    for parent in tmp_path.parents:  # pytest's own temporary directories are private
        if parent == Path("/tmp"):
            break
        parent.chmod(parent.stat().st_mode | stat.S_IXOTH)
    private = tmp_path / "private.gguf"
    private.write_bytes(GGUF)
    private.chmod(0o600)
    nobody = lookup("nobody", "cfg")
    for user, who in ((DYNAMIC_USER, "systemd.s DynamicUser"), (nobody, "nobody")):
        with pytest.raises(ConfigError, match=rf"cannot be read by the instances: {who} may not read it \(chmod o\+r"):
            read_model(str(private), "cfg", user)
    assert read_model(str(private), "cfg", None).size == len(GGUF)  # servers that run as the daemon's user
    assert read_model(str(private), "cfg", lookup("root", "cfg")).size == len(GGUF)  # server.user = root
    # The owner's bits count for the owner: a model of nobody's, mode 0600, is nobody's to read.
    os.chown(private, nobody.uid or 0, nobody.gid or 0)
    assert read_model(str(private), "cfg", nobody).size == len(GGUF)
    with pytest.raises(ConfigError, match="DynamicUser may not read it"):
        read_model(str(private), "cfg", DYNAMIC_USER)
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o700)
    inside = hidden / "m.gguf"
    inside.write_bytes(GGUF)
    inside.chmod(0o644)
    with pytest.raises(ConfigError, match=f"directory {hidden} is not searchable by nobody"):
        read_model(str(inside), "cfg", nobody)
    hidden.chmod(0o755)
    assert read_model(str(inside), "cfg", DYNAMIC_USER).size == len(GGUF)


def reload_cli(state_file: Path, *args: str, user: int | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "numad_infer", "--state-file", str(state_file), "reload", *args,
                           "--timeout", "2"], capture_output=True, text=True, cwd=ROOT, timeout=30,
                          user=user, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_reload_never_signals_a_process_that_is_not_the_daemon(tmp_path: Path) -> None:
    # A stale state file naming an unrelated process: before, it got SIGHUP (and died).
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        state = tmp_path / "state.json"
        state.write_text('{"schema": 2, "daemon": {"state": "running", "config": "/etc/numa-infer.toml", "pid": %d, '
                         '"generation": 1}, "instances": []}' % bystander.pid)
        proc = reload_cli(state)
        assert proc.returncode == 3 and "is not a numa-infer daemon" in proc.stderr and proc.stderr.count("\n") == 1
        proc = reload_cli(state, "--pid", str(bystander.pid))
        assert proc.returncode == 1 and "is not a numa-infer daemon" in proc.stderr
        assert bystander.poll() is None
        for bad in ("-1", "0", "1"):
            proc = reload_cli(state, "--pid", bad)
            assert proc.returncode == 1 and "must be > 1" in proc.stderr and "Traceback" not in proc.stderr
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.parametrize("template, fragment", [
    ("-Hroot", "must start with a letter"),
    ("user", "names a unit systemd or another package ships"),
    ("getty", "names a unit systemd or another package ships"),
])
def test_template_names_that_are_options_or_other_units_are_refused(template: str, fragment: str) -> None:
    from numad_infer.config.load import parse_config

    with pytest.raises(ConfigError, match=fragment) as caught:
        parse_config(f'[model]\npath = "/m.gguf"\n[tuning]\nunit_template = "{template}"\n', "/etc/numa-infer.toml")
    assert str(caught.value).startswith(f'/etc/numa-infer.toml: tuning.unit_template = "{template}"')


def test_environment_values_keep_a_dollar_as_it_is() -> None:
    from numad_infer.units.render import quote_arg

    # In Environment= systemd expands nothing: "$$" would reach the process as two dollars.
    assert quote_arg("A=x$y", command_line=False) == '"A=x$y"'
    assert quote_arg("x$y") == '"x$$y"'  # a command line expands $: doubled to stay literal


def test_the_metrics_endpoint_answers_only_metrics() -> None:
    import socket
    import urllib.error
    import urllib.request

    from numad_infer.status import metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = metrics.serve(f"127.0.0.1:{port}", lambda: None)
    try:
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).status == 200
        for path in ("/", "/anything", "/metrics/x"):
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5)
            assert caught.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.skipif(os.geteuid() != 0, reason="the ownership checks apply to a root daemon")
def test_as_root_no_write_through_a_planted_link_or_into_another_users_directory(tmp_path: Path) -> None:
    from numad_infer.backends.childlog import open_log
    from numad_infer.errors import NumaInferError
    from numad_infer.systemd.unitdir import write_units

    secret = tmp_path / "root-only"
    secret.write_text("untouched\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "infer@0.log").symlink_to(secret)
    with pytest.raises(OSError):
        open_log(logs, "infer@0.log")
    assert secret.read_text() == "untouched\n"

    units = tmp_path / "units"
    units.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (units / "infer@0.service.d").symlink_to(target)
    with pytest.raises(NumaInferError, match="is a symbolic link"):
        write_units(units, {"infer@0.service.d/50-numa-infer.conf": "# Managed by numa-infer\n"})
    assert list(target.iterdir()) == []

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, 65534, 65534)
    with pytest.raises(NumaInferError, match="owned by uid 65534"):
        write_units(foreign, {"infer@.service": "x"})
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(NumaInferError, match="writable by others"):
        open_log(shared, "infer@0.log")


@pytest.mark.skipif(os.geteuid() != 0, reason="only root has privilege to drop")
def test_the_llama_cpp_check_runs_the_configured_python_unprivileged() -> None:
    import tempfile

    from numad_infer.config.load import parse_config
    from numad_infer.engines import LlamaCppPython
    from numad_infer.host.identity import lookup
    from numad_infer.validate.host_check import InstanceHost, run_as

    def _python_has_llama_cpp(python: str, runs_as) -> bool:
        cfg = parse_config(f'[model]\npath = "/m.gguf"\n[server]\nengine = "llama-cpp-python"\npython = "{python}"\n', "cfg")
        return LlamaCppPython().check_host(cfg, "cfg", InstanceHost(runs_as)) == []

    base = Path(tempfile.mkdtemp(prefix="numa-infer-pycheck-"))
    try:
        base.chmod(0o777)
        seen = base / "uid"
        fake = base / "python3"
        # A stand-in interpreter that records who ran it (a .pth file would run the same way).
        fake.write_text(f"#!/bin/sh\nid -u > {seen}\nexit 0\n")
        fake.chmod(0o755)
        assert _python_has_llama_cpp(str(fake), lookup("nobody", "cfg"))
        assert seen.read_text().strip() == "65534"
        hang = base / "hang"
        hang.write_text("#!/bin/sh\nexec sleep 60\n")
        hang.chmod(0o755)
        started = time.monotonic()
        assert run_as([str(hang)], lookup("nobody", "cfg"), timeout_s=1) is None
        assert time.monotonic() - started < 10
    finally:
        import shutil
        shutil.rmtree(base)


def test_a_new_process_forgets_a_pending_memory_repair_measurement() -> None:
    from numad_infer.plan.placement import make_plan
    from numad_infer.supervision.reconcile import Runtime
    from tests.fakes import cfg, three_nodes

    conf = cfg()
    rt = Runtime(make_plan(conf, three_nodes(), served=served_of(conf)).instances[0], pid=10)
    rt.migrated_from = 512 << 20
    rt.new_process(11)
    # Before: the next reading of the new process reported "migrate_pages moved 512 MiB".
    assert rt.migrated_from is None and rt.pid == 11 and rt.memory is None


@pytest.mark.parametrize("host, listen, engine", [
    ("127.0.0.1", "127.0.0.1:8000", ""), ("0.0.0.0", "0.0.0.0:80", ""),
    ("127.0.0.1", "127.0.0.1:8000", 'engine = "llama-server"\nparallel = 4\napi_key_file = "/etc/numa-infer/key"\n'),
    ("127.0.0.1", "127.0.0.1:8000", 'engine = "llama-server"\n#slots\n'),
])
def test_rendered_units_are_hardened(tmp_path: Path, host: str, listen: str, engine: str) -> None:
    from numad_infer.units.render import render_units
    from numad_infer.config.load import parse_config
    from numad_infer.plan.model import Instance, Plan, Policy

    config = parse_config(f'[model]\npath = "/m.gguf"\nmlock = true\n[server]\nhost = "{host}"\n{engine}'
                          f'[frontend]\nlisten = "{listen}"\n')
    plan = Plan((Instance("infer@0", 0, (0, 1), ((0,), (1,)), (0,), Policy.BIND, 2, 8080),))
    # With saved prompt caches: the servers' group and a directory they may write.
    served, chosen = load_of(config)  # `engine` is the [server] text here
    files = render_units(config, plan, served=served, engine=chosen,
                         slots_group="numa-infer" if "#slots" in engine else None)
    instance = score(tmp_path, files, "infer@0.service", 2.0)
    front = score(tmp_path, files, "numa-infer-frontdoor.service", 2.5)
    name = 'llama-server' if 'llama-server' in engine else 'llama-cpp-python'
    print(f"exposure ({host}, {listen}, {name}): infer@0 {instance}, front door {front}")


def test_the_shipped_daemon_unit_is_hardened(tmp_path: Path) -> None:
    text = (ROOT / "packaging/systemd/numa-infer.service").read_text()
    found = score(tmp_path, {"numa-infer.service": text}, "numa-infer.service", 3.0)
    print(f"exposure: numa-infer.service {found}")
    caps = next(line for line in text.splitlines() if line.startswith("CapabilityBoundingSet="))
    # Re-pin and move pages of the instances; bind the front door's port (listener.py), even
    # below 1024, so that HAProxy needs no capability at all.
    assert caps == "CapabilityBoundingSet=CAP_SYS_NICE CAP_NET_BIND_SERVICE"


def test_a_template_that_another_package_ships_is_refused(tmp_path: Path) -> None:
    from numad_infer.config.load import parse_config
    from numad_infer.systemd.unitdir import check_unit_names

    vendor = tmp_path / "lib"
    vendor.mkdir()
    (vendor / "worker@.service").write_text("[Service]\nExecStart=/bin/true\n")
    config = parse_config('[model]\npath = "/m.gguf"\n[tuning]\nunit_template = "worker"\n', "/etc/numa-infer.toml")
    with pytest.raises(ConfigError, match=r'tuning.unit_template = "worker": .*worker@.service exists and was not written'):
        check_unit_names(config, "/etc/numa-infer.toml", dirs=(str(vendor),))
    # One numa-infer rendered itself is its own.
    (vendor / "worker@.service").write_text("# Managed by numa-infer: rewritten by `numa-infer render` and the daemon; "
                                            "do not edit.\n")
    check_unit_names(config, "/etc/numa-infer.toml", dirs=(str(vendor),))


@pytest.mark.parametrize("text", ['{"schema": 1, "daemon": {"pid": 1}, "instances": []}',
                                  '{"schema": 2, "daemon": {"pid": 7}}', '[1, 2]'])
def test_status_on_a_state_file_of_another_shape_is_one_line(tmp_path: Path, text: str) -> None:
    state = tmp_path / "state.json"
    state.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "numad_infer", "--state-file", str(state), "status"],
                          capture_output=True, text=True, cwd=ROOT, timeout=30)
    # Before: KeyError: 'backend' (a traceback).
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert str(state) in proc.stderr


def test_the_status_model_round_trips_through_its_json() -> None:
    from numad_infer.lifecycle.states import State
    from numad_infer.status.records import (
        DaemonState,
        DaemonStatus,
        Event,
        FrontdoorStatus,
        InstanceStatus,
        MemoryStatus,
        ReloadResult,
        Status,
    )

    status = Status(
        DaemonStatus(DaemonState.RUNNING, "/etc/numa-infer.toml", pid=42, generation=3, warnings=("w",),
                     last_reload=ReloadResult(1.0, True, "reload", None, ("infer@1",), (), (), ("infer@0",))),
        (InstanceStatus("infer@0", 0, (0, 1), (0,), 2, 8080, 100, State.DRAINING, memory=MemoryStatus(1, 0, 2, 0.5, "cgroup"),
                        last_drift=Event(2.0, "affinity", "x"), drift_events={"affinity": 1}, rotation="DRAIN",
                        in_flight=1, queued=0, served=9),),
        FrontdoorStatus("127.0.0.1:8000", True, 0, 1))
    import json
    assert Status.from_json(json.loads(json.dumps(status.to_json()))) == status


@pytest.mark.parametrize("engine", ["llama-cpp-python", "llama-server"])
@pytest.mark.parametrize("args", [
    ["--api-key", "sk-SECRET-1"], ["--api-key=sk-SECRET-1"], ["--api_key", "sk-SECRET-1"], ["--api_key=sk-SECRET-1"],
    ["--api-key-file", "/tmp/sk-SECRET-1"], ["--api-key-file=/tmp/sk-SECRET-1"], ["--api_key_file=sk-SECRET-1"],
    ["--api_k", "sk-SECRET-1"],  # argparse's abbreviation (llama_cpp.server)
    ["--verbose", "--api-key", "sk-SECRET-1"],
])
def test_every_spelling_of_the_key_flag_is_refused_for_every_engine_without_echoing_the_key(engine: str,
                                                                                              args: list[str]) -> None:
    import json

    from numad_infer.config.load import parse_config
    from numad_infer.engines.keys import check_engine_keys

    text = f'[model]\npath = "/m.gguf"\n[server]\nengine = "{engine}"\nextra_args = {json.dumps(args)}\n'
    with pytest.raises(ConfigError) as refused:
        check_engine_keys(parse_config(text, "/etc/numa-infer.toml"), "/etc/numa-infer.toml")
    message = str(refused.value)
    index = next(i for i, a in enumerate(args) if a.startswith("--api"))
    flag = args[index].partition("=")[0]
    assert message.startswith(f"/etc/numa-infer.toml: server.extra_args: item {index} is {flag}")
    assert "server.api_key_file" in message
    assert "SECRET" not in message and "SECRET" not in repr(refused.value.value)


def test_an_error_on_an_extra_args_item_never_shows_the_value() -> None:
    from numad_infer.config.load import parse_config

    with pytest.raises(ConfigError) as refused:
        parse_config('[model]\npath = "/m.gguf"\n[server]\nextra_args = ["--x", "sk-SECRET\\n"]\n', "cfg")
    assert str(refused.value).startswith("cfg: server.extra_args[1]: contains a control character")
    assert "SECRET" not in str(refused.value)


def test_other_options_that_begin_like_the_key_flag_are_accepted() -> None:
    from numad_infer.config.load import parse_config
    from numad_infer.engines.keys import check_engine_keys

    config = parse_config('[model]\npath = "/m.gguf"\n[server]\nengine = "llama-server"\n'
                          'extra_args = ["--api-prefix", "/v2", "--a", "1"]\n', "cfg")
    check_engine_keys(config, "cfg")
    assert config.server.extra_args == ["--api-prefix", "/v2", "--a", "1"]


def test_the_api_key_file_must_be_root_only_and_never_reaches_argv_or_a_unit(tmp_path: Path) -> None:
    from numad_infer.units.render import render_units
    from numad_infer.config.apikey import read_api_key
    from numad_infer.config.load import parse_config
    from numad_infer.plan.model import Instance, Plan, Policy

    key = tmp_path / "api-key"
    key.write_text("s3cr3t-key\n")
    key.chmod(0o644)
    config = parse_config(f'[model]\npath = "/m.gguf"\n[server]\nengine = "llama-cpp-python"\napi_key_file = "{key}"\n', "cfg")
    with pytest.raises(ConfigError, match=r"server.api_key_file = .*can be read or written by others \(mode 0644\); chmod 600"):
        read_api_key(config, "cfg")
    key.chmod(0o600)
    assert read_api_key(config, "cfg") == "s3cr3t-key"
    plan = Plan((Instance("infer@0", 0, (0,), ((0,),), (0,), Policy.BIND, 1, 8080),))
    served, engine = load_of(config)
    files = render_units(config, plan, served=served, engine=engine)
    assert all("s3cr3t" not in text for text in files.values())
    assert f"LoadCredential=api-key:{key}" in files["infer@.service"]
    assert "CREDENTIALS_DIRECTORY" in files["infer@0.service.d/50-numa-infer.conf"]
    with pytest.raises(ConfigError, match="must be an absolute path"):
        parse_config('[model]\npath = "/m.gguf"\n[server]\napi_key_file = "key"\n', "cfg")


def _key_config(path: Path):
    from numad_infer.config.load import parse_config

    return parse_config(f'[model]\npath = "/m.gguf"\n[server]\napi_key_file = "{path}"\n', "cfg")


def _private_key(directory: Path, text: str = "s3cr3t-key\n") -> Path:
    directory.mkdir(mode=0o700, exist_ok=True)
    directory.chmod(0o700)
    key = directory / "api-key"
    key.write_text(text)
    key.chmod(0o600)
    return key


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


@needs_root
def test_a_key_file_owned_by_another_user_is_refused_even_mode_600(tmp_path: Path) -> None:
    from numad_infer.config.apikey import read_api_key

    key = _private_key(tmp_path / "keys")
    os.chown(key, 65534, 65534)  # nobody: mode 600, but nobody can write any key into it
    with pytest.raises(ConfigError) as refused:
        read_api_key(_key_config(key), "cfg")
    assert f"cfg: server.api_key_file = \"{key}\": is owned by uid 65534, not by root" in str(refused.value)
    assert f"chown 0 {key}" in str(refused.value) and "s3cr3t" not in str(refused.value)


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o775])
def test_a_key_file_in_a_directory_that_group_or_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    from numad_infer.config.apikey import read_api_key

    key = _private_key(tmp_path / "shared")
    key.parent.chmod(mode)  # sticky (like /tmp) too: another user could have created the name first
    with pytest.raises(ConfigError, match=rf"is under {key.parent}, which group or others can write "
                                          rf"\(mode {mode:04o}\).*/etc/numa-infer"):
        read_api_key(_key_config(key), "cfg")


def test_a_key_file_below_a_directory_others_can_write_and_rename_in_is_refused(tmp_path: Path) -> None:
    from numad_infer.config.apikey import read_api_key

    (tmp_path / "open").mkdir()
    key = _private_key(tmp_path / "open" / "keys")
    (tmp_path / "open").chmod(0o777)  # not sticky: anyone may rename keys/ away and put their own there
    with pytest.raises(ConfigError, match=rf"is under {tmp_path / 'open'}, which group or others can write"):
        read_api_key(_key_config(key), "cfg")
    (tmp_path / "open").chmod(0o1777)  # sticky: keys/ is root's, no one else may rename it
    assert read_api_key(_key_config(key), "cfg") == "s3cr3t-key"


def test_a_key_file_link_is_followed_only_inside_its_directory_and_only_if_no_one_else_owns_it(
        tmp_path: Path) -> None:
    from numad_infer.config.apikey import read_api_key

    real = _private_key(tmp_path / "keys")
    link = tmp_path / "keys" / "link"
    link.symlink_to(real)
    assert read_api_key(_key_config(link), "cfg") == "s3cr3t-key"  # root's link, to a file beside it
    elsewhere = _private_key(tmp_path / "elsewhere")
    out = tmp_path / "keys" / "out"
    out.symlink_to(elsewhere)
    with pytest.raises(ConfigError, match=r"is a link that leads out of its directory .*/keys, to .*/elsewhere/api-key"):
        read_api_key(_key_config(out), "cfg")
    if os.geteuid() == 0:  # only root can give a link away
        os.lchown(link, 65534, 65534)  # nobody's link: nobody could re-point it
        with pytest.raises(ConfigError, match=r"is a link owned by uid 65534 .*who could re-point it"):
            read_api_key(_key_config(link), "cfg")


def _secret_volume(root: Path, key: str, mode: int = 0o400) -> Path:
    """A Kubernetes Secret volume as the kubelet lays it out: a sticky, world-writable tmpfs
    root; the files in a timestamped directory; `..data` pointing at it; each key a link
    through `..data`. Returns the key's name as a pod mounts it."""
    root.mkdir()
    root.chmod(0o1777)
    stamped = root / "..2026_12_02_10_00_00.1"
    stamped.mkdir(mode=0o755)
    (stamped / "api-key").write_text(key)
    (stamped / "api-key").chmod(mode)
    (root / "..data").symlink_to(stamped.name)
    (root / "api-key").symlink_to("..data/api-key")
    return root / "api-key"


def test_a_key_in_a_kubernetes_secret_volume_is_read_and_a_rotation_is_picked_up(tmp_path: Path) -> None:
    from numad_infer.config.apikey import read_api_key

    path = _secret_volume(tmp_path / "secret", "k-ROTATE-1\n")
    assert read_api_key(_key_config(path), "cfg") == "k-ROTATE-1"
    # The kubelet's rotation: a new timestamped directory, then ..data swapped atomically.
    fresh = tmp_path / "secret" / "..2026_12_02_11_00_00.2"
    fresh.mkdir(mode=0o755)
    (fresh / "api-key").write_text("k-ROTATE-2\n")
    (fresh / "api-key").chmod(0o400)
    (tmp_path / "secret" / "..data_tmp").symlink_to(fresh.name)
    os.replace(tmp_path / "secret" / "..data_tmp", tmp_path / "secret" / "..data")
    assert read_api_key(_key_config(path), "cfg") == "k-ROTATE-2"


@pytest.mark.parametrize("mode, problem", [
    (0o644, r"mode 0644\); in a Secret volume set defaultMode: 0400"),  # the Secret's default mode
    (0o460, r"can be written by its group"),
    (0o402, r"read or written by others"),
])
def test_a_secret_key_others_may_read_or_write_is_refused_with_the_secret_setting_to_change(
        tmp_path: Path, mode: int, problem: str) -> None:
    from numad_infer.config.apikey import read_api_key

    path = _secret_volume(tmp_path / "secret", "k-MODE\n", mode)
    with pytest.raises(ConfigError, match=problem):
        read_api_key(_key_config(path), "cfg")
    (tmp_path / "secret" / "..2026_12_02_10_00_00.1" / "api-key").chmod(0o440)  # fsGroup may read
    assert read_api_key(_key_config(path), "cfg") == "k-MODE"


def test_a_secret_link_that_leaves_the_volume_is_refused(tmp_path: Path) -> None:
    from numad_infer.config.apikey import read_api_key

    path = _secret_volume(tmp_path / "secret", "k-IN\n")
    outside = _private_key(tmp_path / "outside", "k-OUT\n")
    (tmp_path / "secret" / "..data").unlink()
    (tmp_path / "secret" / "..data").symlink_to(outside.parent)
    with pytest.raises(ConfigError, match=r"leads out of its directory"):
        read_api_key(_key_config(path), "cfg")


def test_a_fifo_in_place_of_the_key_file_is_refused_at_once(tmp_path: Path) -> None:
    import time

    from numad_infer.config.apikey import read_api_key

    directory = _private_key(tmp_path / "keys").parent
    fifo = directory / "fifo"
    os.mkfifo(fifo, 0o600)
    started = time.monotonic()
    # Swapped in between a stat and an open, a FIFO would block a plain open until a writer came.
    with pytest.raises(ConfigError, match=r"is not a regular file"):
        read_api_key(_key_config(fifo), "cfg")
    assert time.monotonic() - started < 5


def test_a_reload_made_of_slow_systemctl_calls_keeps_feeding_the_watchdog(tmp_path: Path) -> None:
    """In the VM suite a reload (units, daemon-reload, HAProxy reload) took 20-30 s on a
    loaded host and systemd killed the daemon for a missed ping (WatchdogSec=60). Each
    systemctl call now gives the notifier a chance to ping, as the daemon wires it."""
    import socket

    from numad_infer.cli.wiring import make_backend
    from numad_infer.systemd.notify import Notifier

    sock_path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.05)
    fake = tmp_path / "systemctl"
    fake.write_text("#!/bin/sh\nsleep 0.3\n")
    fake.chmod(0o755)
    # Watchdog of 0.4 s: a ping is due 0.2 s after the last one.
    notifier = Notifier({"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "400000"})
    backend = make_backend("systemd", tmp_path / "state.json")
    backend.systemctl.progress = notifier.keepalive  # as make_backend wires it for `run`
    backend.systemctl.binary = str(fake)
    # The clock starts at the last ping before the calls: building the backend (imports, a
    # second or more on a loaded host) is not what is measured.
    notifier.watchdog(time.monotonic())
    last = time.monotonic()
    gaps: list[float] = []
    for _ in range(4):  # 1.2 s of systemctl calls, no loop pass in between
        backend.systemctl.daemon_reload()
        while True:
            try:
                message = sock.recv(4096).decode()
            except TimeoutError:
                break
            if "WATCHDOG=1" in message:
                now = time.monotonic()
                gaps.append(now - last)
                last = now
    sock.close()
    assert len(gaps) >= 3, gaps
    assert max(gaps) < 0.4 + 0.3, gaps  # never longer than the interval plus one call
