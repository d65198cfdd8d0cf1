"""Start HAProxy on the daemon's listening socket: what numa-infer-frontdoor.service runs.

    python3 -m numad_infer.frontdoor_exec SOCKET -- haproxy -Ws -f /run/numa-infer/haproxy.cfg

systemd cannot pass one service's descriptor to another, so the front door's unit asks the
daemon for it (`listener.Handout`, over SOCKET), names it in NUMA_INFER_FRONTDOOR_FD (which
haproxy.cfg binds as "fd@${...}"; its loopback twin, where there is one, in
NUMA_INFER_FRONTDOOR_TWIN_FD) and executes the command in its own place. HAProxy's
master keeps the descriptor and the variable across its seamless reloads (it re-executes
itself), and systemd sees HAProxy as the unit's main process, as before.

Where the daemon is down (killed, restarting) it waits for it: the socket itself lives on
in the daemon unit's file descriptor store meanwhile, and clients wait in its backlog.
Kept small and free of the package's other modules: it starts on every HAProxy start.
"""

from __future__ import annotations

import os
import sys
import time

from numad_infer.frontdoor.listener import receive

WAIT_S = 90.0  # the daemon's RestartSec=2 plus a start under a loaded machine


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python3 -m numad_infer.frontdoor_exec SOCKET -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    path, command = argv[0], argv[2:]
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            fds = receive(path)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                print(f"numa-infer front door: the daemon did not hand over the listening socket at {path} "
                      f"within {WAIT_S:.0f}s ({exc.strerror or exc}): is numa-infer.service running?", file=sys.stderr)
                return 1
            time.sleep(0.5)
    if fds is None:
        print("numa-infer front door: the daemon holds no listening socket (stopping, or the front door is off)",
              file=sys.stderr)
        return 1
    for variable, fd in fds.items():
        os.set_inheritable(fd, True)
        os.environ[variable] = str(fd)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"numa-infer front door: cannot run {command[0]}: {exc.strerror}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
