"""Engine.context: the KV cache and batch one instance's command line asks for, as each
engine reads its own arguments (numa-infer's argv, then server.extra_args, the last winning)."""

from __future__ import annotations

import pytest

from numad_infer.config.load import parse_config
from numad_infer.engines import get
from numad_infer.engines.base import PromptCache, last_option
from numad_infer.model.ggml import CACHE_TYPES
from numad_infer.model.memory import EngineContext

F32, F16, Q8_0, Q4_0 = CACHE_TYPES["f32"], CACHE_TYPES["f16"], CACHE_TYPES["q8_0"], CACHE_TYPES["q4_0"]
CRAM = 8192 << 20  # llama-server's --cache-ram unless set (its --help)


def config(engine: str, server: str = "", context: int = 4096):
    keys = 'llama_server = "/bin/llama-server"\n' if engine == "llama-server" else 'python = "/usr/bin/python3"\n'
    return parse_config(f'[model]\npath = "/m.gguf"\ncontext_size = {context}\n[server]\nengine = "{engine}"\n'
                        f"{keys}{server}", "/etc/numa-infer.toml")


@pytest.mark.parametrize("server, expected", [
    ("", EngineContext(4096, 4096, F16, F16, 512, CRAM)),
    # The slots share --ctx-size = context_size x parallel: each its context_size.
    ("parallel = 4\n", EngineContext(16384, 4096, F16, F16, 512, CRAM)),
    ('parallel = 2\nextra_args = ["--cache-type-k", "q8_0", "-ctv", "Q4_0"]\n', EngineContext(8192, 4096, Q8_0, Q4_0, 512, CRAM)),
    ('extra_args = ["--cache-type-k=q8_0"]\n', EngineContext(4096, 4096, Q8_0, F16, 512, CRAM)),
    # Given after numa-infer's own, a --ctx-size or -ub in extra_args is what the server takes.
    ('parallel = 2\nextra_args = ["-c", "2048", "-ub", "256"]\n', EngineContext(2048, 1024, F16, F16, 256, CRAM)),
    # One pool every slot attends over: the same cells, each slot's attention over all of them.
    ('parallel = 2\nextra_args = ["--kv-unified"]\n', EngineContext(8192, 8192, F16, F16, 512, CRAM)),
    # A type no cache takes is counted as the largest (the server refuses it at start).
    ('extra_args = ["-ctk", "q2_k", "-c", "zero"]\n', EngineContext(4096, 4096, F32, F16, 512, CRAM)),
    # Its prompt cache, which grows with use up to --cache-ram MiB; -1: no limit.
    ('extra_args = ["--cache-ram", "64"]\n', EngineContext(4096, 4096, F16, F16, 512, 64 << 20)),
    ('extra_args = ["-cram=0"]\n', EngineContext(4096, 4096, F16, F16, 512, 0)),
    ('extra_args = ["--cache-ram", "-1"]\n', EngineContext(4096, 4096, F16, F16, 512, None)),
])
def test_llama_server_context(server: str, expected: EngineContext) -> None:
    assert get("llama-server").context(config("llama-server", server)) == expected


@pytest.mark.parametrize("server, expected", [
    ("", EngineContext(4096, 4096, F16, F16, 512)),
    (f'extra_args = ["--type_k", "{Q8_0}", "--type_v", "0", "--n_ubatch", "128"]\n',
     EngineContext(4096, 4096, Q8_0, F32, 128)),
    ('extra_args = ["--n_ctx", "8192", "--type_k", "99"]\n', EngineContext(8192, 8192, F32, F16)),
    # Its prompt cache is off unless --cache is true; then 2 GiB in memory unless --cache_size
    # says otherwise, and none in memory with the disk cache.
    ('extra_args = ["--cache", "True"]\n', EngineContext(4096, 4096, F16, F16, 512, 2 << 30)),
    ('extra_args = ["--cache=on", "--cache_size", "1000"]\n', EngineContext(4096, 4096, F16, F16, 512, 1000)),
    ('extra_args = ["--cache", "yes", "--cache_type", "disk"]\n', EngineContext(4096, 4096, F16, F16, 512, 0)),
    ('extra_args = ["--cache", "false", "--cache_size", "1000"]\n', EngineContext(4096, 4096, F16, F16, 512, 0)),
])
def test_llama_cpp_python_context(server: str, expected: EngineContext) -> None:
    assert get("llama-cpp-python").context(config("llama-cpp-python", server)) == expected


def test_the_context_matches_what_argv_passes() -> None:
    from numad_infer.plan.model import Instance, Policy

    cfg = config("llama-server", "parallel = 3\n", context=1024)
    instance = Instance("infer@0", 0, (0,), ((0,),), (0,), Policy.BIND, 1, 8080, 1)
    argv = get("llama-server").argv(cfg, instance)
    assert int(last_option(argv, "--ctx-size") or 0) == get("llama-server").context(cfg).tokens == 3072


def test_last_option_takes_the_last_in_either_spelling() -> None:
    assert last_option(["-c", "1", "--ctx-size=2", "-c", "3"], "-c", "--ctx-size") == "3"
    assert last_option(["--ctx-size=2"], "-c", "--ctx-size") == "2"
    assert last_option(["-c"], "-c") is None  # no value after it
    assert last_option(["--other", "x"], "-c") is None


@pytest.mark.parametrize("engine, server, planned, expected, passed", [
    # Neither the operator nor the planner bound it: the engine's default, nothing passed.
    ("llama-server", "", None, PromptCache(CRAM), []),
    # The planner's bound (Instance.prompt_cache_mib), 0 (off) too: the launch passes it.
    ("llama-server", "", 512, PromptCache(512 << 20, 512), ["--cache-ram", "512"]),
    ("llama-server", "", 0, PromptCache(0, 0), ["--cache-ram", "0"]),
    # The operator's own bound wins over the planner's, and the launch adds none.
    ("llama-server", 'extra_args = ["-cram", "64"]\n', 512, PromptCache(64 << 20), []),
    ("llama-server", 'extra_args = ["--cache-ram=-1"]\n', None, PromptCache(None), []),
    # An engine with no bound to pass (no prompt_cache_flags): its own arguments only.
    ("llama-cpp-python", "", 512, PromptCache(0), []),
    ("llama-cpp-python", 'extra_args = ["--cache", "true"]\n', 512, PromptCache(2 << 30), []),
])
def test_the_prompt_cache_bound_is_decided_once_operator_then_plan_then_engine(
        engine: str, server: str, planned: int | None, expected: PromptCache, passed: list[str]) -> None:
    chosen = get(engine)
    cfg = config(engine, server)
    cache = chosen.prompt_cache(cfg, planned)
    assert cache == expected
    assert cache.launch_args(chosen.prompt_cache_flags) == passed
    # What the memory estimate counts is the same decision before planning.
    assert chosen.context(cfg).prompt_cache == chosen.prompt_cache(cfg).bytes


def test_the_launch_passes_the_bound_the_engine_decided(tmp_path) -> None:
    from dataclasses import replace

    from numad_infer.config.models import served_models
    from numad_infer.engines.launch import launch_of
    from tests.frontdoor.harness import plan_for

    cfg = config("llama-server")
    instance = replace(plan_for(tmp_path, cfg).instances[0], prompt_cache_mib=300)
    launch = launch_of(get("llama-server"), served_models(cfg)[0], instance)
    assert launch.argv[-2:] == ("--cache-ram", "300") and launch.unit_argv[-2:] == ("--cache-ram", "300")
    own = config("llama-server", 'extra_args = ["-cram", "64"]\n')
    assert "--cache-ram" not in launch_of(get("llama-server"), served_models(own)[0], instance).argv
