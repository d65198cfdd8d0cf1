"""Placement rules, on synthetic machines (tests/fakesys.py) and real captures."""

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


def config(**sections: str):
    text = '[model]\npath = "/m.gguf"\n' + "".join(f"[{name}]\n{body}\n" for name, body in sections.items())
    return parse_config(text, "/etc/numa-infer.toml")


@pytest.fixture
def machine(tmp_path: Path):
    def read(factory) -> Topology:
        return read_topology(fakesys.write_tree(tmp_path / factory.__name__, factory()))
    return read


def test_dual_socket_one_instance_per_node_one_thread_per_core(machine) -> None:
    cfg = config()
    plan = make_plan(cfg, machine(fakesys.dual_socket_smt), served=served_of(cfg))
    assert [(i.name, i.node, i.mems, i.threads, i.port) for i in plan.instances] == [
        ("infer@0", 0, (0,), 32, 8080), ("infer@1", 1, (1,), 32, 8081)]
    assert plan.instances[0].cpus == tuple(range(32))
    assert plan.instances[1].cpus == tuple(range(32, 64))
    assert plan.instances[0].places[:2] == ((0,), (1,))


def test_smt_true_uses_every_sibling_and_places_are_cores(machine) -> None:
    cfg = config(placement="smt = true")
    plan = make_plan(cfg, machine(fakesys.dual_socket_smt), served=served_of(cfg))
    first = plan.instances[0]
    assert first.threads == 64 and first.cpus == tuple(range(32)) + tuple(range(64, 96))
    assert first.places[0] == (0, 64)


def test_round_robin_numbering_keeps_nodes_apart(machine) -> None:
    cfg = config()
    plan = make_plan(cfg, machine(fakesys.round_robin_sockets), served=served_of(cfg))
    assert [i.cpus for i in plan.instances] == [tuple(range(0, 16, 2)), tuple(range(1, 16, 2))]


def test_cpu_less_node_never_hosts_an_instance(machine) -> None:
    cfg = config()
    plan = make_plan(cfg, machine(fakesys.cxl_memory_node), served=served_of(cfg))
    assert [i.node for i in plan.instances] == [0, 1]


def test_listing_a_cpu_less_node_in_per_node_mode_is_an_error(machine) -> None:
    with pytest.raises(ConfigError, match=r"placement.nodes = \[0, 2\]: node 2 has no CPUs"):
        cfg = config(placement="nodes = [0, 2]")
        make_plan(cfg, machine(fakesys.cxl_memory_node), source="/etc/numa-infer.toml", served=served_of(cfg))


def test_interleave_spans_all_selected_nodes_memory_included(machine) -> None:
    cfg = config(placement='mode = "interleave"')
    plan = make_plan(cfg, machine(fakesys.cxl_memory_node), served=served_of(cfg))
    (only,) = plan.instances
    assert (only.name, only.node, only.policy, only.mems, only.cpus) == (
        "infer@interleave", None, "interleave", (0, 1, 2), tuple(range(8)))


def test_memoryless_node_takes_nearest_memory_with_warning(machine) -> None:
    cfg = config()
    plan = make_plan(cfg, machine(fakesys.memoryless_cpu_node), served=served_of(cfg))
    assert [i.mems for i in plan.instances] == [(0,), (2,), (2,)]
    assert any("node 1 has CPUs but no memory" in w for w in plan.warnings)


def test_offline_cpus_are_never_planned(machine) -> None:
    cfg = config(placement="smt = true")
    plan = make_plan(cfg, machine(fakesys.offline_cpus), served=served_of(cfg))
    assert plan.instances[0].cpus == (0, 1, 2, 8, 10)


def test_reserving_a_cpu_reserves_its_whole_core(machine) -> None:
    cfg = config(placement='reserve_cpus = "0"\nsmt = true')
    plan = make_plan(cfg, machine(fakesys.dual_socket_smt), served=served_of(cfg))
    assert 0 not in plan.instances[0].cpus and 64 not in plan.instances[0].cpus
    assert plan.instances[0].threads == 62
    assert any("CPUs 0,64 are reserved" in w for w in plan.warnings)


def test_with_all_nodes_a_fully_reserved_node_is_skipped_with_a_warning(machine) -> None:
    cfg = config(placement='reserve_cpus = "0-31"')
    plan = make_plan(cfg, machine(fakesys.dual_socket_smt), served=served_of(cfg))
    assert [(i.name, i.port) for i in plan.instances] == [("infer@1", 8080)]
    assert any("every CPU of node 0: no instance there" in w for w in plan.warnings)


def test_instances_never_share_a_cpu_and_ports_follow_plan_order(machine) -> None:
    cfg = config(placement="instances_per_node = 3\nsmt = true")
    plan = make_plan(cfg, machine(fakesys.epyc_nps4), served=served_of(cfg))
    seen: set[int] = set()
    for instance in plan.instances:
        assert not seen & set(instance.cpus)
        seen |= set(instance.cpus)
    assert [i.port for i in plan.instances] == list(range(8080, 8080 + 12))
    assert [i.name for i in plan.instances[:3]] == ["infer@0.0", "infer@0.1", "infer@0.2"]


def test_split_follows_l3_boundaries_when_they_divide_evenly(machine) -> None:
    # NPS4 node 0: 4 CCX of 4 cores; 2 instances get 2 whole CCX each.
    cfg = config(placement="instances_per_node = 2")
    plan = make_plan(cfg, machine(fakesys.epyc_nps4), served=served_of(cfg))
    assert plan.instances[0].cpus == tuple(range(0, 8)) and plan.instances[1].cpus == tuple(range(8, 16))


def test_split_is_near_equal_when_l3_does_not_divide(machine) -> None:
    cfg = config(placement="instances_per_node = 3")
    plan = make_plan(cfg, machine(fakesys.epyc_nps4), served=served_of(cfg))
    assert [i.threads for i in plan.instances[:3]] == [6, 5, 5]


@pytest.mark.parametrize(
    "sections, key, fragment",
    [
        ({"placement": "nodes = [0, 7]"}, "placement.nodes", "node 7 does not exist on this machine (nodes: 0-1)"),
        ({"placement": 'reserve_cpus = "200"'}, "placement.reserve_cpus", "CPU 200 is not an online CPU"),
        ({"placement": 'nodes = [0, 1]\nreserve_cpus = "0-31"'}, "placement.reserve_cpus",
         "reserves every CPU of node 0 (0-31,64-95); leave it at least one core or drop it from placement.nodes"),
        ({"placement": 'reserve_cpus = "0-127"'}, "placement.reserve_cpus", "reserves every CPU of every node"),
        ({"placement": "instances_per_node = 40"}, "placement.instances_per_node", "fewer than 40 instances"),
        ({"server": "base_port = 65535"}, "server.base_port", "past 65535; use at most 65534"),
    ],
)
def test_config_that_does_not_fit_this_machine_names_key_and_fix(machine, sections, key, fragment) -> None:
    with pytest.raises(ConfigError) as info:
        cfg = config(**sections)
        make_plan(cfg, machine(fakesys.dual_socket_smt), source="/etc/numa-infer.toml", served=served_of(cfg))
    message = str(info.value)
    assert message.startswith(f"/etc/numa-infer.toml: {key} = ") and fragment in message


def test_model_bigger_than_node_memory_suggests_interleave(machine) -> None:
    topo = machine(fakesys.memoryless_cpu_node)  # 8 GiB nodes 0 and 2; node 1 allocates on node 2
    memory = InstanceMemory("m.gguf", int(7.5 * 2**30), "weights 7.5 GiB")
    with pytest.raises(ConfigError, match="node 0's memory cannot hold its instances: infer@0 .* "
                                          'placement.mode = "interleave"'):
        cfg = config()
        make_plan(cfg, topo, memory, served=served_of(cfg))
    # Interleaved: half of it on each node with memory.
    cfg = config(placement='mode = "interleave"')
    assert make_plan(cfg, topo, memory, served=served_of(cfg)).instances


def test_plan_json_shape(machine) -> None:
    cfg = config()
    data = make_plan(cfg, machine(fakesys.dual_socket_smt), served=served_of(cfg)).to_dict()
    assert set(data) == {"instances", "warnings"}
    assert set(data["instances"][0]) >= {"name", "node", "cpus", "mems", "threads", "port"}


def test_diff_reports_added_changed_removed() -> None:
    diff = diff_plans({"a": 1, "b": 2, "c": 3}, {"b": 2, "c": 4, "d": 5})
    assert (diff.added, diff.changed, diff.removed, diff.unchanged) == (("d",), ("c",), ("a",), ("b",))


@pytest.mark.parametrize("name", ["64amd64-4s2n4ca2co", "nvidiagpunumanodes", "fakeheteromemtiers", "offline-cpu0-node0"])
def test_real_captures_plan_without_overlap(captures, name: str) -> None:
    cfg = config(placement="smt = true")
    plan = make_plan(cfg, read_topology(captures[name]), served=served_of(cfg))
    cpus = [c for i in plan.instances for c in i.cpus]
    assert plan.instances and len(cpus) == len(set(cpus))



def test_listening_beyond_loopback_is_a_warning_naming_the_key(machine) -> None:
    topo = machine(fakesys.dual_socket_smt)
    cfg = config()
    quiet = make_plan(cfg, topo, served=served_of(cfg))
    assert not [w for w in quiet.warnings if "other hosts" in w]
    cfg = config(server='host = "0.0.0.0"', frontend='listen = "10.1.2.3:8000"', metrics='listen = "[::]:9464"')
    loud = make_plan(cfg, topo, served=served_of(cfg))
    exposed = [w for w in loud.warnings if "can be reached from other hosts" in w]
    assert [w.split(" = ")[0] for w in exposed] == ["server.host", "frontend.listen", "metrics.listen"], exposed
