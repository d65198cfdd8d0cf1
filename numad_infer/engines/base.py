"""What every inference engine must say about itself, and the registry of engines. Pure.

An `Engine` owns everything that differs between inference servers: its command line,
the route that tells it is up, where it takes the API key from, how many requests it
serves at once, the config keys that belong to it alone, what it needs of the host, and
how to read its own counters. Nothing outside `numad_infer/engines/` branches on which
engine is configured: it asks `engine_of(config)`.

A new engine is a subclass registered with `register()` (the built-in ones register in
`engines/__init__.py`); `server.engine` accepts every registered name.
"""

from __future__ import annotations

import os
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from numad_infer.host.cpufeatures import EngineCpuReport
from numad_infer.model.ggml import CACHE_TYPES, DEFAULT_CACHE_TYPE
from numad_infer.model.memory import EngineContext, Overhead

if TYPE_CHECKING:
    from numad_infer.config.schema import Config, ModelView
    from numad_infer.plan.model import Instance

# Where systemd puts the API key (LoadCredential=KEY_CREDENTIAL:server.api_key_file).
KEY_CREDENTIAL = "api-key"

# The overhead of an engine that states none of its own (a plugin's): llama-cpp-python's
# figures (engines/llama_cpp_python.py), the larger of the two measured, its runtime
# doubled: a server on llama.cpp in an interpreter of its own.
UNMEASURED = Overhead(runtime=160 << 20, per_embedding=48, per_vocab=8, per_context=24, kept_logits=4,
                      tokenizer=160)


@dataclass(frozen=True)
class EngineCounters:
    """What an engine with its own Prometheus endpoint reports (llama-server --metrics)."""

    tokens_predicted: float  # counter: tokens generated since the server started
    busy_slots: int  # requests being worked on right now
    # The KV cache (`Engine.kv_cache_path`): tokens the busy slots hold, cells of all slots.
    kv_cache_tokens: int | None = None
    kv_cache_size: int | None = None
    # Counters since the server started: prompt tokens it computed (prefill), and prompt
    # tokens it took from its cache instead (None: the engine does not count them).
    prompt_tokens_computed: float | None = None
    prompt_tokens_cached: float | None = None


@dataclass(frozen=True)
class KvCacheUse:
    """How full an engine's KV cache is: tokens held by requests in progress, of its cells."""

    tokens: int
    size: int


@dataclass(frozen=True)
class PromptCache:
    """An instance's prompt cache bound, decided once (`Engine.prompt_cache`)."""

    bytes: int | None  # what it may grow to; None: no limit, 0: off
    # The planner's bound (Instance.prompt_cache_mib), in MiB: the launch passes it in the
    # engine's `prompt_cache_flags`. None where the operator's arguments or the engine's
    # own default hold.
    planned_mib: int | None = None

    def launch_args(self, flags: Sequence[str]) -> list[str]:
        """What the launch adds to the engine's argv (after the operator's extra_args)."""
        return [flags[-1], str(self.planned_mib)] if flags and self.planned_mib is not None else []


class HostAccess(Protocol):
    """The host as an engine's check sees it (host_check.InstanceHost): files, and programs
    run with no more privilege than the instances get."""

    who: str  # for messages: "" (the daemon's own user) or " as nobody"

    def stat(self, path: str) -> os.stat_result: ...
    # `until`: the output it must give; tried again a few times when it does not (a program
    # whose log leaves from a thread of its own may exit before the line is written).
    def run(self, argv: list[str], timeout_s: float,
            until: Callable[[subprocess.CompletedProcess[str]], bool] | None = None,
            ) -> subprocess.CompletedProcess[str] | None: ...


class Engine(ABC):
    name: ClassVar[str]  # the value of server.engine
    # server.* keys that mean something to this engine only: given for another, a mistake.
    own_keys: ClassVar[frozenset[str]] = frozenset()
    # A route that answers 200 when the server can take requests and never waits on the
    # model (a busy server is not a down one): the probe's and the front door's check.
    liveness_path: ClassVar[str]
    # Environment variable the server takes its API key from (never argv: it is public).
    key_env: ClassVar[str]
    # Command-line options that would hand the server its key (or its key file) in argv,
    # which every user can read: `server.extra_args` refuses them, for every engine, so
    # that the daemon alone gives the key (server.api_key_file) and knows which one it is.
    key_flags: ClassVar[frozenset[str]] = frozenset({"--api-key", "--api_key", "--api-key-file", "--api_key_file"})
    # An authenticated route that answers before it waits on the model: a refused key
    # is told at once, even while the instance is busy (OpenAI's model list).
    key_check_path: ClassVar[str] = "/v1/models"
    # The server's own Prometheus counters, None when it has none.
    metrics_path: ClassVar[str | None] = None
    # A route that says how full its KV cache is (`parse_kv_cache`), None when it has none.
    kv_cache_path: ClassVar[str | None] = None
    # The option that names a directory the engine saves slots to and restores them from
    # (engines/slot_cache.py's routes); None: it keeps no cache across a restart.
    slot_save_option: ClassVar[str | None] = None
    # How to get CPU kernels for this host's wide units ("" when the engine has no way).
    cpu_fix: ClassVar[str] = ""
    # The server.* key naming the program every instance executes (`check` shows it, and a
    # new file there is rolled out); "" for an engine whose program no key names (a plugin's).
    program_key: ClassVar[str] = ""
    # What an instance holds besides the weights and the KV cache (model/memory.py), as
    # measured for this engine (bench/memory.py): the per-node memory check counts it.
    overhead: ClassVar[Overhead] = UNMEASURED
    # The extra_args that bound its prompt cache (EngineContext.prompt_cache), as a warning on
    # a node it could overfill names them; "" for an engine that keeps none.
    prompt_cache_args: ClassVar[str] = ""
    # The options that bound, in MiB, a prompt cache the engine keeps by default (the last
    # one the spelling numa-infer passes): with none of them in the instance's extra_args,
    # validation sizes the cache to its node (plan/memory_fit.py, prompt_cache_bounds) and
    # the launch passes the bound. Empty for an engine that keeps none unless asked.
    prompt_cache_flags: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def argv(self, view: ModelView, instance: Instance, key_from_credential: bool = False) -> list[str]:
        """The command line of one instance (systemd's ExecStart=, the process backend's argv).
        `view`: its model's view (`ServedModel.view`); what reads one model's keys (argv,
        slots, context) takes a view, never a whole `Config`, which with `[[models]]` has none.

        `key_from_credential`: under systemd, where the API key is a credential file
        (KEY_CREDENTIAL in the directory $CREDENTIALS_DIRECTORY names)."""

    def program(self, config: Config) -> str:
        """The program every instance executes: the value of `server.<program_key>` ("" when
        no key names it)."""
        return str(getattr(config.server, self.program_key)) if self.program_key else ""

    def slots(self, view: ModelView) -> int:
        """Requests one instance works on at once (the front door's per-server maxconn)."""
        return 1

    def context(self, view: ModelView) -> EngineContext:
        """The KV cache and batch one instance's command line asks for (model/memory.py sizes
        them): by default one slot of `model.context_size` tokens, llama.cpp's f16 cache."""
        size, f16 = view.model.context_size, CACHE_TYPES[DEFAULT_CACHE_TYPE]
        return EngineContext(size, size, f16, f16)

    def prompt_cache(self, view: ModelView, planned_mib: int | None = None) -> PromptCache:
        """The one decision of an instance's prompt cache bound: the operator's (one of
        `prompt_cache_flags` in its extra_args), else the planner's (`planned_mib`:
        Instance.prompt_cache_mib, sized to its nodes by plan/memory_fit.py), else what the
        engine's own arguments and defaults give (`own_prompt_cache`). Without
        `planned_mib`: the bound before planning, which the memory estimate counts."""
        extra = view.server.extra_args
        operator = last_option(extra, *self.prompt_cache_flags) if self.prompt_cache_flags else None
        if operator is None and planned_mib is not None and self.prompt_cache_flags:
            return PromptCache(planned_mib << 20, planned_mib)
        return PromptCache(self.own_prompt_cache(extra))

    def own_prompt_cache(self, extra_args: Sequence[str]) -> int | None:
        """The prompt cache's bound in bytes that `extra_args` (or, without them, the engine's
        default) give it, no planner's bound counted; None: no limit. 0: it keeps none."""
        return 0

    def key_environment(self, key: str) -> dict[str, str]:
        """The API key as the process backend hands it over: in the server's environment,
        readable by its own user only."""
        return {self.key_env: key}

    def credential_environment(self) -> dict[str, str]:
        """Environment for a systemd unit whose key is the credential KEY_CREDENTIAL (%d is
        systemd's specifier for the credentials directory); empty when argv reads it."""
        return {}

    def check_host(self, config: Config, source: str, host: HostAccess) -> list[str]:
        """What the engine needs of this host: raises ConfigError for what stops it from
        starting, returns warnings for what only may."""
        return []

    def parse_metrics(self, text: str) -> EngineCounters | None:
        """The counters in a scrape of `metrics_path`, None when they are not all there."""
        return None

    def parse_kv_cache(self, text: str) -> KvCacheUse | None:
        """The KV cache's use in an answer of `kv_cache_path`, None when it does not say."""
        return None

    def cpu(self, config: Config, host: HostAccess) -> EngineCpuReport:
        """The CPU kernels the engine runs on this host (its ggml CPU variant or compiled ISA),
        or why it cannot tell. The one source for status, metrics, tune's report, and the
        idle wide units that `check` warns of and `doctor` judges."""
        return EngineCpuReport(None, f"{self.name} does not say which CPU kernels it runs", self.cpu_fix)

    def no_stop_fields(self, stop_token_ids: tuple[int, ...]) -> dict[str, object]:
        """Fields of an OpenAI completion request that keep it from ending at end-of-sequence,
        so a measurement gets the tokens it asked for whatever the model would say
        (`stop_token_ids`: the model's EOS/EOT ids, from its GGUF header). By default an
        OpenAI logit_bias that no logit survives."""
        return {"logit_bias": {str(t): -1e30 for t in stop_token_ids}} if stop_token_ids else {}


def last_option(args: Sequence[str], *names: str) -> str | None:
    """The value the last of `names` has in `args` (`--name value` or `--name=value`): what a
    server's argument parser, where the last one given wins, ends up with."""
    found = None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in names:
            found = value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return found


def positive(value: str | None, default: int) -> int:
    """`value` as a count, `default` when it is not one (the server would refuse it)."""
    try:
        number = int(value) if value is not None else default
    except ValueError:
        return default
    return number if number > 0 else default


_REGISTRY: dict[str, Engine] = {}


def register(engine: Engine) -> Engine:
    """Make `engine` a value of server.engine (a later registration of a name replaces it)."""
    _REGISTRY[engine.name] = engine
    return engine


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def names() -> list[str]:
    return list(_REGISTRY)


def engines() -> list[Engine]:
    return list(_REGISTRY.values())


def get(name: str) -> Engine:
    return _REGISTRY[name]


def engine_of(config: Config) -> Engine:
    return _REGISTRY[config.server.engine]
