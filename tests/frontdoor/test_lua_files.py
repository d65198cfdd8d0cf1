"""The Lua HAProxy runs is the package's .lua files as they are (numad_infer/frontdoor/lua.py):
written byte for byte beside haproxy.cfg, with the data file that gives them every name and
limit they read; valid Lua 5.3; and its unit tests (tests/lua, busted) pass."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from numad_infer.frontdoor import lua
from numad_infer.frontdoor.checked_config import put_lua
from numad_infer.frontdoor.haproxy_config import paths_in, write_config

ROOT = Path(__file__).resolve().parents[2]
PACKAGED = ROOT / "numad_infer" / "frontdoor" / "lua"
LUACHECKRC = ROOT / ".luacheckrc"


def _packaged() -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(PACKAGED.glob("*.lua"))}


def test_every_packaged_lua_file_is_written_byte_for_byte_with_the_data(tmp_path: Path) -> None:
    packaged = _packaged()
    assert set(packaged) == {lua.NAME, *lua.CONCERNS}
    assert set(lua.files()) == {*packaged, lua.DATA_NAME}
    # By the daemon's writer (renamed into place) and by write_config (`check`, tests).
    for writer, where in ((put_lua, tmp_path / "daemon"), (None, tmp_path / "in-place")):
        where.mkdir()
        paths = paths_in(where, where / "admin.sock")
        if writer is None:
            write_config(paths, "# haproxy.cfg\n")
        else:
            writer(paths)
        assert paths.lua == where / lua.NAME
        for name, text in packaged.items():
            assert (where / name).read_bytes() == text, name
        assert (where / lua.DATA_NAME).read_text(encoding="utf-8") == lua.data_text()


def test_the_data_holds_exactly_the_values_the_lua_reads() -> None:
    read = set()
    for text in _packaged().values():
        read |= set(re.findall(r'numa\.(?:text|number)\("([^"]+)"\)', text.decode()))
    assert read == set(lua.data()), (read ^ set(lua.data()))
    # One "key value" line each, the order fixed: a rewrite changes nothing that is the same.
    lines = lua.data_text().splitlines()
    assert lines == sorted(lines) and len(lines) == len(lua.data())
    assert lua.data()["lua.load"].split() == list(lua.CONCERNS)


def test_no_python_module_builds_lua_text() -> None:
    for path in (ROOT / "numad_infer").rglob("*.py"):
        source = path.read_text(encoding="utf-8")
        assert "core.register_" not in source and "local function" not in source, path


@pytest.mark.skipif(shutil.which("luac5.3") is None, reason="needs luac5.3 (apt-get install lua5.3)")
def test_lua_5_3_compiles_every_file() -> None:
    for name in _packaged():
        check = subprocess.run(["luac5.3", "-p", str(PACKAGED / name)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr


@pytest.mark.skipif(shutil.which("luacheck") is None, reason="needs luacheck (apt-get install lua-check)")
def test_luacheck_warns_of_nothing() -> None:
    check = subprocess.run(["luacheck", "--no-color", "--config", str(LUACHECKRC), "numad_infer/frontdoor/lua",
                            "tests/lua"], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.skipif(shutil.which("busted") is None or shutil.which("lua5.3") is None,
                    reason="needs busted under Lua 5.3 (apt-get install lua5.3 lua-busted)")
def test_the_lua_unit_tests_pass_under_lua_5_3() -> None:
    run = subprocess.run(["busted", "--lua=lua5.3", "--output=TAP", "tests/lua"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert re.search(r"^ok \d+", run.stdout, re.M), run.stdout
