"""`numa-infer restart`: the request file the daemon takes (only its own user's regular
file, acted on once). The rollout it starts (one at a time behind the front door, refused
while another roll is under way): tests/supervision/test_rollout.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from numad_infer.supervision import restart_request


def test_a_request_is_read_once_and_removed(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    sent = restart_request.write(state, ("infer@1",))
    assert oct(restart_request.request_path(state).stat().st_mode & 0o777) == "0o600"
    taken = restart_request.take(state)
    assert taken == sent and taken.instances == ("infer@1",)
    assert restart_request.take(state) is None


@pytest.mark.parametrize("plant", ["link", "fifo", "garbage", "wrong shape"])
def test_what_is_not_a_request_is_reported_and_removed_never_acted_on(tmp_path: Path, plant: str) -> None:
    state = tmp_path / "state.json"
    path = restart_request.request_path(state)
    if plant == "link":
        target = tmp_path / "elsewhere"
        target.write_text('{"id": "x", "instances": []}')
        path.symlink_to(target)
    elif plant == "fifo":
        os.mkfifo(path)  # opened without waiting for a writer (O_NONBLOCK)
    elif plant == "garbage":
        path.write_text("not json")
    else:
        path.write_text('{"id": 7, "instances": "all"}')
    said = restart_request.take(state)
    assert isinstance(said, str) and str(path) in said
    assert not path.exists() and not path.is_symlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant a file owned by another user")
def test_another_users_request_is_ignored(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    restart_request.write(state, ())
    os.chown(restart_request.request_path(state), 65534, 65534)
    said = restart_request.take(state)
    assert isinstance(said, str) and "not the daemon's user" in said
