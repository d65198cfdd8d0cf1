"""tune's candidates go through the one validation door (validate/pipeline.py), issue 37:
each measuring configuration is validated as any configuration the daemon loads, and the
`Loaded` it returns is what the measuring servers run; tune works out no served models,
engine, plan or launches of its own."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

import numad_infer.tune
from numad_infer.errors import ConfigError
from numad_infer.host.identity import BackendKind
from numad_infer.tune import measure
from numad_infer.tune.choice import Candidate, Layout
from numad_infer.tune.measure import Measurer, Settings, candidate_config
from numad_infer.validate import pipeline
from numad_infer.validate.loaded import Loaded
from tests.tune.harness import checked_setup
from tests.calls import DERIVED, calls_counted

PORT = 10000  # no server binds it: the backend below starts nothing


class Synced(Exception):
    """Raised by the stand-in backend once it has been given a candidate."""


@pytest.fixture
def measured(tmp_path: Path) -> tuple[Measurer, list[Loaded], list[Loaded]]:
    """A measurer of a configuration `check` accepts (the fake 2-node machine), with (1) what
    the process backend was given to run and (2) what pipeline.validate returned to tune;
    the backend stops at its sync, so no server starts."""
    path, fsroot = checked_setup(tmp_path)
    loaded = pipeline.load(str(path), BackendKind.PROCESS, str(fsroot))
    synced: list[Loaded] = []
    returned: list[Loaded] = []

    class Backend:
        def __init__(self, log_dir: Path) -> None:
            pass

        def sync(self, given: Loaded) -> bool:
            synced.append(given)
            raise Synced

    def validate(*args: object, **kwargs: object) -> Loaded:
        found = pipeline.validate(*args, **kwargs)  # type: ignore[arg-type]
        returned.append(found)
        return found

    return (Measurer(loaded, loaded.allowed, tmp_path, Settings(1, 2, 10.0), lambda line: None, backend=Backend,
                     validation=validate), synced, returned)


def test_each_candidate_is_validated_once_and_run_as_the_pipeline_returned_it(measured) -> None:
    measurer, synced, returned = measured
    node = next(n for n in measurer.loaded.topology.nodes if n.id == 0)
    physical = len(node.cores)
    with calls_counted({**DERIVED, "validate": pipeline.validate}) as counts:
        for threads in (1, 2, physical + 1):  # the last needs the SMT siblings
            with pytest.raises(Synced):
                measurer.measure(0, Candidate(threads, "grid"), PORT)
        with pytest.raises(Synced):
            measurer.measure_layout(Layout("per-node", 2, "two per node"), 4, 1, PORT)
    # One validation for the node's physical cores (kept for the node), one per candidate;
    # the served models, the engine and the plan only ever inside them.
    assert counts == Counter({"validate": 5, "served_models": 5, "engine_of": 5, "make_plan": 5})
    assert len(returned) == 5 and all(given is returned[k] for k, given in zip((1, 2, 3, 4), synced, strict=True))
    for given, threads in zip(synced[:3], (1, 2, physical + 1), strict=True):
        (instance,) = given.plan.instances
        assert (instance.node, instance.threads, instance.threads_batch, instance.port) == (0, threads, threads, PORT)
        assert given.kind == BackendKind.PROCESS and given.source == measurer.loaded.source
        assert instance.name in given.launches and given.config.frontend.enabled is False
    assert len(synced[0].plan.instances[0].cpus) == physical and len(synced[2].plan.instances[0].cpus) == len(node.cpus)
    layout = synced[3]
    assert [i.port for i in layout.plan.instances] == [PORT + k for k in range(4)]
    assert layout.config.placement.instances_per_node == 2


def test_a_candidate_the_pipeline_refuses_is_refused_with_its_error_and_nothing_starts(measured) -> None:
    measurer, synced, _ = measured
    source = measurer.loaded.source
    # More threads than the node has CPUs: the plan's refusal, in the configuration's name.
    with pytest.raises(ConfigError, match=rf"^{source}: placement.threads = 999: infer@0 has only 64 CPUs"):
        measurer.measure(0, Candidate(999, "grid"), PORT)
    # The model file replaced after the load by one that is not a model: refused as `check`
    # would refuse the candidate configuration, word for word, before any server is given it.
    Path(measurer.config.model.path).write_bytes(b"not a model")
    wanted = candidate_config(measurer.config, 0, 1, PORT, smt=False)
    with pytest.raises(ConfigError) as direct:
        pipeline.validate(wanted, source, measurer.loaded.topology, BackendKind.PROCESS, unit_dirs=(),
                          allowed=measurer.loaded.allowed)
    with pytest.raises(ConfigError) as refused:
        measurer.measure(0, Candidate(1, "grid"), PORT)
    assert str(refused.value) == str(direct.value) and "model.path" in str(direct.value)
    with pytest.raises(ConfigError) as layout:
        measurer.measure_layout(Layout("per-node", 1, "current setting"), 4, 1, PORT)
    assert str(layout.value) == str(direct.value)
    assert synced == []


FORBIDDEN_IMPORTS = {"make_plan", "served_models", "engine_of", "launches", "replace"}
FORBIDDEN_CALLS = {"make_plan", "served_models", "engine_of"}


def test_tune_works_out_nothing_the_pipeline_works_out() -> None:
    """No tune module plans, reads the served models or the engine, or forges a `Loaded`
    (dataclasses.replace, or building one): what it runs is what validate returned."""
    modules = sorted(Path(numad_infer.tune.__file__).parent.glob("*.py"))
    assert {"measure.py", "run.py"} <= {m.name for m in modules}
    found: list[str] = []
    for module in modules:
        for node in ast.walk(ast.parse(module.read_text(), str(module))):
            where = f"{module.name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom):
                found += [f"{where} imports {a.name}" for a in node.names if a.name in FORBIDDEN_IMPORTS]
            elif isinstance(node, ast.Import):
                found += [f"{where} imports {a.name}" for a in node.names if a.name == "dataclasses"]
            elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_CALLS:
                found.append(f"{where} uses .{node.attr}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Loaded":
                found.append(f"{where} builds a Loaded")
    assert found == []
