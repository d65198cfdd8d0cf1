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
