"""The one Lua file HAProxy loads (`lua-load`), beside haproxy.cfg: the hold's actions
(hold.py) and the prefix routing's pick (affinity.py). One file, written with haproxy.cfg by
whoever writes it: one more name to place and check, not two. Pure."""

from __future__ import annotations

from numad_infer.frontdoor import affinity, hold

NAME = "numa-infer.lua"
SCRIPT = hold.HOLD_LUA + affinity.PICK_LUA
