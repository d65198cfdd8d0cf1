"""Do the instances fit in their nodes' memory? Per node, the sum of what each instance whose
memory is bound there holds (model/memory.py's estimate, in bytes) against the node's memory
less a reserve. Pure.

Over a list of instances, each with its own need: the instances of several models on one
host sum the same way as today's one model's. An instance bound to several nodes (an
interleaved one, or one whose CPUs' node has no memory and that allocates on several
nearest ones) puts an equal share on each, as the kernel's interleave spreads its pages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from numad_infer.errors import ConfigError
from numad_infer.plan.model import Instance
from numad_infer.topology.model import Topology

# Of each node's memory, what the instances may not count on: the kernel's own per node
# (its watermarks, which scale with the node's memory, and the instances' page tables and
# slab), the daemon, HAProxy and the rest of the host, and the page cache a model file goes
# through while an instance reads it (mmap off). 10 %, the share the planner left before it
# counted more than the weights: 0.8 GiB of an 8 GiB node, 26 GiB of a 256 GiB one.
RESERVE_FRACTION = 0.10

# Of what a node has left once its instances are loaded (its memory less the reserve and
# every instance's need), the share its prompt caches may not take. The caches are the one
# part that grows under traffic, and they would fill together (every instance taking
# distinct prompts). What the margin covers: the heap keeps freed cache entries (each a
# vector of MiB; glibc's mmap threshold rises to 32 MiB after the first large free, so an
# evicted state below it stays in the arena rather than going back to the kernel), the
# estimate's error on a model nobody measured (the overhead was fitted to 0.5 MiB on three
# models only), and what the reserve's page cache and other processes take beyond 10 %. A
# quarter: on the demo's 5 GiB node 1 GiB stays free; on a 256 GiB node the bound reaches
# the engine's own default long before the margin matters.
CACHE_MARGIN_FRACTION = 0.25


@dataclass(frozen=True)
class InstanceMemory:
    """What one instance holds, as the check sums it and a refusal shows it."""

    model: str  # the model, as a refusal names it
    bytes: int
    detail: str  # how it adds up (MemoryEstimate.describe)
    shrink: str = "a smaller model.context_size"  # the engine's own ways to hold less
    key: str = "model"  # where the model is configured, as a fix names it: "model" or "models[k]"
    # What use may add (a prompt cache: MemoryEstimate.prompt_cache), None: no bound; and the
    # key and arguments that bound it, as a warning names them.
    grows: int | None = 0
    grows_fix: str = ""
    # Whether the planner sizes its prompt cache to its nodes (`prompt_cache_bounds`): the
    # engine keeps one by default and the operator's arguments do not bound it. `grows` is
    # then the engine's default, the most a sized cache gets.
    sized: bool = False
    slot_state: int = 0  # one slot's full prompt state (MemoryEstimate.slot_state): the smallest cache worth keeping
    # The keys that set how many of its instances a node runs, and on which nodes: the shared
    # [placement] table's, or its own [[models]] table's (ServedModel.key_for).
    count_key: str = "placement.instances_per_node"
    nodes_key: str = "placement.nodes"


@dataclass(frozen=True)
class NodeFit:
    node: int
    need: int  # bytes, summed over the instances bound to it
    total: int  # the node's memory (0: unknown, not checked)
    instances: tuple[str, ...]
    models: tuple[str, ...]
    growth: int | None = 0  # what use may add to `need` there (prompt caches); None: no bound

    @property
    def available(self) -> int:
        return int(self.total * (1 - RESERVE_FRACTION))

    @property
    def fits(self) -> bool:
        return self.total <= 0 or self.need <= self.available

    def describe(self) -> str:
        """`node 0: 2 instance(s) need 448 MiB of 7.2 GiB (8.0 GiB less 10 %)`."""
        needs = f"node {self.node}: {len(self.instances)} instance(s) need {_gib(self.need)}"
        if self.total <= 0:
            return f"{needs}; its memory size is unknown, not checked"
        return f"{needs} of {_gib(self.available)} ({_gib(self.total)} less {RESERVE_FRACTION:.0%}){self._grows()}"

    @property
    def overfills(self) -> bool:
        """Fits once loaded, and what use may add would not: a warning, not a refusal."""
        return self.total > 0 and self.fits and (self.growth is None or self.need + self.growth > self.available)

    def _grows(self) -> str:
        if self.growth is None:
            return "; with use, prompt caches with no limit"
        return f"; with use, prompt caches up to {_gib(self.growth)} more" if self.growth else ""


def node_fits(instances: Sequence[tuple[Instance, InstanceMemory]], topo: Topology) -> list[NodeFit]:
    """Per memory node the instances are bound to, in node order: what they need there."""
    need: dict[int, int] = {}
    growth: dict[int, int | None] = {}
    names: dict[int, list[str]] = {}
    models: dict[int, list[str]] = {}
    for instance, memory in instances:
        for node in instance.mems:
            need[node] = need.get(node, 0) + memory.bytes // max(1, len(instance.mems))
            had, grows = growth.get(node, 0), memory.grows
            growth[node] = None if had is None or grows is None else had + grows // max(1, len(instance.mems))
            names.setdefault(node, []).append(instance.name)
            if memory.model not in models.setdefault(node, []):
                models[node].append(memory.model)
    totals = {n.id: n.memory_total_bytes for n in topo.nodes}
    return [NodeFit(node, need[node], max(totals.get(node, 0), 0), tuple(names[node]), tuple(models[node]),
                    growth[node]) for node in sorted(need)]


def prompt_cache_bounds(instances: Sequence[tuple[Instance, InstanceMemory]], topo: Topology,
                        kept: Mapping[str, int] | None = None) -> dict[str, int]:
    """Instance name -> its prompt cache's bound in MiB, for each instance whose cache the
    planner sizes (InstanceMemory.sized). Per node: its memory less the reserve, less every
    instance's need there and the caches it does not size (the operator's own bounds), less
    CACHE_MARGIN_FRACTION of what is left; shared equally among its sized instances, one
    bound to several nodes counting its share on each (as node_fits sums). An instance gets
    the smallest of its nodes' shares, so that no node's sum passes its budget, and never
    more than the engine's own default (`grows`). A share below one slot's full prompt
    state is 0, off: the engine skips a state larger than its cache, so such a cache keeps
    only short prompts, the cheap ones to compute again, for memory the node lacks. A node
    whose memory size is unknown does not bound it (the engine's default, as before).

    `kept`: the bounds of instances running now on the same cores (name -> MiB). The bound
    is in the engine's command line, so a new one restarts the instance: a reload that adds
    a model beside a running one must not restart it for its cache's sake. Those bounds are
    kept and the others share what they leave (0, off, when nothing is left). Where the
    kept bounds pass what a node has left now (a model added beside them), the node's
    growth warning says so (growth_warnings): the caches are not shrunk behind the
    operator's back by restarting what serves."""
    kept = dict(kept or {})
    fits = [fit for fit in node_fits(instances, topo) if fit.total > 0]
    sized = [(i, m) for i, m in instances if m.sized]
    share = {fit.node: _cache_share(fit, instances, kept) for fit in fits}
    bounds = {}
    for instance, memory in sized:
        shares = [share[n] for n in instance.mems if n in share]
        if not shares:
            continue
        if instance.name in kept:
            bounds[instance.name] = kept[instance.name]
            continue
        cap = min(shares) if memory.grows is None else min(memory.grows, *shares)
        mib = max(cap, 0) >> 20
        bounds[instance.name] = mib if mib << 20 >= max(memory.slot_state, 1) else 0
    return bounds


def _cache_budget(fit: NodeFit, instances: Sequence[tuple[Instance, InstanceMemory]]) -> int:
    """What the sized prompt caches bound to this node may take of it together, in bytes."""
    here = [(i, m) for i, m in instances if fit.node in i.mems]
    fixed = sum((m.grows or 0) // len(i.mems) for i, m in here if not m.sized)  # no limit: warned on, not counted
    return int(max(fit.available - fit.need - fixed, 0) * (1 - CACHE_MARGIN_FRACTION))


def _cache_share(fit: NodeFit, instances: Sequence[tuple[Instance, InstanceMemory]], kept: Mapping[str, int]) -> int:
    """What one sized instance bound only to this node, and not keeping its bound, may cache there, in bytes."""
    here = [i for i, m in instances if fit.node in i.mems and m.sized]
    left = _cache_budget(fit, instances) - sum((kept[i.name] << 20) // len(i.mems) for i in here if i.name in kept)
    weight = sum(1 / len(i.mems) for i in here if i.name not in kept)
    return int(max(left, 0) / weight) if weight else 0


def bounded(instance: Instance, memory: InstanceMemory) -> InstanceMemory:
    """`memory` with what its prompt cache may grow to as the planner bounded it
    (Instance.prompt_cache_mib); as it is where the planner did not size it."""
    if instance.prompt_cache_mib is None:
        return memory
    return replace(memory, grows=instance.prompt_cache_mib << 20)


def growth_warnings(instances: Sequence[tuple[Instance, InstanceMemory]], topo: Topology) -> list[str]:
    """Per node whose instances fit once loaded but whose prompt caches could grow past its
    memory under traffic: a warning naming the bound to set. Not a refusal: the caches
    fill only with many distinct prompts, and the engines' own default limits are what
    runs today (refusing would stop a configuration that serves at upgrade)."""
    warnings = []
    for fit in node_fits(instances, topo):
        if not fit.overfills:
            continue
        here = [m for i, m in instances if fit.node in i.mems]
        grow = ("have no limit on their prompt cache" if fit.growth is None else
                f"can grow by up to {_gib(fit.growth)} more with use (their prompt caches, each to its limit)")
        fixes = _or(list(dict.fromkeys(m.grows_fix for m in here if m.grows_fix))) or "a smaller prompt cache"
        warnings.append(f"node {fit.node}: its instances ({', '.join(fit.instances)}) need {_gib(fit.need)} once "
                        f"loaded, which fits, but {grow}, past the {_gib(fit.available)} the node has for them: the "
                        f"kernel would then reclaim or kill; bound it with {fixes}")
    return warnings


def check_fit(instances: Sequence[tuple[Instance, InstanceMemory]], topo: Topology, source: str) -> None:
    """ConfigError for the first node whose instances need more than it has for them: the
    node, the models, the bytes needed and available, and what to change. A node whose
    memory size is unknown (0) is not checked."""
    for fit in node_fits(instances, topo):
        if fit.fits:
            continue
        here = [(i, m) for i, m in instances if fit.node in i.mems]
        each = "; ".join(dict.fromkeys(f"{m.model}: {m.detail}" for _, m in here))
        raise ConfigError(
            source, None,
            f"node {fit.node}'s memory cannot hold its instances: {', '.join(fit.instances)} "
            f"({', '.join(fit.models)}) need {_gib(fit.need)} ({fit.need} bytes), the node has {_gib(fit.available)} "
            f"for them ({fit.available} bytes: {_gib(fit.total)} less a {RESERVE_FRACTION:.0%} reserve); per "
            f"instance {each}; use {_or(_fixes(fit, here, topo))}",
        )


def _fixes(fit: NodeFit, here: list[tuple[Instance, InstanceMemory]], topo: Topology) -> list[str]:
    """What would make the node's instances fit, most specific first, each named by the key
    that sets it for those models (the single `[model]` form's are [placement]'s)."""
    fixes = dict.fromkeys(m.shrink for _, m in here)
    for count_key in dict.fromkeys(m.count_key for _, m in here):
        count = sum(1 for _, m in here if m.count_key == count_key)
        if count > 1:
            fixes[f"fewer {count_key} ({count} instances on node {fit.node})"] = None
    models = list(dict.fromkeys(m.key for _, m in here))
    fixes["a smaller quantisation of " + ("the model" if len(models) == 1 else "one of the models")] = None
    nodes_keys = _or(list(dict.fromkeys(m.nodes_key for _, m in here)))
    elsewhere = sorted({i.node for i, _ in here if i.node is not None and i.node != fit.node})
    if elsewhere:  # CPUs of a node without memory of its own, allocating here
        fixes[f"leaving node {', '.join(map(str, elsewhere))} out of {nodes_keys} (its instances allocate on "
              f"node {fit.node})"] = None
    if len(models) > 1:
        fixes[f"fewer models on node {fit.node} (leave it out of {nodes_keys})"] = None
    # Interleaving is a mode of the shared [placement] table: offered where it places them
    # ([[models]] are placed per node only: config/models.check_models).
    bound = any(i.node is not None for i, _ in here)
    shared = nodes_keys == "placement.nodes"
    if shared and bound and sum(1 for n in topo.nodes if n.memory_total_bytes > 0) > 1:
        fixes['placement.mode = "interleave" (one instance, its memory spread over every node)'] = None
    return list(fixes)


def _or(items: list[str]) -> str:
    if not items:
        return ""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 1 << 30 else f"{n / 2**20:.0f} MiB"
