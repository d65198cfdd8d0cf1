"""A node's cores split between the instances of the models there: the one allocator for
both forms (the single `[model]` is one model with `instances_per_node` instances). Pure.

The split, per node, as the kubelet's CPU manager hands out exclusive CPUs:
1. the models with `cores_per_instance` take that many physical cores per instance;
2. the models without it share what is left evenly between all their instances there;
3. an instance of the running plan whose cores are still free and still as many keeps
   them: a reload that adds or removes one model leaves the others' processes alone;
4. each other instance then gets whole cores (SMT siblings stay together), inside one
   shared-L3 group where one has room for it (best fit: the fullest group that still holds
   it, so big instances keep whole groups), else the next free cores in L3 order.
No core is given twice, and the reserved ones were taken out before (placement.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from numad_infer.config.models import ServedModel
from numad_infer.errors import ConfigError
from numad_infer.plan.model import Instance
from numad_infer.topology.model import Node

if TYPE_CHECKING:
    from numad_infer.config.schema import ModelView

# One model's thread counts from its view (placement.py's `_thread_counts`).
ThreadStep = Callable[["ModelView", list[Instance], str, tuple[str, str]], list[Instance]]

Core = tuple[int, ...]


@dataclass(frozen=True)
class Want:
    """What one model asks of one node."""

    model: ServedModel
    instances: int  # instances_per_node
    cores: int  # cores per instance; 0: a share of what is left
    had: tuple[tuple[Core, ...], ...] = ()  # per instance, its cores in the running plan (kept if still right)


def instance_ident(model: str, node: int, k: int, per_node: int) -> str:
    """The instance's part of the unit name: `<model>-<node>` or `<model>-<node>.<k>`, and
    `<node>` or `<node>.<k>` for the single form's model (its key is ""). What follows the
    last `-` is always the node (node ids and k have no `-`), so two models' names never
    meet, whatever `-` their own names hold."""
    at = f"{node}" if per_node == 1 else f"{node}.{k}"
    return f"{model}-{at}" if model else at


def split_node(node: Node, cores: Sequence[Core], wants: Sequence[Want], source: str) -> list[list[list[Core]]]:
    """Per want (in order), its instances' cores on this node."""
    sized = sum(w.instances * w.cores for w in wants)
    shared = [w for w in wants if w.cores == 0]
    sharers = sum(w.instances for w in shared)
    if sized > len(cores) or (sharers and len(cores) - sized < sharers):
        if len(wants) == 1 and not sized:  # the value is one model's instances_per_node: show it
            raise ConfigError(source, _key_to_change(wants, False), _too_few(node, len(cores), wants, sized, sharers),
                              wants[0].instances, True)
        raise ConfigError(source, _key_to_change(wants, sized > len(cores)),
                          _too_few(node, len(cores), wants, sized, sharers))
    share, extra = divmod(len(cores) - sized, sharers) if sharers else (0, 0)
    sizes: list[list[int]] = []
    for w in wants:
        row = []
        for _ in range(w.instances):
            if w.cores:
                row.append(w.cores)
            else:
                row.append(share + (1 if extra > 0 else 0))
                extra -= 1
        sizes.append(row)
    groups = _free_groups(node, cores)
    result: list[list[list[Core]]] = [[[] for _ in row] for row in sizes]
    # Biggest first, so that the big instances get whole L3 groups; ties in the file's order.
    order = sorted(((size, i, j) for i, row in enumerate(sizes) for j, size in enumerate(row)),
                   key=lambda t: (-t[0], t[1], t[2]))
    free = {c for g in groups for c in g}
    for size, i, j in order:
        had = wants[i].had[j] if j < len(wants[i].had) else ()
        if len(had) == size and free.issuperset(had):
            result[i][j] = list(had)
            free -= set(had)
            for group in groups:
                group[:] = [c for c in group if c not in had]
    for size, i, j in order:
        if not result[i][j]:
            result[i][j] = _take(groups, size)
    return result


def _free_groups(node: Node, cores: Sequence[Core]) -> list[list[Core]]:
    """The usable cores, per shared-L3 group in the node's order (one group when unknown)."""
    usable = list(cores)
    grouped: list[list[Core]] = [[c for c in group if c in usable] for group in node.l3_groups]
    seen = {c for g in grouped for c in g}
    rest = [c for c in usable if c not in seen]
    return [g for g in [*grouped, rest] if g]


def _take(groups: list[list[Core]], size: int) -> list[Core]:
    fitting = [g for g in groups if len(g) >= size]
    if fitting:
        group = min(fitting, key=len)  # best fit; min keeps the first of equals (L3 order)
        taken, group[:] = group[:size], group[size:]
        return taken
    taken = []
    for group in groups:
        while group and len(taken) < size:
            taken.append(group.pop(0))
    return taken


def _key_to_change(wants: Sequence[Want], over: bool) -> str:
    """`over`: the models with cores_per_instance alone ask for more than the node has."""
    sized = [w for w in wants if w.cores]
    many = [w for w in wants if not w.cores and w.instances > 1]
    if sized and (over or not many):
        return f"{sized[-1].model.key}.cores_per_instance"
    return (many or list(wants))[-1].model.key_for("placement.instances_per_node")


def _too_few(node: Node, have: int, wants: Sequence[Want], sized: int, sharers: int) -> str:
    if len(wants) == 1 and not sized:  # one model sharing the node: nothing else to lower
        return f"node {node.id} has {have} usable core(s), fewer than {sharers} instances"
    asks = ", ".join(f"{w.model.name} {w.instances} x " + (f"{w.cores}" if w.cores else "a share")
                     for w in wants)
    if sized > have:
        need = f"the models with cores_per_instance ask for {sized}"
    else:
        need = (f"after the {sized} that cores_per_instance takes, {have - sized} are left for {sharers} "
                "instance(s) that share them (at least one core each)")
    return (f"node {node.id} has {have} usable physical core(s) ({asks}); {need}; lower cores_per_instance or "
            "instances_per_node, leave the node out of a model's nodes, or reserve fewer CPUs (placement.reserve_cpus)")


def each_models_threads(served: Sequence[ServedModel], instances: list[Instance], source: str,
                        step: ThreadStep) -> list[Instance]:
    """The thread step per model: each model's instances get its view's counts (its own
    `models[k].threads` and `threads_batch`, else `placement`'s), and a refusal names the key
    that set the count. The instances keep their order."""
    done: dict[str, Instance] = {}
    for model in served:
        keys = (model.key_for("placement.threads"), model.key_for("placement.threads_batch"))
        mine = [i for i in instances if i.model == model.ident]
        if mine:
            done |= {i.name: i for i in step(model.view, mine, source, keys)}
    return [done[i.name] for i in instances]
