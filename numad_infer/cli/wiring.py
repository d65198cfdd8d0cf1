"""What a command runs on: the loaded configuration for the backend `--backend` names,
and the backend itself, wired for the daemon (the file descriptor store, the uids that
may take the front door's socket)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from numad_infer.backends.base import Backend
    from numad_infer.systemd.notify import Notifier
    from numad_infer.validate.loaded import Loaded


def load_all(args: argparse.Namespace) -> Loaded:
    """The one pipeline (validate/pipeline.py), for the backend `--backend` names."""
    from numad_infer.host.identity import backend_kind
    from numad_infer.validate.pipeline import load

    return load(args.config, backend_kind(args.backend), args.fsroot)


def make_backend(choice: str, state_file: Path, instance_logs: str = "file",
                  notifier: Notifier | None = None) -> Backend:
    from numad_infer.backends.childlog import InstanceLogs
    from numad_infer.backends.portunit import PortUnit
    from numad_infer.backends.process import ProcessBackend
    from numad_infer.backends.systemd import FrontdoorHandout, SystemdBackend
    from numad_infer.host.identity import BackendKind, backend_kind, frontdoor_runs_as
    from numad_infer.systemd.notify import inherited_fds
    from numad_infer.systemd.systemctl import Systemctl

    if backend_kind(choice) == BackendKind.SYSTEMD:
        systemctl = Systemctl(progress=None if notifier is None else notifier.keepalive)
        handout = None
        if notifier is not None:
            # What systemd passed (numa-infer-port.socket's sockets, what a previous daemon
            # kept in the unit's file descriptor store), and who may take the socket:
            # HAProxy's user (or root, where the package's user is missing).
            user = frontdoor_runs_as(BackendKind.SYSTEMD)
            uids = frozenset({0} | ({user.uid} if user is not None and user.uid is not None else set()))
            handout = FrontdoorHandout(notifier.store_fd, inherited_fds(), uids, None if user is None else user.gid,
                                       port=PortUnit(systemctl))
        # The journal has the instances' output, named by unit.
        return SystemdBackend(systemctl, handout=handout)
    return ProcessBackend(state_file.parent / "logs", InstanceLogs(instance_logs), state_file.parent / "slots")

