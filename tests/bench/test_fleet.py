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
