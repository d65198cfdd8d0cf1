"""The one loading and validation pipeline: configuration, topology, who the instances run
as, model, engine, front door, key file and plan, checked together and in one order.

The daemon (start, reload, CPU hotplug), `check`, `plan`, `render`, offline `status`,
`tune` and `tune --apply` all go through `load` (a file) or `validate` (a parsed
configuration, e.g. the text `tune --apply` is about to write): what one of them
refuses, all of them refuse, and nothing is written or changed before it passes.
"""

from __future__ import annotations

from collections.abc import Sequence

from numad_infer.config.apikey import read_api_key, read_tenant_keys
from numad_infer.config.defaults import SLOTS_DIR, SLOTS_GROUP
from numad_infer.config.load import load_config
from numad_infer.config.models import ServedModel, served_models
from numad_infer.config.schema import Config
from numad_infer.engines import Engine, engine_of
from numad_infer.engines.keys import check_engine_keys
from numad_infer.engines.launch import launches
from numad_infer.errors import ConfigError
from numad_infer.frontdoor.checked_config import render_checked
from numad_infer.frontdoor.haproxy import check_haproxy
from numad_infer.frontdoor.haproxy_config import Paths
from numad_infer.host.cpufeatures import EngineCpuReport, cpuinfo_flags, idle_units
from numad_infer.host.identity import (
    CREATE_USERS,
    BackendKind,
    RunAs,
    group_exists,
    instances_run_as,
    systemd_frontdoor_user,
    systemd_slots_group,
)
from numad_infer.host.pinning import memory_calls
from numad_infer.host.procfs import ProcReader
from numad_infer.model.file import artifact_id, read_model
from numad_infer.model.memory import estimate
from numad_infer.plan.model import Placed
from numad_infer.plan.placement import make_plan
from numad_infer.systemd.unitdir import SYSTEM_UNIT_DIRS, check_unit_names
from numad_infer.topology.cgroup_limits import UNRESTRICTED, Allowed
from numad_infer.topology.cgroups import CgroupReader
from numad_infer.topology.model import Topology
from numad_infer.topology.sysfs import SysfsReader
from numad_infer.units.render import render_units
from numad_infer.validate.host_check import InstanceHost, host_warnings, memory_call_warnings
from numad_infer.validate.loaded import Loaded, LoadedModel, instance_memory


def load(source: str, kind: BackendKind, sysfs: SysfsReader | str = "/",
         unit_dirs: tuple[str, ...] = SYSTEM_UNIT_DIRS, running: Sequence[Placed] = (),
         frontdoor: Paths | None = None) -> Loaded:
    """Read the file at `source` and validate it on this machine (ConfigError otherwise).
    `running`: the running plan's instances, whose cores and ports are kept where they can be.
    `frontdoor`: where the daemon's front door keeps its files (None: not the daemon's load)."""
    reader = sysfs if isinstance(sysfs, SysfsReader) else SysfsReader(sysfs)
    return validate(load_config(source), source, reader.topology(), kind, unit_dirs, read_allowed(kind), running,
                    frontdoor)


def read_allowed(kind: BackendKind) -> Allowed:
    """What the instances' cgroup allows: the daemon's own (its children inherit it), or
    under systemd the slice the instance units run in. Always this host's (the instances
    are its processes, even with --fsroot); a set holding all of the host restricts nothing."""
    reader = CgroupReader("/")
    return reader.for_slice() if kind == BackendKind.SYSTEMD else reader.for_process()


def validate(config: Config, source: str, topology: Topology, kind: BackendKind,
             unit_dirs: tuple[str, ...] = SYSTEM_UNIT_DIRS, allowed: Allowed = UNRESTRICTED,
             running: Sequence[Placed] = (), frontdoor: Paths | None = None) -> Loaded:
    """Every check a configuration must pass before anything runs it; changes nothing (but
    the front door's Lua file, put beside the haproxy.cfg checked for `frontdoor`).

    The order is the order an operator fixes things in: the engine's keys and the names, then what the instances
    need (a readable model, a working engine), then the plan, then the front door and key.
    """
    check_engine_keys(config, source)
    check_unit_names(config, source, unit_dirs)
    runs_as = instances_run_as(config.server.user, source, kind)
    # Worked out once, here, and carried in `Loaded`: everything after takes these.
    engine = engine_of(config)
    served = served_models(config)
    models = tuple(_read_model(model, engine, source, runs_as) for model in served)
    engine_warnings = engine.check_host(config, source, InstanceHost(runs_as))
    engine_cpu = engine.cpu(config, InstanceHost(runs_as))
    engine_warnings += _idle_unit_warnings(engine_cpu)
    needs = {m.served.ident: m.need for m in models if m.need is not None}  # by the one key, Instance.model
    plan = make_plan(config, topology, needs, source=source, allowed=allowed, running=running, served=served)
    launched = launches(engine, served, plan)
    check_haproxy(config, source)
    api_key = read_api_key(config, source)
    tenant_keys = read_tenant_keys(config, source)
    # Rendered once, for the front door's own directory, and checked as it is written.
    haproxy_cfg = (render_checked(config, plan, served, engine, frontdoor, tenant_keys, api_key)
                   if config.frontend.enabled else None)
    # The units as systemd would run them, rendered once: what the systemd backend writes and
    # compares, and what `render` and `check` write or compare, under either backend.
    unit_user = systemd_frontdoor_user()
    slots_group = systemd_slots_group()
    units = render_units(config, plan, unit_user, served=served, launched=launched, engine=engine,
                         slots_group=slots_group)
    frontdoor_user = unit_user if kind == BackendKind.SYSTEMD else None
    # Processes are always this machine's, even with --fsroot.
    warnings = (*plan.warnings, *engine_warnings, *host_warnings(ProcReader("/"), runs_as),
                *memory_call_warnings(memory_calls(), kind), *_slot_warnings(kind, engine))
    return Loaded(source, config, topology, plan, kind, runs_as, engine, models, allowed, engine_cpu, warnings,
                  api_key, frontdoor_user, units, launched, haproxy_cfg, slots_group)


def _read_model(served: ServedModel, engine: Engine, source: str, runs_as: RunAs | None) -> LoadedModel:
    """One model's file read and its instance's memory estimated (its view's context and slots)."""
    view = served.view
    try:
        model = read_model(view.model.path, source, runs_as)
    except ConfigError as exc:
        raise served.rekeyed(exc) from None
    memory = estimate(model.header.weight_bytes(), model.header.dims, engine.context(view), engine.overhead)
    return LoadedModel(served, model.size, memory, model.header.decode_bytes(),
                       artifacts(served, engine, model.artifact_id), instance_memory(served, engine, memory))


def artifacts(served: ServedModel, engine: Engine, model_id: str | None = None) -> str:
    """The model file and engine program one model's instances would load now
    (model/file.artifact_id). `model_id`: the model as the pipeline read it (its
    descriptor's fstat), not whatever is at the path a moment later."""
    program = engine.program(served.view)
    model = model_id if model_id is not None else artifact_id(served.view.model.path)
    return f"model {model}" + (f"; engine {artifact_id(program)}" if program else "")


def current_artifacts(served: tuple[ServedModel, ...], engine: Engine) -> str:
    """Every model's artifacts as they are on disk now, in order (`Loaded.artifacts` is
    what was loaded): the daemon compares the two."""
    return "; ".join(artifacts(model, engine) for model in served)


def _slot_warnings(kind: BackendKind, engine: Engine) -> list[str]:
    """Under systemd, a host without the group the instances' units save their prompt caches
    as (a source install) restarts every instance cold. Silent while only the directory is
    missing: the daemon's unit makes it (StateDirectory=) when it starts, after a `check`."""
    if kind != BackendKind.SYSTEMD or engine.slot_save_option is None:
        return []
    if group_exists(SLOTS_GROUP):
        return []
    return [f"group {SLOTS_GROUP} does not exist on this host: the restarts numa-infer makes start each instance "
            f"with an empty prompt cache (none is saved under {SLOTS_DIR}); {CREATE_USERS}"]


def _idle_unit_warnings(report: EngineCpuReport) -> list[str]:
    """The wide units this CPU and OS offer and the engine's kernels leave idle (prompt
    processing is where they pay: bench/README.md, "Builds"): `idle_units`, doctor's
    verdict too. Silent when the engine cannot tell (doctor says why). /proc/cpuinfo is
    always this machine's, even with --fsroot: the engine runs here."""
    if report.cpu is None:
        return []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = cpuinfo_flags(f.read())
    except OSError:
        return []
    idle = idle_units(flags, report.cpu)
    if not idle:
        return []
    return [f"this CPU has {' and '.join(idle)} that the engine does not use (it runs {report.cpu.describe()})"
            f"{'; ' + report.fix if report.fix else ''}"]
