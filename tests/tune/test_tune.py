"""`numa-infer tune`: the grid, the choice and its noise verdict (fed known measurements),
the thread keys in the planner, `--apply`'s file edit, and tune end to end on the fake
2-node machine (real servers, real holds against a running daemon)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from numad_infer.config.load import parse_config
from numad_infer.errors import ConfigError
from numad_infer.plan.placement import make_plan
from numad_infer.topology.sysfs import read_topology
from numad_infer.tune.choice import Candidate, Figure, Report, Result, Verdict, choose, format_report, thread_grid
from numad_infer.tune.config_edit import Edit, apply_edits, edited_text
from tests import fakesys
from tests.fakes import served_of
from tests.tune.harness import checked_setup

ROOT = Path(__file__).resolve().parents[2]


def result(threads: int, decode: tuple[float, ...], prompt: tuple[float, ...] = (100.0, 100.0, 100.0)) -> Result:
    return Result(Candidate(threads, "t"), Figure(decode), Figure(prompt))


def test_the_grid_has_physical_cores_smt_and_a_few_below() -> None:
    assert [c.threads for c in thread_grid(32, 64)] == [64, 32, 31, 30, 24, 16]
    assert [c.threads for c in thread_grid(32, 64, quick=True)] == [64, 32, 31]
    assert [c.threads for c in thread_grid(2, 2)] == [2, 1]
    assert [c.threads for c in thread_grid(1, 1)] == [1]
    assert thread_grid(32, 64)[0].label == "SMT siblings too"


def test_the_winner_is_the_best_measured_candidate_and_a_clear_margin_changes_the_setting() -> None:
    results = [result(64, (80, 81, 79)), result(32, (100, 101, 99)), result(31, (104, 105, 103)), result(16, (60, 61, 59))]
    choice = choose(results, "placement.threads", "decode", current=32)
    assert (choice.winner, choice.verdict, choice.value) == (31, Verdict.CHANGE, 31)
    assert choice.margin == pytest.approx(0.04) and choice.noise == pytest.approx(0.01)


def test_a_margin_within_the_noise_keeps_the_current_setting() -> None:
    results = [result(32, (90, 100, 110)), result(31, (95, 104, 106))]
    choice = choose(results, "placement.threads", "decode", current=32)
    assert choice.winner == 31 and choice.verdict == Verdict.KEEP and choice.value == 32
    assert choice.margin == pytest.approx(0.04) and choice.noise == pytest.approx(0.1)
    report = Report("m.gguf", 2**30, 2**29, "llama-cpp-python", 0, (0, 1), {(0, 0): Figure((20.0, 21.0))}, results, [choice])
    text = format_report(report)
    assert "within the noise (±10.0%); keep the current setting" in text
    assert json.loads(json.dumps(report.to_json()))["choices"][0]["verdict"] == "keep"


def test_prompt_threads_are_chosen_by_prompt_speed_apart_from_decode() -> None:
    results = [result(64, (80, 80, 80), (300, 301, 299)), result(32, (100, 100, 100), (200, 200, 200))]
    assert choose(results, "placement.threads", "decode", current=32).value == 32
    assert choose(results, "placement.threads_batch", "prompt", current=32).value == 64


def test_the_current_setting_must_have_been_measured() -> None:
    with pytest.raises(ValueError, match="was not measured"):
        choose([result(8, (1, 1))], "placement.threads", "decode", current=16)


def test_thread_keys_are_checked_against_the_plan(tmp_path: Path) -> None:
    topo = read_topology(fakesys.write_tree(tmp_path / "fs", fakesys.dual_socket_smt()))

    def plan(placement: str):
        conf = parse_config(f'[model]\npath = "/m.gguf"\n[placement]\n{placement}', "/etc/x.toml")
        return make_plan(conf, topo, source="/etc/x.toml", served=served_of(conf))

    auto = plan("").instances[0]
    assert (auto.threads, auto.threads_batch) == (32, 32)
    tuned = plan("threads = 31\nthreads_batch = 24").instances[0]
    assert (tuned.threads, tuned.threads_batch) == (31, 24)
    with pytest.raises(ConfigError, match=r"placement.threads = 33: infer@0 has only 32 CPUs \(one per physical core "
                                          r"with smt = false; smt = true counts SMT siblings too\)"):
        plan("threads = 33")
    assert plan("smt = true\nthreads_batch = 64").instances[0].threads_batch == 64
    with pytest.raises(ConfigError, match="placement.threads_batch = 65"):
        plan("smt = true\nthreads_batch = 65")


def test_layouts_and_their_choice() -> None:
    from numad_infer.tune.choice import Layout, LayoutResult, choose_layout, layouts, percentile

    assert [lay.name for lay in layouts(4, 16)] == ["per-node x1", "per-node x4", "interleave"]
    assert [lay.name for lay in layouts(1, 8)] == ["per-node x1", "per-node x2", "interleave"]
    assert [lay.name for lay in layouts(1, 2)] == ["per-node x1", "interleave"]
    one, four, inter = layouts(4, 16)
    results = [LayoutResult(one, 2, 8, Figure((100, 102, 98)), 1.0, 1.2),
               LayoutResult(four, 8, 8, Figure((130, 131, 129)), 0.8, 0.9),
               LayoutResult(inter, 1, 8, Figure((60, 61, 59)), 2.0, 2.4)]
    best, margin, noise, verdict = choose_layout(results, one)
    assert best.layout == four and verdict == Verdict.CHANGE and margin == pytest.approx(0.3)
    noisy = [LayoutResult(one, 2, 8, Figure((80, 100, 120)), 1, 1), LayoutResult(four, 8, 8, Figure((105, 106)), 1, 1)]
    assert choose_layout(noisy, one)[3] == Verdict.KEEP
    assert percentile([1.0, 2.0, 3.0, 4.0, 100.0], 0.5) == 3.0 and percentile([1.0, 2.0, 100.0], 0.99) == 100.0
    assert Layout("interleave", 1, "x").name == "interleave"


CONFIG = """# numa-infer on this box; tuned by hand in 2025
[model]
path = "/m.gguf"   # the 8B model

[placement]
smt = false        # A/B tested: off is faster here
# threads = 30

[server]
base_port = 9000
"""


def test_apply_edits_the_file_keeping_comments_and_a_backup(tmp_path: Path) -> None:
    path = tmp_path / "numa-infer.toml"
    path.write_text(CONFIG)
    path.chmod(0o640)
    topo = read_topology(fakesys.write_tree(tmp_path / "fs", fakesys.dual_socket_smt()))
    backup = apply_edits(path, [Edit("placement", "threads", 31), Edit("placement", "threads_batch", 32)],
                         lambda cfg: make_plan(cfg, topo, served=served_of(cfg)) and None)
    text = path.read_text()
    for kept in ("# numa-infer on this box; tuned by hand in 2025", 'path = "/m.gguf"   # the 8B model',
                 "smt = false        # A/B tested: off is faster here", "# threads = 30", "base_port = 9000"):
        assert kept in text
    assert parse_config(text, "x").placement.threads == 31 and parse_config(text, "x").placement.threads_batch == 32
    assert backup.read_text() == CONFIG and oct(path.stat().st_mode & 0o777) == "0o640"
    # A section that is not there yet is added.
    assert "[placement]\nthreads = 4" in edited_text('[model]\npath = "/m.gguf"\n', [Edit("placement", "threads", 4)])


def test_apply_refuses_a_result_the_plan_refuses_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "numa-infer.toml"
    path.write_text(CONFIG)
    topo = read_topology(fakesys.write_tree(tmp_path / "fs", fakesys.dual_socket_smt()))
    with pytest.raises(ConfigError, match=r"the tuned settings were refused, nothing written: placement.threads = 64: "):
        apply_edits(path, [Edit("placement", "threads", 64)],
                    lambda cfg: make_plan(cfg, topo, served=served_of(cfg)) and None)
    assert path.read_text() == CONFIG and list(tmp_path.glob("*.bak")) == []


def _numa_infer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "numad_infer", "--backend", "process", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("edits, refusal", [
    # Only the engine's own check refuses this (the schema and the plan accept it).
    ([Edit("server", "engine", "llama-server"), Edit("server", "llama_server", "/bin/true")],
     "server.llama_server = \"/bin/true\": is not llama.cpp's llama-server"),
    # Only the unit-name check refuses this: e2fsprogs' e2scrub@.service would be shadowed.
    ([Edit("tuning", "unit_template", "e2scrub")], "tuning.unit_template = \"e2scrub\": /"),
])
def test_tune_apply_refuses_exactly_what_check_refuses_and_writes_nothing(tmp_path: Path, edits, refusal) -> None:
    from numad_infer.host.identity import BackendKind
    from numad_infer.tune.run import write_tuned

    if edits[0].key == "unit_template" and not Path("/lib/systemd/system/e2scrub@.service").exists():
        pytest.skip("no e2scrub@.service on this host to shadow")
    path, fsroot = checked_setup(tmp_path)
    before = path.read_text()
    assert _numa_infer("--config", str(path), "--fsroot", str(fsroot), "check").returncode == 0
    # What `check` says of the edited file ...
    edited = tmp_path / "edited.toml"
    edited.write_text(edited_text(before, edits))
    checked = _numa_infer("--config", str(edited), "--fsroot", str(fsroot), "check")
    assert checked.returncode == 1 and refusal in checked.stderr, checked.stderr
    reason = checked.stderr.strip().removeprefix(f"numa-infer: {edited}: ")
    # ... is what `tune --apply` says, and the file is left as it was, with no backup.
    with pytest.raises(ConfigError) as refused:
        write_tuned(str(path), str(fsroot), BackendKind.PROCESS, edits)
    assert str(refused.value) == f"{path}: the tuned settings were refused, nothing written: {reason}"
    assert path.read_text() == before and list(tmp_path.glob("*.bak")) == []


# -- end to end: real servers (llama-cpp-python, tiny model), the daemon's holds -------------------

from tests.daemon_harness import daemons, generated_model  # noqa: E402


def tune(run, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "numad_infer", "--config", str(run.config), "--fsroot", str(run.fsroot),
                           "--state-file", str(run.state_file), "tune", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


@pytest.fixture
def daemon(tmp_path: Path):
    with daemons(tmp_path, generated_model("tiny")) as start:
        yield start


def test_tune_measures_every_candidate_it_lists_and_applies_the_winner(daemon) -> None:
    # This host as it is (2 CPUs, one node): the grid is 2 threads (today's rule) and 1.
    from bench.serving import host_machine

    run = daemon(machine=host_machine(), frontend='listen = ""\n')
    run.stop()  # no daemon: tune runs its own servers on the node
    run.write_config(extra="# the operator's note\n")
    done = tune(run, "--quick", "--json", "--samples", "2", "--tokens", "8")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [c["threads"] for c in report["candidates"]] == [2, 1]
    for c in report["candidates"]:
        assert len(c["decode_tokens_per_s"]["samples"]) == 2 and c["decode_tokens_per_s"]["median"] > 0
        assert len(c["prompt_tokens_per_s"]["samples"]) == 2 and c["prompt_tokens_per_s"]["median"] > 0
    assert [(b["cpus_node"], b["memory_node"]) for b in report["bandwidth_gbs"]] == [(0, 0)]
    assert report["bandwidth_gbs"][0]["median"] > 0.5
    # Efficiency counts the bytes a decoded token reads (tensor table), not the file size.
    from numad_infer.model.gguf import read_header
    assert report["engine_cpu"] and "AVX2" in report["engine_cpu"]  # the wheel's kernels, as check sees them
    assert report["decode_bytes"] == read_header(str(run.model)).decode_bytes() < report["weight_bytes"]
    for c in report["candidates"]:
        assert c["decode_efficiency"] == pytest.approx(
            c["decode_tokens_per_s"]["median"] * report["decode_bytes"] / (report["bandwidth_gbs"][0]["median"] * 1e9),
            rel=0.01, abs=1e-4)
    choices = {c["key"]: c for c in report["choices"]}
    best = max(report["candidates"], key=lambda c: c["decode_tokens_per_s"]["median"])
    assert choices["placement.threads"]["winner"] == best["threads"] and choices["placement.threads"]["current"] == 2
    applied = tune(run, "--quick", "--samples", "2", "--tokens", "8", "--apply")
    assert applied.returncode == 0, applied.stderr
    text = run.config.read_text()
    assert "# the operator's note" in text
    if "threads = " in text:  # a winner beyond the noise was written, with a backup
        assert list(run.config.parent.glob("numa-infer.toml.*.bak"))
        assert "(previous file kept as" in applied.stdout
    else:
        assert "unchanged" in applied.stdout


@pytest.mark.parametrize("engine", ["llama-cpp-python", "llama-server"])
def test_tune_measures_a_model_that_ends_every_completion_at_once(tmp_path: Path, engine: str) -> None:
    # A random model that draws </s> first (make_model --draw-eos): without suppressing
    # end-of-sequence, tune stopped with "asked for 8 streamed tokens, got 0".
    from bench.serving import host_machine
    from tests.daemon_harness import shared_dir

    model = shared_dir() / "draws-eos.gguf"
    if not model.exists():
        subprocess.run([sys.executable, str(ROOT / "tools/make_model.py"), str(model), "--draw-eos"], check=True,
                       capture_output=True)
        model.chmod(0o644)
    with daemons(tmp_path, model) as start:
        run = start(machine=host_machine(), frontend='listen = ""\n', engine=engine)
        run.stop()
        done = tune(run, "--quick", "--json", "--samples", "1", "--tokens", "8")
    assert done.returncode == 0, done.stderr[-1500:]
    for c in json.loads(done.stdout)["candidates"]:
        assert c["decode_tokens_per_s"]["median"] > 0 and c["prompt_tokens_per_s"]["median"] > 0


def test_tune_on_a_running_fleet_holds_one_node_at_a_time_and_gives_it_back(daemon) -> None:
    run = daemon()
    state = run.all_healthy(2)
    before = {i["name"]: i["restarts"] for i in state["instances"]}
    done = tune(run, "--quick", "--json", "--nodes", "0,1", "--samples", "2", "--tokens", "8")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert {(b["cpus_node"], b["memory_node"]) for b in report["bandwidth_gbs"]} == {(0, 0), (1, 0)}
    logs = run.logs()
    for name in ("infer@0", "infer@1"):
        assert f"{name}: held by numa-infer tune" in logs and f"{name}: released: starting it again" in logs
    state = run.all_healthy(2)
    assert {i["name"]: i["restarts"] for i in state["instances"]} == before  # a hold is not a crash
    assert not list((run.state_file.parent / "holds").glob("*.hold"))


def test_tune_interrupted_leaves_the_fleet_as_it_was(daemon) -> None:
    import signal

    run = daemon()
    run.all_healthy(2)
    config_before = run.config.read_text()
    # SIGINT back to its default in tune: a CI run started in the background (`.ci/run &`,
    # nohup) has SIGINT ignored, that is inherited, and Python then raises no
    # KeyboardInterrupt: tune ran to the end and exited 0. An operator's ^C reaches it with the
    # default disposition, which is what is tested. More samples than the default keep it
    # measuring when the interrupt comes.
    proc = subprocess.Popen([sys.executable, "-m", "numad_infer", "--config", str(run.config), "--fsroot",
                             str(run.fsroot), "--state-file", str(run.state_file), "tune", "--apply",
                             "--samples", "100"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    run.wait(lambda s: any(i["state"] == "held" for i in s["instances"]), 120, "an instance held by tune")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted; nothing was changed" in err
    run.all_healthy(2, timeout=120)
    assert run.config.read_text() == config_before
    assert not list((run.state_file.parent / "holds").glob("*.hold"))
    assert not tune_servers()  # no measuring server left behind


def tune_servers() -> list[int]:
    """Processes writing to a tune log directory: tune's own measuring servers."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if "/numa-infer-tune-" in os.readlink(f"/proc/{pid}/fd/1"):
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_tune_refuses_a_running_fleet_without_a_front_door(daemon) -> None:
    run = daemon(frontend='listen = ""\n')
    run.all_healthy(2)
    done = tune(run, "--quick")
    assert done.returncode == 1 and "no front door to route around a node" in done.stderr
    assert "--stop-instances" in done.stderr


def test_the_bandwidth_tune_measured_is_kept_for_the_daemon(tmp_path: Path) -> None:
    from numad_infer.tune import bandwidth_file as bandwidthfile

    path = tmp_path / bandwidthfile.RESULTS_NAME
    results = bandwidthfile.Results(path)
    assert results.local_gbs(0) is None
    bandwidthfile.save(path, {(0, 0): 40.0, (0, 1): 25.0})
    bandwidthfile.save(path, {(1, 1): 38.5})  # a later run on node 1 adds to it
    assert (results.local_gbs(0), results.local_gbs(1)) == (40.0, 38.5)
    os.utime(path, (1, 1))
    bandwidthfile.save(path, {(0, 0): 41.0})
    assert results.local_gbs(0) == 41.0  # re-read when the file changed


def test_status_shows_llama_server_decode_as_a_share_of_the_measured_bandwidth(daemon) -> None:
    import threading
    import urllib.request

    from numad_infer.tune import bandwidth_file as bandwidthfile

    run = daemon(engine="llama-server")
    run.all_healthy(2)
    bandwidthfile.save(run.state_file.parent / bandwidthfile.RESULTS_NAME, {(0, 0): 10.0, (1, 1): 10.0})
    port = run.instance(run.state(), "infer@0")["port"]
    stop = threading.Event()

    def load() -> None:
        body = json.dumps({"prompt": "hello", "max_tokens": 32}).encode()
        while not stop.is_set():
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=30).read()

    client = threading.Thread(target=load, daemon=True)
    client.start()
    try:
        state = run.wait(lambda s: (run.instance(s, "infer@0").get("decode_efficiency") or 0) > 0, 30,
                         "decode efficiency in status")
    finally:
        stop.set()
        client.join(30)
    inst = run.instance(state, "infer@0")
    # Bytes a decoded token reads (the tensor table), not the file: tiny's token_embd is 1/8 of it.
    from numad_infer.model.gguf import read_header
    read = read_header(str(run.model)).decode_bytes()
    assert read < 0.95 * run.model.stat().st_size
    expected = inst["decode_tokens_per_s"] * read / 10e9
    assert inst["decode_efficiency"] == pytest.approx(expected, rel=0.01, abs=1e-4)
    text = run.cli("status").stdout
    assert "BW-EFF" in text and "TOK/S" in text


def test_layouts_are_measured_under_concurrency_and_compared_with_the_current_one(daemon) -> None:
    run = daemon(frontend='listen = ""\n')
    run.all_healthy(2)
    refused = tune(run, "--quick", "--layouts", "--stop-instances", "--samples", "1", "--tokens", "4", "--json")
    assert refused.returncode == 0, refused.stderr  # --stop-instances: the whole fleet held, then given back
    report = json.loads(refused.stdout)
    assert [(lay["name"], lay["instances"], lay["clients"]) for lay in report["layouts"]] == [
        ("per-node x1", 2, 4), ("interleave", 1, 4)]
    assert next(lay for lay in report["layouts"] if lay["current"])["name"] == "per-node x1"
    for lay in report["layouts"]:
        assert lay["aggregate_tokens_per_s"]["median"] > 0 and 0 < lay["p50_s"] <= lay["p99_s"]
    run.all_healthy(2, timeout=120)
    assert "held by numa-infer tune" in run.logs()
    without = tune(run, "--quick", "--layouts")
    assert without.returncode == 1 and "the whole service would be down" in without.stderr


def test_tune_measures_as_the_process_backends_user_even_when_systemd_runs_the_fleet(tmp_path: Path) -> None:
    """Under systemd the fleet's user is a DynamicUser, which only systemd can create; tune's
    measuring servers are its own children and run as the process backend's user: each
    candidate is validated for the process backend, which works that user out."""
    import dataclasses

    from numad_infer.backends.process import ProcessBackend
    from numad_infer.host.identity import BackendKind, instances_run_as
    from numad_infer.tune.measure import Measurer, Settings
    from numad_infer.validate.pipeline import load

    path, fsroot = checked_setup(tmp_path)
    loaded = load(str(path), BackendKind.PROCESS, str(fsroot))
    user = loaded.config.server.user
    # The fleet as the systemd backend validated it (only its kind and user differ here).
    fleet = dataclasses.replace(loaded, kind=BackendKind.SYSTEMD,
                                runs_as=instances_run_as(user, str(path), BackendKind.SYSTEMD))
    measurer = Measurer(fleet, fleet.allowed, tmp_path, Settings(1, 2, 10.0), lambda line: None)
    candidate = measurer.instance_for(0, 1, 10000)
    assert candidate.kind == BackendKind.PROCESS
    assert candidate.runs_as == instances_run_as(user, str(path), BackendKind.PROCESS)
    backend = ProcessBackend(tmp_path / "logs")
    backend.sync(candidate)
    assert backend.loaded is not None and backend.loaded.runs_as == candidate.runs_as
    with pytest.raises(ValueError, match="validated for systemd"):
        backend.sync(fleet)  # the fleet's user is not one this backend can run as


# -- tune --model: several models ([[models]]) -------------------------------------------------

MODELS_CONFIG = """# two models on this box
[[models]]
name = "big"     # the chat model
path = "/big.gguf"
cores_per_instance = 28

[[models]]
name = "small"
aliases = ["gpt-4o-mini"]
path = "/small.gguf"
# threads = 3   (tried by hand)
"""


def test_apply_writes_one_models_threads_into_its_own_table_keeping_comments(tmp_path: Path) -> None:
    path = tmp_path / "numa-infer.toml"
    path.write_text(MODELS_CONFIG)
    topo = read_topology(fakesys.write_tree(tmp_path / "fs", fakesys.dual_socket_smt()))
    edits = [Edit.at("models[1].threads", 3), Edit.at("models[1].threads_batch", 4)]
    assert [e.name for e in edits] == ["models[1].threads", "models[1].threads_batch"] and edits[0].index == 1
    apply_edits(path, edits, lambda cfg: make_plan(cfg, topo, served=served_of(cfg)) and None)
    text = path.read_text()
    for kept in ("# two models on this box", 'name = "big"     # the chat model', "# threads = 3   (tried by hand)"):
        assert kept in text
    config = parse_config(text, "x")
    big, small = config.models
    assert (big.threads, big.threads_batch) == (None, None) and (small.threads, small.threads_batch) == (3, 4)
    assert "threads" not in text.split("[[models]]")[1] and config.placement.model_fields_set == set()
    plan = make_plan(config, topo, served=served_of(config))
    assert {(i.model, i.threads, i.threads_batch) for i in plan.instances} == {("big", 28, 28), ("small", 3, 4)}
    # More threads than the model's own cores: refused as the plan refuses it, nothing written.
    with pytest.raises(ConfigError, match=r"the tuned settings were refused, nothing written: models\[1\]\.threads = "
                                          r"5: infer@small-0 has only 4 CPUs"):
        apply_edits(path, [Edit.at("models[1].threads", 5)],
                    lambda cfg: make_plan(cfg, topo, served=served_of(cfg)) and None)
    assert parse_config(path.read_text(), "x").models[1].threads == 3
    assert Edit.at("placement.threads", 8) == Edit("placement", "threads", 8)


def _models_setup(tmp_path: Path, tables: str) -> tuple[Path, Path]:
    """A [[models]] configuration `check` accepts on the fake 2-node machine (no front door)."""
    from tests.conftest import searchable_by_others
    from tests.daemon_harness import llama_server_binary

    home = searchable_by_others(tmp_path)
    for name in ("big", "small"):
        (home / f"{name}.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(4088))
        (home / f"{name}.gguf").chmod(0o644)
    path = tmp_path / "numa-infer.toml"
    tables = tables.replace("/big.gguf", str(home / "big.gguf")).replace("/small.gguf", str(home / "small.gguf"))
    path.write_text(f'[server]\nllama_server = "{llama_server_binary()}"\n[frontend]\nlisten = ""\n' + tables)
    return path, fakesys.write_tree(tmp_path / "fs", fakesys.dual_socket_smt())


def test_tune_model_is_required_with_several_models_and_names_one_of_them(tmp_path: Path) -> None:
    from numad_infer.host.identity import BackendKind
    from numad_infer.topology.cgroup_limits import within
    from numad_infer.tune.run import TuneRequest, _own_cores, model_to_tune
    from numad_infer.validate.pipeline import load

    path, fsroot = _models_setup(tmp_path, MODELS_CONFIG)
    loaded = load(str(path), BackendKind.PROCESS, str(fsroot))

    def request(model: str | None) -> TuneRequest:
        return TuneRequest(str(path), str(fsroot), tmp_path / "state.json", None, True, False, False, None, None,
                           model=model)

    with pytest.raises(ConfigError) as missing:
        model_to_tune(request(None), loaded)
    assert str(missing.value) == (f"{path}: models: has 2 models and tune measures one at a time: pass --model NAME, "
                                  "one of big, small")
    with pytest.raises(ConfigError) as unknown:
        model_to_tune(request("medium"), loaded)
    assert str(unknown.value) == f"{path}: --model medium: no such model in the file; the models are one of big, small"
    assert model_to_tune(request("small"), loaded).served.key == "models[1]"
    assert model_to_tune(request("gpt-4o-mini"), loaded).served.name == "small"  # an alias names it too
    # The small model is measured on its own cores (32 - 28 = 4 on node 0, with their SMT siblings), not the node's.
    planned = {i.node: i for i in loaded.plan.instances if i.model == "small"}
    view = model_to_tune(request("small"), loaded).served.view
    allowed, config = _own_cores(loaded.topology, loaded.allowed, planned, [0], view, "models[1]")
    cut = within(loaded.topology, allowed)  # what its candidates are planned within (Measurer.candidate)
    node0 = next(n for n in cut.nodes if n.id == 0)
    assert len(node0.cores) == 4 and set(planned[0].cpus) < set(node0.cpus) and len(node0.cpus) == 8
    assert allowed.source.startswith("the cores the plan gives models[1]")
    assert not next(n for n in cut.nodes if n.id == 1).cpus and config.placement.reserve_cpus == ""
    # The CLI says the same and measures nothing.
    done = _numa_infer("--config", str(path), "--fsroot", str(fsroot), "--state-file", str(tmp_path / "s.json"),
                       "tune", "--quick")
    assert done.returncode == 1 and "pass --model NAME, one of big, small" in done.stderr, done.stderr


def test_tune_model_reports_the_chosen_models_bytes_not_the_first_models(tmp_path: Path) -> None:
    # `tune --model small` printed big's bytes per token (loaded.models[0]'s) and so its
    # decode efficiency: each model here reads a different number of bytes per token.
    from numad_infer.host.identity import BackendKind
    from numad_infer.tune.measure import Measurer, Settings
    from numad_infer.tune.run import TuneRequest, _report, _target, model_to_tune
    from numad_infer.validate.pipeline import load
    from tests.model import raw

    path, fsroot = _models_setup(tmp_path, MODELS_CONFIG)
    for name, floats in (("big", 4096), ("small", 512)):  # one F32 tensor each
        model = Path(parse_config(path.read_text(), str(path)).models[0 if name == "big" else 1].path)
        model.write_bytes(raw.gguf(tensors=[raw.tensor("output.weight", (floats,), 0, 0)], data=bytes(4 * floats)))
    loaded = load(str(path), BackendKind.PROCESS, str(fsroot))
    assert [m.decode_bytes for m in loaded.models] == [4 * 4096, 4 * 512]
    request = TuneRequest(str(path), str(fsroot), tmp_path / "s.json", None, True, False, False, None, None,
                          model="small")
    chosen = model_to_tune(request, loaded)
    instance = next(i for i in loaded.plan.instances if i.model == chosen.served.ident and i.node == 0)
    report = _report(loaded, chosen, chosen.served.view, 0, instance)
    assert (report.model, report.decode_bytes, report.weight_bytes) == (
        chosen.served.view.model.path, 4 * 512, chosen.model_bytes)
    assert report.weight_bytes == Path(chosen.served.view.model.path).stat().st_size != loaded.models[0].model_bytes
    # What is measured is that model too: each candidate the pipeline validates reads small's
    # file (its figures, not big's) and its server is launched on it.
    config, allowed, _, _ = _target(request, loaded, chosen, chosen.served.ident)
    measurer = Measurer(loaded, allowed, tmp_path, Settings(1, 2, 10.0), lambda line: None,
                        model=chosen.served.ident, config=config)
    candidate = measurer.instance_for(0, 1, 10000)
    (measured,) = candidate.models
    assert (measured.decode_bytes, measured.model_bytes) == (4 * 512, chosen.model_bytes)
    (server,) = candidate.plan.instances
    assert chosen.served.view.model.path in candidate.launches[server.name].argv
    assert set(server.cpus) <= set(next(i for i in loaded.plan.instances if i.model == "small" and i.node == 0).cpus)


def test_tune_takes_its_ports_below_the_ephemeral_range_and_off_the_plans(tmp_path: Path) -> None:
    # tune bound port 0 and closed it: a port in the kernel's ephemeral range, which a client
    # socket could take before tune's server bound it.
    import socket

    from numad_infer.tune.errors import TuneError
    from numad_infer.tune.run import _ephemeral_low, _free_port_block

    (tmp_path / "range").write_text("40000\t60999\n")
    assert _ephemeral_low(str(tmp_path / "range")) == 40000
    assert _ephemeral_low(str(tmp_path / "missing")) == 32768
    for count in (1, 4):
        base = _free_port_block(count)
        assert 10000 <= base and base + count <= _ephemeral_low()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", base))
        assert _free_port_block(1, low=base, top=base + 2) == base + 1  # not the port in use
        with pytest.raises(TuneError, match="no block of 1 free ports"):
            _free_port_block(1, frozenset({base + 1}), low=base, top=base + 2)  # nor one of the plan's


def test_tune_model_on_a_single_model_file_is_refused_unless_it_names_that_model(tmp_path: Path) -> None:
    from numad_infer.host.identity import BackendKind
    from numad_infer.tune.run import TuneRequest, model_to_tune
    from numad_infer.validate.pipeline import load

    path, fsroot = checked_setup(tmp_path)
    loaded = load(str(path), BackendKind.PROCESS, str(fsroot))
    request = TuneRequest(str(path), str(fsroot), tmp_path / "s.json", None, True, False, False, None, None)
    assert model_to_tune(request, loaded) is loaded.models[0]  # without --model: unchanged
    with pytest.raises(ConfigError, match=r"--model chat: no such model in the file; the models are none \(the "
                                          r"\[model\] table has no name: leave out --model\)"):
        model_to_tune(TuneRequest(**{**request.__dict__, "model": "chat"}), loaded)


def test_tune_model_measures_that_models_instance_on_its_own_cores_only(daemon) -> None:
    # This host (2 cores, one node) split between two models of one core each: the grid of
    # model b is its one core (the whole node's would be 2 and 1), and the choice is its key.
    # Model a is a larger file: the report's figures are b's, through the whole command.
    from bench.serving import host_machine
    from numad_infer.host.identity import BackendKind
    from numad_infer.validate.pipeline import load
    from tests.daemon_harness import engine_keys

    run = daemon(machine=host_machine(), frontend='listen = ""\n')
    run.stop()
    files = {"a": generated_model("small"), "b": run.model}
    tables = "".join(f'[[models]]\nname = "{name}"\npath = "{files[name]}"\ncontext_size = {run.context_size}\n'
                     "cores_per_instance = 1\n" for name in ("a", "b"))
    run.config.write_text(f'[server]\nbase_port = {run.base_port}\n{engine_keys(run.engine)}\n[frontend]\nlisten = ""\n'
                          + tables)
    refused = tune(run, "--quick")
    assert refused.returncode == 1 and "pass --model NAME, one of a, b" in refused.stderr, refused.stderr
    done = tune(run, "--model", "b", "--quick", "--json", "--samples", "1", "--tokens", "8")
    assert done.returncode == 0, done.stderr[-1500:]
    report = json.loads(done.stdout)
    assert [c["threads"] for c in report["candidates"]] == [1] and report["cpus"] == [1]
    assert report["candidates"][0]["decode_tokens_per_s"]["median"] > 0
    assert [c["key"] for c in report["choices"]] == ["models[1].threads", "models[1].threads_batch"]
    loaded = load(str(run.config), BackendKind.PROCESS, str(run.fsroot))
    a, b = loaded.model("a"), loaded.model("b")
    assert a.decode_bytes != b.decode_bytes and a.model_bytes != b.model_bytes
    assert (report["model"], report["weight_bytes"], report["decode_bytes"]) == (
        str(run.model), run.model.stat().st_size, b.decode_bytes)
    applied = tune(run, "--model", "b", "--quick", "--samples", "1", "--tokens", "8", "--apply")
    assert applied.returncode == 0 and "unchanged" in applied.stdout, applied.stderr[-1500:]
