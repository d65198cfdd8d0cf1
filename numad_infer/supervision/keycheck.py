"""Does an instance's process take the configured API key? Asked once per process."""

from __future__ import annotations

import logging

from numad_infer.config.schema import Config
from numad_infer.frontdoor.control import Frontdoor
from numad_infer.host.procfs import ProcReader
from numad_infer.lifecycle.states import State
from numad_infer.supervision.health import KeyCheck, check_key
from numad_infer.supervision.instance import Runtime

log = logging.getLogger(__name__)


def check_api_key(rt: Runtime, cfg: Config, api_key: str, frontdoor: Frontdoor | None, proc: ProcReader,
                  path: str) -> None:
    """`path`: the engine's route that checks a key (`Engine.key_check_path`). A refused key
    is reported as such (the instance is healthy, its clients' requests would fail), never
    restarted: only a restart gives the process the current key."""
    if rt.key_check == KeyCheck.ACCEPTED or rt.supervision.state != State.HEALTHY or rt.pid is None:
        return
    if frontdoor is not None and frontdoor.in_flight(rt.instance):
        return  # busy: the check would wait on the model; ask when it is idle
    if not proc.port_owner(cfg.server.host, rt.instance.port, rt.pid).ours:
        return  # the key goes to the instance's own process only (its probe says whose the port is)
    verdict = check_key(cfg.server.host, rt.instance.port, api_key, min(cfg.tuning.probe_timeout_s, 0.5),
                        path)
    if verdict == KeyCheck.REJECTED and rt.key_check != KeyCheck.REJECTED:
        log.error("%s: refuses the API key of server.api_key_file (it runs with another one): restart it "
                  "(systemctl restart %s) to give it the current key", rt.instance.name, rt.instance.unit)
    if verdict != KeyCheck.UNKNOWN:
        rt.key_check = verdict
