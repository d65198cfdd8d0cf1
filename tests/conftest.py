from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

CAPTURES = Path(__file__).resolve().parent / "data" / "topologies"


def capture_names() -> list[str]:
    return sorted(p.name.removesuffix(".tar.bz2") for p in CAPTURES.glob("*.tar.bz2"))


@pytest.fixture(scope="session")
def captures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Archive name -> the filesystem root it unpacks to (one top directory each)."""
    base = tmp_path_factory.mktemp("captures")
    roots: dict[str, Path] = {}
    for name in capture_names():
        target = base / name
        target.mkdir()
        # GNU tar: Python's tarfile takes minutes on these many-small-file archives.
        subprocess.run(["tar", "xjf", str(CAPTURES / f"{name}.tar.bz2"), "-C", str(target)], check=True)
        (top,) = list(target.iterdir())
        roots[name] = top
    return roots


def searchable_by_others(path: Path) -> Path:
    """Let the instances' unprivileged user reach `path` (pytest's temporary directories
    are 0700): a root `check` verifies the model as that user (model/file.read_model)."""
    for directory in [path, *path.parents]:
        if directory == Path("/tmp") or directory == Path("/"):
            break
        if os.geteuid() == directory.stat().st_uid:
            directory.chmod(directory.stat().st_mode | stat.S_IXOTH)
    return path


@pytest.fixture(scope="session", autouse=True)
def _temp_root_searchable(tmp_path_factory: pytest.TempPathFactory) -> None:
    """pytest's temporary root (/tmp/pytest-of-USER/pytest-N) searchable by the instances'
    user from the start, so that a test whose model lives in its tmp_path passes alone as
    it does after another test made the root searchable (searchable_by_others): no test
    depends on the order it runs in."""
    searchable_by_others(tmp_path_factory.getbasetemp())
