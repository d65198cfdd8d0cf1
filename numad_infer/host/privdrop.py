"""Switching a child (HAProxy under the process backend) to another user between fork and
exec, with no capability left.

The switch is done here, in a preexec function, rather than with subprocess.Popen's
`user=`/`group=`, so that the parent-death signal can be set after it: changing credentials
clears it, and HAProxy must die with the daemon. No capability is kept: the daemon binds the
front door's port, even one below 1024, and HAProxy only accepts on it (listener.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

from numad_infer.host.identity import RunAs

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def switch_user(user: RunAs | None) -> Callable[[], None]:
    """A preexec function: become `user` (None: stay who the daemon is), and die with the
    daemon."""

    def in_child() -> None:
        if user is not None:
            assert user.uid is not None and user.gid is not None
            os.setgroups(list(user.groups))
            os.setresgid(user.gid, user.gid, user.gid)
            os.setresuid(user.uid, user.uid, user.uid)
        # After the switch: changing credentials clears the parent-death signal.
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return in_child
