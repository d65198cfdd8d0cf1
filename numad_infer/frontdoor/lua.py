"""The one Lua file HAProxy loads (`lua-load`), beside haproxy.cfg: the hold's actions
(hold.py), the prefix routing's pick (affinity.py), the batch wait (batch_wait.py) and the
answers' token counts (token_count.py). One file, written with haproxy.cfg by whoever
writes it: one more name to place and check, not several. Pure."""

from __future__ import annotations

from numad_infer.frontdoor import affinity, batch_wait, hold, token_count

NAME = "numa-infer.lua"
SCRIPT = hold.HOLD_LUA + affinity.PICK_LUA + batch_wait.BATCH_LUA + token_count.TOKEN_LUA
