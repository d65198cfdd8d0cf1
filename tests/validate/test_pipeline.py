"""The one validation door (validate/pipeline.py): what it works out once and carries in
`Loaded` (the served models, the engine, the plan, each instance's launch, the units), and
the single `[model]` form going through the same code as a one-entry `[[models]]`."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from numad_infer.backends.process import ProcessBackend
from numad_infer.config import models as config_models
from numad_infer.config.load import parse_config
from numad_infer.engines import base as engines_base
from numad_infer.errors import ConfigError
from numad_infer.frontdoor.haproxy_config import Paths, render_haproxy
from numad_infer.frontdoor.routing import backends, models_list
from numad_infer.host.identity import BackendKind
from numad_infer.plan import placement
from numad_infer.units.render import render_units
from numad_infer.validate import pipeline
from numad_infer.validate.pipeline import validate
from tests.calls import DERIVED, calls_counted
from tests.validate.conftest import small_nodes

SOURCE = "/etc/numa-infer.toml"
def _two(model: Path, server: Path) -> str:
    return (f'[[models]]\nname = "a"\npath = "{model}"\ncontext_size = 256\n'
            f'[[models]]\nname = "b"\npath = "{model}"\ncontext_size = 256\n'
            f'[server]\nllama_server = "{server}"\n[frontend]\nlisten = ""\n')


def _single(model: Path, server: Path, name: str = "a") -> str:
    return (f'[model]\npath = "{model}"\nname = "{name}"\ncontext_size = 256\n'
            f'[server]\nllama_server = "{server}"\n[frontend]\nlisten = ""\n')


@pytest.mark.parametrize("form", ["single", "two"])
def test_what_validation_works_out_is_worked_out_once_per_load(tmp_path: Path, host, form: str) -> None:
    """The served models, the engine and the plan: once per load, however many instances,
    models and renderings follow; the backends and the renderers take them from `Loaded`."""
    model, server = host
    text = _single(model, server) if form == "single" else _two(model, server)
    config = parse_config(text, SOURCE)
    topology = small_nodes(tmp_path, 4)
    with calls_counted(DERIVED) as counts:
        loaded = validate(config, SOURCE, topology, BackendKind.PROCESS, unit_dirs=())
    assert counts == Counter({"served_models": 1, "engine_of": 1, "make_plan": 1})
    with calls_counted(DERIVED) as after:
        ProcessBackend(tmp_path / "logs").specs(loaded)
        render_units(loaded.config, loaded.plan, served=loaded.served, launched=loaded.launches, engine=loaded.engine)
        backends(loaded.served)
        models_list(loaded.served)
        for instance in loaded.plan.instances:
            loaded.model(instance.model)
            loaded.memory_of(instance.model)
    assert not after, f"derived again after validation: {dict(after)}"
    # Each instance's launch is the unit's ExecStart= and the process backend's argv.
    for instance in loaded.plan.instances:
        launch = loaded.launches[instance.name]
        assert launch.argv[0] == str(server) and "--port" in launch.argv
        assert dict(launch.environment)["NUMA_INFER_INSTANCE"] == instance.name


def test_one_key_per_model_looks_up_every_instance_exactly(tmp_path: Path, host) -> None:
    """`Instance.model` is the model's one key (`ServedModel.ident`): "" for the single form
    whatever model.name says, the name with [[models]]. No lookup falls back to the only
    model: an unknown key is a KeyError, not someone else's model."""
    model, server = host
    single = validate(parse_config(_single(model, server, "named"), SOURCE), SOURCE, small_nodes(tmp_path / "a", 4),
                      BackendKind.PROCESS, unit_dirs=())
    assert {i.model for i in single.plan.instances} == {""}
    assert single.model("").served.name == "named"
    with pytest.raises(KeyError):
        single.model("named")
    two = validate(parse_config(_two(model, server), SOURCE), SOURCE, small_nodes(tmp_path / "b", 4),
                   BackendKind.PROCESS, unit_dirs=())
    assert [i.model for i in two.plan.instances] == ["a", "a", "b", "b"]
    assert [two.model(i.model).served.key for i in two.plan.instances] == ["models[0]"] * 2 + ["models[1]"] * 2


def test_the_single_form_is_planned_as_a_one_entry_models_list(tmp_path: Path, host) -> None:
    """Same allocator: the single `[model]` and a one-entry `[[models]]` give their instances
    the same cores, memory and ports; only the names differ (the single form's carry no
    model, as its units always did)."""
    model, server = host
    extra = "[placement]\ninstances_per_node = 2\n"
    single = validate(parse_config(_single(model, server) + extra, SOURCE), SOURCE, small_nodes(tmp_path / "a", 4),
                      BackendKind.PROCESS, unit_dirs=())
    one = validate(parse_config(f'[[models]]\nname = "a"\npath = "{model}"\ncontext_size = 256\n'
                                'instances_per_node = 2\n'
                                f'[server]\nllama_server = "{server}"\n[frontend]\nlisten = ""\n', SOURCE),
                   SOURCE, small_nodes(tmp_path / "b", 4), BackendKind.PROCESS, unit_dirs=())
    assert [i.name for i in single.plan.instances] == ["infer@0.0", "infer@0.1", "infer@1.0", "infer@1.1"]
    assert [i.name for i in one.plan.instances] == ["infer@a-0.0", "infer@a-0.1", "infer@a-1.0", "infer@a-1.1"]
    shape = [(i.cpus, i.mems, i.port, i.threads) for i in single.plan.instances]
    assert shape == [(i.cpus, i.mems, i.port, i.threads) for i in one.plan.instances]


def test_the_single_form_keeps_its_cores_across_a_reload(tmp_path: Path, host) -> None:
    """The running plan's cores are kept with the single form too (one allocator): an
    instance whose cores are still free and still as many keeps them."""
    model, server = host
    text = _single(model, server) + "[placement]\ninstances_per_node = 2\n"
    topology = small_nodes(tmp_path, 4)
    first = validate(parse_config(text, SOURCE), SOURCE, topology, BackendKind.PROCESS, unit_dirs=())
    by_name = {i.name: i for i in first.plan.instances}
    # Swapped: infer@0.0 ran on CPU 1 and infer@0.1 on CPU 0; the next plan keeps that.
    swapped = [by_name["infer@0.0"].__class__(**{**vars(by_name["infer@0.0"]), "cpus": (1,)}),
               by_name["infer@0.1"].__class__(**{**vars(by_name["infer@0.1"]), "cpus": (0,)})]
    again = validate(parse_config(text, SOURCE), SOURCE, topology, BackendKind.PROCESS, unit_dirs=(), running=swapped)
    cpus = {i.name: i.cpus for i in again.plan.instances}
    assert cpus["infer@0.0"] == (1,) and cpus["infer@0.1"] == (0,)


def test_a_refusal_names_the_key_of_the_table_that_sets_the_value(tmp_path: Path, host) -> None:
    """One re-keying rule (`ServedModel.key_for`): a model table's own value is named in its
    table, a shared one where it is shared; the single form is its own table."""
    model, server = host
    missing = tmp_path / "gone.gguf"
    two = _two(model, server).replace(f'name = "b"\npath = "{model}"', f'name = "b"\npath = "{missing}"')
    with pytest.raises(ConfigError) as refused:
        validate(parse_config(two, SOURCE), SOURCE, small_nodes(tmp_path / "a", 4), BackendKind.PROCESS, unit_dirs=())
    assert refused.value.key == "models[1].path"
    nodes = _two(model, server).replace('name = "b"\n', 'name = "b"\nnodes = [7]\n')
    with pytest.raises(ConfigError) as refused:
        validate(parse_config(nodes, SOURCE), SOURCE, small_nodes(tmp_path / "b", 4), BackendKind.PROCESS,
                 unit_dirs=())
    assert refused.value.key == "models[1].nodes" and "node 7 does not exist" in str(refused.value)
    single = _single(model, server) + "[placement]\nnodes = [7]\n"
    with pytest.raises(ConfigError) as refused:
        validate(parse_config(single, SOURCE), SOURCE, small_nodes(tmp_path / "c", 4), BackendKind.PROCESS,
                 unit_dirs=())
    assert refused.value.key == "placement.nodes"
    many = _single(model, server) + "[placement]\ninstances_per_node = 3\n"
    with pytest.raises(ConfigError) as refused:
        validate(parse_config(many, SOURCE), SOURCE, small_nodes(tmp_path / "d", 4), BackendKind.PROCESS,
                 unit_dirs=())
    assert str(refused.value).startswith(f"{SOURCE}: placement.instances_per_node = 3: node 0 has 2 usable core(s), "
                                         "fewer than 3 instances")


@pytest.mark.parametrize("name", ["7b", "-x", ".hidden"])
def test_one_name_rule_for_both_forms(name: str) -> None:
    """A name `check` would accept in `[model]` is one `[[models]]` accepts: moving the table
    (the fix `check` suggests for a second model) never meets a new refusal."""
    with pytest.raises(ConfigError) as single:
        parse_config(f'[model]\npath = "/m.gguf"\nname = "{name}"\n', SOURCE)
    with pytest.raises(ConfigError) as table:
        parse_config(f'[[models]]\npath = "/m.gguf"\nname = "{name}"\n', SOURCE)
    assert "starting with a letter" in str(single.value) and "starting with a letter" in str(table.value)
    for ok in ("llama-3.1-8b", "a", "Qwen2.5:7b"):
        parse_config(f'[model]\npath = "/m.gguf"\nname = "{ok}"\n', SOURCE)
        parse_config(f'[[models]]\npath = "/m.gguf"\nname = "{ok}"\n', SOURCE)


# Where production code may call what validation works out: the pipeline, once each, and
# nowhere else (the planner and the renderers take it as arguments; none has a fallback).
# tune is not here: each of its candidates goes through the pipeline (tests/tune/test_candidates.py).
ALLOWED_CALLS = {
    ("validate/pipeline.py", "engine_of"): 1, ("validate/pipeline.py", "served_models"): 1,
    ("validate/pipeline.py", "make_plan"): 1,
}


def test_one_load_asks_for_the_models_and_the_engine_once_and_the_planner_and_renderers_never_do(
        tmp_path: Path, host, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted at the names the pipeline calls them by; what it carries is required by the
    planner and the renderers: called without it they refuse, rather than work it out again."""
    model, server = host
    counts: Counter[str] = Counter()

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(config: Any) -> Any:
            counts[name] += 1
            return real(config)
        return counted

    monkeypatch.setattr(pipeline, "served_models", counting("served_models", pipeline.served_models))
    monkeypatch.setattr(pipeline, "engine_of", counting("engine_of", pipeline.engine_of))
    config = parse_config(_two(model, server), SOURCE)
    topology = small_nodes(tmp_path, 4)
    loaded = validate(config, SOURCE, topology, BackendKind.PROCESS, unit_dirs=())
    assert counts == Counter({"served_models": 1, "engine_of": 1})
    with pytest.raises(TypeError, match="served"):
        placement.make_plan(config, topology)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="served"):
        render_units(config, loaded.plan)  # type: ignore[call-arg]
    paths = Paths(tmp_path / "cfg", tmp_path / "state", tmp_path / "sock")
    with pytest.raises(TypeError, match="served"):
        render_haproxy(config, loaded.plan, paths)  # type: ignore[call-arg]


def test_production_code_calls_the_derivations_only_where_listed() -> None:
    import ast

    root = Path(__file__).resolve().parents[2] / "numad_infer"
    found: Counter[tuple[str, str]] = Counter()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                if name in DERIVED:
                    found[(str(path.relative_to(root)), name)] += 1
    assert dict(found) == ALLOWED_CALLS


@pytest.mark.skipif(not Path("/usr/sbin/haproxy").exists(), reason="needs haproxy (apt-get install haproxy)")
def test_haproxy_cfg_is_rendered_once_for_the_front_doors_directory_and_written_as_checked(tmp_path: Path,
                                                                                            host) -> None:
    """Before: validation rendered and `haproxy -c`-checked a scratch copy (HAProxy binding
    the address, files in a temporary directory), and the front door rendered and checked
    its own again: two texts. Now one, rendered and checked in validation, written as is."""
    from numad_infer.frontdoor import haproxy, haproxy_config
    from numad_infer.frontdoor.control import Frontdoor
    from numad_infer.frontdoor.haproxy import HaproxyError
    from numad_infer.frontdoor.haproxy_config import CheckedConfig
    from tests.daemon_harness import free_port_block

    model, server = host
    listen = f'listen = "127.0.0.1:{free_port_block(1)}"\nhaproxy = "/usr/sbin/haproxy"'
    config = parse_config(_two(model, server).replace('listen = ""', listen), SOURCE)
    (tmp_path / "run").mkdir()
    door = Frontdoor(ProcessBackend(tmp_path / "logs").frontdoor_runner(tmp_path / "run"))
    counted = {"render": haproxy_config.render_haproxy, "haproxy -c": haproxy.validate}
    try:
        with calls_counted(counted) as counts:
            loaded = validate(config, SOURCE, small_nodes(tmp_path, 4), BackendKind.PROCESS, unit_dirs=(),
                              frontdoor=door.paths)
            assert loaded.haproxy_cfg is not None and loaded.haproxy_cfg.paths == door.paths
            assert door.apply(loaded.config, loaded.plan, loaded.served, loaded.haproxy_cfg)
        assert counts == Counter({"render": 1, "haproxy -c": 1})
        assert door.paths.config.read_text() == loaded.haproxy_cfg.text
        assert '"fd@${NUMA_INFER_FRONTDOOR_FD}"' in loaded.haproxy_cfg.text and str(door.paths.lua) in loaded.haproxy_cfg.text
        # A text checked for another directory (`check`'s scratch one) is never written here.
        elsewhere = validate(config, SOURCE, small_nodes(tmp_path / "b", 4), BackendKind.PROCESS, unit_dirs=())
        assert elsewhere.haproxy_cfg is not None and elsewhere.haproxy_cfg.paths != door.paths
        with pytest.raises(HaproxyError, match="no haproxy.cfg was checked for"):
            door.apply(elsewhere.config, elsewhere.plan, elsewhere.served,
                       CheckedConfig(elsewhere.haproxy_cfg.paths, "bogus"))
        assert door.paths.config.read_text() == loaded.haproxy_cfg.text
    finally:
        door.stop()


@pytest.mark.parametrize("group, slots", [(False, False), (True, False), (True, True)])
def test_under_systemd_the_units_keep_slots_where_the_host_can_and_a_host_without_the_group_is_told(
        tmp_path: Path, host, monkeypatch: pytest.MonkeyPatch, group: bool, slots: bool) -> None:
    from numad_infer.engines.llama_server import LlamaServer
    from numad_infer.host import identity
    from numad_infer.validate import pipeline

    model, server = host
    # Whether a DynamicUser can run the stand-in binary is another test's (engines/).
    monkeypatch.setattr(LlamaServer, "check_host", lambda self, config, source, host: [])
    root = tmp_path / "slots"
    if slots:
        root.mkdir()
    monkeypatch.setattr(identity, "group_exists", lambda name: group)
    monkeypatch.setattr(pipeline, "group_exists", lambda name: group)
    monkeypatch.setattr(pipeline, "systemd_slots_group",
                        lambda: identity.systemd_slots_group(str(root), "numa-infer"))
    loaded = validate(parse_config(_single(model, server), SOURCE), SOURCE, small_nodes(tmp_path / "n", 4),
                      BackendKind.SYSTEMD, unit_dirs=())
    told = [w for w in loaded.warnings if "empty prompt cache" in w]
    assert len(told) == (0 if group else 1), loaded.warnings
    # The units and the value carried say the same: a --slot-save-path only where kept.
    assert loaded.slots_group == ("numa-infer" if slots else None)
    dropin = loaded.units["infer@0.service.d/50-numa-infer.conf"]
    assert ("--slot-save-path" in dropin) is slots
