"""numa-infer under a container runtime's seccomp profile, with a real filter (libseccomp).

Kubernetes' RuntimeDefault profile (containerd's, the same as Docker's) allows
set_mempolicy and mbind only with CAP_SYS_NICE, which numa-infer's DaemonSet does not
give, and refuses migrate_pages everywhere; podman's default refuses only the migration.
The VM suite runs the image under podman, so the stricter profile is tried here: the
daemon and its servers run under the same refusals a pod would give them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import seccomp
from tests.daemon_harness import ROOT, daemons, generated_model

pytestmark = pytest.mark.skipif(not seccomp.available(), reason="needs libseccomp (libseccomp2)")


def probe_under(refused: tuple[str, ...]) -> str:
    code = ("from tests import seccomp; seccomp.refuse(%r)\n"
            "from numad_infer.host import pinning; c = pinning.memory_calls(); print(c.bind_refused, c.migrate_refused)"
            % (refused,))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return done.stdout.strip()


def test_the_probe_tells_which_memory_calls_a_profile_refuses() -> None:
    assert probe_under(()) == "None None"
    assert probe_under(seccomp.PODMAN_DEFAULT) == "None Operation not permitted"
    assert probe_under(seccomp.RUNTIME_DEFAULT) == "Operation not permitted Operation not permitted"


def test_under_kubernetes_runtime_default_the_instances_start_pinned_and_status_says_memory_is_not_bound(
        tmp_path: Path) -> None:
    # Before: set_mempolicy failed in the child between fork and exec, so no instance ever
    # started (a crash loop, every instance), under the profile the DaemonSet asks for.
    with daemons(tmp_path, generated_model("tiny")) as start:
        run = start(seccomp_refuse=seccomp.RUNTIME_DEFAULT)
        state = run.all_healthy(2)
        for instance in state["instances"]:
            # Still pinned: sched_setaffinity is allowed by every profile.
            assert os.sched_getaffinity(instance["pid"]) == set(instance["cpus"]), instance
        warnings = " ".join(state["daemon"]["warnings"])
        assert "set_mempolicy is refused" in warnings and "seccomp" in warnings, warnings
        assert "migrate_pages is refused" in warnings, warnings
        # `check` says the same, where an operator runs it first (in the same pod).
        checked = subprocess.run(
            [sys.executable, "-m", "numad_infer", "--config", str(run.config), "--fsroot", str(run.fsroot),
             "check", "--backend", "process"], capture_output=True, text=True, cwd=ROOT,
            preexec_fn=lambda: seccomp.refuse(seccomp.RUNTIME_DEFAULT))
        assert "set_mempolicy is refused" in checked.stdout + checked.stderr, checked
        # A request is answered.
        import json
        import urllib.request
        port = state["instances"][0]["port"]
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "numa", "max_tokens": 2}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert answer.status == 200


def test_under_podmans_default_the_memory_bind_is_kept_and_only_repair_is_named(tmp_path: Path) -> None:
    with daemons(tmp_path, generated_model("tiny")) as start:
        run = start(seccomp_refuse=seccomp.PODMAN_DEFAULT)
        state = run.all_healthy(2)
        warnings = " ".join(state["daemon"]["warnings"])
        assert "migrate_pages is refused" in warnings and "set_mempolicy" not in warnings, warnings
        for instance in state["instances"]:
            policy = Path(f"/proc/{instance['pid']}/numa_maps").read_text().splitlines()[0]
            assert "bind:" in policy, policy  # set_mempolicy worked in the child


def test_the_warnings_name_the_call_what_it_costs_and_where_the_fix_is() -> None:
    from numad_infer.host.identity import BackendKind
    from numad_infer.host.pinning import MemoryCalls
    from numad_infer.validate.host_check import memory_call_warnings

    assert memory_call_warnings(MemoryCalls(None, None), BackendKind.PROCESS) == []
    both = memory_call_warnings(MemoryCalls("Operation not permitted", "Operation not permitted"), BackendKind.PROCESS)
    assert len(both) == 2 and all("docs/kubernetes.md" in w for w in both)
    assert "not bound" in both[0] and "first touch" in both[0]
    assert "not repaired" in both[1]
    # Under systemd, systemd binds the instances (NUMAPolicy=): only the repair is the daemon's.
    assert memory_call_warnings(MemoryCalls("Operation not permitted", None), BackendKind.SYSTEMD) == []


def test_under_numa_infers_own_localhost_profile_both_memory_calls_are_allowed() -> None:
    """deploy/kubernetes/seccomp/numa-infer.json's allow list as a real filter (every other
    call refused), with the daemon's own probe: binding and migration both work, and Python
    and numa-infer run under it at all."""
    import json

    profile = json.loads((ROOT / "deploy/kubernetes/seccomp/numa-infer.json").read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    # Unconditional allows only: a capability the pod lacks, or another architecture, gives nothing.
    allowed = tuple(sorted({n for rule in profile["syscalls"] if rule["action"] == "SCMP_ACT_ALLOW"
                            and not (rule.get("includes") or {}).get("caps") and not rule.get("args")
                            and "amd64" in (rule.get("includes") or {}).get("arches", ["amd64"])
                            for n in rule["names"]}))
    refused = {n for rule in profile["syscalls"] if rule["action"] == "SCMP_ACT_ERRNO" and not rule.get("includes")
               and not rule.get("excludes") for n in rule["names"]}
    memory = {"get_mempolicy", "set_mempolicy", "mbind", "migrate_pages", "move_pages"}
    assert memory <= set(allowed) and not memory & refused
    code = ("from tests import seccomp; seccomp.allow_only(%r)\n"
            "from numad_infer.host import pinning; c = pinning.memory_calls(); print(c.bind_refused, c.migrate_refused)"
            % (allowed + ("personality", "socket"),))  # allowed there for the argument values Python uses
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None None"
