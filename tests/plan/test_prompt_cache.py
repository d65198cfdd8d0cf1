"""Prompt caches sized to their nodes (plan/memory_fit.py, prompt_cache_bounds), through the
planner on synthetic machines: one node and several, several instances a node, two models
sharing one, an instance over two nodes, the floor below which a cache is off, and the
operator's own bound left alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from numad_infer.config.load import parse_config
from numad_infer.plan.memory_fit import CACHE_MARGIN_FRACTION, RESERVE_FRACTION, InstanceMemory, bounded, node_fits
from numad_infer.plan.placement import make_plan
from numad_infer.topology.model import Topology
from numad_infer.topology.sysfs import read_topology
from tests import fakesys
from tests.fakes import served_of

GiB, MiB = 1 << 30, 1 << 20
SOURCE = "/etc/numa-infer.toml"


def config(text: str = ""):
    return parse_config(f'[model]\npath = "/m.gguf"\n[placement]\n{text}\n', SOURCE)


@pytest.fixture
def machine(tmp_path: Path):
    made: list[Path] = []

    def read(factory) -> Topology:
        made.append(tmp_path / f"{factory.__name__}-{len(made)}")
        return read_topology(fakesys.write_tree(made[-1], factory()))
    return read


def one_node() -> fakesys.FakeMachine:
    """A laptop: one node of 8 GiB, 4 cores."""
    return fakesys.FakeMachine(nodes={0: fakesys.FakeNode((0, 1, 2, 3), 8 * fakesys.GiB_KB, (10,))},
                               siblings=((0,), (1,), (2,), (3,)), l3=((0, 1, 2, 3),), offline=())


def sized(gib: float, default_gib: float | None = 8, model: str = "m.gguf", state_mib: int = 16) -> InstanceMemory:
    """llama-server's instance with no --cache-ram of the operator's: the planner sizes it."""
    return InstanceMemory(model, int(gib * GiB), f"weights {gib} GiB", "a smaller model.context_size", "model",
                          None if default_gib is None else int(default_gib * GiB),
                          'server.extra_args = [..., "--cache-ram", "MIB"]', sized=True, slot_state=state_mib * MiB)


def share(node_gib: int, need: int, weight: float) -> int:
    """What each instance gets, in MiB: the node less the reserve and the needs, less the margin, shared."""
    return int((int(node_gib * GiB * (1 - RESERVE_FRACTION)) - need) * (1 - CACHE_MARGIN_FRACTION) / weight) >> 20


def caches(plan) -> dict[str, int | None]:
    return {i.name: i.prompt_cache_mib for i in plan.instances}


def test_one_node_shares_what_its_instances_leave_among_them(machine) -> None:
    topo = machine(one_node)  # 7.2 GiB for the instances
    conf = config("instances_per_node = 2")
    plan = make_plan(conf, topo, sized(1), served=served_of(conf))
    each = share(8, 2 * GiB, 2)
    assert each == 1996 and caches(plan) == {"infer@0.0": each, "infer@0.1": each}
    assert not [w for w in plan.warnings if "prompt cache" in w]
    (fit,) = node_fits([(i, bounded(i, sized(1))) for i in plan.instances], topo)
    assert fit.growth == 2 * each * MiB and fit.need + fit.growth <= fit.available
    assert fit.describe().endswith("; with use, prompt caches up to 3.9 GiB more")


def test_several_nodes_each_size_their_own_and_never_past_the_engines_default(machine) -> None:
    # 32 GiB nodes, two 4 GiB instances each: 28.8 - 8 GiB left, a quarter kept: 7.8 GiB each.
    conf = config("instances_per_node = 2")
    plan = make_plan(conf, machine(fakesys.round_robin_sockets), sized(4), served=served_of(conf))
    assert set(caches(plan).values()) == {share(32, 8 * GiB, 2)} == {7987}
    # 256 GiB nodes: far more than llama-server's own 8 GiB, which stays the bound.
    conf = config("instances_per_node = 4")
    big = make_plan(conf, machine(fakesys.dual_socket_smt), sized(8), served=served_of(conf))
    assert set(caches(big).values()) == {8192} and len(big.instances) == 8
    # Four nodes of 64 GiB, two instances each: each node its own share.
    conf = config("instances_per_node = 2")
    nps4 = make_plan(conf, machine(fakesys.epyc_nps4), sized(20, None), served=served_of(conf))
    assert set(caches(nps4).values()) == {share(64, 40 * GiB, 2)} and len(nps4.instances) == 8


def test_an_instance_over_two_nodes_counts_its_share_on_each(machine) -> None:
    # Interleaved over two 32 GiB nodes: 4 GiB of its 8 on each, its cache half on each.
    topo = machine(fakesys.round_robin_sockets)
    conf = config('mode = "interleave"')
    plan = make_plan(conf, topo, sized(8, None), served=served_of(conf))
    (instance,) = plan.instances
    assert instance.mems == (0, 1) and instance.prompt_cache_mib == share(32, 4 * GiB, 0.5)
    for fit in node_fits([(instance, bounded(instance, sized(8, None)))], topo):
        assert fit.growth is not None and fit.growth <= (fit.available - fit.need) * (1 - CACHE_MARGIN_FRACTION)


def test_two_models_on_one_node_share_it_and_an_operators_bound_is_counted_and_kept(machine) -> None:
    cfg = parse_config('[[models]]\nname = "a"\npath = "/a.gguf"\n[[models]]\nname = "b"\npath = "/b.gguf"\n'
                       '[server]\nllama_server = "/bin/llama-server"\n', SOURCE)
    topo = machine(fakesys.round_robin_sockets)
    plan = make_plan(cfg, topo, {"a": sized(4, 64, "a.gguf"), "b": sized(8, 64, "b.gguf")}, served=served_of(cfg))
    assert {i.name: (i.mems, i.prompt_cache_mib) for i in plan.instances} == {
        name: ((node,), share(32, 12 * GiB, 2)) for name, node in
        (("infer@a-0", 0), ("infer@a-1", 1), ("infer@b-0", 0), ("infer@b-1", 1))}
    # b bounds its own (2 GiB, not sized): a takes what is left after it, b's is not passed.
    own = InstanceMemory("b.gguf", 8 * GiB, "weights 8 GiB", grows=2 * GiB)
    mixed = make_plan(cfg, topo, {"a": sized(4, 64, "a.gguf"), "b": own}, served=served_of(cfg))
    assert {i.name: i.prompt_cache_mib for i in mixed.instances} == {
        "infer@a-0": share(32, 14 * GiB, 1), "infer@a-1": share(32, 14 * GiB, 1), "infer@b-0": None, "infer@b-1": None}
    assert not [w for w in mixed.warnings if "prompt cache" in w]


def test_an_operators_bound_that_cannot_fit_is_kept_and_warned_on(machine) -> None:
    own = InstanceMemory("m.gguf", 4 * GiB, "weights 4 GiB", grows=12 * GiB, grows_fix="server.extra_args")
    conf = config("instances_per_node = 2")
    plan = make_plan(conf, machine(fakesys.round_robin_sockets), own, served=served_of(conf))
    assert set(caches(plan).values()) == {None}
    assert len([w for w in plan.warnings if "can grow by up to 24.0 GiB more" in w]) == 2


def test_a_share_below_one_slots_full_state_turns_the_cache_off(machine) -> None:
    # Two 14 GiB instances on a 32 GiB node leave 0.8 GiB: 307 MiB each, less than one
    # slot's 512 MiB state, which the engine would not keep: off, and no warning.
    topo = machine(fakesys.round_robin_sockets)
    conf = config("instances_per_node = 2")
    plan = make_plan(conf, topo, sized(14, state_mib=512), served=served_of(conf))
    assert share(32, 28 * GiB, 2) == 307 and set(caches(plan).values()) == {0}
    assert not [w for w in plan.warnings if "prompt cache" in w]
    # With a 256 MiB state the same share is kept.
    conf = config("instances_per_node = 2")
    assert set(caches(make_plan(conf, topo, sized(14, state_mib=256), served=served_of(conf))).values()) == {307}


def test_without_a_memory_check_nothing_is_sized(machine) -> None:
    """A caller that passes no memory (the goldens' renderings): the engine's own default, as before."""
    conf = config()
    assert set(caches(make_plan(conf, machine(fakesys.dual_socket_smt), served=served_of(conf))).values()) == {None}


# a takes 4 cores of a node either way, so adding b keeps a's cores (its CPUAffinity).
TWO_MODELS = '[[models]]\nname = "a"\npath = "/a.gguf"\ncores_per_instance = 4\n{b}[server]\nllama_server = "/bin/llama-server"\n'
B = '[[models]]\nname = "b"\npath = "/b.gguf"\n'


def test_a_running_instance_keeps_its_bound_when_a_model_is_added_beside_it(machine) -> None:
    """The bound is in the engine's command line: a reload that adds a model on its node must
    not restart a running instance for its cache's sake. It keeps its bound; the new model's
    instances share what it leaves."""
    topo = machine(fakesys.round_robin_sockets)
    memory = {"a": sized(4, 8, "a.gguf"), "b": sized(4, 8, "b.gguf")}  # llama-server's own 8 GiB at most
    conf = parse_config(TWO_MODELS.format(b=""), SOURCE)
    alone = make_plan(conf, topo, memory, served=served_of(conf))
    assert set(caches(alone).values()) == {8192}
    conf = parse_config(TWO_MODELS.format(b=B), SOURCE)
    both = make_plan(conf, topo, memory, running=alone.instances, served=served_of(conf))
    left = share(32, 8 * GiB, 1) - 8192  # the node's budget less a's kept bound
    assert {i.name: i.prompt_cache_mib for i in both.instances} == {
        "infer@a-0": 8192, "infer@a-1": 8192, "infer@b-0": left, "infer@b-1": left} and left == 7782
    # Without a running plan (a fresh start), the two share each node evenly.
    conf = parse_config(TWO_MODELS.format(b=B), SOURCE)
    fresh = make_plan(conf, topo, memory, served=served_of(conf))
    assert set(caches(fresh).values()) == {share(32, 8 * GiB, 2)}


def test_kept_bounds_a_node_can_no_longer_hold_are_kept_and_warned_on(machine) -> None:
    """A bigger model beside them leaves less: the running instances keep their bounds (a
    new one would restart them), the new ones get what is left, here nothing (off), and the
    node's warning says the caches could pass its memory."""
    topo = machine(fakesys.round_robin_sockets)
    cfg = parse_config(TWO_MODELS.format(b=B), SOURCE)
    conf = parse_config(TWO_MODELS.format(b=""), SOURCE)
    alone = make_plan(conf, topo, {"a": sized(4, 64, "a.gguf")}, served=served_of(conf))
    kept = share(32, 4 * GiB, 1)
    bigger = {"a": sized(4, 64, "a.gguf"), "b": sized(14, 64, "b.gguf")}
    again = make_plan(cfg, topo, bigger, running=alone.instances, served=served_of(cfg))
    assert {i.name: i.prompt_cache_mib for i in again.instances} == {
        "infer@a-0": kept, "infer@a-1": kept, "infer@b-0": 0, "infer@b-1": 0}
    assert len([w for w in again.warnings if "prompt cache" in w]) == 2


def test_an_instance_whose_cores_change_is_sized_again(machine) -> None:
    """It restarts anyway (its CPUAffinity changes): it gets a fresh share, not its old bound."""
    from dataclasses import replace
    topo = machine(fakesys.round_robin_sockets)
    memory = {"a": sized(4, 64, "a.gguf"), "b": sized(4, 64, "b.gguf")}
    cfg = parse_config(TWO_MODELS.format(b=B), SOURCE)
    first = make_plan(cfg, topo, memory, served=served_of(cfg))
    moved = [replace(i, cpus=i.cpus[:1], prompt_cache_mib=1) if i.name == "infer@a-0" else i for i in first.instances]
    plan = make_plan(cfg, topo, memory, running=moved, served=served_of(cfg))
    assert caches(plan)["infer@a-0"] == share(32, 8 * GiB, 2)
