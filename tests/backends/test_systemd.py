"""backends/systemd.py: instances as template units driven through systemctl. What `sync`
writes (the units validation rendered) and when it reloads systemd, what its specs are made
of, which unit each call names, how it reads the instances' states, and whether the
daemon's own stop is a restart (instances kept) or a stop.

systemd is not PID 1 on these hosts, so systemctl is a stand-in script that records its
arguments and prints what the real one prints; the real systemctl runs in the VM suite
(tests/vm). Units go to a temporary directory, never /etc/systemd/system."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from numad_infer.backends.systemd import SystemdBackend
from numad_infer.host.identity import BackendKind
from numad_infer.plan.placement import make_plan
from numad_infer.systemd.systemctl import Systemctl
from tests.fakes import cfg, loaded_for, served_of, three_nodes


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


def systemd_loaded(unit_dir: Path, extra: str = ""):
    config = cfg(f'[tuning]\nunit_dir = "{unit_dir}"\n{extra}')
    return loaded_for(config, make_plan(config, three_nodes(), served=served_of(config)), kind=BackendKind.SYSTEMD)


def on_disk(unit_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(unit_dir)): p.read_text() for p in sorted(unit_dir.rglob("*")) if p.is_file()}


def recorded(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls"
    return path.read_text().splitlines() if path.exists() else []


def test_sync_writes_the_units_validation_rendered_and_reloads_systemd_only_on_a_change(tmp_path: Path) -> None:
    unit_dir = tmp_path / "units"
    backend = SystemdBackend(fake_systemctl(tmp_path, ""))
    loaded = systemd_loaded(unit_dir)
    assert "infer@.service" in loaded.units and "infer@2.service.d/50-numa-infer.conf" in loaded.units
    assert backend.sync(loaded) is True
    assert on_disk(unit_dir) == loaded.units
    assert recorded(tmp_path) == ["daemon-reload"]
    assert backend.sync(loaded) is False  # the same units: nothing written, no reload
    assert recorded(tmp_path) == ["daemon-reload"]
    # What is written is the value handed in, not units rendered again from the configuration.
    dropin = "infer@1.service.d/50-numa-infer.conf"
    edited = dataclasses.replace(loaded, units={**loaded.units, dropin: loaded.units[dropin] + "# edited\n"})
    assert backend.sync(edited) is True
    assert on_disk(unit_dir)[dropin].endswith("# edited\n") and recorded(tmp_path) == ["daemon-reload"] * 2
    # A node dropped: its instance's drop-in goes with the next sync.
    fewer = systemd_loaded(unit_dir, "[placement]\nnodes = [0, 1]\n")
    assert backend.sync(fewer) is True
    assert on_disk(unit_dir) == fewer.units and "infer@2.service.d/50-numa-infer.conf" not in on_disk(unit_dir)
    assert recorded(tmp_path) == ["daemon-reload"] * 3


def test_the_specs_are_the_rendered_template_and_each_instances_drop_in(tmp_path: Path) -> None:
    loaded = systemd_loaded(tmp_path / "units")
    backend = SystemdBackend(fake_systemctl(tmp_path, ""))
    specs = backend.specs(loaded)
    dropin = "infer@1.service.d/50-numa-infer.conf"
    edited = backend.specs(dataclasses.replace(loaded, units={**loaded.units, dropin: loaded.units[dropin] + "#\n"}))
    assert [n for n in specs if specs[n] != edited[n]] == ["infer@1"]
    template = backend.specs(dataclasses.replace(
        loaded, units={**loaded.units, "infer@.service": loaded.units["infer@.service"] + "#\n"}))
    assert all(template[n] != specs[n] for n in specs)  # a template change changes every instance
    keyed = backend.specs(dataclasses.replace(loaded, api_key="k-NEW"))
    assert all(keyed[n] != specs[n] for n in specs)  # so does a new key, which no unit carries
    assert all("k-NEW" not in spec for spec in keyed.values())


def test_the_units_a_sync_wrote_are_what_a_restarted_daemon_adopts(tmp_path: Path) -> None:
    loaded = systemd_loaded(tmp_path / "units")
    backend = SystemdBackend(fake_systemctl(tmp_path, ""))
    assert backend.current_specs(loaded) == {}  # nothing written yet: nothing to adopt
    backend.sync(loaded)
    assert SystemdBackend(fake_systemctl(tmp_path, "")).current_specs(loaded) == backend.specs(loaded)


def test_start_stop_and_restart_name_the_instances_unit(tmp_path: Path) -> None:
    backend = SystemdBackend(fake_systemctl(tmp_path, ""))
    conf = cfg()
    instance = make_plan(conf, three_nodes(), served=served_of(conf)).instances[1]
    backend.start(instance)
    backend.stop("infer@2")
    backend.restart(instance)
    assert recorded(tmp_path) == ["start --no-block -- infer@1.service", "stop -- infer@2.service",
                                  "restart --no-block -- infer@1.service"]


def test_forget_removes_the_units_it_wrote_and_reloads_systemd(tmp_path: Path) -> None:
    unit_dir = tmp_path / "units"
    backend = SystemdBackend(fake_systemctl(tmp_path, ""))
    loaded = systemd_loaded(unit_dir)
    backend.sync(loaded)
    (unit_dir / "operator.service").write_text("[Service]\nExecStart=/bin/true\n")  # not ours: left alone
    backend.forget(loaded.config)
    assert on_disk(unit_dir) == {"operator.service": "[Service]\nExecStart=/bin/true\n"}
    assert recorded(tmp_path) == ["daemon-reload", "daemon-reload"]


def test_before_each_start_an_instance_that_keeps_its_slots_gets_its_directory_of_the_group(tmp_path: Path) -> None:
    import grp
    import os
    import stat

    # A group other than the one mkdir gives, which this user may give its own directory.
    others = [g for g in os.getgroups() if g != os.getgid()]
    if os.geteuid() == 0:  # root may give it any group
        others.append(next(g.gr_gid for g in grp.getgrall() if g.gr_gid != os.getgid()))
    if not others:
        pytest.skip("this user is in no group but its own: nothing to give the directory")
    gid = others[-1]
    group = grp.getgrgid(gid).gr_name
    backend = SystemdBackend(fake_systemctl(tmp_path, ""), slots_dir=tmp_path / "slots")
    conf = cfg()
    instance = make_plan(conf, three_nodes(), served=served_of(conf)).instances[1]
    backend.start(instance)  # not synced with a configuration that keeps slots: nothing made
    assert not (tmp_path / "slots").exists()
    backend.sync(dataclasses.replace(systemd_loaded(tmp_path / "units"), slots_group=group))
    backend.start(instance)
    made = (tmp_path / "slots/infer-1").stat()
    # The server (a DynamicUser in the group) writes; the daemon, its owner, reads and removes.
    assert (stat.S_IMODE(made.st_mode), made.st_gid) == (0o770, gid)
    os.chmod(tmp_path / "slots/infer-1", 0o700)  # changed by hand: set again before a restart
    backend.restart(instance)
    assert stat.S_IMODE((tmp_path / "slots/infer-1").stat().st_mode) == 0o770
    assert recorded(tmp_path)[-2:] == ["start --no-block -- infer@1.service", "restart --no-block -- infer@1.service"]


def test_a_surges_copy_is_a_unit_of_the_template_with_the_instances_drop_in_on_its_own_port(tmp_path: Path) -> None:
    """supervision/surge.py: the copy runs in the template's sandbox, pinned as the instance,
    on another port; its drop-in is there while it runs and goes when it stops, and a sync
    meanwhile (a reload) keeps it."""
    unit_dir = tmp_path / "units"
    backend = SystemdBackend(fake_systemctl(tmp_path, ""))
    loaded = systemd_loaded(unit_dir)
    backend.sync(loaded)
    instance = loaded.plan.instances[1]
    copy = dataclasses.replace(instance, name="infer@1-surge", port=41234)
    backend.start_copy(copy)
    written = on_disk(unit_dir)["infer@1-surge.service.d/50-numa-infer.conf"]
    mine = loaded.units["infer@1.service.d/50-numa-infer.conf"]
    assert written.replace("41234", str(instance.port)).replace("infer@1-surge", "infer@1") == mine
    assert '"--port" "41234"' in written and "CPUAffinity=1\n" in written
    assert recorded(tmp_path) == ["daemon-reload", "daemon-reload", "start --no-block -- infer@1-surge.service"]
    assert backend.sync(loaded) is False  # a reload meanwhile leaves the copy's drop-in
    backend.stop("infer@1-surge")
    assert on_disk(unit_dir) == loaded.units
    assert recorded(tmp_path)[-2:] == ["stop -- infer@1-surge.service", "daemon-reload"]
    backend.stop("infer@1")  # an instance's stop writes nothing
    assert recorded(tmp_path)[-1] == "stop -- infer@1.service"
