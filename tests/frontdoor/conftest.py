"""Fixtures of the front door's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.frontdoor.harness import Door


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
