"""host/identity.py: where the instances run (the backend kind) and who they and the front
door run as: a user that exists, one that does not (the package's own, which falls back to
`nobody`, or one the operator named, which is an error), systemd's DynamicUser, and a
daemon that is not root (which cannot switch).

The users are this host's (root, nobody) and a name no host has. Tests that need a root
daemon are skipped elsewhere; a non-root daemon is stood in for by os.geteuid() patched to
return a non-zero uid, since these tests run as root in CI and cannot drop privileges
within the test process."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from numad_infer.config.load import parse_config
from numad_infer.errors import ConfigError
from numad_infer.host.identity import (
    DYNAMIC_USER,
    FALLBACK_USER,
    FRONTDOOR_USER,
    INSTANCE_USER,
    BackendKind,
    backend_kind,
    frontdoor_runs_as,
    instances_run_as,
    lookup,
    lookup_packaged,
    systemd_frontdoor_user,
    unreadable_reason,
)
from numad_infer.host.procfs import ProcReader
from numad_infer.validate.host_check import host_warnings
from tests.frontdoor.harness import as_root

MISSING = "numa-infer-no-such-user"


def test_a_missing_packaged_user_falls_back_to_nobody_with_the_fix_named() -> None:
    found = lookup_packaged(MISSING, "/etc/numa-infer.toml", "server.user", packaged=MISSING)
    assert found.name == FALLBACK_USER and found.uid == pwd.getpwnam(FALLBACK_USER).pw_uid
    assert f"user {MISSING} does not exist" in found.fallback and "systemd-sysusers" in found.fallback
    assert any(found.fallback in w for w in host_warnings(ProcReader("/"), found))
    # A user the operator named, not the package's, is an error: they meant that one.
    with pytest.raises(ConfigError, match=f"server.user = \"{MISSING}\": no such user"):
        lookup_packaged(MISSING, "/etc/numa-infer.toml", "server.user", packaged=INSTANCE_USER)



@as_root
def test_a_root_daemon_runs_its_servers_as_the_packaged_user_by_default() -> None:
    config = parse_config('[model]\npath = "/m.gguf"\n')
    assert config.server.user == INSTANCE_USER
    runs_as = instances_run_as(config.server.user, "cfg", BackendKind.PROCESS)
    try:
        assert runs_as.uid == pwd.getpwnam(INSTANCE_USER).pw_uid and not runs_as.fallback
    except KeyError:
        assert runs_as.name == FALLBACK_USER and INSTANCE_USER in runs_as.fallback



@as_root
def test_the_front_door_user_falls_back_to_nobody_under_the_process_backend_only() -> None:
    process = frontdoor_runs_as(BackendKind.PROCESS, MISSING)
    assert process is not None and process.name == FALLBACK_USER and "systemd-sysusers" in process.fallback
    # Under systemd a User= that does not exist keeps the unit from starting: no User= at all.
    assert frontdoor_runs_as(BackendKind.SYSTEMD, MISSING) is None
    assert systemd_frontdoor_user(MISSING) is None


def test_server_user_must_exist_and_be_a_user_name() -> None:
    from numad_infer.config.load import parse_config
    from numad_infer.host.identity import lookup

    with pytest.raises(ConfigError, match=r"server.user = .*no such user on this host; create it"):
        lookup("numa-infer-no-such-user", "cfg")
    with pytest.raises(ConfigError, match="server.user.*must be a user name"):
        parse_config('[model]\npath = "/m.gguf"\n[server]\nuser = "-x"\n', "cfg")


def not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon that is not root: stood in for by os.geteuid (CI runs these tests as root)."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)


@pytest.mark.parametrize("choice, systemd_runs, kind", [
    ("systemd", False, BackendKind.SYSTEMD), ("process", True, BackendKind.PROCESS),
    ("auto", True, BackendKind.SYSTEMD), ("auto", False, BackendKind.PROCESS),
])
def test_the_backend_kind_is_the_choice_or_where_systemd_runs_for_auto(
        tmp_path: Path, choice: str, systemd_runs: bool, kind: BackendKind) -> None:
    if systemd_runs:  # what systemd creates at boot, under a root of the test's own
        (tmp_path / "run/systemd/system").mkdir(parents=True)
    assert backend_kind(choice, str(tmp_path)) == kind


def test_a_backend_kind_that_is_none_of_them_is_refused() -> None:
    with pytest.raises(ValueError, match="'container'"):
        backend_kind("container")


def test_under_systemd_the_instances_run_as_a_dynamic_user_whatever_server_user_names() -> None:
    for user in ("nobody", MISSING, INSTANCE_USER):
        assert instances_run_as(user, "cfg", BackendKind.SYSTEMD) is DYNAMIC_USER
    assert DYNAMIC_USER.uid is None and not DYNAMIC_USER.is_root


@as_root
def test_a_root_daemon_runs_its_servers_as_a_server_user_that_exists() -> None:
    nobody = pwd.getpwnam("nobody")
    runs_as = instances_run_as("nobody", "cfg", BackendKind.PROCESS)
    assert runs_as is not None
    assert (runs_as.name, runs_as.uid, runs_as.gid, runs_as.fallback) == ("nobody", nobody.pw_uid, nobody.pw_gid, "")
    assert runs_as.popen_kwargs() == {"user": nobody.pw_uid, "group": nobody.pw_gid,
                                      "extra_groups": list(runs_as.groups)}
    root = instances_run_as("root", "cfg", BackendKind.PROCESS)
    assert root is not None and root.is_root and root.home == pwd.getpwnam("root").pw_dir


@as_root
def test_a_server_user_that_does_not_exist_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError,
                       match=rf'/etc/numa-infer.toml: server.user = "{MISSING}": no such user on this host'):
        instances_run_as(MISSING, "/etc/numa-infer.toml", BackendKind.PROCESS)


def test_a_daemon_that_is_not_root_runs_its_servers_and_haproxy_as_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    not_root(monkeypatch)
    assert instances_run_as("nobody", "cfg", BackendKind.PROCESS) is None
    assert instances_run_as(MISSING, "cfg", BackendKind.PROCESS) is None  # not looked up: it cannot switch anyway
    assert frontdoor_runs_as(BackendKind.PROCESS, "nobody") is None
    assert instances_run_as(MISSING, "cfg", BackendKind.SYSTEMD) is DYNAMIC_USER  # systemd switches, not the daemon


def test_the_front_door_unit_names_its_user_where_the_host_has_it_and_none_where_not() -> None:
    assert systemd_frontdoor_user("nobody") == "nobody"
    found = frontdoor_runs_as(BackendKind.SYSTEMD, "nobody")
    assert found is not None and found.uid == pwd.getpwnam("nobody").pw_uid and not found.fallback
    assert systemd_frontdoor_user(MISSING) is None and frontdoor_runs_as(BackendKind.SYSTEMD, MISSING) is None
    try:
        pwd.getpwnam(FRONTDOOR_USER)
    except KeyError:
        assert systemd_frontdoor_user() is None  # a source tree without the package's users
    else:
        assert systemd_frontdoor_user() == FRONTDOOR_USER


@as_root
def test_a_root_daemon_runs_haproxy_as_the_front_door_user_that_exists() -> None:
    found = frontdoor_runs_as(BackendKind.PROCESS, "nobody")
    assert found is not None and found.name == "nobody" and found.uid == pwd.getpwnam("nobody").pw_uid
    assert not found.fallback


def test_what_a_user_cannot_read_is_named_with_the_fix(tmp_path: Path) -> None:
    nobody, root = lookup("nobody", "cfg"), lookup("root", "cfg")
    tmp_path.chmod(0o755)  # conftest makes pytest's root searchable; this test's own directory too
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    model.chmod(0o600)
    if os.stat(model).st_uid == nobody.uid:
        pytest.skip("the tests run as nobody: the file is its own")
    assert unreadable_reason(str(model), nobody) == f"nobody may not read it (chmod o+r {model})"
    assert unreadable_reason(str(model), root) is None  # root reads every file
    model.chmod(0o604)
    assert unreadable_reason(str(model), nobody) is None
    assert unreadable_reason(str(tmp_path / "absent"), nobody) is None  # what cannot be stat'ed: model_size says so
    tmp_path.chmod(0o700)
    assert unreadable_reason(str(model), nobody) == (f"directory {tmp_path} is not searchable by nobody "
                                                     f"(chmod o+x {tmp_path})")


def test_the_instance_units_keep_slots_only_where_the_group_and_the_directory_exist(tmp_path: Path) -> None:
    import grp
    import os

    from numad_infer.host.identity import systemd_slots_group

    group = grp.getgrgid(os.getgid()).gr_name
    assert systemd_slots_group(str(tmp_path / "missing"), group) is None  # an older daemon unit: start cold
    assert systemd_slots_group(str(tmp_path), "no-such-group-here") is None  # a source install
    assert systemd_slots_group(str(tmp_path), group) == group
    # Host facts only: who asks (a `check` by someone who cannot write there) changes nothing.
    os.chmod(tmp_path, 0o500)
    try:
        assert systemd_slots_group(str(tmp_path), group) == group
    finally:
        os.chmod(tmp_path, 0o700)
