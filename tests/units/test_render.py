"""Rendered units: golden files, systemd's own parser, injection, idempotent writes."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from numad_infer.units.render import RenderError, quote_arg, render_units
from numad_infer.config.load import parse_config
from numad_infer.errors import ConfigError
from numad_infer.plan.placement import make_plan
from numad_infer.systemd.unitdir import write_units
from numad_infer.systemd.unitnames import PORT_DROPIN, PORT_FD_NAME, PORT_HOLD, PORT_SOCKET
from numad_infer.systemd.unitnames import UNIT_MARKER as MARKER
from numad_infer.topology.sysfs import read_topology
from tests import fakesys
from tests.unitfiles import directives, systemd_split, systemd_verify, values_of
from tests.fakes import load_of

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def toml_str(value: str) -> str:
    return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes


def make_config(model: str = "/var/lib/numa-infer/models/model.gguf", python: str = "/usr/bin/python3",
                extra: list[str] | None = None, placement: str = "", mlock: bool = False):
    extra_toml = "[" + ", ".join(toml_str(a) for a in (extra or [])) + "]"
    return parse_config(
        f"[model]\npath = {toml_str(model)}\nmlock = {'true' if mlock else 'false'}\n"
        f"[placement]\n{placement}\n"
        f"[server]\nengine = \"llama-cpp-python\"\npython = {toml_str(python)}\nextra_args = {extra_toml}\n",
        "/etc/numa-infer.toml",
    )


def units_for(tmp_path: Path, factory, **kwargs) -> dict[str, str]:
    config = make_config(**kwargs)
    topo = read_topology(fakesys.write_tree(tmp_path / "fs", factory()))
    served, engine = load_of(config)
    plan = make_plan(config, topo, served=served)
    # The python: the package's daemon's.
    return render_units(config, plan, python="/usr/bin/python3", served=served, engine=engine)


@pytest.mark.parametrize("name, factory, placement", [
    ("dual_socket_smt", fakesys.dual_socket_smt, ""),
    ("dual_socket_smt_on", fakesys.dual_socket_smt, "smt = true"),
    ("epyc_nps4_split", fakesys.epyc_nps4, "instances_per_node = 2"),
    ("cxl_interleave", fakesys.cxl_memory_node, 'mode = "interleave"'),
])
def test_rendered_units_match_golden_files(tmp_path: Path, name: str, factory, placement: str) -> None:
    files = units_for(tmp_path, factory, placement=placement)
    golden = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        shutil.rmtree(golden, ignore_errors=True)
        for rel, text in files.items():
            (golden / rel).parent.mkdir(parents=True, exist_ok=True)
            (golden / rel).write_text(text)
    expected = {str(p.relative_to(golden)): p.read_text() for p in golden.rglob("*") if p.is_file()}
    assert files == expected


def test_dropin_carries_pinning_and_server_arguments(tmp_path: Path) -> None:
    files = units_for(tmp_path, fakesys.dual_socket_smt)
    d = dict(directives(files["infer@1.service.d/50-numa-infer.conf"]))
    assert d["CPUAffinity"] == " ".join(map(str, range(32, 64)))
    assert (d["NUMAPolicy"], d["NUMAMask"]) == ("bind", "1")
    env = systemd_split(d["Environment"])
    assert "OMP_NUM_THREADS=32" in env and "OMP_PROC_BIND=close" in env
    assert "OMP_PLACES=" + ",".join(f"{{{c}}}" for c in range(32, 64)) in env
    argv = systemd_split(d["ExecStart"])
    for flag, value in (("--n_threads", "32"), ("--n_threads_batch", "32"), ("--port", "8081"),
                        ("--use_mmap", "false"), ("--host", "127.0.0.1"), ("--n_ctx", "4096"),
                        ("--interrupt_requests", "false")):
        assert argv[argv.index(flag) + 1] == value


def test_output_passes_systemd_analyze_verify_without_warnings(tmp_path: Path) -> None:
    files = units_for(tmp_path, fakesys.epyc_nps4, python=sys.executable, placement="instances_per_node = 2")
    write_units(tmp_path / "units", files)
    names = [rel.split("/")[0].removesuffix(".d") for rel in files if rel.endswith(".conf")]
    # The front door's unit too (verify checks that its haproxy exists: setup installs it).
    assert systemd_verify(tmp_path / "units", [*names, "numa-infer-frontdoor.service"]) == ""


def test_verify_would_catch_a_broken_dropin(tmp_path: Path) -> None:
    # Negative control: proves the verify test above can fail.
    files = units_for(tmp_path, fakesys.round_robin_sockets, python=sys.executable)
    write_units(tmp_path / "units", files)
    dropin = tmp_path / "units/infer@0.service.d/50-numa-infer.conf"
    dropin.write_text(dropin.read_text().replace("NUMAPolicy=bind", "NUMAPolicy=sometimes"))
    assert "sometimes" in systemd_verify(tmp_path / "units", ["infer@0.service"])


HOSTILE = ['%n%i%%', "$HOME ${PATH} $$", 'a"b\'c', "trail\\", "sp ace; ExecStartPre=/bin/false", "\\n"]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_strings_stay_inside_their_argument(tmp_path: Path, hostile: str) -> None:
    # systemd refuses $ " ' \\ in an executable path, and so does the config (test_config).
    pydir = tmp_path / ("bin " + "".join(c for c in hostile if c not in "/$\"'\\"))
    pydir.mkdir()
    python = pydir / "python3"
    python.symlink_to(sys.executable)
    model = f"/models/{hostile}.gguf"
    files = units_for(tmp_path, fakesys.round_robin_sockets, model=model, python=str(python), extra=["--alias", hostile])
    text = files["infer@0.service.d/50-numa-infer.conf"]
    baseline = units_for(tmp_path / "b", fakesys.round_robin_sockets)["infer@0.service.d/50-numa-infer.conf"]
    assert [k for k, _ in directives(text)] == [k for k, _ in directives(baseline)]
    argv = systemd_split(dict(directives(text))["ExecStart"])
    assert argv[0] == str(python) and argv[argv.index("--model") + 1] == model and argv[-1] == hostile
    write_units(tmp_path / "units", files)
    assert systemd_verify(tmp_path / "units", ["infer@0.service", "infer@1.service"]) == ""


@pytest.mark.parametrize("bad", ["line\nExecStartPre=/bin/sh", "cr\r", "nul\x00"])
def test_control_characters_never_reach_a_unit(bad: str) -> None:
    with pytest.raises(ConfigError, match="control character"):
        make_config(extra=[bad])
    with pytest.raises(RenderError):
        quote_arg(bad)


def test_mlock_raises_memlock_limit(tmp_path: Path) -> None:
    assert "LimitMEMLOCK=infinity" in units_for(tmp_path, fakesys.round_robin_sockets, mlock=True)["infer@.service"]
    assert "LimitMEMLOCK" not in units_for(tmp_path / "2", fakesys.round_robin_sockets)["infer@.service"]


def test_the_instance_units_stop_timeout_is_the_one_the_stop_bound_counts() -> None:
    # TimeoutStopSec was a literal 30 while the bound (and the process backend) used 15.
    from numad_infer.config.defaults import FRONTDOOR_STOP_S, INSTANCE_STOP_S, stop_bound_s
    from numad_infer.units.render import render_template

    config = make_config()
    served, engine = load_of(config)
    lines = render_template(config, engine, served).splitlines()
    assert [line for line in lines if line.startswith("TimeoutStopSec=")] == [f"TimeoutStopSec={INSTANCE_STOP_S:g}"]
    assert stop_bound_s(0) == INSTANCE_STOP_S + FRONTDOOR_STOP_S
    assert "TimeoutStopSec=30\n" in (GOLDEN / "dual_socket_smt" / "infer@.service").read_text()  # unchanged


def test_the_daemons_run_directory_is_spelled_once() -> None:
    from numad_infer.config.defaults import DEFAULT_STATE_FILE, RUN_DIR
    from numad_infer.units.render import FRONTDOOR_HANDOUT, FRONTDOOR_RUN_DIR

    assert RUN_DIR == FRONTDOOR_RUN_DIR == str(Path(DEFAULT_STATE_FILE).parent) == str(Path(FRONTDOOR_HANDOUT).parent)
    shipped = (Path(__file__).resolve().parents[2] / "packaging/systemd/numa-infer.service").read_text()
    assert f"RuntimeDirectory={Path(RUN_DIR).name}\n" in shipped and RUN_DIR == f"/run/{Path(RUN_DIR).name}"
    assert not [p for p in (Path(__file__).resolve().parents[2] / "numad_infer").rglob("*.py")
                if re.search(f'"{re.escape(RUN_DIR)}[/"]', p.read_text()) and p.name != "defaults.py"]


def test_rendering_twice_leaves_files_untouched(tmp_path: Path) -> None:
    files = units_for(tmp_path, fakesys.dual_socket_smt)
    unit_dir = tmp_path / "units"
    first = write_units(unit_dir, files)
    assert first.changed and len(first.written) == 4
    stats = {p: (p.stat().st_mtime_ns, p.stat().st_ino, p.read_bytes()) for p in unit_dir.rglob("*") if p.is_file()}
    second = write_units(unit_dir, files)
    assert not second.changed
    assert stats == {p: (p.stat().st_mtime_ns, p.stat().st_ino, p.read_bytes()) for p in unit_dir.rglob("*") if p.is_file()}


def test_dropped_instances_are_removed_and_foreign_files_kept(tmp_path: Path) -> None:
    unit_dir = tmp_path / "units"
    write_units(unit_dir, units_for(tmp_path, fakesys.dual_socket_smt))
    own = unit_dir / "infer@1.service.d/10-operator.conf"
    own.write_text("[Service]\nNice=5\n")
    other = unit_dir / "other@.service"
    other.write_text("[Service]\nExecStart=/bin/true\n")
    result = write_units(unit_dir, units_for(tmp_path / "2", fakesys.dual_socket_smt, placement="nodes = [0]"))
    assert result.removed == ("infer@1.service.d/50-numa-infer.conf",)
    assert own.exists() and other.exists()
    assert not (unit_dir / "infer@1.service.d/50-numa-infer.conf").exists()


def test_a_file_numa_infer_did_not_write_is_never_overwritten(tmp_path: Path) -> None:
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    (unit_dir / "infer@.service").write_text("[Service]\nExecStart=/bin/true\n")
    with pytest.raises(Exception, match="was not written by numa-infer"):
        write_units(unit_dir, units_for(tmp_path, fakesys.dual_socket_smt))
    assert (unit_dir / "infer@.service").read_text().startswith("[Service]")
    assert not (unit_dir / "infer@0.service.d").exists()


def test_every_file_starts_with_the_ownership_marker(tmp_path: Path) -> None:
    assert all(t.startswith(MARKER + "\n") for t in units_for(tmp_path, fakesys.epyc_nps4).values())


SHIPPED = Path(__file__).resolve().parents[2] / "packaging/systemd"


def test_shipped_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    text = (SHIPPED / "numa-infer.service").read_text()
    assert "Type=notify" in text and "WatchdogSec=" in text and "ExecReload=" in text
    # verify checks that ExecStart's program exists: point it at this interpreter.
    (tmp_path / "numa-infer.service").write_text(text.replace("/usr/bin/numa-infer", sys.executable))
    for name in (PORT_SOCKET, PORT_HOLD):
        shutil.copy(SHIPPED / name, tmp_path / name)
    assert systemd_verify(tmp_path, ["numa-infer.service", PORT_SOCKET, PORT_HOLD]) == ""


def test_the_shipped_port_socket_is_the_default_front_door_s_and_feeds_the_daemon_only() -> None:
    from numad_infer.frontdoor.listener import BACKLOG
    from numad_infer.units.render import SHIPPED_PORT_LISTENS, port_listens

    socket_unit = (SHIPPED / PORT_SOCKET).read_text()
    default = parse_config('[model]\npath = "/m.gguf"\n')
    assert tuple(values_of(socket_unit, "ListenStream")) == SHIPPED_PORT_LISTENS == port_listens(default)
    assert values_of(socket_unit, "Backlog") == [str(BACKLOG)]  # what waits is what the daemon's own would keep
    assert values_of(socket_unit, "FileDescriptorName") == [PORT_FD_NAME]
    assert values_of(socket_unit, "BindIPv6Only") == ["ipv6-only"] and values_of(socket_unit, "Accept") in ([], ["no"])
    # Never the daemon: a connection while it is stopped would start it again.
    assert values_of(socket_unit, "Service") == [PORT_HOLD] and values_of(socket_unit, "WantedBy") == ["sockets.target"]
    hold = (SHIPPED / PORT_HOLD).read_text()
    assert values_of(hold, "RemainAfterExit") == ["yes"] and values_of(hold, "ExecStart") == ["/bin/true"]
    daemon = (SHIPPED / "numa-infer.service").read_text()
    assert values_of(daemon, "Sockets") == [PORT_SOCKET] and values_of(daemon, "Also") == [PORT_SOCKET]
    # Both are passed the sockets HAProxy accepts on: systemd must leave them non-blocking.
    assert values_of(daemon, "NonBlocking") == ["yes"] and values_of(hold, "NonBlocking") == ["yes"]


@pytest.mark.parametrize("listen, expected", [
    ("127.0.0.1:8000", None), ("[::1]:8000", None), ("", None),  # the shipped addresses; no front door
    ("127.0.0.1:9000", ["", "127.0.0.1:9000", "[::1]:9000"]),
    ("0.0.0.0:8000", ["", "0.0.0.0:8000", "[::1]:8000"]),
    ("10.0.0.5:8000", ["", "10.0.0.5:8000"]),
])
def test_the_port_drop_in_gives_the_socket_unit_frontend_listen_where_it_differs(tmp_path: Path, listen: str,
                                                                                 expected: list[str] | None) -> None:
    from numad_infer.units.render import render_port_dropin

    text = render_port_dropin(parse_config(f'[model]\npath = "/m.gguf"\n[frontend]\nlisten = "{listen}"\n'))
    if expected is None:
        assert text is None
        return
    assert text is not None and text.startswith(MARKER + "\n") and values_of(text, "ListenStream") == expected
    # systemd's own parser, reading it as the shipped unit's drop-in.
    for name in (PORT_SOCKET, PORT_HOLD):
        shutil.copy(SHIPPED / name, tmp_path / name)
    (tmp_path / f"{PORT_SOCKET}.d").mkdir()
    (tmp_path / PORT_DROPIN).write_text(text)
    assert systemd_verify(tmp_path, [PORT_SOCKET]) == ""


@pytest.mark.parametrize("host, allowed", [("127.0.0.1", "localhost"), ("0.0.0.0", "localhost"),
                                           ("10.1.2.3", "localhost 10.1.2.3"), ("fd00::7", "localhost fd00::7")])
def test_a_loopback_front_door_may_reach_instances_on_another_address_of_this_machine(host: str, allowed: str) -> None:
    # Before: IPAddressAllow=localhost alone, so with server.host = "10.1.2.3" every server
    # went DOWN behind the front door and every request got a 503.
    from numad_infer.units.render import render_frontdoor_unit

    config = parse_config(f'[model]\npath = "/m.gguf"\n[server]\nhost = "{host}"\n[frontend]\nlisten = "127.0.0.1:8000"\n')
    lines = render_frontdoor_unit(config).splitlines()
    assert "IPAddressDeny=any" in lines and f"IPAddressAllow={allowed}" in lines
    public = parse_config(f'[model]\npath = "/m.gguf"\n[server]\nhost = "{host}"\n[frontend]\nlisten = "0.0.0.0:8000"\n')
    assert not [l for l in render_frontdoor_unit(public).splitlines() if l.startswith("IPAddress")]


def _llama_server_units(tmp_path: Path, extra: str = "", slots_group: str | None = "numa-infer") -> dict[str, str]:
    config = parse_config(f'[model]\npath = "/m.gguf"\n[server]\nengine = "llama-server"\n{extra}',
                          "/etc/numa-infer.toml")
    topo = read_topology(fakesys.write_tree(tmp_path / "fs", fakesys.dual_socket_smt()))
    served, engine = load_of(config)
    return render_units(config, make_plan(config, topo, served=served), python="/usr/bin/python3", served=served,
                        engine=engine, slots_group=slots_group)


def test_under_systemd_a_server_saves_its_slots_in_its_own_directory_of_the_servers_group(tmp_path: Path) -> None:
    from numad_infer.config.defaults import SLOTS_DIR

    files = _llama_server_units(tmp_path)
    template = dict(directives(files["infer@.service"]))
    # The group that owns the directory; files the daemon (root, no CAP_DAC_*) can read.
    assert values_of(files["infer@.service"], "SupplementaryGroups") == ["numa-infer"]
    assert values_of(files["infer@.service"], "UMask") == ["0022"] and template["DynamicUser"] == "yes"
    for node in (0, 1):
        dropin = files[f"infer@{node}.service.d/50-numa-infer.conf"]
        where = f"{SLOTS_DIR}/infer-{node}"
        assert values_of(dropin, "ReadWritePaths") == [f"-{where}"]  # the one place it may write
        # ...and the only one of SLOTS_DIR it sees: the others' conversations are hidden.
        assert values_of(dropin, "TemporaryFileSystem") == [f"{SLOTS_DIR}:ro"]
        assert values_of(dropin, "BindPaths") == [f"-{where}"]
        exec_start = values_of(dropin, "ExecStart")[-1]
        assert exec_start.endswith(f'"--slot-save-path" "{where}/"'), exec_start


@pytest.mark.parametrize("extra, group", [
    ("", None),  # the host cannot keep them (identity.systemd_slots_group): as before
    ('extra_args = ["--slot-save-path", "/srv/slots/"]\n', "numa-infer"),  # the operator's own: left alone
])
def test_no_slot_directory_where_the_host_keeps_none_or_the_operator_named_one(tmp_path: Path, extra: str,
                                                                              group: str | None) -> None:
    files = _llama_server_units(tmp_path, extra, group)
    assert values_of(files["infer@.service"], "UMask") == ["0077"]
    assert "SupplementaryGroups" not in files["infer@.service"]
    dropin = files["infer@0.service.d/50-numa-infer.conf"]
    assert "ReadWritePaths" not in dropin and "TemporaryFileSystem" not in dropin and "BindPaths" not in dropin
    assert values_of(dropin, "ExecStart")[-1].count("--slot-save-path") == (1 if extra else 0)


def test_an_engine_without_slot_files_gets_no_slot_directory(tmp_path: Path) -> None:
    config = make_config()  # llama-cpp-python
    topo = read_topology(fakesys.write_tree(tmp_path / "fs", fakesys.dual_socket_smt()))
    served, engine = load_of(config)
    files = render_units(config, make_plan(config, topo, served=served), python="/usr/bin/python3", served=served,
                         engine=engine, slots_group="numa-infer")
    assert "--slot-save-path" not in files["infer@0.service.d/50-numa-infer.conf"]
    assert "ReadWritePaths" not in files["infer@0.service.d/50-numa-infer.conf"]
