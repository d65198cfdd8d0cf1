"""backends/systemd.py: instances as template units driven through systemctl. What `sync`
writes (the units validation rendered) and when it reloads systemd, what its specs are made
of, which unit each call names, how it reads the instances' states, and whether the
daemon's own stop is a restart (instances kept) or a stop.

systemd is not PID 1 on these hosts, so systemctl is a stand-in script that records its
arguments and prints what the real one prints; the real systemctl runs in the VM suite
(tests/vm). Units go to a temporary directory, never /etc/systemd/system."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from numad_infer.backends.systemd import SystemdBackend
from numad_infer.host.identity import BackendKind
from numad_infer.plan.placement import make_plan
from numad_infer.systemd.systemctl import Systemctl
from tests.fakes import cfg, loaded_for, three_nodes


SHOW = """Id=infer@0.service
MainPID=4242
ActiveState=active
SubState=running

Id=infer@1.service
MainPID=0
ActiveState=activating
SubState=auto-restart

Id=infer@2.service
MainPID=0
ActiveState=failed
SubState=failed
"""



def fake_systemctl(tmp_path: Path, stdout: str) -> Systemctl:
    script = tmp_path / "systemctl"
    (tmp_path / "out.txt").write_text(stdout)
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/calls\ncat {tmp_path}/out.txt\n")
    script.chmod(0o755)
    return Systemctl(binary=str(script))



def test_one_systemctl_call_observes_every_instance(tmp_path: Path) -> None:
    backend = SystemdBackend(fake_systemctl(tmp_path, SHOW))
    seen = backend.observe(["infer@0", "infer@1", "infer@2"])
    assert (seen["infer@0"].pid, seen["infer@0"].pending) == (4242, False)
    assert (seen["infer@1"].pid, seen["infer@1"].pending, seen["infer@1"].description) == (None, True, "activating (auto-restart)")
    assert (seen["infer@2"].pid, seen["infer@2"].pending) == (None, False)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == ["show --property=Id,MainPID,ActiveState,SubState -- infer@0.service infer@1.service infer@2.service"]



def test_restart_job_of_the_daemon_keeps_instances(tmp_path: Path) -> None:
    jobs = "1234 numa-infer.service restart running\n1240 infer@0.service start waiting\n"
    assert SystemdBackend(fake_systemctl(tmp_path, jobs)).stop_all_on_exit() is False
    (tmp_path / "calls").unlink()
    assert SystemdBackend(fake_systemctl(tmp_path, "1234 numa-infer.service stop running\n")).stop_all_on_exit() is True



def test_a_failed_systemctl_show_is_an_error_not_stopped_instances(tmp_path: Path) -> None:
    from numad_infer.systemd.systemctl import SystemctlError

    script = tmp_path / "systemctl"
    script.write_text("#!/bin/sh\necho 'Failed to get properties: Connection reset by peer' >&2\nexit 1\n")
    script.chmod(0o755)
    with pytest.raises(SystemctlError):
        SystemdBackend(Systemctl(binary=str(script))).observe(["infer@0"])
    with pytest.raises(SystemctlError, match="no state for infer@1"):
        SystemdBackend(fake_systemctl(tmp_path, SHOW.split("\n\n")[0])).observe(["infer@0", "infer@1"])



def sequenced_systemctl(tmp_path: Path, answers: list[tuple[int, str]]) -> Systemctl:
    """A systemctl whose Nth call exits with answers[N][0] and prints answers[N][1] (the last
    repeats); exit status -15 means killed by SIGTERM, as systemd does to a child of ours."""
    for i, (rc, out) in enumerate(answers):
        (tmp_path / f"out{i}").write_text(out)
        (tmp_path / f"rc{i}").write_text(str(rc))
    last = len(answers) - 1
    script = tmp_path / "systemctl"
    script.write_text(f"""#!/bin/sh
n=$(cat {tmp_path}/n 2>/dev/null || echo 0)
echo $((n + 1)) > {tmp_path}/n
[ "$n" -gt {last} ] && n={last}
rc=$(cat {tmp_path}/rc$n)
[ "$rc" = -15 ] && kill -TERM $$
cat {tmp_path}/out$n
exit $rc
""")
    script.chmod(0o755)
    return Systemctl(binary=str(script))



def calls(tmp_path: Path) -> int:
    return int((tmp_path / "n").read_text())



def test_restart_job_seen_on_a_second_look_keeps_instances(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # systemd SIGTERMs every process in the daemon's cgroup, a list-jobs forked right after
    # the daemon's own SIGTERM included (reproduced in the VM). A killed, failed or empty
    # list-jobs is looked at again: reading it as "stop" would take every instance down on a
    # plain `systemctl restart numa-infer`.
    answers = [(-15, ""), (1, ""), (0, ""), (0, "7 numa-infer.service restart running\n")]
    with caplog.at_level(logging.INFO, logger="numad_infer"):
        assert SystemdBackend(sequenced_systemctl(tmp_path, answers)).stop_all_on_exit(pause_s=0) is False
    assert calls(tmp_path) == 4
    assert "list-jobs --plain --no-legend --full: killed by SIGTERM: looking again" in caplog.text



def test_no_job_at_all_is_a_stop_from_outside_systemd(tmp_path: Path) -> None:
    systemctl = sequenced_systemctl(tmp_path, [(0, "9 infer@0.service start waiting\n")])
    assert SystemdBackend(systemctl).stop_all_on_exit(looks=3, pause_s=0) is True
    assert calls(tmp_path) == 3



def test_systemctl_failing_every_time_is_an_error(tmp_path: Path) -> None:
    from numad_infer.systemd.systemctl import SystemctlError

    with pytest.raises(SystemctlError, match="list-jobs"):
        SystemdBackend(sequenced_systemctl(tmp_path, [(1, "")])).stop_all_on_exit(looks=2, pause_s=0)
