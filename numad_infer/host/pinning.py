"""The kernel calls that pin: thread affinity, memory policy, page migration.

Thin edge over syscalls (no libnuma dependency). Used by the repair step and, in the
process backend, in the child between fork and exec.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import threading
from dataclasses import dataclass

from numad_infer.plan.model import Policy

MPOL_DEFAULT = 0
MPOL_BIND = 2
MPOL_INTERLEAVE = 3

# (set_mempolicy, migrate_pages) syscall numbers; not exported by Python or glibc wrappers.
_SYSCALLS = {"x86_64": (238, 256), "aarch64": (237, 238), "ppc64le": (261, 258), "s390x": (270, 287)}

_libc = ctypes.CDLL(None, use_errno=True)


def _nodemask(nodes: tuple[int, ...], maxnode: int) -> ctypes.Array[ctypes.c_ulong]:
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
    result: int = _libc.syscall(numbers[index], *args)
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


@dataclass(frozen=True)
class MemoryCalls:
    """Whether this process may set a memory policy and move pages: why not, or None.

    A container's seccomp profile decides it, not the kernel: Kubernetes' RuntimeDefault
    (containerd's and Docker's profile) allows set_mempolicy and mbind only with
    CAP_SYS_NICE and refuses migrate_pages and move_pages; podman's default allows the
    policy and refuses the migration. A refused call fails with EPERM, in the daemon and in
    every child it starts (a filter survives fork and exec)."""

    bind_refused: str | None  # set_mempolicy: an instance cannot be started bound to its node(s)
    migrate_refused: str | None  # migrate_pages: memory drift cannot be repaired


# Where the operator reads how to allow the memory calls: which profiles refuse them, the fix.
SECCOMP_DOC = "docs/kubernetes.md, \"Memory policy under seccomp\""

# What a refusal looks like: a seccomp filter answers EPERM (SECCOMP_RET_ERRNO), a kernel
# without NUMA support ENOSYS. Anything else (EINVAL...) is not a refusal of the call.
_REFUSED = (errno.EPERM, errno.EACCES, errno.ENOSYS)


@functools.cache
def memory_calls() -> MemoryCalls:
    """Try each call once, harmlessly: a seccomp filter does not change while we run."""
    refused: dict[str, str | None] = {"bind": None, "migrate": None}

    def attempt(key: str, call: int, *args: object) -> None:
        try:
            _syscall(call, *args)
        except OSError as exc:
            if exc.errno in _REFUSED:
                refused[key] = exc.strerror or str(exc)

    # MPOL_DEFAULT with no mask ("the default"), on a thread that ends right after: no
    # policy of the daemon's own threads changes.
    probe = threading.Thread(target=attempt, args=("bind", 0, ctypes.c_int(MPOL_DEFAULT), None, ctypes.c_ulong(0)),
                             name="mempolicy-probe")
    probe.start()
    probe.join()
    # No nodes to no nodes: moves nothing (kernels answer 0 or EINVAL for an empty target,
    # neither a refusal), yet meets the same filter a real repair does: seccomp answers
    # before the kernel reads the arguments.
    attempt("migrate", 1, ctypes.c_int(os.getpid()), ctypes.c_ulong(0), None, None)
    return MemoryCalls(refused["bind"], refused["migrate"])
