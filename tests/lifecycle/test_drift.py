"""Drift verdicts (numad_infer/lifecycle/drift.py) and what /proc gives them
(host/procfs.py): expected vs observed, pure, tables of inputs."""

from __future__ import annotations

from numad_infer.host.proc_types import NodeUsage, ThreadInfo
from numad_infer.host.procfs import parse_numa_maps, parse_numa_stat
from numad_infer.lifecycle.drift import check_affinity, check_memory

CPUS = frozenset({4, 5, 6, 7})


def thread(tid: int, allowed: set[int], last: int | None) -> ThreadInfo:
    return ThreadInfo(tid, f"t{tid}", frozenset(allowed), last)


def test_openmp_narrow_masks_are_not_drift() -> None:
    verdict = check_affinity(CPUS, [thread(1, {4}, 4), thread(2, {5}, 5), thread(3, CPUS, 6)], {})
    assert verdict.drifted == () and verdict.good_masks == {1: {4}, 2: {5}, 3: CPUS}


def test_drifted_thread_gets_back_its_last_good_mask_not_the_whole_set() -> None:
    verdict = check_affinity(CPUS, [thread(2, {0, 1}, 0)], {2: frozenset({5})})
    (d,) = verdict.drifted
    assert d.tid == 2 and d.target == {5}


def test_drifted_thread_without_history_gets_the_instance_cpus() -> None:
    (d,) = check_affinity(CPUS, [thread(9, {0}, 0)], {}).drifted
    assert d.target == CPUS


def test_thread_that_last_ran_outside_is_drift_even_with_a_good_mask() -> None:
    (d,) = check_affinity(CPUS, [thread(3, {6}, 1)], {}).drifted
    assert d.target == {6}


NUMA_MAPS = """\
55d0c0000000 default file=/usr/bin/python3.11 mapped=100 N0=100 kernelpagesize_kB=4
55d0c0400000 default file=/usr/bin/python3.11 anon=5 dirty=5 N1=5 kernelpagesize_kB=4
55d0c1000000 default heap anon=1000 dirty=1000 N0=900 N1=100 kernelpagesize_kB=4
7f0000000000 bind:0 anon=2 dirty=2 N0=2 kernelpagesize_kB=2048
7fff00000000 default stack anon=3 dirty=3 N0=3 kernelpagesize_kB=4
"""


def test_numa_maps_separates_anonymous_memory_from_page_cache() -> None:
    usage = parse_numa_maps(NUMA_MAPS)
    assert usage.file == {0: 100 * 4096}
    assert usage.anon == {0: 903 * 4096 + 2 * 2 * 2**20, 1: 105 * 4096}


def test_numa_stat_is_read_in_bytes() -> None:
    usage = parse_numa_stat("anon N0=1000 N1=3000\nfile N0=5 N1=0\nkernel N0=1\n")
    assert usage.anon == {0: 1000, 1: 3000} and usage.file == {0: 5, 1: 0}


def test_memory_below_threshold_is_drift_and_page_cache_is_reported_apart() -> None:
    usage = NodeUsage(anon={0: 850, 1: 150}, file={0: 10, 1: 90}, source="numa_maps")
    verdict = check_memory(usage, frozenset({0}), 0.9)
    assert verdict.drifted and verdict.local_fraction == 0.85 and verdict.remote_nodes == (1,) and verdict.remote_bytes == 150
    assert verdict.file_local_fraction == 0.1
    assert not check_memory(NodeUsage(anon={0: 950, 1: 50}), frozenset({0}), 0.9).drifted
    assert check_memory(NodeUsage(), frozenset({0}), 0.9).local_fraction is None
