"""The one value the validation pipeline (validate/pipeline.py) returns and everything after
it takes: the rollout, the backends, the front door and tune use what was checked, and
work nothing out again.

Pure data."""

from __future__ import annotations

import os
from dataclasses import dataclass

from numad_infer.config.schema import Config
from numad_infer.engines import Engine
from numad_infer.host.cpufeatures import EngineCpuReport
from numad_infer.host.identity import BackendKind, RunAs
from numad_infer.model.memory import MemoryEstimate
from numad_infer.plan.memory_fit import InstanceMemory
from numad_infer.plan.model import Plan
from numad_infer.topology.cgroup_limits import Allowed
from numad_infer.topology.model import Topology


@dataclass(frozen=True)
class Loaded:
    source: str  # the configuration file, as errors name it
    config: Config
    topology: Topology
    plan: Plan
    kind: BackendKind  # where the instances run
    runs_as: RunAs | None  # who they run as (None: the daemon's own user)
    engine: Engine
    model_bytes: int  # the file's size (tune's report)
    memory: MemoryEstimate  # what one instance holds: weights, KV cache, overhead (the planner fits it per node)
    decode_bytes: int  # what one decoded token reads (decode efficiency's numerator)
    allowed: Allowed  # what the instances' cgroup lets them use (planned within it)
    engine_cpu: EngineCpuReport  # the CPU kernels the engine runs here, or why it cannot tell
    # What does not stop the plan but undoes its work or may stop an instance: the
    # plan's, the engine's and the host's, in that order.
    warnings: tuple[str, ...]
    # The key as it was checked, read once: what the instances get and the probes send. A
    # file changed after this is the next reload's, never half of this one.
    api_key: str | None
    frontdoor_user: str | None  # the front door's user under systemd (None: the host lacks it)
    # Unit file name -> text, rendered once (systemd backend; empty for the process backend):
    # what the rollout compares and what is written are the same text.
    units: dict[str, str]
    # Which model file and engine program the instances load (device, inode, size, mtime):
    # part of every instance's definition, so another file at the same path restarts them,
    # one at a time behind the front door, as a changed definition does.
    artifacts: str = ""

    @property
    def instance_memory(self) -> InstanceMemory:
        return instance_memory(self.config, self.engine, self.memory)


def instance_memory(config: Config, engine: Engine, memory: MemoryEstimate) -> InstanceMemory:
    """One instance's estimate as the planner sums it per node, with the engine's own ways to
    hold less (a shorter context; with llama-server, fewer slots too)."""
    shrink = "a smaller model.context_size" + (" or server.parallel" if "parallel" in engine.own_keys else "")
    return InstanceMemory(config.model.name or os.path.basename(config.model.path), memory.total, memory.describe(),
                          shrink)
