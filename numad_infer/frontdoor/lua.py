"""The Lua HAProxy runs, as files: this package's lua/ folder holds one .lua file per concern
(the hold, hold.py; the prefix pick, affinity.py; the batch wait, batch_wait.py; the token
counts, token_count.py) and NAME, the one haproxy.cfg loads (`lua-load`), which runs the
others. Whoever writes haproxy.cfg copies them beside it byte for byte (a package upgrade
never pairs a running config with newer Lua), with DATA_NAME: what the Python side tells
the Lua (names of actions, fetches, variables and stick tables; steps and limits), one
"key value" line each. No Lua text is formatted here; what changes per config (a backend's
name, a wait, a bound) is an action's or fetch's argument in haproxy.cfg.

One `lua-load`, not one per file: HAProxy 2.6's takes no arguments, so each file needs a
way to the data and the shared helpers. NAME reads the data once and hands each file it
runs (the data's `lua.load`) a table of both, with no global set; haproxy.cfg keeps its one
line. Reads only this package's own files."""

from __future__ import annotations

import functools
from importlib import resources

from numad_infer.frontdoor import affinity, batch_wait, hold, names, token_count

NAME = "numa-infer.lua"
DATA_NAME = "numa-infer-lua.data"  # NAME reads it from its own folder
CONCERNS = (hold.LUA_FILE, affinity.LUA_FILE, batch_wait.LUA_FILE, token_count.LUA_FILE)  # run in this order


def data() -> dict[str, str]:
    """What the Lua reads: the names it shares with the rules (names.py), each concern's
    LUA_DATA, and the files NAME runs."""
    values = {"lua.load": " ".join(CONCERNS), **names.lua_data(), **hold.LUA_DATA, **affinity.LUA_DATA,
              **batch_wait.LUA_DATA, **token_count.LUA_DATA}
    return {key: str(value) for key, value in values.items()}


def data_text() -> str:
    """DATA_NAME's text: "key value" lines (a value is the rest of its line)."""
    lines = []
    for key, value in sorted(data().items()):
        if not key or any(c.isspace() for c in key) or "\n" in value or "\r" in value:
            raise ValueError(f"{DATA_NAME}: cannot write {key!r} = {value!r} as one line")
        lines.append(f"{key} {value}\n")
    return "".join(lines)


@functools.cache
def packaged(name: str) -> str:
    """A .lua file of this package's lua/ folder, as it is."""
    return (resources.files(__package__) / "lua" / name).read_text(encoding="utf-8")


def files() -> dict[str, str]:
    """Every file written beside haproxy.cfg, name -> text: the concerns and the data before
    NAME, which loads them (a writer that stops halfway leaves the old NAME)."""
    return {**{name: packaged(name) for name in CONCERNS}, DATA_NAME: data_text(), NAME: packaged(NAME)}
