"""Who listens on an instance's port: the instance's own process, or another one.

The daemon sends the API key to an instance's port (the key check, llama-server's
/metrics) and puts a port that answers its probe into rotation, where clients' prompts
and keys go. While an instance restarts or loads its model, any local user can listen on
that port first. So before either, every socket that listens where a client of the port
connects must be the instance's: its inode, from /proc/net/tcp and tcp6, among the file
descriptors of the instance's process or of its children.

The connections such a listener took are told the same way, by the listener and not by
the port alone (`open_connections`: a retiring instance's requests; `clients_gone`: the
front door's clients that left): the local address one of its sockets takes connections
at, and the user who listens or accepts there.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import psutil

from numad_infer.util.addresses import connect_host, host_port, unmapped

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


class Holder(Enum):
    INSTANCE = "instance"  # every socket listening there belongs to the instance's process (or its children)
    NOBODY = "nobody"  # nothing listens there (yet): the server is still starting, or gone
    OTHER = "other"  # another process listens there, or whose it is cannot be told


@dataclass(frozen=True)
class PortOwner:
    holder: Holder
    detail: str = ""  # why the port is not the instance's, for the probe's error and status

    @property
    def ours(self) -> bool:
        return self.holder == Holder.INSTANCE


@dataclass(frozen=True)
class Listeners:
    """The TCP sockets listening on the host when read (/proc/net/tcp and tcp6), each as
    (address, port, inode, uid). A monitoring pass reads them once for all its instances:
    the kernel writes a row for every connection of the host into those files (thousands,
    with the front door's and the probes' TIME_WAIT), and reading them for each instance's
    probe and counters was most of the daemon's time at 64 instances (bench/README.md).
    Read just before the pass's probes start; whose each listener is, its process's
    descriptors, is still read live for each instance."""
    sockets: tuple[tuple[IPAddress, int, int, int], ...]


def listeners(proc: Path) -> Listeners:
    return Listeners(tuple((_address(fields[1].partition(":")[0]), _port(fields[1]), int(fields[9]), int(fields[7]))
                           for fields in _sockets(proc, _LISTEN)))


def port_owner(proc: Path, host: str, port: int, pid: int, table: Listeners | None = None) -> PortOwner:
    """Does process `pid` (the instance's main process) hold the port its clients reach?
    `table`: the listening sockets as the caller read them (None: read them now)."""
    target = ipaddress.ip_address(connect_host(host))
    where = host_port(str(target), port)
    table = listeners(proc) if table is None else table
    listening = {inode for inode, _ in _listeners(table, target, port)}
    if not listening:
        return PortOwner(Holder.NOBODY, f"nothing listens on {where}")
    try:
        # The main process first: one directory read in the usual case (it holds the socket).
        missing = listening - _socket_inodes(proc, pid)
        family = {pid, *(_descendants(proc, pid) if missing else [])}
        for child in family - {pid}:
            missing -= _socket_inodes(proc, child, gone_ok=True)
    except (FileNotFoundError, ProcessLookupError):
        return PortOwner(Holder.OTHER, f"{where} is held by another process: the instance's process {pid} is gone")
    except PermissionError:
        return _by_user(proc, table, target, port, pid, where)
    except OSError as exc:
        return PortOwner(Holder.OTHER, f"cannot tell who holds {where}: the sockets of process {pid} cannot be read "
                                       f"({exc.strerror}); run the daemon as root")
    if not missing:
        return PortOwner(Holder.INSTANCE)
    return PortOwner(Holder.OTHER, f"port {port} is held by {_holder(proc, port, family)}, not by the instance "
                                   f"(pid {pid}): no API key and no requests go to it")


_ESTABLISHED = "01"  # TCP_ESTABLISHED


def open_connections(proc: Path, port: int, pid: int) -> int:
    """Connections clients hold open to the instance of process `pid` on its `port`
    (requests in flight, kept-alive ones).

    Only those its own listening socket accepted count. Any local user may listen on
    another local address at the same port (127.0.0.2:PORT where the instance holds
    127.0.0.1:PORT) and connect to it: by port alone, those connections would hold a
    retiring instance up to its drain's timeout. A connection's uid is its listener's
    while it waits to be accepted (the kernel copies it), then the accepting process's
    (accept() makes it the caller's): an instance listens and accepts as its own user, the
    process's (under systemd a DynamicUser of its own). So a connection counts when a
    socket of that user listening on the port takes connections at its local address, and
    the connection is that user's too. A process gone has none open."""
    try:
        uid = _real_uid(proc, pid)
    except (OSError, ValueError):
        return 0
    listeners = [address for address, owner in _listen_rows(_sockets(proc, _LISTEN), port) if owner == uid]
    return sum(1 for fields in _sockets(proc, _ESTABLISHED) if int(fields[7]) == uid
               and _accepted_at(fields, port, listeners))


_CLOSE_WAIT = "08"  # TCP_CLOSE_WAIT: the peer sent its FIN, the local end is still open


Peer = tuple[IPAddress, int]


def clients_gone(proc: Path, listen_hosts: Iterable[str], port: int, acceptors: Iterable[int]) -> set[Peer]:
    """The clients of `gone_at`, wherever they connected to."""
    return set(gone_at(proc, listen_hosts, port, acceptors))


def gone_at(proc: Path, listen_hosts: Iterable[str], port: int, acceptors: Iterable[int]) -> dict[Peer, set[Peer]]:
    """The clients (address, port) that closed a connection the sockets listening on
    `port` at `listen_hosts` took, while the local end is still open: for the front door's
    addresses (its own and its loopback twin), port and HAProxy's users (`acceptors`),
    requests HAProxy has not yet seen abandoned (frontdoor/abandoned.py). An IPv4 client
    of an IPv6 socket as IPv4.

    Not every half-closed connection to the port: any local user may listen on another
    local address at the same port (127.0.0.2:PORT beside a front door on 127.0.0.1),
    connect to it from a client's address and port (read in /proc/net/tcp), and close that
    end; the socket left in CLOSE_WAIT would name the client, whose request the watch
    would end. So a connection counts only when its local address is one a front door
    listener takes connections at, and its uid is that listener's (not accepted yet: the
    kernel copies the listener's) or one of `acceptors` (accept() gives it the caller's;
    the daemon, or systemd, creates the listener, HAProxy accepts on it).

    Each client with the local address and port it had connected to: on a wildcard
    listener, one client address and port may hold connections to two local addresses
    (the watch tells them apart by the stream's own, abandon_watch.py)."""
    hosts = {ipaddress.ip_address(host) for host in listen_hosts}
    acceptors = set(acceptors)
    listeners = [(address, uid) for address, uid in _listen_rows(_sockets(proc, _LISTEN), port)
                 if address in hosts]
    gone: dict[Peer, set[Peer]] = {}
    for fields in _sockets(proc, _CLOSE_WAIT):
        uid = int(fields[7])
        by = [address for address, owner in listeners if uid == owner or uid in acceptors]
        if _accepted_at(fields, port, by):
            host, _, client_port = fields[2].partition(":")
            local = (unmapped(_address(fields[1].partition(":")[0])), port)
            gone.setdefault((unmapped(_address(host)), int(client_port, 16)), set()).add(local)
    return gone


def _listen_rows(rows: Iterable[list[str]], port: int) -> list[tuple[IPAddress, int]]:
    """(address, uid) of each TCP socket listening on `port`."""
    return [(_address(fields[1].partition(":")[0]), int(fields[7])) for fields in rows
            if fields[3] == _LISTEN and _port(fields[1]) == port]


def _accepted_at(fields: list[str], port: int, listeners: list[IPAddress]) -> bool:
    """Is the connection of this row on `port`, at a local address one of the sockets
    listening at `listeners` takes connections at? A wildcard takes its family's: an IPv4
    client of an IPv6 socket is ::ffff:a.b.c.d there, an IPv6 listener's."""
    if _port(fields[1]) != port:
        return False
    local = _address(fields[1].partition(":")[0])
    return any(address == local or (address.is_unspecified and address.version == local.version)
               for address in listeners)


def _sockets(proc: Path, state: str) -> Iterator[list[str]]:
    """The rows of /proc/net/tcp and tcp6 in `state` (`_LISTEN`...), split in their
    columns: sl, local and remote address, state, queues, timers, retransmits, uid,
    timeout, inode. A host's tables hold a row for every connection (thousands, with the
    front door's and the probes' TIME_WAIT), its listeners are a few, and the check runs
    for every instance on every pass: splitting every row was 56 % of the daemon's time at
    64 instances (bench/README.md). So a row is split only when its state's column, which
    no other column can look like (the others are decimal, or hex without spaces around
    two digits), is in it."""
    column = f" {state} "
    for table in ("tcp", "tcp6"):
        try:
            text = (proc / "net" / table).read_text()
        except OSError:
            continue  # no IPv6 on this host
        at = text.find(column)
        while at != -1:
            start, end = text.rfind("\n", 0, at) + 1, text.find("\n", at)
            end = len(text) if end == -1 else end
            fields = text[start:end].split()
            if len(fields) >= 10 and fields[3] == state:
                yield fields
            at = text.find(column, end)


def _port(address: str) -> int:
    return int(address.rpartition(":")[2], 16)


def _by_user(proc: Path, table: Listeners, target: IPAddress, port: int, pid: int, where: str) -> PortOwner:
    """When the instance's descriptors cannot be read: under systemd each instance runs as a
    DynamicUser of its own, and the daemon (root, with no capability but CAP_SYS_NICE) may
    not look into another user's process. Each instance's user is then its own, so a socket
    created by that user is the instance's; anyone else's is not. Root's never is."""
    try:
        uid = _real_uid(proc, pid)
    except (OSError, ValueError):
        return PortOwner(Holder.OTHER, f"{where} is held by another process: the instance's process {pid} is gone")
    owners = {uid for _, uid in _listeners(table, target, port)}
    if uid != 0 and owners and owners <= {uid}:
        return PortOwner(Holder.INSTANCE)
    others = ", ".join(str(u) for u in sorted(owners - {uid}))
    return PortOwner(Holder.OTHER, f"port {port} is held by uid {others or uid}, not by the instance's user "
                                   f"(uid {uid}, pid {pid}): no API key and no requests go to it")


def _real_uid(proc: Path, pid: int) -> int:
    for line in (proc / str(pid) / "status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise ValueError(f"no Uid line for process {pid}")


def _descendants(proc: Path, pid: int) -> list[int]:
    """The process's children, theirs, and so on (a server that forks workers)."""
    found, parents = [], [pid]
    while parents:
        parent = parents.pop()
        try:
            tasks = os.listdir(proc / str(parent) / "task")
        except FileNotFoundError:
            continue  # exited meanwhile
        for tid in tasks:
            try:
                children = [int(c) for c in (proc / str(parent) / "task" / tid / "children").read_text().split()]
            except FileNotFoundError:
                continue  # the thread exited, or a kernel without CONFIG_PROC_CHILDREN: the main process only
            found += children
            parents += children
    return found


def _socket_inodes(proc: Path, pid: int, gone_ok: bool = False) -> set[int]:
    """Inodes of the sockets among the process's file descriptors (`socket:[INODE]` links).
    `gone_ok`: a process that exited has none (a child may exit while it is looked at)."""
    fds = proc / str(pid) / "fd"
    inodes: set[int] = set()
    try:
        names = os.listdir(fds)
    except FileNotFoundError:
        if gone_ok:
            return inodes
        raise
    for fd in names:
        try:
            target = os.readlink(fds / fd)
        except FileNotFoundError:
            continue  # closed between the listing and the read
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def _listeners(table: Listeners, target: IPAddress, port: int) -> set[tuple[int, int]]:
    """(inode, uid) of each TCP socket listening on `port` that a connection to `target` may reach."""
    return {(inode, uid) for address, at, inode, uid in table.sockets if at == port and _reaches(address, target)}


def _address(hex_address: str) -> IPAddress:
    # The kernel prints the address as 32-bit words, each in the host's byte order.
    raw = bytes.fromhex(hex_address)
    words = [raw[i:i + 4] for i in range(0, len(raw), 4)]
    if sys.byteorder == "little":
        words = [word[::-1] for word in words]
    return ipaddress.ip_address(b"".join(words))


def _reaches(listen: IPAddress, target: IPAddress) -> bool:
    """Would a connection to `target` reach a socket listening on `listen`? A wildcard takes
    its family's connections, and `::` IPv4's too (unless IPV6_V6ONLY: counted all the same)."""
    if listen == target:
        return True
    if listen.is_unspecified:
        return listen.version == target.version or listen.version == 6
    return isinstance(listen, ipaddress.IPv6Address) and listen.ipv4_mapped == target


def _holder(proc: Path, port: int, family: set[int]) -> str:
    """The other process listening on the port, in words (only asked when there is one)."""
    if proc != Path("/proc"):
        return "another process"
    try:
        found = [c.pid for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                 and c.pid is not None and c.pid not in family]
    except (psutil.AccessDenied, OSError):
        found = []
    if not found:
        return "another process"
    try:
        return f"pid {found[0]} ({psutil.Process(found[0]).name()})"
    except psutil.Error:
        return f"pid {found[0]}"
