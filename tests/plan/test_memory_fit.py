"""Per node, the instances bound there against its memory (plan/memory_fit.py), through the
planner on synthetic machines: the sum, the even split of an instance over several nodes,
and the refusal naming the node, the models, the bytes and what to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from numad_infer.config.load import parse_config
from numad_infer.errors import ConfigError
from numad_infer.plan.memory_fit import InstanceMemory, node_fits
from numad_infer.plan.placement import make_plan
from numad_infer.topology.model import Topology
from numad_infer.topology.sysfs import read_topology
from tests import fakesys
from tests.fakes import served_of

GiB = 1 << 30


def config(placement: str = ""):
    return parse_config(f'[model]\npath = "/m.gguf"\n[placement]\n{placement}\n', "/etc/numa-infer.toml")


@pytest.fixture
def machine(tmp_path: Path):
    made: list[Path] = []

    def read(factory) -> Topology:
        made.append(tmp_path / f"{factory.__name__}-{len(made)}")
        return read_topology(fakesys.write_tree(made[-1], factory()))
    return read


def need(gib: float, model: str = "m.gguf") -> InstanceMemory:
    return InstanceMemory(model, int(gib * GiB), f"weights {gib} GiB",
                          "a smaller model.context_size or server.parallel")


def fits(cfg, topo: Topology, memory: InstanceMemory) -> list[tuple[int, int, int]]:
    plan = make_plan(cfg, topo, memory, served=served_of(cfg))
    return [(f.node, f.need, len(f.instances)) for f in node_fits([(i, memory) for i in plan.instances], topo)]


def test_each_node_sums_its_instances(machine) -> None:
    topo = machine(fakesys.dual_socket_smt)  # 256 GiB nodes
    assert fits(config("instances_per_node = 4"), topo, need(50)) == [(0, 200 * GiB, 4), (1, 200 * GiB, 4)]
    # 5 x 50 GiB is more than 90 % of 256 GiB (230.4 GiB).
    with pytest.raises(ConfigError) as refused:
        conf = config("instances_per_node = 5")
        make_plan(conf, topo, need(50), source="/etc/numa-infer.toml", served=served_of(conf))
    message = str(refused.value)
    assert message.startswith("/etc/numa-infer.toml: node 0's memory cannot hold its instances: infer@0.0, infer@0.1, "
                              "infer@0.2, infer@0.3, infer@0.4 (m.gguf) need 250.0 GiB (268435456000 bytes), the node "
                              "has 230.4 GiB for them (247390116249 bytes: 256.0 GiB less a 10% reserve); per instance "
                              "m.gguf: weights 50 GiB; use a smaller model.context_size or server.parallel, fewer "
                              "placement.instances_per_node (5 instances on node 0), a smaller quantisation of the model or "
                              'placement.mode = "interleave"')
    assert "\n" not in message


def test_an_instance_over_several_nodes_puts_an_equal_share_on_each(machine) -> None:
    topo = machine(fakesys.memoryless_cpu_node)  # nodes 0 and 2: 8 GiB; node 1: CPUs, no memory
    # Interleaved over the two nodes with memory: half on each.
    assert fits(config('mode = "interleave"'), topo, need(10)) == [(0, 5 * GiB, 1), (2, 5 * GiB, 1)]
    # Per node, node 1's instance allocates on node 2, the nearest: two instances there.
    assert fits(config(), topo, need(3)) == [(0, 3 * GiB, 1), (2, 6 * GiB, 2)]


def test_a_node_holding_another_nodes_instance_names_it_in_the_fix(machine) -> None:
    with pytest.raises(ConfigError) as refused:
        conf = config()
        make_plan(conf, machine(fakesys.memoryless_cpu_node), need(4), served=served_of(conf))
    message = str(refused.value)
    # 4 GiB fits node 0 (7.2 GiB for the instances); node 2 holds its own and node 1's: 8 GiB.
    assert "node 2's memory cannot hold its instances: infer@1, infer@2 (m.gguf) need 8.0 GiB" in message
    assert "leaving node 1 out of placement.nodes (its instances allocate on node 2)" in message
    conf = config("nodes = [0, 2]")
    assert make_plan(conf, machine(fakesys.memoryless_cpu_node), need(4), served=served_of(conf)).instances


def test_instances_of_several_models_on_one_node_are_named_together(machine) -> None:
    topo = machine(fakesys.dual_socket_smt)
    conf = config()
    plan = make_plan(conf, topo, served=served_of(conf))
    small, big = need(100, "small.gguf"), need(150, "big.gguf")
    together = [(plan.instances[0], small), (plan.instances[0], big), (plan.instances[1], small)]
    assert [(f.node, f.need, f.models, f.fits) for f in node_fits(together, topo)] == [
        (0, 250 * GiB, ("small.gguf", "big.gguf"), False), (1, 100 * GiB, ("small.gguf",), True)]


def test_a_node_whose_memory_size_is_unknown_is_not_checked(machine) -> None:
    # A capture (or a kernel) that gives no node meminfo: size 0.
    bare = fakesys.FakeMachine(nodes={0: fakesys.FakeNode((0, 1), 0, (10,))}, siblings=((0,), (1,)), l3=((0, 1),),
                               offline=())
    topo = machine(lambda: bare)
    conf = config()
    plan = make_plan(conf, topo, need(1000), served=served_of(conf))
    (fit,) = node_fits([(i, need(1000)) for i in plan.instances], topo)
    assert fit.fits
    assert fit.describe() == "node 0: 1 instance(s) need 1000.0 GiB; its memory size is unknown, not checked"


def test_the_fit_as_plan_prints_it(machine) -> None:
    topo = machine(fakesys.round_robin_sockets)  # 32 GiB nodes
    conf = config()
    plan = make_plan(conf, topo, need(0.5), served=served_of(conf))
    lines = [f.describe() for f in node_fits([(i, need(0.5)) for i in plan.instances], topo)]
    assert lines == ["node 0: 1 instance(s) need 512 MiB of 28.8 GiB (32.0 GiB less 10%)",
                     "node 1: 1 instance(s) need 512 MiB of 28.8 GiB (32.0 GiB less 10%)"]


def grows(gib: float, by: float | None, fix: str = 'server.extra_args = [..., "--cache-ram", "MIB"]') -> InstanceMemory:
    return InstanceMemory("m.gguf", int(gib * GiB), f"weights {gib} GiB", "a smaller model.context_size", "model",
                          None if by is None else int(by * GiB), fix)


def test_prompt_caches_that_could_outgrow_a_node_are_a_warning_naming_the_bound(machine) -> None:
    topo = machine(fakesys.round_robin_sockets)  # 32 GiB nodes: 28.8 GiB for the instances
    # 2 x 4 GiB loaded fits; with 2 x 12 GiB of prompt cache it would not (8 + 24 > 28.8).
    conf = config("instances_per_node = 2")
    plan = make_plan(conf, topo, grows(4, 12), served=served_of(conf))
    (first, second) = [w for w in plan.warnings if "prompt caches" in w]
    assert first == ("node 0: its instances (infer@0.0, infer@0.1) need 8.0 GiB once loaded, which fits, but can "
                     "grow by up to 24.0 GiB more with use (their prompt caches, each to its limit), past the 28.8 GiB "
                     "the node has for them: the kernel would then reclaim or kill; bound it with server.extra_args = "
                     '[..., "--cache-ram", "MIB"]')
    assert second.startswith("node 1: its instances (infer@1.0, infer@1.1)")
    (fit, _) = node_fits([(i, grows(4, 12)) for i in plan.instances], topo)
    assert fit.describe() == ("node 0: 2 instance(s) need 8.0 GiB of 28.8 GiB (32.0 GiB less 10%); with use, prompt "
                              "caches up to 24.0 GiB more")
    # Bounded to what fits: no warning; a refusal stays a refusal, loaded sizes alone.
    assert not [w for w in make_plan(conf, topo, grows(4, 2), served=served_of(conf)).warnings if "prompt" in w]
    with pytest.raises(ConfigError, match="node 0's memory cannot hold"):
        make_plan(conf, topo, grows(15, 0), served=served_of(conf))


def test_a_prompt_cache_without_a_limit_is_a_warning_whatever_the_node(machine) -> None:
    topo = machine(fakesys.dual_socket_smt)  # 256 GiB nodes
    conf = config()
    plan = make_plan(conf, topo, grows(1, None), served=served_of(conf))
    warned = [w for w in plan.warnings if "prompt cache" in w]
    assert len(warned) == 2 and "need 1.0 GiB once loaded, which fits, but have no limit on their prompt cache" in warned[0]
    assert not [w for w in make_plan(conf, topo, grows(1, 8), served=served_of(conf)).warnings if "prompt" in w]


def test_with_several_models_the_fix_names_each_models_own_extra_args() -> None:
    from numad_infer.config.models import served_models
    from numad_infer.engines import get
    from numad_infer.model.memory import MemoryEstimate
    from numad_infer.validate.loaded import instance_memory

    cfg = parse_config('[[models]]\nname = "a"\npath = "/a.gguf"\n[[models]]\nname = "b"\npath = "/b.gguf"\n'
                       'extra_args = ["--cache-ram", "512"]\n[server]\nllama_server = "/bin/llama-server"\n',
                       "/etc/numa-infer.toml")
    engine = get("llama-server")
    got = [instance_memory(s, engine, MemoryEstimate(GiB, 0, 0, prompt_cache=engine.context(s.view).prompt_cache))
           for s in served_models(cfg)]
    assert [(m.grows, m.grows_fix) for m in got] == [
        (8 << 30, 'models[0].extra_args = [..., "--cache-ram", "MIB"]'),
        (512 << 20, 'models[1].extra_args = [..., "--cache-ram", "MIB"]')]
    assert got[1].detail.endswith(", and a prompt cache of up to 512 MiB with use")


def test_one_fix_builder_for_both_forms_each_naming_its_own_keys(machine) -> None:
    """The single `[model]` and a `[[models]]` table get the same fixes from the same code,
    each naming the keys that set it (InstanceMemory.count_key, nodes_key), and interleaving
    only where the shared [placement] places the model."""
    topo = machine(fakesys.dual_socket_smt)  # 256 GiB nodes
    shared = need(50)
    own = InstanceMemory("m.gguf", 50 * GiB, "weights 50 GiB", "a smaller models[0].context_size", "models[0]",
                         count_key="models[0].instances_per_node", nodes_key="models[0].nodes")
    fixes = []
    for memory in (shared, own):
        with pytest.raises(ConfigError) as refused:
            conf = config("instances_per_node = 5")
            make_plan(conf, topo, memory, served=served_of(conf))
        fixes.append(str(refused.value).split("; use ", 1)[1])
    assert fixes[0] == ("a smaller model.context_size or server.parallel, fewer placement.instances_per_node (5 "
                        "instances on node 0), a smaller quantisation of the model or placement.mode = \"interleave\" "
                        "(one instance, its memory spread over every node)")
    assert fixes[1] == ("a smaller models[0].context_size, fewer models[0].instances_per_node (5 instances on node 0) "
                        "or a smaller quantisation of the model")
