"""The daemon's re-plan (numad_infer/daemon/desired.py, one pass of daemon/loop.py) over
fakes: whatever goes wrong in it (a refusal, or a bug no NumaInferError explains) keeps
the running plan and its instances, is logged, and shows in status as a refused reload
does. Before (issue 30): a ZeroDivisionError from the model's header, raised by the
re-plan after a CPU hotplug, ended the main loop and with it the supervision."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from numad_infer.backends.process import ProcessFrontdoorRunner
from numad_infer.daemon import desired
from numad_infer.daemon.loop import Daemon
from numad_infer.errors import ConfigError
from numad_infer.host.identity import BackendKind
from numad_infer.plan.placement import make_plan
from numad_infer.topology.cgroup_limits import UNRESTRICTED
from numad_infer.validate.loaded import Loaded
from tests.fakes import RecordingBackend, cfg, loaded_for, served_of, three_nodes


class Backend(RecordingBackend):
    kind = BackendKind.PROCESS

    def frontdoor_runner(self, run_dir: Path) -> ProcessFrontdoorRunner:
        return ProcessFrontdoorRunner(run_dir, None, None)  # never started: the front door is off here


class Sysfs:
    """The CPUs online, as the test sets them; or the error reading them raises."""

    def __init__(self, online: frozenset[int]) -> None:
        self.online: frozenset[int] | Exception = online

    def online_cpus(self) -> frozenset[int]:
        if isinstance(self.online, Exception):
            raise self.online
        return self.online


class Running:
    """A daemon that applied a plan for three nodes and supervises its instances."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        config = cfg('[frontend]\nlisten = ""')
        self.loaded = loaded_for(config, make_plan(config, three_nodes(), served=served_of(config)))
        self.backend = Backend()
        # The pipeline's seam (desired.Validation): this machine's model file and cgroup
        # are not the test's.
        self.daemon = Daemon(str(tmp_path / "numa-infer.toml"), str(tmp_path), self.backend, tmp_path / "state.json",
                             validation=self)
        assert self.daemon.plan.apply(self.loaded, "start")
        self.sysfs = Sysfs(self.loaded.topology.online_cpus)
        self.daemon.plan.sysfs = self.sysfs  # type: ignore[assignment]
        self.loads: list[str] = []
        self.load_error: Exception | None = None
        self.monitored: list[float] = []
        monkeypatch.setattr(self.daemon.reconciler, "monitor", self.monitored.append)
        self.current = lambda: self.loaded.artifacts  # the model and engine files are the ones loaded
        self.backend.calls.clear()

    # -- desired.Validation ------------------------------------------------------------------
    def load(self, source, kind, sysfs, running, frontdoor) -> Loaded:
        self.loads.append("load")
        if self.load_error is not None:
            raise self.load_error
        return self.loaded

    def allowed(self, kind):
        return UNRESTRICTED

    def artifacts(self, served, engine) -> str:
        return self.current()

    def assert_still_running_the_old_plan(self) -> None:
        assert self.daemon.plan.loaded is self.loaded
        assert set(self.daemon.reconciler.runtimes) == {"infer@0", "infer@1", "infer@2"}
        assert self.backend.calls == []  # nothing stopped or restarted

    def status_error(self, now: float) -> tuple[str, str | None]:
        last = self.daemon.snapshot(now).daemon.last_reload
        assert last is not None and not last.ok
        return last.why, last.error


@pytest.fixture
def running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Running:
    return Running(tmp_path, monkeypatch)


def test_a_bug_in_the_re_plan_after_a_hotplug_keeps_the_old_plan_and_shows_in_status(
        running: Running, caplog: pytest.LogCaptureFixture) -> None:
    running.sysfs.online = frozenset({0, 1})  # CPU 2 went offline
    running.load_error = ZeroDivisionError("integer division or modulo by zero")  # the header reader's, before
    with caplog.at_level(logging.ERROR):
        running.daemon.monitor_pass(10.0)
    running.assert_still_running_the_old_plan()
    assert running.monitored == [10.0]  # the instances are still supervised
    assert running.status_error(10.0) == ("cpu hotplug", "internal error: ZeroDivisionError: integer division or "
                                                         "modulo by zero")
    assert "config error, running previous plan: internal error: ZeroDivisionError" in running.daemon.status_line()
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.getMessage().startswith("the machine changed and the configuration no longer fits: internal error")
    assert record.exc_info is not None  # a bug: its traceback is in the log
    running.daemon.monitor_pass(20.0)
    assert running.loads == ["load"] and running.monitored == [10.0, 20.0]  # tried once, not at every pass


def test_a_refused_re_plan_is_logged_without_a_traceback(running: Running, caplog: pytest.LogCaptureFixture) -> None:
    running.sysfs.online = frozenset({0, 1})
    running.load_error = ConfigError("/etc/numa-infer.toml", "model.path", "general.alignment is 0", "/m.gguf", True)
    with caplog.at_level(logging.ERROR):
        running.daemon.monitor_pass(10.0)
    running.assert_still_running_the_old_plan()
    assert running.status_error(10.0) == ("cpu hotplug", str(running.load_error))
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.exc_info is None  # an operator's error: one line, the fix in it


def test_a_machine_check_that_raises_keeps_the_old_plan_logs_once_and_shows_in_status(
        running: Running, caplog: pytest.LogCaptureFixture) -> None:
    running.sysfs.online = ValueError("invalid literal for int() with base 10: 'x'")  # a bug reading sysfs
    with caplog.at_level(logging.ERROR):
        for now in (10.0, 20.0, 30.0):
            running.daemon.monitor_pass(now)
    running.assert_still_running_the_old_plan()
    assert running.monitored == [10.0, 20.0, 30.0] and running.loads == []
    assert running.status_error(30.0) == ("machine check", "internal error: ValueError: invalid literal for int() "
                                                           "with base 10: 'x'")
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None  # once, with the traceback
    assert errors[0].getMessage().startswith("machine check failed, still running the previous plan")
    # Fixed (the same CPUs again): nothing to re-plan, and a later failure is logged again.
    running.sysfs.online = running.loaded.topology.online_cpus
    running.daemon.monitor_pass(40.0)
    running.sysfs.online = ValueError("invalid literal for int() with base 10: 'x'")
    with caplog.at_level(logging.ERROR):
        running.daemon.monitor_pass(50.0)
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 2


def test_a_bug_in_rolling_out_a_changed_model_keeps_the_old_plan_and_shows_in_status(running: Running) -> None:
    running.current = lambda: "model /m.gguf: 1:2:3:4"  # another file moved into place
    running.load_error = RecursionError("maximum recursion depth exceeded")
    running.daemon.monitor_pass(10.0)  # noticed: waits until the file holds still
    assert running.loads == []
    running.daemon.monitor_pass(10.0 + desired.SETTLE_S)
    running.assert_still_running_the_old_plan()
    assert running.status_error(20.0) == ("model or engine changed",
                                          "internal error: RecursionError: maximum recursion depth exceeded")
    running.daemon.monitor_pass(30.0)
    assert running.loads == ["load"]  # the same file is not tried again until it changes
    # A bug before the pipeline (the engine's program path, a plugin's) is caught the same way.
    running.current = lambda: str(1 // 0)
    running.daemon.monitor_pass(40.0)
    running.assert_still_running_the_old_plan()
    assert running.status_error(40.0) == ("model or engine check",
                                          "internal error: ZeroDivisionError: integer division or modulo by zero")


def test_the_daemon_holds_one_applied_value_and_a_reload_moves_it_everywhere_at_once(
        running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37: the plan's state reads the reconciler's applied value, the one `Loaded`, and
    keeps none of its own: a reload moves everything to the new one at once, and one that
    cannot be applied leaves the previous one applied everywhere."""
    plan, reconciler = running.daemon.plan, running.daemon.reconciler
    assert plan.loaded is reconciler.loaded is running.loaded
    config = cfg('[frontend]\nlisten = ""\n[tuning]\nprobe_timeout_s = 3')
    running.loaded = reloaded = loaded_for(config, make_plan(config, three_nodes(), served=served_of(config)))
    plan.reload()
    assert plan.loaded is reconciler.loaded is reloaded and plan.config is reloaded.config
    config = cfg('[frontend]\nlisten = ""\n[tuning]\nprobe_timeout_s = 4')
    running.loaded = loaded_for(config, make_plan(config, three_nodes(), served=served_of(config)))

    def refuse(loaded: Loaded) -> bool:
        raise OSError("Read-only file system")  # the definitions cannot be written

    monkeypatch.setattr(running.backend, "sync", refuse)
    plan.reload()
    assert plan.last_reload is not None and not plan.last_reload.ok
    assert plan.loaded is reconciler.loaded is reloaded


def _config_ok(running: Running) -> float:
    from numad_infer.status.metrics import SnapshotCollector
    assert running.daemon.latest is not None
    snapshot = running.daemon.latest
    (family,) = [m for m in SnapshotCollector(lambda: snapshot).collect() if m.name == "numa_infer_config_ok"]
    return float(family.samples[0].value)


@pytest.mark.parametrize("broken", ["refused", "unreadable"])
def test_the_original_model_moved_back_clears_the_error_the_bad_one_left(running: Running, broken: str) -> None:
    """A non-GGUF file moved over the model (refused), then the original moved back (the
    same inode, size and time: the identity the instances loaded). Before: status said
    `config error ... is not a GGUF model file` and numa_infer_config_ok stayed 0 until a
    reload; the daemon saw the applied identity, "unchanged", and never judged it again."""
    applied = running.loaded.artifacts
    not_gguf = ConfigError("/etc/numa-infer.toml", "model.path", "is not a GGUF model file (llama.cpp loads only GGUF)",
                           "/m.gguf", True)
    if broken == "refused":
        running.current = lambda: "model /m.gguf: 9:9:9:9"  # the bad file, moved into place
        running.load_error = not_gguf
        running.daemon.monitor_pass(10.0)
        running.daemon.monitor_pass(10.0 + desired.SETTLE_S)
        assert running.status_error(20.0) == ("model or engine changed", str(not_gguf))
    else:  # the model moved away for a while: reading its identity fails
        def gone() -> str:
            raise ConfigError("/etc/numa-infer.toml", "model.path", "file not found", "/m.gguf", True)
        running.current = gone
        running.daemon.monitor_pass(10.0)
        running.daemon.monitor_pass(10.0 + desired.SETTLE_S)
        assert running.status_error(20.0)[0] == "model or engine check"
    assert "config error, running previous plan" in running.daemon.status_line()
    assert _config_ok(running) == 0.0
    running.assert_still_running_the_old_plan()
    # The original moved back: the next pass judges it again and clears the error.
    running.current = lambda: applied
    running.load_error = None
    generation = running.daemon.plan.generation
    running.daemon.monitor_pass(30.0)
    last = running.daemon.snapshot(30.0).daemon.last_reload
    assert last is not None and last.ok and last.error is None
    assert "config error" not in running.daemon.status_line()
    assert _config_ok(running) == 1.0
    assert running.daemon.plan.generation == generation + 1
    assert set(running.daemon.reconciler.runtimes) == {"infer@0", "infer@1", "infer@2"}
    assert last.changed == () and last.added == () and last.removed == ()  # nothing restarted
    loads = list(running.loads)
    running.daemon.monitor_pass(40.0)  # and it is not judged again at every pass
    assert running.loads == loads


def test_the_original_back_but_still_refused_is_judged_once(running: Running) -> None:
    applied = running.loaded.artifacts
    running.current = lambda: "model /m.gguf: 9:9:9:9"
    running.load_error = ConfigError("/etc/numa-infer.toml", "model.path", "is not a GGUF model file", "/m.gguf", True)
    running.daemon.monitor_pass(10.0)
    running.daemon.monitor_pass(10.0 + desired.SETTLE_S)
    running.current = lambda: applied  # back, but the configuration itself no longer loads
    running.daemon.monitor_pass(20.0)
    running.daemon.monitor_pass(30.0)
    assert running.loads == ["load", "load"]
    assert running.status_error(30.0)[1] is not None
    running.assert_still_running_the_old_plan()


def test_a_reload_that_changed_only_tenants_or_keys_says_so(
        running: Running, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Before: `reload: 3 instance(s): added none, changed none, removed none, ...` when a
    tenant's key was rotated and HAProxy reloaded: as if the reload had done nothing."""
    monkeypatch.setattr(running.daemon.frontdoor, "apply", lambda *args: True)  # HAProxy reloaded
    with caplog.at_level(logging.INFO):
        assert running.daemon.plan.apply(running.loaded, "reload")
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("reload: ")]
    assert line == ("reload: 3 instance(s): no instance changed (unchanged infer@0, infer@1, infer@2); "
                    "front door: tenants, keys or routing changed, HAProxy reloaded")
    assert "added none" not in line
    monkeypatch.setattr(running.daemon.frontdoor, "apply", lambda *args: False)  # nothing at all changed
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert running.daemon.plan.apply(running.loaded, "reload")
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("reload: ")]
    assert line == "reload: 3 instance(s): no instance changed (unchanged infer@0, infer@1, infer@2)"


def test_the_change_summary_names_instances_and_the_front_door() -> None:
    from numad_infer.plan.model import PlanDiff
    diff = PlanDiff(("infer@2",), ("infer@0",), (), ("infer@1",))
    assert desired.change_summary(diff, False) == "added infer@2, changed infer@0, removed none, unchanged infer@1"
    assert desired.change_summary(diff, True).endswith("; front door: tenants, keys or routing changed, HAProxy "
                                                       "reloaded")
