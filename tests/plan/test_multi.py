"""Several models on one host ([[models]]): the core split per node, unit names, memory per
node, ports kept across a reload. Synthetic machines (tests/fakesys.py: the 2 x 32-core
server of the issue's example cannot run here) and real captures."""

from __future__ import annotations

from pathlib import Path

import pytest

from numad_infer.config.load import parse_config
from numad_infer.errors import ConfigError
from numad_infer.plan.memory_fit import InstanceMemory
from numad_infer.plan.model import diff_plans
from numad_infer.plan.placement import make_plan
from numad_infer.topology.model import Topology
from numad_infer.topology.sysfs import read_topology
from tests import fakesys
from tests.fakes import served_of


def models(*tables: str, extra: str = ""):
    text = extra + "".join(f"[[models]]\n{body}\n" for body in tables)
    return parse_config(text, "/etc/numa-infer.toml")


BIG = 'name = "big"\npath = "/m/70b.gguf"\ncores_per_instance = 28\n'
SMALL = 'name = "small"\naliases = ["fast"]\npath = "/m/8b.gguf"\n'


@pytest.fixture
def machine(tmp_path: Path):
    def read(factory) -> Topology:
        return read_topology(fakesys.write_tree(tmp_path / factory.__name__, factory()))
    return read


def _physical(topo: Topology, cpus: tuple[int, ...]) -> set[tuple[int, ...]]:
    return {topo.sibling_core(c) for c in cpus}


def test_the_issue_example_70b_takes_28_cores_per_node_8b_the_4_left(machine) -> None:
    topo = machine(fakesys.dual_socket_smt)
    cfg = models(BIG, SMALL)
    plan = make_plan(cfg, topo, served=served_of(cfg))
    assert [(i.name, i.model, i.node, len(i.cpus), i.port) for i in plan.instances] == [
        ("infer@big-0", "big", 0, 28, 8080), ("infer@big-1", "big", 1, 28, 8081),
        ("infer@small-0", "small", 0, 4, 8082), ("infer@small-1", "small", 1, 4, 8083)]
    for node in (0, 1):
        here = [i for i in plan.instances if i.node == node]
        cpus = [c for i in here for c in i.cpus]
        assert len(cpus) == len(set(cpus)) == 32  # every core once, none shared
        assert all(i.mems == (node,) for i in here)


def test_smt_keeps_siblings_together_and_no_two_instances_share_a_core(machine) -> None:
    topo = machine(fakesys.dual_socket_smt)
    cfg = models(BIG, SMALL, extra="[placement]\nsmt = true\n")
    plan = make_plan(cfg, topo, served=served_of(cfg))
    cores = [_physical(topo, i.cpus) for i in plan.instances]
    for a in range(len(cores)):
        for b in range(a + 1, len(cores)):
            assert not cores[a] & cores[b]
    big0 = plan.instances[0]
    assert len(big0.cpus) == 56 and all(c + 64 in big0.cpus for c in big0.cpus if c < 64)


def test_models_without_cores_share_what_is_left_evenly(machine) -> None:
    topo = machine(fakesys.dual_socket_smt)
    a = 'name = "a"\npath = "/m/a.gguf"\nnodes = [0]\ninstances_per_node = 2\n'
    b = 'name = "b"\npath = "/m/b.gguf"\nnodes = [0]\ncores_per_instance = 8\n'
    c = 'name = "c"\npath = "/m/c.gguf"\nnodes = [0]\n'
    cfg = models(a, b, c)
    plan = make_plan(cfg, topo, served=served_of(cfg))
    sizes = {i.name: len(i.cpus) for i in plan.instances}
    # 32 cores, 8 to b, 24 left for the three instances of a and c.
    assert sizes == {"infer@a-0.0": 8, "infer@a-0.1": 8, "infer@b-0": 8, "infer@c-0": 8}


def test_instances_stay_inside_l3_groups_where_they_fit(machine) -> None:
    topo = machine(fakesys.epyc_nps4)  # 4 cores per L3 group, 16 per node
    a = 'name = "a"\npath = "/m/a.gguf"\nnodes = [0]\ncores_per_instance = 8\n'
    b = 'name = "b"\npath = "/m/b.gguf"\nnodes = [0]\ninstances_per_node = 2\ncores_per_instance = 4\n'
    cfg = models(a, b)
    plan = make_plan(cfg, topo, served=served_of(cfg))
    groups = [set(g) for g in topo.nodes[0].l3_groups]
    for i in plan.instances[1:]:  # b's instances: one whole L3 group each
        inside = [g for g in groups if _physical(topo, i.cpus) <= g]
        assert len(inside) == 1 and len(i.cpus) == 4


def test_reserved_cpus_stay_out(machine) -> None:
    topo = machine(fakesys.dual_socket_smt)
    cfg = models(BIG, SMALL, extra='[placement]\nreserve_cpus = "0"\n')
    plan = make_plan(cfg, topo, served=served_of(cfg))
    assert all(0 not in i.cpus and 64 not in i.cpus for i in plan.instances)
    assert [len(i.cpus) for i in plan.instances if i.node == 0] == [28, 3]


def test_cores_asked_beyond_the_node_are_refused_naming_the_key(machine) -> None:
    topo = machine(fakesys.dual_socket_smt)
    greedy = BIG.replace("28", "30")
    with pytest.raises(ConfigError) as err:
        cfg = models(greedy, SMALL, 'name = "third"\npath = "/m/t.gguf"\ncores_per_instance = 4\n')
        make_plan(cfg, topo, served=served_of(cfg))
    message = str(err.value)
    assert "models[2].cores_per_instance" in message and "node 0 has 32 usable" in message
    assert "big 1 x 30" in message and "lower cores_per_instance" in message
    with pytest.raises(ConfigError, match=r"models\[1\].instances_per_node.*2 are left for 3 instance"):
        cfg = models(greedy, 'name = "s"\npath = "/m/s.gguf"\ninstances_per_node = 3\n')
        make_plan(cfg, topo, served=served_of(cfg))


def test_a_model_node_that_does_not_exist_names_the_models_key(machine) -> None:
    with pytest.raises(ConfigError, match=r"models\[1\].nodes = \[5\]: node 5 does not exist"):
        cfg = models(BIG, SMALL + "nodes = [5]\n")
        make_plan(cfg, machine(fakesys.dual_socket_smt), served=served_of(cfg))


def test_memory_is_summed_per_node_over_both_models(machine) -> None:
    topo = machine(fakesys.dual_socket_smt)  # 256 GiB per node
    need = {"big": InstanceMemory("big", 200 << 30, "200 GiB"), "small": InstanceMemory("small", 20 << 30, "20 GiB")}
    cfg = models(BIG, SMALL)
    make_plan(cfg, topo, need, served=served_of(cfg))  # 220 of 230.4 GiB: fits
    need["small"] = InstanceMemory("small", 40 << 30, "40 GiB", "a smaller models[1].context_size")
    with pytest.raises(ConfigError) as err:
        cfg = models(BIG, SMALL)
        make_plan(cfg, topo, need, served=served_of(cfg))
    message = str(err.value)
    assert "node 0's memory cannot hold its instances: infer@big-0, infer@small-0 (big, small) need 240.0 GiB" in message
    assert "models[1].context_size" in message


def test_single_model_form_is_unchanged(machine) -> None:
    topo = machine(fakesys.dual_socket_smt)
    cfg = parse_config('[model]\npath = "/m.gguf"\nname = "tiny"\n', "f")
    plan = make_plan(cfg, topo, served=served_of(cfg))
    assert [(i.name, i.model, i.port) for i in plan.instances] == [("infer@0", "", 8080), ("infer@1", "", 8081)]


def test_a_reload_that_adds_or_removes_a_model_keeps_every_other_instance(machine) -> None:
    topo = machine(fakesys.dual_socket_smt)
    a = 'name = "a"\npath = "/m/a.gguf"\ncores_per_instance = 8\n'
    b = 'name = "b"\npath = "/m/b.gguf"\ncores_per_instance = 8\n'
    c = 'name = "c"\npath = "/m/c.gguf"\ncores_per_instance = 8\n'
    cfg = models(a, b)
    before = make_plan(cfg, topo, served=served_of(cfg))
    cfg = models(a, b, c)
    added = make_plan(cfg, topo, running=before.instances, served=served_of(cfg))
    diff = diff_plans({i.name: i for i in before.instances}, {i.name: i for i in added.instances})
    assert diff.added == ("infer@c-0", "infer@c-1") and diff.changed == () and diff.removed == ()
    cfg = models(b, c)
    removed = make_plan(cfg, topo, running=added.instances, served=served_of(cfg))
    diff = diff_plans({i.name: i for i in added.instances}, {i.name: i for i in removed.instances})
    assert diff.removed == ("infer@a-0", "infer@a-1") and diff.changed == () and diff.added == ()


def test_a_reload_that_drops_a_node_keeps_every_other_instance_in_both_forms(machine) -> None:
    # One code path for [model] and [[models]]: a running instance keeps its port (and so its
    # process) when another goes; before, the single form moved infer@2 down to 8081.
    topo = machine(fakesys.epyc_nps4)
    for form in ('[model]\npath = "/m.gguf"\n[placement]\nnodes = {}\n',
                 '[[models]]\nname = "a"\npath = "/m.gguf"\nnodes = {}\n'):
        cfg = parse_config(form.format("[0, 1, 2, 3]"), "f")
        every = make_plan(cfg, topo, served=served_of(cfg))
        cfg = parse_config(form.format("[0, 2, 3]"), "f")
        fewer = make_plan(cfg, topo, running=every.instances, served=served_of(cfg))
        diff = diff_plans({i.name: i for i in every.instances}, {i.name: i for i in fewer.instances})
        assert len(diff.removed) == 1 and diff.changed == () and diff.added == (), (form, diff)
        cfg = parse_config(form.format("[0, 1, 2, 3]"), "f")
        again = make_plan(cfg, topo, running=fewer.instances, served=served_of(cfg))
        back = {i.name: i.port for i in again.instances}
        assert sorted(back.values()) == [8080, 8081, 8082, 8083]  # the one that came back takes the free port
        assert diff_plans({i.name: i for i in fewer.instances}, {i.name: i for i in again.instances}).changed == ()


def test_names_with_dashes_never_collide(machine) -> None:
    topo = machine(fakesys.epyc_nps4)
    a = 'name = "m-1"\npath = "/m/a.gguf"\nnodes = [0]\n'
    b = 'name = "m"\npath = "/m/b.gguf"\nnodes = [1]\ninstances_per_node = 2\n'
    cfg = models(a, b)
    names = [i.name for i in make_plan(cfg, topo, served=served_of(cfg)).instances]
    assert names == ["infer@m-1-0", "infer@m-1.0", "infer@m-1.1"] and len(set(names)) == 3
