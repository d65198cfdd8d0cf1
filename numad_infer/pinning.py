"""The kernel calls that pin: thread affinity, memory policy, page migration.

Thin edge over syscalls (no libnuma dependency). Used by the repair step and, in the
process backend, in the child between fork and exec.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

from numad_infer.planner import Policy

MPOL_BIND = 2
MPOL_INTERLEAVE = 3

# (set_mempolicy, migrate_pages) syscall numbers; not exported by Python or glibc wrappers.
_SYSCALLS = {"x86_64": (238, 256), "aarch64": (237, 238), "ppc64le": (261, 258), "s390x": (270, 287)}

_libc = ctypes.CDLL(None, use_errno=True)


def _nodemask(nodes: tuple[int, ...], maxnode: int) -> ctypes.Array:
    array = (ctypes.c_ulong * ((maxnode + 63) // 64))()
    for node in nodes:
        array[node // 64] |= 1 << (node % 64)
    return array


def _maxnode(*node_lists: tuple[int, ...]) -> int:
    # maxnode counts bits; the kernel drops the last one (a historic off-by-one), so +1.
    highest = max((n for nodes in node_lists for n in nodes), default=0)
    return ((highest + 64) // 64) * 64 + 1


def _syscall(index: int, *args: object) -> int:
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        raise OSError(errno.ENOSYS, f"unsupported architecture {platform.machine()}")
    result = _libc.syscall(numbers[index], *args)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def set_mempolicy(policy: Policy, nodes: tuple[int, ...]) -> None:
    """Memory policy of the calling thread (inherited across fork and exec)."""
    maxnode = _maxnode(nodes)
    mode = MPOL_INTERLEAVE if policy == Policy.INTERLEAVE else MPOL_BIND
    _syscall(0, ctypes.c_int(mode), _nodemask(nodes, maxnode), ctypes.c_ulong(maxnode))


def migrate_pages(pid: int, from_nodes: tuple[int, ...], to_nodes: tuple[int, ...]) -> int:
    """Move a process's pages from `from_nodes` to `to_nodes`; returns pages that could not move."""
    maxnode = _maxnode(from_nodes, to_nodes)
    return _syscall(1, ctypes.c_int(pid), ctypes.c_ulong(maxnode),
                    _nodemask(from_nodes, maxnode), _nodemask(to_nodes, maxnode))


def set_thread_affinity(tid: int, cpus: frozenset[int]) -> bool:
    """Re-pin one thread; False if it is gone (a thread exiting is not an error)."""
    try:
        os.sched_setaffinity(tid, cpus)
        return True
    except ProcessLookupError:
        return False
