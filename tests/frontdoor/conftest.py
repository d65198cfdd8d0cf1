"""Fixtures of the front door's tests."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from numad_infer.config.apikey import read_tenant_keys
from tests.daemon_harness import wait_for

from tests.frontdoor.harness import Door
from tests.frontdoor.tenant_door import INSTANCE_KEY, KEY_A, KEY_B, TWO_MODELS, Echo, EchoServer, key_file, post, \
    tenant_tables


@pytest.fixture
def doors(tmp_path: Path):
    made: list[Door] = []

    def make(**kwargs) -> Door:
        door = Door(tmp_path, **kwargs)
        made.append(door)
        return door

    yield make
    for door in made:
        door.stop()


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o755)
    return path


@pytest.fixture
def door_with(tmp_path: Path, keys_dir: Path) -> Iterator:
    made: list[tuple[Door, list[EchoServer]]] = []

    def make(models: str = TWO_MODELS, server: str = "", a: str = "", b: str = "", frontend: str = "") -> Door:
        """`frontend`: more [frontend] keys."""
        key_file(keys_dir, "a", KEY_A)
        key_file(keys_dir, "b", KEY_B)
        door = Door(tmp_path, models=models, server=server, extra=frontend + tenant_tables(keys_dir, a, b))
        stubs = []
        for instance in door.plan.instances:
            stub = EchoServer(("127.0.0.1", instance.port), Echo)
            threading.Thread(target=stub.serve_forever, daemon=True).start()
            stubs.append(stub)
        made.append((door, stubs))
        door.keys = read_tenant_keys(door.config, "test.toml")  # type: ignore[attr-defined]
        assert door.apply(door.keys, INSTANCE_KEY if "api_key_file" in server else None)  # type: ignore[attr-defined]
        wait_for(lambda: post(door.port, KEY_A).status == 200, f"the front door serving team-a\n{door.log()}")
        return door

    yield make
    for door, stubs in made:
        door.stop()
        for stub in stubs:
            stub.shutdown()
            stub.server_close()
