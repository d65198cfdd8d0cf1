"""The topology reader (numad_infer/topology/sysfs.py) on a tree someone else captured
(--fsroot): its own links are followed as before, a link out of it or a FIFO in it is an
error naming the file, never read and never waited on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from numad_infer.errors import TopologyError
from numad_infer.topology.sysfs import read_topology
from tests import fakesys


def topology_cli(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "numad_infer", "--fsroot", str(root), "topology"],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return fakesys.write_tree(tmp_path / "fs", fakesys.dual_socket_smt())


def test_nodes_reached_through_links_inside_the_tree_are_read(root: Path) -> None:
    """As on a real host: /sys/bus/node/devices/nodeN -> ../../../devices/system/node/nodeN,
    and no other way to the nodes."""
    before = read_topology(root)
    nodes = root / "sys/devices/system/node"
    (root / "sys/devices/system/nodes-real").mkdir()
    devices = root / "sys/bus/node/devices"
    devices.mkdir(parents=True)
    for node in (0, 1):
        (nodes / f"node{node}").rename(root / f"sys/devices/system/nodes-real/node{node}")
        (devices / f"node{node}").symlink_to(f"../../../devices/system/nodes-real/node{node}")
    assert read_topology(root) == before


def test_a_node_linked_out_of_the_tree_is_an_error_naming_it(root: Path, tmp_path: Path) -> None:
    elsewhere = fakesys.write_tree(tmp_path / "other", fakesys.dual_socket_smt())
    node = root / "sys/devices/system/node/node1"
    os.rename(node, tmp_path / "moved")
    node.symlink_to(elsewhere / "sys/devices/system/node/node1")
    with pytest.raises(TopologyError, match="node1 leads out of"):
        read_topology(root)
    proc = topology_cli(root)
    assert proc.returncode == 1 and "leads out of" in proc.stderr and "Traceback" not in proc.stderr


def test_a_fifo_in_the_tree_is_an_error_at_once(root: Path) -> None:
    online = root / "sys/devices/system/cpu/online"
    online.unlink()
    os.mkfifo(online)
    proc = topology_cli(root)  # TimeoutExpired if the reader waits for a writer
    assert proc.returncode == 1 and "online is not a regular file" in proc.stderr, proc.stderr
