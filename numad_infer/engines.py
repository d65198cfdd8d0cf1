"""What differs between the inference servers an instance can run. Pure.

Everything engine-specific lives here: the command line, the environment variable that
carries the API key, the probe path, how many requests one instance serves at once.
The renderer, the backends, the probe and the front door ask this module; adding an
engine means an `Engine` value in config.py and an entry here.

- llama-cpp-python (`python -m llama_cpp.server`): one request at a time per instance.
- llama-server (llama.cpp's native server): `parallel` slots with continuous batching;
  decoding is memory-bound, so several sequences read the weights once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from numad_infer.config import Config, Engine
from numad_infer.planner import Instance

# Where systemd puts the API key (LoadCredential=KEY_CREDENTIAL:server.api_key_file).
KEY_CREDENTIAL = "api-key"
# llama_cpp.server reads its settings from the environment (pydantic-settings): under
# systemd a small bootstrap copies the credential into API_KEY and runs the server.
_FROM_CREDENTIAL = ("import os, runpy; "
                    "os.environ['API_KEY'] = open(os.path.join(os.environ['CREDENTIALS_DIRECTORY'], "
                    f"'{KEY_CREDENTIAL}')).read().strip(); "
                    "runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)")


@dataclass(frozen=True)
class EngineTraits:
    # A route that answers 200 when the server can take requests, and never waits on the
    # model: llama-cpp-python has no /health, and its /v1/models waits on the model lock,
    # but FastAPI's /docs never does; llama-server's /health is 503 until the model loaded.
    liveness_path: str
    # Environment variable the server takes its API key from (never argv: it is public).
    key_env: str
    # llama-server reads the key from a file named in this variable (under systemd, the
    # credential); llama-cpp-python needs the bootstrap above instead.
    key_file_env: str | None
    # Prometheus counters of its own (llama-server --metrics), None when it has none.
    metrics_path: str | None


TRAITS = {
    Engine.LLAMA_CPP_PYTHON: EngineTraits("/docs", "API_KEY", None, None),
    Engine.LLAMA_SERVER: EngineTraits("/health", "LLAMA_API_KEY", "LLAMA_ARG_API_KEY_FILE", "/metrics"),
}


def traits(config: Config) -> EngineTraits:
    return TRAITS[config.server.engine]


def slots(config: Config) -> int:
    """Requests one instance works on at once (the front door's per-server maxconn)."""
    return config.server.parallel if config.server.engine == Engine.LLAMA_SERVER else 1


def server_argv(config: Config, instance: Instance, key_from_credential: bool = False) -> list[str]:
    """The command line of one instance (systemd's ExecStart=, the process backend's argv).

    `key_from_credential`: under systemd, where the API key is a credential file.
    """
    if config.server.engine == Engine.LLAMA_SERVER:
        return _llama_server_argv(config, instance)
    threads, batch = str(instance.threads), str(instance.threads_batch)
    start = ["-c", _FROM_CREDENTIAL] if key_from_credential and config.server.api_key_file else ["-m", "llama_cpp.server"]
    return [
        config.server.python, *start,
        "--model", config.model.path,
        "--host", config.server.host,
        "--port", str(instance.port),
        "--n_ctx", str(config.model.context_size),
        "--n_threads", threads,
        "--n_threads_batch", batch,
        # With mmap every instance would share one page cache of the file, on whichever
        # node read it first: each instance must own a copy of the weights on its node.
        "--use_mmap", "false",
        "--use_mlock", "true" if config.model.mlock else "false",
        # The default (true) ends a running stream whenever another request arrives:
        # concurrent clients, or a probe, would cut answers short.
        "--interrupt_requests", "false",
        *config.server.extra_args,
    ]


def _llama_server_argv(config: Config, instance: Instance) -> list[str]:
    threads, batch = str(instance.threads), str(instance.threads_batch)
    parallel = config.server.parallel
    return [
        config.server.llama_server,
        "--model", config.model.path,
        "--host", config.server.host,
        "--port", str(instance.port),
        # The context is shared by the slots: each gets context_size tokens.
        "--ctx-size", str(config.model.context_size * parallel),
        "--parallel", str(parallel),
        "--threads", threads,
        "--threads-batch", batch,
        # Not mmap (this llama.cpp spells --no-mmap as a load mode): the weights are read
        # into the instance's own memory, allocated under its NUMA policy, on its node.
        "--load-mode", "mlock" if config.model.mlock else "none",
        "--metrics",
        "--no-webui",
        *config.server.extra_args,
    ]


def key_environment(config: Config, key: str) -> dict[str, str]:
    """The API key as the process backend hands it over: in the server's environment,
    readable by its own user only."""
    return {traits(config).key_env: key}
