"""The one value the validation pipeline (validate/pipeline.py) returns and everything after
it takes: the rollout, the backends, the front door and tune use what was checked, and
work nothing out again.

Pure data."""

from __future__ import annotations

import os
from dataclasses import dataclass

from numad_infer.config.models import ServedModel
from numad_infer.config.schema import Config
from numad_infer.engines import Engine
from numad_infer.engines.launch import Launch
from numad_infer.engines.slot_names import gives_slot_path
from numad_infer.frontdoor.haproxy_config import CheckedConfig
from numad_infer.host.cpufeatures import EngineCpuReport
from numad_infer.host.identity import BackendKind, RunAs
from numad_infer.model.memory import MemoryEstimate
from numad_infer.plan.memory_fit import InstanceMemory, NodeFit, bounded, node_fits
from numad_infer.plan.model import Plan
from numad_infer.topology.cgroup_limits import Allowed
from numad_infer.topology.model import Topology


@dataclass(frozen=True)
class LoadedModel:
    """One served model as the pipeline read it."""

    served: ServedModel
    model_bytes: int  # the file's size (tune's report)
    memory: MemoryEstimate  # what one instance holds: weights, KV cache, overhead
    decode_bytes: int  # what one decoded token reads (decode efficiency's numerator)
    # Which model file and engine program its instances load (device, inode, size, mtime):
    # part of each of its instances' definition, so another file at the same path restarts
    # that model's instances, one at a time behind the front door, and no other model's.
    artifacts: str = ""
    need: InstanceMemory | None = None  # `memory` as the planner sums it per node


@dataclass(frozen=True)
class Loaded:
    source: str  # the configuration file, as errors name it
    config: Config
    topology: Topology
    plan: Plan
    kind: BackendKind  # where the instances run
    runs_as: RunAs | None  # who they run as (None: the daemon's own user)
    engine: Engine
    models: tuple[LoadedModel, ...]  # in the file's order; one in the single-[model] form
    allowed: Allowed  # what the instances' cgroup lets them use (planned within it)
    engine_cpu: EngineCpuReport  # the CPU kernels the engine runs here, or why it cannot tell
    # What does not stop the plan but undoes its work or may stop an instance: the
    # plan's, the engine's and the host's, in that order.
    warnings: tuple[str, ...]
    # The key as it was checked, read once: what the instances get and the probes send. A
    # file changed after this is the next reload's, never half of this one.
    api_key: str | None
    frontdoor_user: str | None  # the front door's user under systemd (None: the host lacks it)
    # Unit file name -> text, rendered once: what the rollout compares and what is written
    # are the same text (the systemd backend's; `render` and `check` write or compare it).
    units: dict[str, str]
    # Instance name -> how it starts (argv, unit argv, environment), worked out once here:
    # the process backend executes it, the units carry it.
    launches: dict[str, Launch]
    # haproxy.cfg as `haproxy -c` passed it, for the front door's directory the load was
    # given (frontdoor/checked_config.py): what the daemon writes. None: no front door.
    haproxy_cfg: CheckedConfig | None = None
    # The group of the instances' saved prompt caches under systemd (identity.
    # systemd_slots_group), which the units were rendered with; None: none is kept there.
    slots_group: str | None = None

    @property
    def served(self) -> tuple[ServedModel, ...]:
        """The served models as validation read them, in the file's order."""
        return tuple(m.served for m in self.models)

    def keeps_slots(self, name: str) -> bool:
        """Whether numa-infer gave the instance its --slot-save-path, so that its slots are
        saved before a restart it makes and restored after (supervision/slot_keeper.py): not
        for an engine without slot files, an operator's own path, or systemd units rendered
        without one (units/render.slot_save_arguments, backends/process.py)."""
        launch = self.launches.get(name)
        if launch is None or not gives_slot_path(self.engine.slot_save_option, launch.argv):
            return False
        return self.kind != BackendKind.SYSTEMD or self.slots_group is not None

    def model(self, ident: str) -> LoadedModel:
        """The model an instance serves, by its one key (`Instance.model`, `ServedModel.ident`)."""
        for loaded in self.models:
            if loaded.served.ident == ident:
                return loaded
        raise KeyError(f"no model {ident!r} is loaded")

    def memory_of(self, ident: str) -> InstanceMemory:
        found = self.model(ident)
        return found.need or instance_memory(found.served, self.engine, found.memory)

    def artifacts_of(self, instance: str) -> str:
        """The artifacts of the model that instance (a name) serves; "" for one not in the plan."""
        for i in self.plan.instances:
            if i.name == instance:
                return self.model(i.model).artifacts
        return ""

    def fits(self) -> list[NodeFit]:
        """Per node, what the plan's instances need of its memory (the sum validation checked)."""
        return node_fits([(i, bounded(i, self.memory_of(i.model))) for i in self.plan.instances], self.topology)

    @property
    def artifacts(self) -> str:
        """Every model's artifacts, in order: a change anywhere is a change to roll out."""
        return "; ".join(m.artifacts for m in self.models)


def instance_memory(served: ServedModel, engine: Engine, memory: MemoryEstimate) -> InstanceMemory:
    """One instance's estimate as the planner sums it per node, with the engine's own ways to
    hold less (a shorter context; with llama-server, fewer slots too), each named by the key
    that sets it for this model (`ServedModel.key_for`)."""
    slots = served.key_for("server.parallel", fix=True)
    shrink = f"a smaller {served.key_for('model.context_size')}" + (
        f" or {slots}" if "parallel" in engine.own_keys else "")
    model = served.view.model
    # The prompt cache is bounded in the engine's own arguments: the model's table's, or server's.
    args = served.key_for("server.extra_args", fix=True)
    grows_fix = f"{args} = [..., {engine.prompt_cache_args}]" if engine.prompt_cache_args else ""
    # Unbounded by the operator, a cache the engine keeps by default is sized per instance by the planner.
    sized = engine.prompt_cache(served.view, 0).planned_mib is not None  # the one decision (engines/base.py)
    detail = (memory.describe().removesuffix(memory.describe_growth()) + ", and a prompt cache sized to its node "
              "(per instance)") if sized else memory.describe()
    return InstanceMemory(model.name or os.path.basename(model.path), memory.total, detail, shrink,
                          served.key, memory.prompt_cache, grows_fix, sized, memory.slot_state,
                          served.key_for("placement.instances_per_node", fix=True),
                          served.key_for("placement.nodes", fix=True))
