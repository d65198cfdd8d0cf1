"""Switching a child to another user between fork and exec, optionally keeping the one
capability a front door on a port below 1024 needs (CAP_NET_BIND_SERVICE).

subprocess.Popen's `user=`/`group=` switch drops every capability, and its `preexec_fn`
runs only after the switch, too late to ask the kernel to keep one. So the switch is done
here, in the preexec function: PR_SET_KEEPCAPS, then groups, gid and uid, then capset to
that one capability and PR_CAP_AMBIENT_RAISE, so it survives the exec of an ordinary
binary (capabilities(7), "Ambient capability set"). Everything else is gone: HAProxy can
bind its port and nothing more. Under systemd the unit does the same with `User=` and
`AmbientCapabilities=`.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

from numad_infer.identity import RunAs

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1
PR_SET_KEEPCAPS = 8
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_RAISE = 2
CAP_NET_BIND_SERVICE = 10
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _keep_only_bind_service() -> None:
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()  # capabilities 0-31, then 32-63: ours is in the first word
    bit = 1 << CAP_NET_BIND_SERVICE
    data[0].effective = data[0].permitted = data[0].inheritable = bit
    _check(_libc.capset(ctypes.byref(header), data), "capset")
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_NET_BIND_SERVICE, 0, 0), "PR_CAP_AMBIENT_RAISE")


def switch_user(user: RunAs | None, bind_below_1024: bool) -> Callable[[], None]:
    """A preexec function: become `user` (None: stay who the daemon is), keep
    CAP_NET_BIND_SERVICE if asked and the switch is from root, and die with the daemon."""

    def in_child() -> None:
        if user is not None:
            assert user.uid is not None and user.gid is not None
            if bind_below_1024:
                _check(_libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0), "PR_SET_KEEPCAPS")
            os.setgroups(list(user.groups))
            os.setresgid(user.gid, user.gid, user.gid)
            os.setresuid(user.uid, user.uid, user.uid)
            if bind_below_1024:
                _keep_only_bind_service()
        # After the switch: changing credentials clears the parent-death signal.
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return in_child
