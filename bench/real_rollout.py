#!/usr/bin/env python3
"""A roll-out onto a new model file with the models the size operators run (issue 60, part 3):
the real daemon (process backend), HAProxy and llama-server, one instance with both CPUs
(`placement.nodes = [0]` on a one-node topology that mirrors this host), the 1B- or
8B-class file of tools/make_model.py (Q4_K_M), under a steady trickle of requests through
the front door (2 clients one request after another, one of them streaming, end-of-sequence
suppressed so that each asks for exactly --tokens tokens).

The roll-out: the configuration is rewritten to name another file (a hard link to the same
GGUF under a new name: the daemon sees a changed instance, the page cache already holds the
weights) and `numa-infer reload` applies it, which restarts the instance as any roll-out does
(docs/frontdoor.md, "A restart made on purpose"). Two cases, each its own daemon:

- surge: no memory limit (the host has room for two copies): the daemon should start a
  second copy (`infer@0-surge`), send the requests to it while the instance restarts, then
  retire the copy. Measured: the phases status shows, the most llama-server processes at
  once, the time from the reload to the copy stopped, the peak RSS of the daemon's
  llama-servers together (sampled every 0.1 s), every request's outcome and the longest.
- hold: the daemon started inside a cgroup v1 memory directory of its own (its PID written
  there before it starts anything, so the instance and HAProxy are charged there too; the
  file read once from outside it first, so that its page cache is not charged there: v1's
  usage counts that cache; the daemon counted it as taken until this bench found it, and
  now counts the cgroup's inactive file pages as room).
  Once the instance serves, memory.limit_in_bytes is set to the usage then (daemon, HAProxy,
  one instance) plus half of the lesser of the plan's need + margin and the instance's RSS:
  room for the one copy, not for a second. The daemon should read the v1 limit and hold
  (requests wait in the front door while the instance restarts). Measured: what status said,
  how long no server was in rotation (from the status file, published every 0.5 s), the
  longest request (its wait included), the cgroup's peak usage (memory.max_usage_in_bytes),
  its failcnt and OOM kills, every request's outcome.

    NUMA_INFER_MODEL_CACHE=/var/tmp/numa-infer-models .venv/bin/python bench/real_rollout.py \\
        [--size 1b|8b] [--case surge|hold|both] [--context 2048] [--tokens 8]

Never in CI: the 8B file takes 16 minutes to make, each of its loads 10-21 s on 2 CPUs,
and the hold case needs root and a writable cgroup memory controller.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.memory import MiB, estimate_of  # noqa: E402
from numad_infer.lifecycle.surge import MARGIN_BYTES  # noqa: E402
from numad_infer.status.records import in_rotation  # noqa: E402
from tests import fakesys  # noqa: E402
from tests.daemon_harness import DaemonRun, daemons, generated_model, shared_dir  # noqa: E402
from tests.e2e.test_frontdoor import Load, MemoryCgroup, Outcome, healthy_behind_frontdoor, request  # noqa: E402

PLACEMENT = "nodes = [0]"
LOG_DIR = Path(tempfile.mkdtemp(prefix="numa-infer-bench-rollout-"))
GiB = 1 << 30


def this_host_as_one_node() -> fakesys.FakeMachine:
    """The harness's topology, but this host's: one node with every CPU and all its memory
    (the harness's default gives node 0 one CPU and 4 GiB, too little for an 8B)."""
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    total_kb = int(Path("/proc/meminfo").read_text().split()[1])
    return fakesys.FakeMachine(nodes={0: fakesys.FakeNode(cpus, total_kb, (10,))},
                               siblings=tuple((c,) for c in cpus), l3=(cpus,), offline=())


class Trickle(Load):
    """tests/e2e's Load with end-of-sequence suppressed: the generated models' random weights
    may end a completion early, which Outcome.complete would count as a failure."""

    def _client(self, port: int, stream: bool, count: int, max_tokens: int) -> None:
        for _ in range(count):
            if self._stop.is_set():
                return
            outcome = request(port, max_tokens, stream, body={"ignore_eos": True})
            with self._lock:
                self.outcomes.append(outcome)


@dataclass
class Watch:
    """Every 0.1 s: the status file (cover, rotation) and the RSS of the daemon's llama-servers."""

    run: DaemonRun
    phases: dict[str, float] = field(default_factory=dict)  # surge phase -> first seen
    covers: list[str] = field(default_factory=list)  # each distinct restart_cover said
    peak_rss: int = 0
    peak_servers: int = 0
    pids_seen: set[int] = field(default_factory=set)
    gaps: list[tuple[float, float]] = field(default_factory=list)  # [from, to) with no server in rotation
    rotations: list[tuple[float, str, str]] = field(default_factory=list)  # (when, instance's, copy's) as it changed
    _out_since: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Watch:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(5)
        if self._out_since is not None:
            self.gaps.append((self._out_since, time.monotonic()))

    def timeline(self, since: float) -> str:
        """The instance's and the copy's rotation as status showed them, from `since` on."""
        return ", ".join(f"{inst}/{copy} {when - since:+.1f}" for when, inst, copy in self.rotations if when >= since)

    def servers(self) -> list[psutil.Process]:
        try:
            return [p for p in psutil.Process(self.run.proc.pid).children(recursive=True)
                    if p.name() == "llama-server"]
        except psutil.Error:
            return []

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            servers = self.servers()
            rss = 0
            for proc in servers:
                try:
                    rss += proc.memory_info().rss
                    self.pids_seen.add(proc.pid)
                except psutil.Error:
                    pass
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_servers = max(self.peak_servers, len(servers))
            state = self.run.state()
            if not state or not state.get("instances"):
                continue
            inst = state["instances"][0]
            said = inst.get("restart_cover") or ""
            if said and (not self.covers or self.covers[-1] != said):
                self.covers.append(said)
            for phase in ("starting", "joining", "serving", "leaving", "done"):
                if f": {phase}" in said or f"({phase}" in said:
                    self.phases.setdefault(phase, time.monotonic())
            serving = in_rotation(inst.get("rotation")) or in_rotation(inst.get("copy_rotation"))
            now = time.monotonic()
            seen = (str(inst.get("rotation")), str(inst.get("copy_rotation")))
            if not self.rotations or self.rotations[-1][1:] != seen:
                self.rotations.append((now, *seen))
            if not serving and self._out_since is None:
                self._out_since = now
            elif serving and self._out_since is not None:
                self.gaps.append((self._out_since, now))
                self._out_since = None


def linked(source: Path, name: str) -> Path:
    """`source` under another name where the servers' user reads it: a hard link (the same
    inode, no copy: the page cache already holds it), a copy where the filesystem differs."""
    path = shared_dir() / name
    try:
        os.link(source, path)
    except OSError:
        path.write_bytes(source.read_bytes())
        path.chmod(0o644)
    return path


def into_page_cache(path: Path) -> None:
    """Read the file once from here (outside any cgroup of this bench): its pages are then
    charged to this process's cgroup, not to the bench's, whose usage counts the instance's
    own memory only."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def start_daemon(start: Callable[..., DaemonRun], context: int, cgroup: Path | None) -> DaemonRun:
    return start(engine="llama-server", placement=PLACEMENT, machine=this_host_as_one_node(), context_size=context,
                 cgroup=cgroup)


def kept_log(run: DaemonRun, case: str) -> str:
    """The daemon's log so far, also kept in the bench's log directory (the run's goes with it)."""
    text = (run.tmp / "daemon.log").read_text()
    (LOG_DIR / f"{case}-daemon.log").write_text(text)
    return text


def roll_out(run: DaemonRun, new_model: Path) -> tuple[float, str]:
    """Point the configuration at `new_model` and reload; (when the reload was sent, what it said)."""
    run.model = new_model
    run.write_config(placement=PLACEMENT)
    sent = time.monotonic()
    done = run.cli("reload", "--timeout", "120")
    if done.returncode != 0:
        raise SystemExit(f"reload failed: {done.stdout}{done.stderr}\n{run.logs()}")
    return sent, done.stdout.strip()


def requests_line(outcomes: list[Outcome], since: float) -> tuple[str, list[Outcome]]:
    failed = [o for o in outcomes if not o.complete]
    during = [o for o in outcomes if o.started + o.seconds >= since]
    seconds = sorted(o.seconds for o in outcomes)
    longest_during = max((o.seconds for o in during), default=0.0)
    before = [o.seconds for o in outcomes if o.started + o.seconds < since]
    return (f"{len(outcomes)} requests ({len(during)} ended after the roll-out began), {len(failed)} failed; "
            f"longest {longest_during:.2f} s (p50 {statistics.median(seconds):.2f} s; "
            f"p50 before the roll-out {statistics.median(before) if before else float('nan'):.2f} s)"), failed


def show_failed(failed: list[Outcome], acted: float) -> None:
    for o in failed[:10]:
        print(f"    failed: {'stream' if o.stream else 'plain'} sent at {o.started - acted:+.1f} s, status "
              f"{o.status}, {o.tokens}/{o.asked} tokens, finish {o.finish_reason}, {o.seconds:.1f} s: "
              f"{o.error[:200]}")


def serving_one(run: DaemonRun, clients: int, tokens: int) -> tuple[int, Load]:
    state = healthy_behind_frontdoor(run, count=1, timeout=600)
    (pid,) = [i["pid"] for i in state["instances"]]
    load = Trickle(run.frontend_port, clients=clients, per_client=100_000, max_tokens=tokens).start()
    run.wait(lambda s: (s["instances"][0].get("in_flight") or 0) > 0, 120, "requests in flight")
    time.sleep(5.0)  # a few requests answered before the roll-out
    return pid, load


def back(run: DaemonRun, old: int, surge: bool, timeout: float) -> dict[str, Any]:
    done = "its copy stopped" if surge else ""
    return run.wait(lambda s: s["instances"][0]["pid"] not in (None, old) and s["instances"][0]["state"] == "healthy"
                    and s["instances"][0].get("rotation") == "UP"
                    and done in (s["instances"][0].get("restart_cover") or ""), timeout, "the instance back")


@dataclass
class Rolled:
    """What one roll-out under the trickle gave: `sent` when the reload was sent (monotonic)."""
    sent: float
    said: str
    finished: float
    watch: Watch
    logs: str
    cover: str
    line: str
    failed: list[Outcome]


def roll_and_collect(run: DaemonRun, load: Load, old: int, second: Path, surge: bool) -> Rolled:
    """The roll-out onto `second` under the trickle, until the instance is back (a new
    process: `old` gone), 3 s more of serving, then every request's outcome."""
    watch = Watch(run).start()
    sent, said = roll_out(run, second)
    state = back(run, old, surge, 900)
    finished = time.monotonic()
    time.sleep(3.0)  # serving again under the trickle
    watch.stop()
    load.stop()
    outcomes = load.wait(600)
    line, failed = requests_line(outcomes, sent)
    return Rolled(sent, said, finished, watch, kept_log(run, "surge" if surge else "hold"),
                  state["instances"][0]["restart_cover"], line, failed)


def surge_case(source: Path, context: int, clients: int, tokens: int) -> None:
    first, second = linked(source, f"rollout-surge-{os.getpid()}-a.gguf"), linked(
        source, f"rollout-surge-{os.getpid()}-b.gguf")
    with tempfile.TemporaryDirectory() as tmp, daemons(Path(tmp), first) as start:
        run = start_daemon(start, context, None)
        old, load = serving_one(run, clients, tokens)
        one_rss = psutil.Process(old).memory_info().rss
        r = roll_and_collect(run, load, old, second, True)
        sent, said, finished, watch, logs, cover, line, failed = (r.sent, r.said, r.finished, r.watch, r.logs,
                                                                  r.cover, r.line, r.failed)
        phases = ", ".join(f"{p} +{t - sent:.1f} s" for p, t in sorted(watch.phases.items(), key=lambda kv: kv[1]))
        print(f"surge (no memory limit): `numa-infer reload` said: {said}")
        print(f"  cover: {cover}")
        print(f"  phases seen: {phases}")
        print(f"  journal: copy started {'yes' if 'surge: infer@0-surge started on port' in logs else 'NO'}, "
              f"surge over {'yes' if 'infer@0: surge over: infer@0-surge stopped' in logs else 'NO'}; "
              f"llama-servers at once: up to {watch.peak_servers}; processes seen {len(watch.pids_seen)}; "
              f"old pid {old} gone: {not psutil.pid_exists(old)}")
        print(f"  time from the reload to the copy stopped: {finished - sent:.1f} s")
        print(f"  RSS: one copy {one_rss / MiB:.0f} MiB; both copies together, peak {watch.peak_rss / MiB:.0f} MiB")
        gaps = [b - a for a, b in watch.gaps]
        print(f"  no server in rotation: {' + '.join(f'{g:.1f}' for g in gaps) or '0'} s")
        print(f"  rotation (instance/copy, s from the reload): {watch.timeline(sent)}")
        print(f"  requests: {line}")
        show_failed(failed, sent)


def _cgroup_file(where: Path, name: str) -> str:
    return (where / name).read_text().strip()


def _stat(where: Path) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in _cgroup_file(where, "memory.stat").splitlines())}


def _oom_kills(where: Path) -> str:
    """memory.oom_control's oom_kill count (kernels since 4.13), '?' where it has none."""
    said = dict(row.split() for row in _cgroup_file(where, "memory.oom_control").splitlines())
    return said.get("oom_kill", "?")


def hold_case(source: Path, context: int, clients: int, tokens: int) -> None:
    first, second = linked(source, f"rollout-hold-{os.getpid()}-a.gguf"), linked(
        source, f"rollout-hold-{os.getpid()}-b.gguf")
    need = estimate_of("llama-server", source, context, 1).total
    into_page_cache(source)
    cgroup = MemoryCgroup(64 * GiB)  # no limit to speak of until the instance serves
    if cgroup.base != Path("/sys/fs/cgroup/memory"):
        cgroup.remove()
        raise SystemExit(f"only cgroup v2 is writable here ({cgroup.where}): this bench measures v1")
    where = cgroup.where
    try:
        with tempfile.TemporaryDirectory() as tmp, daemons(Path(tmp), first) as start:
            run = start_daemon(start, context, where)
            old, load = serving_one(run, clients, tokens)
            one_rss = psutil.Process(old).memory_info().rss
            usage = int(_cgroup_file(where, "memory.usage_in_bytes"))
            stat = _stat(where)
            room = min(need + MARGIN_BYTES, one_rss) // 2
            limit = (usage + room) // MiB * MiB
            (where / "memory.limit_in_bytes").write_text(str(limit))
            (where / "memory.max_usage_in_bytes").write_text("0")  # the peak from here on
            oom_before = _oom_kills(where)
            print(f"hold (cgroup v1 {where}): plan's need {need / MiB:.0f} MiB (+ margin {MARGIN_BYTES / MiB:.0f}), "
                  f"the instance's RSS {one_rss / MiB:.0f} MiB; the cgroup's usage with it serving "
                  f"{usage / MiB:.0f} MiB (rss {stat['total_rss'] / MiB:.0f}, cache {stat['total_cache'] / MiB:.0f})")
            print(f"  memory.limit_in_bytes = {limit} ({limit / MiB:.0f} MiB): usage + {room / MiB:.0f} MiB, half the "
                  f"lesser of need + margin and one RSS: room for one copy, not two")
            r = roll_and_collect(run, load, old, second, False)
            sent, said, finished, watch, logs, cover, line, failed = (r.sent, r.said, r.finished, r.watch, r.logs,
                                                                      r.cover, r.line, r.failed)
            gaps = [b - a for a, b in watch.gaps]
            print(f"  `numa-infer reload` said: {said}")
            print(f"  cover: {cover}")
            print(f"  journal: copy started {'YES' if 'infer@0-surge' in logs else 'no'}; hold said "
                  f"{'yes' if 'hold: a second copy does not fit' in logs else 'NO'}; llama-servers at once: up to "
                  f"{watch.peak_servers}; old pid {old} gone: {not psutil.pid_exists(old)}")
            print(f"  time from the reload to the instance back in rotation: {finished - sent:.1f} s; no server in "
                  f"rotation (the hold): {' + '.join(f'{g:.1f}' for g in gaps) or '0'} s")
            print(f"  rotation (instance/copy, s from the reload): {watch.timeline(sent)}")
            print(f"  cgroup: peak usage {int(_cgroup_file(where, 'memory.max_usage_in_bytes')) / MiB:.0f} MiB of "
                  f"{limit / MiB:.0f}; failcnt {_cgroup_file(where, 'memory.failcnt')}; oom_kill "
                  f"{_oom_kills(where)} (before the roll-out: {oom_before}); "
                  f"llama-servers' RSS peak {watch.peak_rss / MiB:.0f} MiB")
            print(f"  requests: {line}")
            show_failed(failed, sent)
    finally:
        cgroup.remove()
        if where.exists():
            print(f"  (could not remove {where})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("1b", "8b"), default="1b")
    parser.add_argument("--case", choices=("surge", "hold", "both"), default="both")
    parser.add_argument("--context", type=int, default=2048, help="model.context_size (one slot)")
    parser.add_argument("--clients", type=int, default=2, help="clients one request after another (half stream)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens each request asks for")
    args = parser.parse_args()
    source = generated_model(args.size, "Q4_K_M")
    print(f"# host: {os.cpu_count()} CPUs, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / GiB:.0f} GiB; "
          f"{args.size} Q4_K_M ({source.stat().st_size / MiB:.0f} MiB), context {args.context}, one slot; "
          f"{args.clients} clients x {args.tokens} tokens through the front door; daemon logs in {LOG_DIR}", flush=True)
    if args.case in ("surge", "both"):
        surge_case(source, args.context, args.clients, args.tokens)
    if args.case in ("hold", "both"):
        hold_case(source, args.context, args.clients, args.tokens)


if __name__ == "__main__":
    main()
