"""The registry of names the rules and the Lua share (frontdoor/names.py): every `txn.*`
variable in a rendered haproxy.cfg or a .lua file is in it, each entry is used, and the Lua's
data file carries the registry's names under its keys."""

from __future__ import annotations

import re
from pathlib import Path

from numad_infer.frontdoor import lua, names
from tests.frontdoor import golden_haproxy as golden

FRONTDOOR = Path(names.__file__).resolve().parent
_VARIABLE = re.compile(r"\btxn\.[a-z_]+")


def _goldens() -> str:
    return "".join(golden.golden_path(name).read_text() for name in golden.cases())


def test_every_variable_the_rules_or_the_lua_use_is_registered() -> None:
    registered = {entry.text for entry in names.REGISTRY}
    used = set(_VARIABLE.findall(_goldens()))
    for path in (FRONTDOOR / "lua").glob("*.lua"):
        # As a string: `txn.f`, `txn.c` are the Lua API's own (fetches, converters).
        used |= {m[1:] for m in re.findall(r"[\"']txn\.[a-z_]+", path.read_text())}
    assert used - registered == set()


def test_every_registered_name_is_rendered_in_a_golden_and_none_twice() -> None:
    text = _goldens()
    assert [e.text for e in names.REGISTRY if e.text not in text] == []
    assert len({e.text for e in names.REGISTRY}) == len(names.REGISTRY)
    assert {e.kind for e in names.REGISTRY} == {names.VARIABLE, names.TABLE, names.LUA}


def test_no_module_spells_a_variable_itself() -> None:
    """Only names.py writes a `txn.` name as a string; the others take its constants."""
    spelled = [f"{path.name}: {m}" for path in FRONTDOOR.glob("*.py") if path.name != "names.py"
               for m in re.findall(r"[\"']txn\.[a-z_]+", path.read_text())]
    assert spelled == []


def test_the_lua_reads_the_registrys_names() -> None:
    data = lua.data()
    for key, text in names.lua_data().items():
        assert data[key] == text, key
