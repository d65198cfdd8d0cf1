"""Who may connect to the socket the daemon hands the front door's listening socket out on
(frontdoor/listener.Handout): its owner, and HAProxy's group where HAProxy has one. The
peer's uid is checked besides (tests/frontdoor/test_listener.py); the file's mode keeps
everyone else from connecting at all."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from numad_infer.frontdoor.listener import Handout, HeldListener


def test_the_handout_socket_is_its_owners_alone_without_a_front_door_group(tmp_path: Path) -> None:
    # With no group for HAProxy, the file's group would be the daemon's own (root's, or a
    # login group other users share): no one's to connect through.
    handout = Handout(HeldListener(), tmp_path / "listener.sock", frozenset({os.geteuid()}), None)
    handout.start()
    try:
        assert stat.S_IMODE(handout.path.stat().st_mode) == 0o600
    finally:
        handout.close()


def test_the_handout_socket_lets_the_front_doors_group_connect(tmp_path: Path) -> None:
    handout = Handout(HeldListener(), tmp_path / "listener.sock", frozenset({os.geteuid()}), os.getegid())
    handout.start()
    try:
        info = handout.path.stat()
        assert stat.S_IMODE(info.st_mode) == 0o660 and info.st_gid == os.getegid()
    finally:
        handout.close()
