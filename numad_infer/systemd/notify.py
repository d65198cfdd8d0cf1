"""sd_notify: READY, STATUS, RELOADING, STOPPING and the watchdog, over the sdnotify package.

The socket address is taken from the environment once and removed from it, so child
processes (systemctl, servers started by the process backend) cannot notify for us.
"""

from __future__ import annotations

import os
import socket
import time

import sdnotify

from numad_infer.util.printable import printable

# What systemd gives the service's main process to talk back with.
NOTIFY_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
# What it gives back from the file descriptor store at start (sd_listen_fds(3)).
LISTEN_VARIABLES = ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")
LISTEN_FDS_START = 3


def inherited_fds(environ: dict[str, str] | None = None) -> dict[str, list[int]]:
    """Descriptors systemd passed this process, by name (a socket unit's FileDescriptorName=,
    the store's FDNAME=; one name may come with several), taken out of the environment so
    that no child believes they are its own."""
    env = os.environ if environ is None else environ
    count, pid, names = (env.pop(name, None) for name in LISTEN_VARIABLES)
    if not count or not count.isdigit() or pid != str(os.getpid()):
        return {}
    labels = (names or "").split(":")
    found: dict[str, list[int]] = {}
    for i in range(int(count)):
        found.setdefault(labels[i] if i < len(labels) and labels[i] else f"fd{i}", []).append(LISTEN_FDS_START + i)
    return found


def child_environ() -> dict[str, str]:
    """This process's environment without the notify variables: a child (systemctl, a
    server) must never notify for us, even when no Notifier took them out first."""
    return {k: v for k, v in os.environ.items() if k not in NOTIFY_VARIABLES}


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.socket = env.pop("NOTIFY_SOCKET", None)
        usec = env.pop("WATCHDOG_USEC", None)
        watchdog_pid = env.pop("WATCHDOG_PID", None)
        self.watchdog_s: float | None = None
        if usec and usec.isdigit() and (watchdog_pid is None or watchdog_pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6
        self._notifier = None
        if self.socket:
            previous = os.environ.get("NOTIFY_SOCKET")
            os.environ["NOTIFY_SOCKET"] = self.socket  # sdnotify reads it at construction
            try:
                self._notifier = sdnotify.SystemdNotifier()
            finally:
                if previous is None:
                    os.environ.pop("NOTIFY_SOCKET", None)
                else:
                    os.environ["NOTIFY_SOCKET"] = previous
        self._last_status: str | None = None
        self._last_ping = 0.0

    def send(self, *fields: str) -> None:
        """Each field escaped (`printable`): the message is one `KEY=value` a line, so a newline
        in a STATUS= (an error quoting what a program printed) would add fields of its own
        (READY=1, MAINPID=...), and `systemctl status` shows the text to a terminal."""
        if self._notifier is not None:
            self._notifier.notify("\n".join(printable(field) for field in fields))

    def store_fd(self, name: str, fd: int | None) -> None:
        """Keep `fd` in the unit's file descriptor store under `name` (FileDescriptorStoreMax=
        in numa-infer.service), so that it outlives this process; None: drop it from there.
        The sdnotify package sends text only: a descriptor needs SCM_RIGHTS.

        FDPOLL=0: systemd drops a stored descriptor that reports a hang-up, and a listening
        socket the drain shut down does (listener.refuse) while it still holds the port."""
        if not self.socket:
            return
        address = "\0" + self.socket[1:] if self.socket.startswith("@") else self.socket
        message = f"FDSTOREREMOVE=1\nFDNAME={name}" if fd is None else f"FDSTORE=1\nFDNAME={name}\nFDPOLL=0"
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.connect(address)
                socket.send_fds(sock, [message.encode()], [] if fd is None else [fd])
        except OSError:
            pass  # as sd_notify: a manager that does not listen is not the daemon's failure

    def ready(self, status: str) -> None:
        self._last_status = status
        self.send("READY=1", f"STATUS={status}")

    def status(self, text: str) -> None:
        if text != self._last_status:
            self._last_status = text
            self.send(f"STATUS={text}")

    def reloading(self) -> None:
        # MONOTONIC_USEC lets systemd >= 253 match the reload to its completion (READY=1).
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def watchdog_due(self, now: float) -> bool:
        return self.watchdog_s is not None and now - self._last_ping >= self.watchdog_s / 2

    def watchdog(self, now: float) -> None:
        self._last_ping = now
        self.send("WATCHDOG=1")

    def keepalive(self) -> None:
        """Ping if one is due. Called between the steps of slow work (every systemctl call of
        a reload or a pass), not only between passes: a reload that writes units, runs
        daemon-reload and reloads HAProxy takes 20-30 s on a slow or loaded machine, and
        with the last ping up to half the watchdog interval old, systemd killed a daemon
        that was busy, not hung. A step that hangs still starves it, which is the point."""
        now = time.monotonic()
        if self.watchdog_due(now):
            self.watchdog(now)
