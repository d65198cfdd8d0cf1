"""`FsRoot` (numad_infer/util/fsroot.py): reads inside a tree someone else captured follow
its own links but no link out of it, read only regular files, and stop at a limit. On
real files, links, FIFOs and devices made in a temporary directory."""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

import pytest

from numad_infer.util.atomicfile import NotRegularFile
from numad_infer.util.fsroot import SMALL, FsRoot


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A sysfs-like tree with its own relative links, and a secret beside (outside) it."""
    root = tmp_path / "capture"
    cpu = root / "sys/devices/system/cpu/cpu0"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text("1\n")
    node = root / "sys/devices/system/node/node0"
    node.mkdir(parents=True)
    (node / "cpu0").symlink_to("../../cpu/cpu0")  # as the kernel links them
    (node / "self").symlink_to(".")
    devices = root / "sys/bus/node/devices"
    devices.mkdir(parents=True)
    (devices / "node0").symlink_to("../../../devices/system/node/node0")
    (tmp_path / "secret").write_text("TOPSECRET\n")
    return root


def test_links_inside_the_tree_are_followed(tree: Path) -> None:
    fs = FsRoot(tree)
    assert fs.read(tree / "sys/devices/system/node/node0/cpu0/online") == b"1\n"
    assert fs.read(tree / "sys/bus/node/devices/node0/cpu0/online") == b"1\n"  # a link through a link
    assert fs.read(tree / "sys/bus/node/devices/node0/self/self/cpu0/online") == b"1\n"
    assert fs.is_dir(tree / "sys/bus/node/devices/node0") and sorted(fs.listdir(tree / "sys/bus/node/devices/node0")) == [
        "cpu0", "self"]


@pytest.mark.parametrize("target", ["{secret}", "../../../../../../secret", "../" * 12 + "etc/passwd"])
def test_a_link_out_of_the_tree_is_refused(tree: Path, target: str) -> None:
    governor = tree / "sys/devices/system/cpu/cpu0/scaling_governor"
    governor.symlink_to(target.format(secret=tree.parent / "secret"))
    with pytest.raises(NotRegularFile, match="leads out of"):
        FsRoot(tree).read(governor)


def test_a_directory_linked_out_of_the_tree_is_refused_for_listing_and_reading(tree: Path) -> None:
    (tree / "sys/devices/system/cpu/cpu1").symlink_to(tree.parent)
    fs = FsRoot(tree)
    for call in (fs.listdir, fs.is_dir):
        with pytest.raises(NotRegularFile):
            call(tree / "sys/devices/system/cpu/cpu1")
    with pytest.raises(NotRegularFile):
        fs.read(tree / "sys/devices/system/cpu/cpu1/secret")


def test_dangling_links_and_missing_files_are_absent_not_refused(tree: Path) -> None:
    (tree / "sys/devices/system/node/node1").symlink_to("../../../devices/nowhere")  # an offline node
    fs = FsRoot(tree)
    assert not fs.is_dir(tree / "sys/devices/system/node/node1")
    with pytest.raises(FileNotFoundError):
        fs.read(tree / "sys/devices/system/node/node1/cpulist")
    with pytest.raises(FileNotFoundError):
        fs.read(tree / "sys/devices/system/cpu/cpu0/missing")
    with pytest.raises(IsADirectoryError):
        fs.read(tree / "sys/devices/system/cpu/cpu0")


def test_a_loop_of_links_ends(tree: Path) -> None:
    (tree / "a").symlink_to("b")
    (tree / "b").symlink_to("a")
    with pytest.raises(OSError) as caught:
        FsRoot(tree).read(tree / "a")
    assert caught.value.errno == errno.ELOOP


@pytest.mark.parametrize("root", ["tree", "/"])
def test_a_fifo_is_refused_at_once_under_any_root(tree: Path, root: str) -> None:
    """No writer will come: a reader that opens it blocks for ever (`/` reads go the
    kernel's own way, and are refused by the file's type all the same)."""
    fifo = tree / "sys/devices/system/cpu/online"
    os.mkfifo(fifo)
    fs = FsRoot(tree if root == "tree" else "/")
    started = time.monotonic()
    with pytest.raises(NotRegularFile, match="not a regular file"):
        fs.read(fifo)
    assert time.monotonic() - started < 5


def test_a_device_in_the_tree_is_refused(tree: Path) -> None:
    zero = tree / "proc/meminfo"
    zero.parent.mkdir()
    try:
        os.mknod(zero, stat.S_IFCHR | 0o644, os.makedev(1, 5))  # /dev/zero's numbers
    except PermissionError:
        pytest.skip("mknod needs CAP_MKNOD")
    with pytest.raises(NotRegularFile, match="not a regular file"):
        FsRoot(tree).read(zero)


def test_reads_stop_at_the_limit(tree: Path) -> None:
    big = tree / "proc/cpuinfo"
    big.parent.mkdir()
    with big.open("wb") as handle:
        handle.truncate(1 << 30)  # 1 GiB, sparse: reading it whole would take the memory
    fs = FsRoot(tree)
    with pytest.raises(NotRegularFile, match=f"larger than {SMALL} bytes"):
        fs.read(big)
    assert len(fs.read(big, whole=False)) == SMALL  # only the start wanted (a command line)


def test_a_component_that_is_a_file_is_not_a_directory(tree: Path) -> None:
    with pytest.raises(NotADirectoryError):
        FsRoot(tree).read(tree / "sys/devices/system/cpu/cpu0/online/more")
