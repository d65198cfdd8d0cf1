"""A real seccomp filter for tests: what a container runtime's profile does to numa-infer.

Installed with libseccomp (ctypes) in a child between fork and exec, so it holds for that
process and everything it starts, as a container's profile does. Only the calls named are
refused (EPERM, as runtimes answer); everything else is allowed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno

# Kubernetes' RuntimeDefault (containerd's and Docker's profile) for a container without
# CAP_SYS_NICE, as numa-infer's DaemonSet runs: no memory policy, no page migration.
RUNTIME_DEFAULT = ("get_mempolicy", "mbind", "set_mempolicy", "set_mempolicy_home_node", "migrate_pages", "move_pages")
# podman's default (containers-common): the policy is allowed, the migration is not.
PODMAN_DEFAULT = ("migrate_pages", "move_pages")

_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_ACT_ERRNO = 0x00050000


def available() -> bool:
    return ctypes.util.find_library("seccomp") is not None


def _libseccomp() -> ctypes.CDLL:
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    return lib


def refuse(names: tuple[str, ...]) -> None:
    """Install the filter on the calling process (and its future children)."""
    lib = _libseccomp()
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    for name in names:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:
            continue  # a call this kernel's table does not know (set_mempolicy_home_node on old ones)
        if lib.seccomp_rule_add(ctx, _SCMP_ACT_ERRNO | errno.EPERM, number, 0) != 0:
            raise OSError(f"seccomp_rule_add {name} failed")
    if lib.seccomp_load(ctx) != 0:
        raise OSError("seccomp_load failed")


def allow_only(names: tuple[str, ...]) -> None:
    """Install an allow-list filter: the calls named are allowed, every other one refused
    with EPERM (a profile's defaultAction SCMP_ACT_ERRNO)."""
    lib = _libseccomp()
    ctx = lib.seccomp_init(_SCMP_ACT_ERRNO | errno.EPERM)
    if not ctx:
        raise OSError("seccomp_init failed")
    for name in names:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:
            continue  # another architecture's call, or one this kernel's table does not know
        if lib.seccomp_rule_add(ctx, _SCMP_ACT_ALLOW, number, 0) != 0:
            raise OSError(f"seccomp_rule_add {name} failed")
    if lib.seccomp_load(ctx) != 0:
        raise OSError("seccomp_load failed")
