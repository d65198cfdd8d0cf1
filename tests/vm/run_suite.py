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
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vm"))
from scenarios import GROUPS, TOPOLOGY  # noqa: E402  (scenario names, to notice a scenario that never reported)

# The "deb" group installs numa-infer from its Debian package instead of the wheel.
WHEEL_SETUP = """/opt/llm/bin/pip install -q --no-deps --no-index /mnt/share/dist/*.whl
sed 's#/usr/bin/numa-infer#/opt/llm/bin/numa-infer#g' /mnt/share/numa-infer.service > /etc/systemd/system/numa-infer.service
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
    shutil.copy(ROOT / "packaging/systemd/numa-infer.service", work / "numa-infer.service")
    shutil.copy(ROOT / "debian/numa-infer.sysusers", work / "numa-infer.sysusers")

    failed = False
    for group in groups:
        share = work / f"share-{group}"
        share.mkdir()
        for item in ("dist", "tiny.gguf", "scenarios.py", "numa-infer.service", "numa-infer.sysusers"):
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
            subprocess.run([str(python), str(ROOT / "tools/make_model.py"), str(share / "bench.gguf"), "--size", "small"],
                           check=True, stdout=subprocess.DEVNULL)
        (share / "test.sh").write_text(GUEST_TEST.format(group=group, setup="" if group == "deb" else WHEEL_SETUP))
        (share / "test.sh").chmod(0o755)
        started = time.monotonic()
        for attempt in (1, 2):
            # `podman load` of the image alone takes minutes under TCG on a busy host; tune and
            # the chaos soak together take 15.
            long_guest = group in ("container", "tune-chaos")
            guest_env = dict(env, VM_TIMEOUT=env.get("VM_TIMEOUT", "1500")) if long_guest else env
            proc, serial = run_guest(share, TOPOLOGY[group], guest_env)
            # The guest mounts the 9p share once boot completes; once in a while virtio-9p is
            # not there yet ("9pnet_virtio: no channels available"): nothing ran, so boot again.
            if attempt == 1 and proc.returncode == 99 and "no share or no test.sh" in serial:
                print(f"--- {group}: the guest did not get its share (9p), booting once more", flush=True)
                continue
            # Under multi-threaded TCG the guest kernel once in a while oopses while it patches
            # its own code ("Oops: int3" in a static-key site, seen once so far in many hundred boots):
            # QEMU's emulation, not numa-infer. Say so, keep that log, and boot once more.
            if attempt == 1 and PANIC in serial:
                oops = next((l for l in serial.splitlines() if "Oops" in l), PANIC)
                kept = share / "serial-panic.log"
                (share / "serial.log").rename(kept)
                print(f"--- {group}: the guest kernel panicked ({oops.strip()}; {kept}), booting once more",
                      flush=True)
                continue
            break
        out = (share / "out.txt").read_text() if (share / "out.txt").exists() else ""
        lines = [l for l in out.splitlines() if re.match(r"^(PASS|FAIL) ", l)]
        print(f"--- {group}: guest ran {time.monotonic() - started:.0f}s (boot included), exit {proc.returncode}")
        for line in lines:
            print(line, flush=True)
        reported = {l.split()[1].rstrip(":") for l in lines}
        expected = [run.scenario_name for run in GROUPS[group]]
        missing = [n for n in expected if n not in reported]
        for name in missing:
            print(f"FAIL {name}: no result from the guest (exit {proc.returncode}); see {share}/serial.log")
        if any(l.startswith("FAIL") for l in lines) or missing or proc.returncode != 0:
            failed = True
            tail = out.splitlines()[-40:]
            print("guest output (tail):\n  " + "\n  ".join(tail))
            print(proc.stderr[-2000:])
            args.keep = True
    print(f"vm suite: {'FAILED' if failed else 'passed'} in {time.monotonic() - t0:.0f}s")
    if args.keep:
        print(f"logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


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
