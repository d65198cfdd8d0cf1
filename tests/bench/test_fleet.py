"""bench/fleet.py's smoke run (issue 59): 8 stand-in instances planned from a captured
8-node machine (16amd64-8n2c), behind the real HAProxy with the rendered configuration and
Lua, the daemon's own code (bench/standin/fleet_daemon.py's Backend), for seconds: every
turn answered in both modes, and prefix routing sends a conversation's later turns back to
the instance of its turn before more often than least connections does."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from bench import fleet

HAPROXY = "/usr/sbin/haproxy"
pytestmark = pytest.mark.skipif(not os.access(HAPROXY, os.X_OK) and shutil.which("haproxy") is None,
                                reason="haproxy not installed")


def test_eight_standins_behind_the_front_door_prefix_keeps_conversations_home(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)  # HAProxy, as its own user, reads the configuration under it
    args = fleet.options(["--turns", "4", "--think-s", "0.1:0.4", "--system-words", "40", "--user-words", "8",
                          "--max-tokens", "3", "--jitter", "0", "--timeout-s", "60"])
    assets = fleet.shared_assets(Path(args.calibration))
    conversations = 4  # half the slots: the prefix key is kept (below its balance bound)
    got = {mode: fleet.measure(8, 1, mode, [conversations / 8], args, tmp_path, assets)[conversations / 8]
           for mode in ("none", "prefix")}
    for mode, result in got.items():
        assert result["failed"] == 0, (mode, result)
        assert result["requests"] == conversations * 4, (mode, result)
        assert len(result["per_instance"]) == 8, (mode, result)
        assert result["lua_routes"], f"{mode}: the front door ran without the rendered Lua"
    # The real property: a conversation's later turns go home under "prefix"...
    assert got["prefix"]["home"] >= 0.75, got["prefix"]
    assert got["prefix"]["home"] > got["none"]["home"], (got["prefix"]["home"], got["none"]["home"])
    # ...and find their prompt cached there.
    assert got["prefix"]["cached"] > got["none"]["cached"], (got["prefix"]["cached"], got["none"]["cached"])


def test_conversations_across_a_reload_pair_their_last_turn_before_with_their_first_after() -> None:
    """across(): per conversation, the last turn that ended before the reload was asked and
    the first sent after the new HAProxy took over; home when the same port answered both."""
    def turn(c: int, k: int, port: int, sent: float, ended: float) -> fleet.Turn:
        return fleet.Turn(c, k, 0.1, 10, 0, 1, port, sent, ended)
    turns = [turn(0, 0, 1, 0.0, 1.0), turn(0, 1, 1, 2.0, 3.0), turn(0, 2, 2, 4.2, 4.5), turn(0, 3, 1, 6.0, 7.0),
             turn(1, 0, 2, 0.0, 1.0), turn(1, 1, 3, 6.0, 7.0), turn(1, 2, 2, 8.0, 9.0),
             turn(2, 0, 2, 0.0, 4.5), turn(2, 1, 2, 6.0, 7.0),  # its only turn before ended during the reload
             turn(3, 0, 4, 0.0, 1.0), turn(3, 1, 4, 4.8, 7.0)]  # sent before the new worker took over
    # conversation 0: turn 1 (port 1) and turn 3 (port 1), its turn 2 in the window aside; 1: 2 then 3
    assert fleet.across(turns, (4.0, 5.0)) == (2, 0.5)
    assert fleet.across(turns[:1], (4.0, 5.0))[0] == 0


def test_conversations_stay_home_across_a_reload_under_load(tmp_path: Path) -> None:
    """The daemon's reload (a haproxy.cfg change, SIGHUP) in the middle of 8 conversations
    on 8 instances: a new HAProxy worker whose Lua starts empty but for the homes the daemon
    hands it. No turn fails, and the later turns on both sides of it still go home."""
    tmp_path.chmod(0o755)
    args = fleet.options(["--turns", "10", "--think-s", "0.2:0.6", "--system-words", "40", "--user-words", "8",
                          "--max-tokens", "3", "--jitter", "0", "--timeout-s", "60", "--reload-after", "0.3"])
    assets = fleet.shared_assets(Path(args.calibration))
    # As many conversations as slots: a first turn often finds the instance hashing would
    # give its key busy and goes elsewhere, so a new worker without the homes would move it.
    result = fleet.measure(8, 1, "prefix", [1.0], args, tmp_path, assets)[1.0]
    assert result["failed"] == 0 and result["requests"] == 80, result
    count, home = result["across"]
    assert count >= 4, result  # conversations on both sides of the reload
    assert home >= 0.75, result
