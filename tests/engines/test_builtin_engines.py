"""The second engine (llama.cpp's llama-server): config, units, front door, probe, counters
and the binary check. The servers themselves run in test_daemon.py and test_frontdoor.py
(every test there runs once per engine) and in the VM's "engine" group."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from numad_infer.units.render import render_units
from numad_infer.config.load import parse_config
from numad_infer.engines import EngineCounters, LlamaServer, engine_of
from numad_infer.engines.keys import check_engine_keys
from numad_infer.errors import ConfigError
from numad_infer.frontdoor.haproxy_config import SPARE_CONNECTIONS, Paths, render_haproxy
from numad_infer.supervision.reconcile import Runtime
from numad_infer.validate.host_check import InstanceHost
from tests.unitfiles import directives, systemd_split, systemd_verify
from tests.fakes import load_of
from tests.frontdoor.harness import plan_for

SERVER = '[server]\nengine = "llama-server"\nllama_server = "/usr/local/bin/llama-server"\n'


def config(server: str = SERVER, extra: str = "", model: str = "/m.gguf"):
    """Parsed, and its engine keys checked as the validation pipeline checks them first."""
    cfg = parse_config(f'[model]\npath = "{model}"\ncontext_size = 1024\n{server}{extra}', "/etc/numa-infer.toml")
    check_engine_keys(cfg, "/etc/numa-infer.toml")
    return cfg


@pytest.mark.parametrize("server, key", [
    ('[server]\nengine = "llama-cpp-python"\nparallel = 4\n', "server.parallel"),
    ('[server]\nengine = "llama-cpp-python"\nllama_server = "/usr/bin/llama-server"\n', "server.llama_server"),
    ('[server]\nengine = "llama-server"\npython = "/usr/bin/python3"\n', "server.python"),
    # No engine named: the default, llama-server, so llama-cpp-python's key is the mistake.
    ('[server]\npython = "/usr/bin/python3"\n', "server.python"),
])
def test_a_key_of_the_other_engine_is_refused_by_name(server: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^/etc/numa-infer.toml: {key} = .*: applies to server.engine = "):
        config(server)


@pytest.mark.parametrize("server, problem", [
    (SERVER + "parallel = 0\n", r"server.parallel = 0: must be at least 1"),
    (SERVER + "parallel = 65\n", r"server.parallel = 65: must be at most 64"),
    ('[server]\nengine = "vllm"\n', r"server.engine = \"vllm\": must be one of"),
    ('[server]\nengine = "llama-server"\nllama_server = "bin/llama-server"\n', r"server.llama_server = .*absolute"),
])
def test_bad_engine_values_are_refused_with_one_line(server: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        config(server)


def test_the_unit_runs_llama_server_with_the_instance_placement_and_no_mmap(tmp_path: Path) -> None:
    cfg = config(SERVER + "parallel = 4\n")
    plan = plan_for(tmp_path, cfg)
    served, engine = load_of(cfg)
    files = render_units(cfg, plan, served=served, engine=engine)
    d = dict(directives(files["infer@1.service.d/50-numa-infer.conf"]))
    assert d["CPUAffinity"] == " ".join(map(str, range(32, 64))) and d["NUMAPolicy"] == "bind"
    assert "OMP_NUM_THREADS=32" in systemd_split(d["Environment"])
    argv = systemd_split(d["ExecStart"])
    assert argv[0] == "/usr/local/bin/llama-server"
    for flag, value in (("--threads", "32"), ("--threads-batch", "32"), ("--port", "8081"), ("--parallel", "4"),
                        ("--ctx-size", str(1024 * 4)), ("--load-mode", "none"), ("--host", "127.0.0.1")):
        assert argv[argv.index(flag) + 1] == value, flag
    assert "--metrics" in argv and "llama_cpp.server" not in d["ExecStart"]
    mlocked = config(SERVER + "parallel = 4\n").model_copy(update={"model": config().model.model_copy(update={"mlock": True})})
    argv = engine_of(mlocked).argv(mlocked, plan.instances[0])
    assert argv[argv.index("--load-mode") + 1] == "mlock"


def test_the_api_key_reaches_llama_server_as_a_credential_file_not_argv(tmp_path: Path) -> None:
    cfg = config(SERVER + 'api_key_file = "/etc/numa-infer/api-key"\n')
    served, engine = load_of(cfg)
    files = render_units(cfg, plan_for(tmp_path, cfg), served=served, engine=engine)
    template = files["infer@.service"]
    assert "LoadCredential=api-key:/etc/numa-infer/api-key" in template
    # %d is systemd's specifier for the service's credentials directory.
    assert "Environment=LLAMA_ARG_API_KEY_FILE=%d/api-key" in template
    assert "api-key" not in files["infer@0.service.d/50-numa-infer.conf"]


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_llama_server_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    from numad_infer.systemd.unitdir import write_units

    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    cfg = config(f'[server]\nengine = "llama-server"\nllama_server = "{binary}"\nparallel = 2\n'
                 'api_key_file = "/etc/numa-infer/api-key"\n')
    served, engine = load_of(cfg)
    write_units(tmp_path / "units", render_units(cfg, plan_for(tmp_path, cfg), served=served, engine=engine))
    assert systemd_verify(tmp_path / "units", ["infer@0.service", "infer@1.service"]) == ""


def test_the_front_door_sends_each_instance_as_many_requests_as_it_has_slots(tmp_path: Path) -> None:
    for server, per_server, path in ((SERVER + "parallel = 4\n", 4, "/health"),
                                     ('[server]\nengine = "llama-cpp-python"\n', 1, "/docs")):
        cfg = config(server)
        plan = plan_for(tmp_path / str(per_server), cfg)
        served, engine = load_of(cfg)
        text = render_haproxy(cfg, plan, Paths(Path("/c"), Path("/s"), Path("/k")), served=served, engine=engine)
        assert engine.slots(cfg) == per_server
        assert f" maxconn {per_server} " in text and f"option httpchk GET {path}" in text
        # The slots, and the model's queue and holds (hold.py: arriving, and on the hold server,
        # two connections each).
        held = 4 * cfg.frontend.queue_size
        assert f"    maxconn {len(plan.instances) * per_server + held + SPARE_CONNECTIONS}\n" in text


METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 120
llamacpp:tokens_predicted_total 4096
llamacpp:predicted_tokens_seconds 55.2
llamacpp:requests_processing 3
llamacpp:requests_deferred 0
"""


def test_llama_server_counters_are_read_and_turned_into_a_decode_rate() -> None:
    parse_engine_metrics = LlamaServer().parse_metrics
    assert parse_engine_metrics(METRICS) == EngineCounters(4096.0, 3)
    assert parse_engine_metrics("llamacpp:requests_processing 1\n") is None  # a counter missing
    assert parse_engine_metrics("llamacpp:tokens_predicted_total x\nllamacpp:requests_processing 1\n") is None
    rt = Runtime(instance=None)  # type: ignore[arg-type]
    rt.on_counters(EngineCounters(1000, 2), 10.0)
    assert rt.decode_tokens_per_s is None  # one reading is no rate
    rt.on_counters(EngineCounters(1500, 2), 15.0)
    assert rt.decode_tokens_per_s == 100.0
    rt.on_counters(EngineCounters(10, 0), 20.0)  # the server restarted: counters went back
    assert rt.decode_tokens_per_s == 100.0
    rt.new_process(42)
    assert rt.counters is None and rt.decode_tokens_per_s is None


def check_llama_server(cfg, source: str, runs_as) -> list[str]:
    return engine_of(cfg).check_host(cfg, source, InstanceHost(runs_as))


def test_the_binary_must_be_there_executable_and_llama_server(tmp_path: Path) -> None:
    def cfg(path: Path):
        return config(f'[server]\nengine = "llama-server"\nllama_server = "{path}"\n')

    with pytest.raises(ConfigError, match=r"server.llama_server = .*: no such file; build it with scripts/build-llama"):
        check_llama_server(cfg(tmp_path / "absent"), "cfg", None)
    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\n")
    plain.chmod(0o644)
    with pytest.raises(ConfigError, match=r"is not an executable file \(chmod 755"):
        check_llama_server(cfg(plain), "cfg", None)
    other = tmp_path / "llama-cli"
    other.write_text("#!/bin/sh\necho 'version: 1 (abc)' >&2\necho 'usage: llama-cli [options]'\n")
    other.chmod(0o755)
    with pytest.raises(ConfigError, match="is not llama.cpp's llama-server"):
        check_llama_server(cfg(other), "cfg", None)
    failing = tmp_path / "broken"
    failing.write_text("#!/bin/sh\nexit 127\n")
    failing.chmod(0o755)
    with pytest.raises(ConfigError, match="does not run"):
        check_llama_server(cfg(failing), "cfg", None)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root drops privileges")
def test_the_binary_check_runs_unprivileged_and_accepts_the_real_llama_server() -> None:
    from numad_infer.host.identity import lookup
    from tests.daemon_harness import llama_server_binary

    binary = llama_server_binary()
    assert stat.S_IMODE(binary.stat().st_mode) & 0o001
    cfg = config(f'[server]\nengine = "llama-server"\nllama_server = "{binary}"\n')
    assert check_llama_server(cfg, "cfg", lookup("nobody", "cfg")) == []


def test_a_configuration_that_names_no_engine_runs_llama_server(tmp_path: Path) -> None:
    cfg = config("")
    assert engine_of(cfg).name == "llama-server" and cfg.server.engine == "llama-server"
    argv = engine_of(cfg).argv(cfg, plan_for(tmp_path, cfg).instances[0])
    assert argv[0] == "/usr/bin/llama-server" and "--alias" not in argv


def test_a_configuration_that_names_its_engine_keeps_it(tmp_path: Path) -> None:
    cfg = config('[server]\nengine = "llama-cpp-python"\npython = "/opt/llm/bin/python3"\n')
    argv = engine_of(cfg).argv(cfg, plan_for(tmp_path, cfg).instances[0])
    assert engine_of(cfg).name == "llama-cpp-python" and argv[:3] == ["/opt/llm/bin/python3", "-m", "llama_cpp.server"]


def test_check_names_the_engine_its_binary_and_the_key_to_set(tmp_path: Path) -> None:
    from numad_infer.cli.present import format_engine

    absent = tmp_path / "absent"
    default = config(f'[server]\nllama_server = "{absent}"\n')
    assert format_engine(default, engine_of(default)) == (
        f"engine: llama-server (the default; server.engine), every instance runs {absent} (server.llama_server)")
    # The binary missing, with no engine named: the key to set, and how to choose the other.
    with pytest.raises(ConfigError, match=r"server.llama_server = .*: no such file; .*server.engine is not set, and the "
                                          r"default engine is llama-server: set server.llama_server to its binary, or "
                                          r"server.engine = \"llama-cpp-python\""):
        check_llama_server(default, "cfg", None)
    named = config(f'[server]\nengine = "llama-server"\nllama_server = "{absent}"\n')
    with pytest.raises(ConfigError) as refused:
        check_llama_server(named, "cfg", None)
    assert "server.engine is not set" not in str(refused.value)
    other = config('[server]\nengine = "llama-cpp-python"\npython = "/opt/llm/bin/python3"\n')
    assert format_engine(other, engine_of(other)) == (
        "engine: llama-cpp-python (server.engine), every instance runs /opt/llm/bin/python3 (server.python)")


@pytest.mark.parametrize("server, flag", [(SERVER, "--alias"),
                                          ('[server]\nengine = "llama-cpp-python"\n', "--model_alias")])
def test_the_model_name_is_what_the_engine_reports_as_model(tmp_path: Path, server: str, flag: str) -> None:
    named = parse_config(f'[model]\npath = "/m.gguf"\nname = "llama-3.1-8b:q4"\n{server}', "/etc/numa-infer.toml")
    instance = plan_for(tmp_path, named).instances[0]
    argv = engine_of(named).argv(named, instance)
    assert argv[argv.index(flag) + 1] == "llama-3.1-8b:q4"
    unnamed = config(server)
    assert flag not in engine_of(unnamed).argv(unnamed, instance)


@pytest.mark.parametrize("name", ["a b", "-alias", "x" * 65, "m/n", "é"])
def test_an_unsafe_model_name_is_refused_with_the_rule(name: str) -> None:
    with pytest.raises(ConfigError, match=r"model.name = .*: must be 1-64 letters, digits or \. _ : -"):
        parse_config(f'[model]\npath = "/m.gguf"\nname = "{name}"\n', "/etc/numa-infer.toml")


SLOTS = ('[{"id":0,"n_ctx":256,"is_processing":false,"n_prompt_tokens":243},'
         '{"id":1,"n_ctx":256,"is_processing":true,"n_prompt_tokens":56}]')


def test_the_kv_cache_use_is_what_the_busy_slots_hold_of_every_slot_s_cells() -> None:
    from numad_infer.engines import KvCacheUse
    parse = LlamaServer().parse_kv_cache
    # The idle slot keeps its last 243 tokens for reuse: free for the next request.
    assert parse(SLOTS) == KvCacheUse(56, 512)
    assert parse('[{"id":0,"n_ctx":256,"is_processing":false}]') == KvCacheUse(0, 256)
    for bad in ("", "{}", "[]", '[{"n_ctx":"256"}]', '[{"n_ctx":256,"n_prompt_tokens":-1}]', "[1]"):
        assert parse(bad) is None, bad


def test_the_real_llama_server_s_slots_say_the_tokens_a_request_holds(tmp_path: Path) -> None:
    """The field names (`n_ctx`, `is_processing`, `n_prompt_tokens`) on the built server."""
    import json
    import subprocess
    import threading
    import time
    import urllib.request

    from numad_infer.supervision.health import read_engine_metrics
    from tests.daemon_harness import free_port_block, generated_model, llama_server_binary

    port = free_port_block(1)
    proc = subprocess.Popen([str(llama_server_binary()), "--model", str(generated_model("tiny")), "--host",
                             "127.0.0.1", "--port", str(port), "--ctx-size", "1024", "--parallel", "2",
                             "--threads", "1", "--metrics", "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        engine = LlamaServer()
        deadline = time.monotonic() + 60
        idle = None
        while idle is None and time.monotonic() < deadline:
            idle = read_engine_metrics(engine, "127.0.0.1", port, None, 2.0)
            time.sleep(0.2)
        assert idle is not None and (idle.kv_cache_tokens, idle.kv_cache_size) == (0, 1024)
        body = json.dumps({"prompt": "hello world", "n_predict": 480, "ignore_eos": True, "n_probs": 50}).encode()

        def complete() -> None:
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/completion", body), timeout=60)

        worker = threading.Thread(target=complete)
        worker.start()
        seen = []
        while worker.is_alive():
            got = read_engine_metrics(engine, "127.0.0.1", port, None, 2.0)
            if got is not None and got.kv_cache_tokens:
                seen.append(got.kv_cache_tokens)
        worker.join()
        assert seen and all(0 < n <= 512 for n in seen) and seen == sorted(seen), seen
    finally:
        proc.terminate()
        proc.wait(10)


PROMPT_METRICS = METRICS + """# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
llamacpp:prompt_tokens_cached_total 80
"""


def test_prompt_tokens_cached_and_computed_are_read_and_summed_over_the_instance_s_processes() -> None:
    parse = LlamaServer().parse_metrics
    assert parse(PROMPT_METRICS) == EngineCounters(4096.0, 3, prompt_tokens_computed=120.0, prompt_tokens_cached=80.0)
    # A build without the cached counter: neither figure, not half of one.
    assert parse(METRICS) == EngineCounters(4096.0, 3)
    rt = Runtime(instance=None)  # type: ignore[arg-type]
    assert rt.prompt.totals is None
    rt.on_counters(EngineCounters(1, 0), 1.0)  # an engine that does not count them
    assert rt.prompt.totals is None
    rt.on_counters(EngineCounters(1, 0, prompt_tokens_computed=100, prompt_tokens_cached=20), 2.0)
    rt.on_counters(EngineCounters(2, 0, prompt_tokens_computed=150, prompt_tokens_cached=60), 3.0)
    assert rt.prompt.totals == (60, 150)
    rt.new_process(7)  # a restart numa-infer made: the old process's figures stay
    assert rt.prompt.totals == (60, 150)
    rt.on_counters(EngineCounters(1, 0, prompt_tokens_computed=10, prompt_tokens_cached=5), 4.0)
    assert rt.prompt.totals == (65, 160)
    rt.on_counters(EngineCounters(1, 0, prompt_tokens_computed=3, prompt_tokens_cached=0), 5.0)  # it restarted
    assert rt.prompt.totals == (65, 163)
    rt.on_counters(None, 6.0)  # a scrape that failed changes nothing
    assert rt.prompt.totals == (65, 163)


def test_the_real_llama_server_counts_a_shared_prefix_as_cached_in_metrics_and_answers(tmp_path: Path) -> None:
    """Two requests with a shared prefix: the second's answer says `timings.cache_n` > 0 and
    the /metrics counters the daemon reads (prompt_tokens_cached_total) count the same."""
    import json
    import subprocess
    import time
    import urllib.request

    from numad_infer.supervision.health import read_engine_metrics
    from tests.daemon_harness import free_port_block, generated_model, llama_server_binary

    port = free_port_block(1)
    proc = subprocess.Popen([str(llama_server_binary()), "--model", str(generated_model("tiny")), "--host",
                             "127.0.0.1", "--port", str(port), "--ctx-size", "1024", "--parallel", "1",
                             "--threads", "1", "--metrics", "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        engine = LlamaServer()
        deadline = time.monotonic() + 60
        idle = None
        while idle is None and time.monotonic() < deadline:
            idle = read_engine_metrics(engine, "127.0.0.1", port, None, 2.0)
            time.sleep(0.2)
        assert idle is not None and (idle.prompt_tokens_cached, idle.prompt_tokens_computed) == (0, 0)
        prefix = "You are a careful assistant who answers in one short sentence. " * 8

        def complete(question: str) -> dict:
            body = json.dumps({"prompt": prefix + question, "n_predict": 4, "cache_prompt": True}).encode()
            with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/completion", body),
                                        timeout=60) as answer:
                return json.loads(answer.read())

        first, second = complete("What is a NUMA node?"), complete("What is a page cache?")
        assert first["timings"]["cache_n"] == 0 and second["timings"]["cache_n"] > 0, (first["timings"],
                                                                                       second["timings"])
        after = read_engine_metrics(engine, "127.0.0.1", port, None, 2.0)
        assert after is not None
        assert after.prompt_tokens_cached == second["timings"]["cache_n"]
        assert after.prompt_tokens_computed == first["timings"]["prompt_n"] + second["timings"]["prompt_n"]
        print(f"second request: {second['timings']['cache_n']} prompt tokens cached, "
              f"{second['timings']['prompt_n']} computed")
    finally:
        proc.terminate()
        proc.wait(10)


def _similarity(argv: list[str]) -> list[str]:
    """Every value given to --slot-prompt-similarity (or -sps), in order: the last one wins."""
    return [argv[k + 1] for k, a in enumerate(argv) if a in ("--slot-prompt-similarity", "-sps")]


def test_llama_server_takes_prompts_from_its_cache_not_the_most_similar_slot(tmp_path: Path) -> None:
    """-sps 0 wherever the instance has one slot and keeps a prompt cache (why:
    LlamaServer._keeps_prompts); none with several slots, or where --cache-ram is 0, the operator's or the plan's bound (with no cache to take
    prompts from, the most similar slot is the best the server has); an operator's own
    value comes after it, and wins."""
    from dataclasses import replace

    cfg = config()
    instance = plan_for(tmp_path, cfg).instances[0]
    assert _similarity(LlamaServer().argv(cfg, instance)) == ["0"]
    assert _similarity(LlamaServer().argv(cfg, replace(instance, prompt_cache_mib=512))) == ["0"]
    assert _similarity(LlamaServer().argv(cfg, replace(instance, prompt_cache_mib=0))) == []
    off = config(SERVER + 'extra_args = ["--cache-ram", "0"]\n')
    assert _similarity(LlamaServer().argv(off, replace(instance, prompt_cache_mib=None))) == []
    own = config(SERVER + 'extra_args = ["-sps", "0.5", "-cram", "256"]\n')
    assert _similarity(LlamaServer().argv(own, instance)) == ["0", "0.5"]
    # Several slots: the server's own pick keeps a conversation in its slot, which a restart keeps.
    assert _similarity(LlamaServer().argv(config(SERVER + "parallel = 2\n"), instance)) == []


def test_the_real_llama_server_brings_a_conversation_back_from_its_cache_after_another_took_the_slot(
        tmp_path: Path) -> None:
    """One slot, numa-infer's argv: conversation A's first turn, then B's (the same system
    prompt), then A's second turn. A's whole first prompt comes back from the prompt cache
    (`timings.cache_n`), not only the system prompt both share. The same server given the
    slot pick by similarity again (its default, -sps 0.1) finds the system prompt only:
    what numa-infer's -sps 0 is for, and a sign if a llama.cpp update changes it."""
    import json
    import subprocess
    import time
    import urllib.request
    from dataclasses import replace

    from tests.daemon_harness import free_port_block, generated_model, llama_server_binary

    cfg = parse_config(f'[model]\npath = "{generated_model("tiny")}"\ncontext_size = 512\n'
                       f'[server]\nllama_server = "{llama_server_binary()}"\n', "/etc/numa-infer.toml")
    words = " ".join(f"w{k % 97}" for k in range(40))  # the tiny model's context: 512 tokens
    system = {"role": "system", "content": f"You are a careful assistant. {words}"}
    planned = plan_for(tmp_path, cfg).instances[0]

    def turns(extra: list[str]) -> tuple[int, int, int]:
        """A's first prompt's tokens, what B found cached, and what A's second turn did."""
        port = free_port_block(1)
        instance = replace(planned, port=port, threads=1, threads_batch=1,
                           prompt_cache_mib=64)
        proc = subprocess.Popen([*LlamaServer().argv(cfg, instance), "--cache-ram", "64", *extra],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def ask(messages: list[dict[str, str]]) -> dict:
            body = json.dumps({"messages": messages, "max_tokens": 2, "temperature": 0}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as answer:
                return json.load(answer)

        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as health:
                        if health.status == 200:
                            break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            a = [system, {"role": "user", "content": "conversation a: " + words}]
            first = ask(a)["timings"]
            b = ask([system, {"role": "user", "content": "conversation b: " + words[::-1]}])["timings"]
            second = ask([*a, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}])
            return first["prompt_n"] + first["cache_n"], b["cache_n"], second["timings"]["cache_n"]
        finally:
            proc.terminate()
            proc.wait(10)

    a_prompt, shared, back = turns([])
    assert 0 < shared < a_prompt and back >= a_prompt - 4, (a_prompt, shared, back)
    a_prompt, shared, back = turns(["--slot-prompt-similarity", "0.1"])
    assert back == shared, (a_prompt, shared, back)
