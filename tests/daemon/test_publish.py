"""What the daemon publishes: the one-line status systemd shows (STATUS=)."""

from __future__ import annotations

from numad_infer.daemon.publish import status_line
from numad_infer.lifecycle.states import State, Supervision
from numad_infer.plan.model import Instance, Policy
from numad_infer.supervision.instance import Runtime


def runtime(name: str, model: str, state: State) -> Runtime:
    instance = Instance(name, 0, (0,), ((0,),), (0,), Policy.BIND, 1, 8080, model=model)
    return Runtime(instance, Supervision(state=state))


def test_the_line_counts_instances_and_with_several_models_the_models_serving() -> None:
    single = [runtime("infer@0", "", State.HEALTHY), runtime("infer@1", "", State.STARTING)]
    assert status_line(single, None) == "1/2 instances healthy (1 starting)"
    several = [runtime("infer@a-0", "a", State.HEALTHY), runtime("infer@a-1", "a", State.FAILED),
               runtime("infer@b-0", "b", State.BACKOFF)]
    assert status_line(several, None) == "1/3 instances healthy (1 backoff, 1 failed); 1/2 models serving (b not)"
    several[2] = runtime("infer@b-0", "b", State.HEALTHY)
    assert status_line(several, None).endswith("; 2/2 models serving")
