"""numa-infer's topology agrees with hwloc's (`--disallowed`) on every real capture and here.

The captures are hwloc's own test inputs (tests/data/topologies, BSD-3-Clause).
hwloc-nox must be installed (.ci/run installs it): without the oracle this test fails
rather than skipping, because agreeing with hwloc is a requirement, not an extra.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from numad_infer.errors import TopologyError
from numad_infer.topology.sysfs import read_topology
from tests import hwloc_oracle
from tests.conftest import capture_names

# Captures hwloc itself cannot read as Linux sysfs (it aborts Linux discovery and
# describes the host it runs on instead): numa-infer must refuse them clearly.
UNREADABLE = {"test1.fsroot"}

# AMD Bulldozer-family "compute units": the kernel reports the two integer cores of a
# module as thread siblings (they share one FPU), hwloc splits them into two Cores.
# For FPU-bound inference the kernel's grouping is the right one, so there the
# rule is weaker: every hwloc core lies inside one of ours.
KERNEL_GROUPING_STANDS = {"64amd64-4s2n4ca2co"}


def compare(fsroot: Path, name: str) -> None:
    view = hwloc_oracle.read(str(fsroot))
    topo = read_topology(fsroot)
    ours = {n.id: frozenset(n.cpus) for n in topo.nodes if n.cpus}
    theirs = {n: c for n, c in hwloc_oracle.owned_cpus(view).items() if c}
    assert ours == theirs, f"{name}: node -> online CPUs differ"
    used = frozenset().union(*ours.values())
    our_cores = {frozenset(core) for n in topo.nodes for core in n.cores}
    their_cores = {core & used for core in view.cores if core & used}
    if name in KERNEL_GROUPING_STANDS:
        assert our_cores != their_cores, f"{name}: no longer differs; drop it from KERNEL_GROUPING_STANDS"
        for core in their_cores:
            assert any(core <= ours_ for ours_ in our_cores), f"{name}: hwloc core {sorted(core)} split across ours"
    else:
        assert our_cores == their_cores, f"{name}: thread-sibling groups differ"


@pytest.mark.parametrize("name", capture_names())
def test_capture_agrees_with_hwloc(captures: dict[str, Path], name: str) -> None:
    fsroot = captures[name]
    if name in UNREADABLE:
        with pytest.raises(TopologyError, match="not a Linux filesystem root"):
            read_topology(fsroot)
        return
    compare(fsroot, name)


def test_this_machine_agrees_with_hwloc() -> None:
    compare(Path("/"), "this machine")


def test_every_capture_is_exercised() -> None:
    # Guards against an empty glob making the parametrized test vacuous.
    assert len(capture_names()) >= 40
