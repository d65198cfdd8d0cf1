"""The plan's data model: the instances (CPUs, memory, policy, port, threads), the plan
that holds them, and the diff between two plans. What placement produces and everything
after it (engines, units, the front door, the rollout) reads.

Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Protocol

from numad_infer.systemd import unitnames


class Policy(str, Enum):
    """The instance's memory policy (systemd's NUMAPolicy=, the kernel's set_mempolicy)."""

    BIND = "bind"  # its own node(s) only
    INTERLEAVE = "interleave"  # pages spread over several nodes (a model bigger than one node)


@dataclass(frozen=True)
class Instance:
    name: str  # unit instance name: <template>@<id>
    node: int | None  # None: interleaved over `mems`
    cpus: tuple[int, ...]
    places: tuple[tuple[int, ...], ...]  # one OpenMP place per thread, in pinning order
    mems: tuple[int, ...]
    policy: Policy
    threads: int  # generation threads (OMP_NUM_THREADS)
    port: int
    threads_batch: int = 0  # prompt-processing threads; set by the planner's thread step
    model: str = ""  # the key of the model it serves (`ServedModel.ident`): its `[[models]]` name, "" for `[model]`
    # Its prompt cache's bound in MiB as the planner sized it to its nodes (0: off), passed
    # to the engine (Engine.prompt_cache_flags); None: not sized (the engine keeps none, or
    # the operator's extra_args bound it).
    prompt_cache_mib: int | None = None

    @property
    def unit(self) -> str:
        return unitnames.unit(self.name)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["places"] = [list(p) for p in self.places]
        data["policy"] = self.policy.value
        for key in ("cpus", "mems"):
            data[key] = list(data[key])
        return data


class Placed(Protocol):
    """An instance as the running plan had it: what the planner keeps of it (its cores,
    its port, its prompt cache's bound). An `Instance`, or its `status` record as the last
    daemon left it in the state file."""

    @property
    def name(self) -> str: ...
    @property
    def cpus(self) -> tuple[int, ...]: ...
    @property
    def port(self) -> int: ...
    @property
    def prompt_cache_mib(self) -> int | None: ...


@dataclass(frozen=True)
class Plan:
    instances: tuple[Instance, ...]
    warnings: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"instances": [i.to_dict() for i in self.instances], "warnings": list(self.warnings)}


@dataclass(frozen=True)
class PlanDiff:
    added: tuple[str, ...]
    changed: tuple[str, ...]
    removed: tuple[str, ...]
    unchanged: tuple[str, ...]


def diff_plans(old: Mapping[str, object], new: Mapping[str, object]) -> PlanDiff:
    """Diff two {instance name: anything comparable} maps (instances, or their rendered units)."""
    return PlanDiff(
        added=tuple(sorted(new.keys() - old.keys())),
        changed=tuple(sorted(n for n in new.keys() & old.keys() if new[n] != old[n])),
        removed=tuple(sorted(old.keys() - new.keys())),
        unchanged=tuple(sorted(n for n in new.keys() & old.keys() if new[n] == old[n])),
    )
