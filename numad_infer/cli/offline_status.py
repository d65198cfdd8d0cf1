"""`status` with the daemon down: the plan, and what its units (or processes) are doing,
nobody supervising them."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from numad_infer.cli.wiring import load_all
from numad_infer.errors import NumaInferError
from numad_infer.lifecycle.states import State

if TYPE_CHECKING:
    from numad_infer.status.records import Status


def offline_status(args: argparse.Namespace) -> Status:
    """The daemon is down: still show the plan and what the units are doing."""
    from numad_infer.status.records import DaemonState, DaemonStatus, InstanceStatus, Status, group_models

    try:
        loaded = load_all(args)
    except NumaInferError as exc:
        return Status(DaemonStatus(DaemonState.NOT_RUNNING, args.config, warnings=(str(exc),)), ())
    from numad_infer.backends.base import Observation
    from numad_infer.backends.systemd import SystemdBackend
    from numad_infer.host.identity import BackendKind

    warnings: list[str] = []
    names = [inst.name for inst in loaded.plan.instances]
    no_unit = Observation(None, False, "not running (process backend: instances stop with the daemon)")
    seen = dict.fromkeys(names, no_unit)
    if loaded.kind == BackendKind.SYSTEMD:
        try:
            seen = SystemdBackend().observe(names)
        except NumaInferError as exc:
            warnings.append(str(exc))
            seen = dict.fromkeys(names, Observation(None, False, "unknown"))
    # Nobody supervises them: a running one is UNSUPERVISED, never "healthy".
    instances = tuple(InstanceStatus.planned(i, seen[i.name].pid,
                                             State.UNSUPERVISED if seen[i.name].pid else State.STOPPED,
                                             unit_state=seen[i.name].description)
                      for i in loaded.plan.instances)
    served = tuple((m.served.ident, m.served.name, m.served.aliases) for m in loaded.models)
    # No daemon, no front door it runs: no model is in rotation, each says why.
    return Status(DaemonStatus(DaemonState.NOT_RUNNING, args.config, warnings=tuple(warnings)), instances,
                  models=group_models(served, instances, True))
