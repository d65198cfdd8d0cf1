"""Each instance's launch, worked out once by validation: the command line the process
backend executes, the one its unit's ExecStart= runs (the key from systemd's credential),
and its OpenMP environment. The renderers and the backends take these; none derives an
argv again. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from numad_infer.config.models import ServedModel, find
from numad_infer.engines.base import Engine
from numad_infer.plan.model import Instance, Plan


@dataclass(frozen=True)
class Launch:
    """How one instance starts."""

    argv: tuple[str, ...]  # the process backend's (the key from the environment)
    unit_argv: tuple[str, ...]  # ExecStart='s (the key from $CREDENTIALS_DIRECTORY)
    environment: tuple[tuple[str, str], ...]  # OpenMP's pinning and the instance's own name, in order

    @property
    def env(self) -> dict[str, str]:
        return dict(self.environment)


def omp_places(instance: Instance) -> str:
    return ",".join("{" + ",".join(str(c) for c in place) + "}" for place in instance.places)


def instance_environment(instance: Instance) -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": str(instance.threads),
        "OMP_PROC_BIND": "close",
        "OMP_PLACES": omp_places(instance),
        # Lets the daemon recognise its own servers among processes (process backend, adoption).
        "NUMA_INFER_INSTANCE": instance.name,
    }


def launch_of(engine: Engine, model: ServedModel, instance: Instance) -> Launch:
    """One instance's launch: its model's view gives the engine its file, context and slots."""
    # The prompt cache's bound as the planner sized it (none where it did not, or where the
    # operator's extra_args named one of their own): after the engine's arguments.
    cache = engine.prompt_cache(model.view, instance.prompt_cache_mib).launch_args(engine.prompt_cache_flags)
    return Launch(tuple(engine.argv(model.view, instance) + cache),
                  tuple(engine.argv(model.view, instance, key_from_credential=True) + cache),
                  tuple(instance_environment(instance).items()))


def launches(engine: Engine, served: Sequence[ServedModel], plan: Plan) -> dict[str, Launch]:
    """Instance name -> its launch, for every instance of the plan."""
    models = tuple(served)
    return {i.name: launch_of(engine, find(models, i.model), i) for i in plan.instances}
