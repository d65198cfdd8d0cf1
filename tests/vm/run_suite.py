#!/usr/bin/env python3
"""Host side of the VM end-to-end suite: image (cached), wheel, model, three boots.

    tests/vm/run_suite.py [--group 2x2|2x2smt|4x1 ...]

Builds (or reuses) the Debian 13 guest image (tests/vm/image.sh), builds numa-infer's
wheel and a tiny random-weight GGUF model, boots the guest under QEMU TCG once per
emulated topology and runs tests/vm/scenarios.py inside with real systemd. Prints the
guest's PASS/FAIL lines; exit status 1 if any scenario failed or did not report.
NUMA_INFER_SKIP_VM=1 skips the suite (it is never skipped silently).
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vm"))
from scenarios import GROUPS, TOPOLOGY  # noqa: E402  (scenario names, to notice a scenario that never reported)

# The "deb" group installs numa-infer from its Debian package instead of the wheel.
WHEEL_SETUP = """/opt/llm/bin/pip install -q --no-deps --no-index /mnt/share/dist/*.whl
sed 's#/usr/bin/numa-infer#/opt/llm/bin/numa-infer#g' /mnt/share/numa-infer.service > /etc/systemd/system/numa-infer.service
# The unit that holds the front door's port from boot, and the no-op it "activates".
cp /mnt/share/numa-infer-port.socket /mnt/share/numa-infer-port.service /etc/systemd/system/
# The users the package would make: the shipped unit names the front door's group.
systemd-sysusers /mnt/share/numa-infer.sysusers
systemctl daemon-reload
"""
GUEST_TEST = """#!/bin/bash
set -euo pipefail
{setup}
install -D -m 0644 /mnt/share/tiny.gguf /var/lib/numa-infer/models/tiny.gguf
chmod 0755 /var/lib/numa-infer /var/lib/numa-infer/models
rc=0
/opt/llm/bin/python /mnt/share/scenarios.py {group} || rc=$?
journalctl --no-pager -o short-monotonic > /mnt/share/journal.txt 2>&1 || true
exit $rc
"""


PANIC = "Kernel panic - not syncing"
# packaging/systemd/: what the wheel groups install as the package would.
PACKAGED_UNITS = ("numa-infer.service", "numa-infer-port.socket", "numa-infer-port.service")


def run_guest(share: Path, topology: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], str]:
    """Boot one guest; stop it at once if its kernel panics (QEMU would idle until VM_TIMEOUT).

    Returns the finished process and the guest's serial log."""
    serial_log = share / "serial.log"
    args = [str(HERE / "image.sh"), "run", str(share), topology]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(args, stdout=out, stderr=err, text=True, env=env, start_new_session=True)
        while proc.poll() is None:
            time.sleep(5)
            if serial_log.exists() and PANIC in serial_log.read_text(errors="replace"):
                time.sleep(2)  # let the panic's last lines reach the log
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(args, proc.returncode, out.read(), err.read())
    return done, serial_log.read_text(errors="replace") if serial_log.exists() else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", action="append", choices=sorted(GROUPS), help="topology group(s) to run (default: all)")
    parser.add_argument("--keep", action="store_true", help="keep the share directories (logs, journal)")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("NUMA_INFER_VM_JOBS", "2")),
                        help="guests run at once (default 2, or NUMA_INFER_VM_JOBS)")
    parser.add_argument("--more-jobs-when", metavar="FILE",
                        help="run one guest at a time until FILE exists, then --jobs (.ci/run: while pytest runs)")
    parser.add_argument("--prepare", action="store_true",
                        help="only build what is cached (the guest image, the container image's base) and exit: "
                             ".ci/run does this while pytest runs, so a machine without caches builds them "
                             "alongside the tests instead of after them")
    args = parser.parse_args()
    if os.environ.get("NUMA_INFER_SKIP_VM") == "1":
        print("SKIP vm suite: NUMA_INFER_SKIP_VM=1 is set")
        return 0
    groups = args.group or ["2x2", "2x2smt", "4x1", "engine", "container", "tune-chaos", "deb"]

    t0 = time.monotonic()
    python = ROOT / ".venv/bin/python"
    python = python if python.exists() else Path(sys.executable)
    env = dict(os.environ)
    if "NUMA_INFER_LLAMA_WHEEL" not in env:
        env["NUMA_INFER_LLAMA_WHEEL"] = str(llama_wheel(python))
    build = subprocess.run([str(HERE / "image.sh"), "build"], stdout=subprocess.PIPE, text=True, env=env)
    if build.returncode != 0:
        print("FAIL vm-image: tests/vm/image.sh build failed (see above)")
        return 1
    print(f"image ready in {time.monotonic() - t0:.0f}s: {build.stdout.strip().splitlines()[-1]}", flush=True)
    if args.prepare:
        if "container" in groups:
            t1 = time.monotonic()
            subprocess.run([str(ROOT / "scripts/build-image")], check=True, stdout=subprocess.DEVNULL)
            print(f"container image built in {time.monotonic() - t1:.0f}s", flush=True)
        return 0

    work = Path(tempfile.mkdtemp(prefix="numa-infer-vm-"))
    subprocess.run([str(python), "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work / "dist"), str(ROOT)],
                   check=True)
    subprocess.run([str(python), str(ROOT / "tools/make_model.py"), str(work / "tiny.gguf"), "--size", "tiny"], check=True,
                   stdout=subprocess.DEVNULL)
    shutil.copy(HERE / "scenarios.py", work / "scenarios.py")
    for unit in PACKAGED_UNITS:
        shutil.copy(ROOT / "packaging/systemd" / unit, work / unit)
    shutil.copy(ROOT / "debian/numa-infer.sysusers", work / "numa-infer.sysusers")

    # Guests side by side: under TCG a guest spends much of its time waiting (a model
    # load on one vCPU, a daemon's probe interval, a scenario's condition), so two share
    # this machine's cores well. Longest first, so the last to finish is a short one.
    jobs = max(1, args.jobs)
    order = sorted(groups, key=lambda g: -EXPECTED_S.get(g, 0))
    print(f"vm suite: {len(order)} group(s), {jobs} guest(s) at a time: {' '.join(order)}", flush=True)
    results: dict[str, GroupResult] = {}
    finished: queue.Queue[GroupResult] = queue.Queue()

    def worker(group: str) -> None:
        try:
            finished.put(run_group(group, work, python, env, jobs))
        except Exception as exc:  # a harness bug fails the group, visibly, and the others go on
            finished.put(GroupResult(group, 0.0, True, [f"FAIL {group}: the harness failed: {exc!r}"]))

    pending, running = list(order), set()
    while pending or running:
        # --more-jobs-when FILE: one guest until FILE exists (.ci/run: the tests are over),
        # so a guest never shares the machine with both pytest and another guest.
        allowed = jobs if args.more_jobs_when is None or Path(args.more_jobs_when).exists() else 1
        while pending and len(running) < allowed:
            group = pending.pop(0)
            running.add(group)
            print(f"vm suite: {group} started at {time.monotonic() - t0:.0f}s", flush=True)
            threading.Thread(target=worker, args=(group,), daemon=True).start()
        try:
            result = finished.get(timeout=5)
        except queue.Empty:
            continue
        running.discard(result.group)
        results[result.group] = result
        print("\n".join(result.report), flush=True)
    failed = any(r.failed for r in results.values())
    total = time.monotonic() - t0
    # The table that tests/vm/README.md keeps: each group's time, and the suite's.
    print("vm suite timings (boot included; guests ran side by side):")
    for group in order:
        r = results[group]
        print(f"  {group:<12} {r.seconds:6.0f}s  {'FAILED' if r.failed else 'passed'}")
    print(f"vm suite: {'FAILED' if failed else 'passed'} in {total:.0f}s")
    if args.keep or failed:
        print(f"logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


# Each group's time in the last measured CI run (tests/vm/README.md), alone on the machine:
# only the order of starting them, longest first.
EXPECTED_S = {"tune-chaos": 900, "2x2": 785, "deb": 680, "container": 510, "engine": 620, "2x2smt": 220, "4x1": 200}


@dataclass
class GroupResult:
    group: str
    seconds: float
    failed: bool
    report: list[str]


def stage(group: str, work: Path) -> Path:
    """The group's share: what every group gets, and what its scenarios need besides."""
    share = work / f"share-{group}"
    share.mkdir()
    for item in ("dist", "tiny.gguf", "scenarios.py", *PACKAGED_UNITS, "numa-infer.sysusers"):
        src = work / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, share / item)
    if group == "deb":
        build_debs(share / "debs")
    if group == "engine":
        # llama.cpp's llama-server, built from the pinned sdist (cached), through the share: the
        # whole directory, since the binary loads its libraries and one CPU variant from beside itself.
        built = subprocess.run([str(ROOT / "scripts/build-llama-server")], check=True, stdout=subprocess.PIPE,
                               text=True).stdout.strip().splitlines()[-1]
        shutil.copytree(Path(built).parent, share / "llama-server")
    if group == "container":
        (share / "image.txt").write_text(save_image(share / "numa-infer-image.tar"))
        shutil.copy(ROOT / "deploy/kubernetes/numa-infer.toml", share / "container.toml")
    if group in ("bench", "filter-cost"):
        subprocess.run([str(ROOT / ".venv/bin/python"), str(ROOT / "tools/make_model.py"), str(share / "bench.gguf"),
                        "--size", "small"], check=True, stdout=subprocess.DEVNULL)
    (share / "test.sh").write_text(GUEST_TEST.format(group=group, setup="" if group == "deb" else WHEEL_SETUP))
    (share / "test.sh").chmod(0o755)
    return share


def run_group(group: str, work: Path, python: Path, env: dict[str, str], jobs: int) -> GroupResult:
    """Stage one group's share, boot its guest (once more after a boot that never ran the
    test), and judge what it reported."""
    started = time.monotonic()
    report: list[str] = []
    try:
        share = stage(group, work)
    except (OSError, subprocess.CalledProcessError) as exc:
        return GroupResult(group, time.monotonic() - started, True, [f"FAIL {group}: staging its share failed: {exc}"])
    staged = time.monotonic() - started
    for attempt in (1, 2):
        # `podman load` of the image alone takes minutes under TCG on a busy host; tune and
        # the chaos soak together take 15. A guest beside another runs slower: each limit
        # is the guest's harness limit, not a scenario's, and grows with the guests at once.
        long_guest = group in ("container", "tune-chaos")
        limit = (1500 if long_guest else 900) * (1 if jobs == 1 else 1.6)
        guest_env = dict(env, VM_TIMEOUT=env.get("VM_TIMEOUT", str(int(limit))))
        proc, serial = run_guest(share, TOPOLOGY[group], guest_env)
        # The guest mounts the 9p share once boot completes; once in a while virtio-9p is
        # not there yet ("9pnet_virtio: no channels available"): nothing ran, so boot again.
        if attempt == 1 and proc.returncode == 99 and "no share or no test.sh" in serial:
            report.append(f"--- {group}: the guest did not get its share (9p), booting once more")
            continue
        # Under multi-threaded TCG the guest kernel once in a while oopses while it patches
        # its own code ("Oops: int3" in a static-key site, seen once so far in many hundred boots):
        # QEMU's emulation, not numa-infer. Say so, keep that log, and boot once more.
        if attempt == 1 and PANIC in serial:
            oops = next((l for l in serial.splitlines() if "Oops" in l), PANIC)
            kept = share / "serial-panic.log"
            (share / "serial.log").rename(kept)
            report.append(f"--- {group}: the guest kernel panicked ({oops.strip()}; {kept}), booting once more")
            continue
        break
    out = (share / "out.txt").read_text() if (share / "out.txt").exists() else ""
    lines = [l for l in out.splitlines() if re.match(r"^(PASS|FAIL) ", l)]
    seconds = time.monotonic() - started
    report.append(f"--- {group}: guest ran {seconds - staged:.0f}s (boot included; share staged in {staged:.0f}s), "
                  f"exit {proc.returncode}")
    report += lines
    reported = {l.split()[1].rstrip(":") for l in lines}
    expected = [run.scenario_name for run in GROUPS[group]]
    missing = [n for n in expected if n not in reported]
    for name in missing:
        report.append(f"FAIL {name}: no result from the guest (exit {proc.returncode}); see {share}/serial.log")
    failed = any(l.startswith("FAIL") for l in lines) or bool(missing) or proc.returncode != 0
    if failed:
        tail = out.splitlines()[-40:]
        report.append("guest output (tail):\n  " + "\n  ".join(tail))
        report.append(proc.stderr[-2000:])
    return GroupResult(group, seconds, failed, report)


def save_image(out: Path) -> str:
    """numa-infer's container image (scripts/build-image: cached base, this tree's code and
    llama-server), saved as an archive for `podman load` in the guest (it has no registry)."""
    t0 = time.monotonic()
    image = subprocess.run([str(ROOT / "scripts/build-image")], check=True, stdout=subprocess.PIPE,
                           text=True).stdout.strip().splitlines()[-1]
    # `podman load` of it takes 5-10 minutes under TCG on a busy 2-core host (451 s for this
    # gzip-compressed oci-archive, 607 s for the uncompressed docker-archive, one run each).
    subprocess.run(["podman", "save", "-q", "--format", "oci-archive", "-o", str(out), image], check=True)
    size = subprocess.run(["podman", "image", "inspect", "-f", "{{.Size}}", image], check=True, stdout=subprocess.PIPE,
                          text=True).stdout.strip()
    print(f"container image {image}: {int(size) / 1e6:.0f} MB, built and saved in {time.monotonic() - t0:.0f}s",
          flush=True)
    return image


def build_debs(out: Path) -> None:
    """The package as built now, and a rebuild with a higher version for the upgrade."""
    for version in (None, "0.1.0+1"):
        env = dict(os.environ, **({"NUMA_INFER_DEB_VERSION": version} if version else {}))
        subprocess.run([str(ROOT / "scripts/build-deb"), str(out)], check=True, env=env, stdout=subprocess.DEVNULL)


def llama_wheel(python: Path) -> Path:
    """The llama-cpp-python wheel that scripts/setup built and installed (one build, one place:
    its portable AVX2 flags are what TCG can run, and its CMAKE_ARGS file says so)."""
    pin = re.search(r'"llama-cpp-python\[server\]==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    cache = Path(os.environ.get("NUMA_INFER_CACHE", Path.home() / ".cache" / "numa-infer"))
    out = cache / "llama-wheel" / pin
    found = sorted(out.glob("llama_cpp_python-*.whl"))
    if not found:
        raise SystemExit(f"run_suite: no llama-cpp-python wheel in {out}: run scripts/setup first")
    return found[-1]


if __name__ == "__main__":
    sys.exit(main())
