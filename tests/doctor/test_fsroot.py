"""`doctor --fsroot DIR` on a tree someone else captured: what it reads stays inside the
tree. A link out of it is not followed (root would print /etc/shadow as a governor), a
FIFO does not hang it, /dev/zero does not eat the memory; the tree's own links, as sysfs
has them, still lead where they lead. Real links, FIFOs and devices in a temporary tree;
the command as an operator runs it (a subprocess with a timeout: a hang fails the test).
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from numad_infer.doctor.verdicts import Level
from tests.doctor import hosts as base

SECRET = "TOPSECRET-shadow-line"


def _outside(root: Path) -> Path:
    secret = root.parent / "shadow"
    secret.write_text(SECRET + "\n")
    return secret


def governors_linked_out(root: Path) -> None:
    """Every CPU's governor (and energy preference) a link to a file beside the tree."""
    secret = _outside(root)
    for cpu in range(128):
        for name in ("scaling_governor", "energy_performance_preference"):
            path = root / f"sys/devices/system/cpu/cpu{cpu}/cpufreq/{name}"
            path.unlink()
            path.symlink_to(secret if cpu % 2 else os.path.relpath(secret, path.parent))


def test_a_governor_linked_out_of_the_tree_is_told_not_printed(tmp_path: Path) -> None:
    check = base.doctor(tmp_path, governors_linked_out)["cpu governor"]
    assert (check.level, check.seen) == (Level.INFO, "no cpufreq")
    config, root = base.setup(tmp_path / "cli", governors_linked_out)
    for extra in ((), ("--json",)):
        proc = base.run_cli(config, root, *extra)
        assert SECRET not in proc.stdout + proc.stderr
        assert proc.returncode == 0, proc.stderr
        assert "not read" in proc.stderr and "leads out of" in proc.stderr and "Traceback" not in proc.stderr


def fifos(root: Path) -> None:
    for rel in ("proc/sys/kernel/numa_balancing", "sys/kernel/mm/transparent_hugepage/enabled", "proc/700/comm"):
        (root / rel).unlink()
        os.mkfifo(root / rel)


def test_fifos_in_the_tree_do_not_hang_doctor(tmp_path: Path) -> None:
    config, root = base.setup(tmp_path, fifos)
    started = time.monotonic()
    proc = base.run_cli(config, root)  # raises TimeoutExpired after 120 s: a read waiting for a writer
    assert time.monotonic() - started < 60
    assert "[  OK] kernel.numa_balancing: absent" in proc.stdout
    assert "[INFO] transparent_hugepage/enabled: absent" in proc.stdout
    assert proc.stderr.count("is not a regular file") == 3, proc.stderr


def endless(root: Path) -> None:
    """/proc/cpuinfo a link to /dev/zero, /proc/interrupts /dev/zero's own device node in
    the tree (where mknod is allowed), THP's defrag a sparse 1 GiB file."""
    (root / "proc/cpuinfo").unlink()
    (root / "proc/cpuinfo").symlink_to("/dev/zero")
    (root / "proc/interrupts").unlink()
    try:
        os.mknod(root / "proc/interrupts", stat.S_IFCHR | 0o644, os.makedev(1, 5))
    except PermissionError:
        (root / "proc/interrupts").symlink_to("../" * 20 + "dev/zero")
    with (root / "sys/kernel/mm/transparent_hugepage/defrag").open("wb") as handle:
        handle.truncate(1 << 30)


def test_endless_files_are_not_read_to_their_end(tmp_path: Path) -> None:
    config, root = base.setup(tmp_path, endless)
    proc = base.run_cli(config, root, "--json")
    assert proc.returncode in (0, 1), proc.stderr
    assert "/proc/cpuinfo leads out of" in proc.stderr
    assert "/transparent_hugepage/defrag is larger than" in proc.stderr
    assert "/proc/interrupts" in proc.stderr


def cpufreq_as_sysfs_links_it(root: Path) -> None:
    """As the kernel has it: cpuN/cpufreq -> ../cpufreq/policyN, one governor powersave."""
    cpus = root / "sys/devices/system/cpu"
    (cpus / "cpufreq").mkdir()
    for cpu in range(128):
        (cpus / f"cpu{cpu}/cpufreq").rename(cpus / f"cpufreq/policy{cpu}")
        (cpus / f"cpu{cpu}/cpufreq").symlink_to(f"../cpufreq/policy{cpu}")
    (cpus / "cpufreq/policy5/scaling_governor").write_text("powersave\n")


def test_links_inside_the_tree_are_still_followed(tmp_path: Path) -> None:
    check = base.doctor(tmp_path, cpufreq_as_sysfs_links_it)["cpu governor"]
    assert check.level == Level.WARN and check.seen == "performance,powersave (CPUs 5)"


def test_a_name_with_escapes_in_the_tree_is_printed_escaped(tmp_path: Path) -> None:
    """A captured /proc is someone else's too: an IRQ's action name (a directory's name)
    carrying ESC and a newline is still shown, escaped, on a line of doctor's own."""

    def named(root: Path) -> None:
        base.put(root, "proc/irq/30/effective_affinity_list", "2")  # an inference CPU: doctor names the IRQ
        (root / "proc/irq/30/eth0-rx-0").rename(root / "proc/irq/30/eth0\x1b[2J\n[  OK] forged")

    config, root = base.setup(tmp_path, named)
    proc = base.run_cli(config, root)
    assert "30 eth0\\x1b[2J\\n[  OK] forged" in proc.stdout
    assert "\x1b" not in proc.stdout + proc.stderr
    assert not any(line.startswith("[  OK] forged") for line in proc.stdout.splitlines())
