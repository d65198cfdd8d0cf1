"""llama.cpp's native server (`llama-server`): `parallel` slots with continuous batching.
Decoding is memory-bound, so several sequences read the weights once per step."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from numad_infer.engines.base import (
    KEY_CREDENTIAL,
    Engine,
    EngineCounters,
    HostAccess,
    KvCacheUse,
    last_option,
    positive,
)
from numad_infer.errors import ConfigError
from numad_infer.host.cpufeatures import VARIANT_FEATURES, EngineCpuReport, declined_by, from_backend_log
from numad_infer.model.ggml import CACHE_TYPES, DEFAULT_CACHE_TYPE
from numad_infer.model.memory import EngineContext, Overhead

if TYPE_CHECKING:
    from numad_infer.config.schema import Config, ModelView
    from numad_infer.plan.model import Instance

# Its --metrics counters that status and the decode efficiency read.
_COUNTERS = {"llamacpp:tokens_predicted_total": "tokens_predicted", "llamacpp:requests_processing": "busy_slots"}
# Prompt tokens (tools/server/server-task.cpp, to_metrics): `prompt_tokens_total` counts
# those it computed ("excluding cached tokens"), `prompt_tokens_cached_total` those reused
# from a slot or its --cache-ram cache, both added when a prompt is done. Optional: a build
# before the cached counter reports neither figure rather than half of one.
_PROMPT_COUNTERS = {"llamacpp:prompt_tokens_total": "prompt_tokens_computed",
                    "llamacpp:prompt_tokens_cached_total": "prompt_tokens_cached"}

_HINT = "build it with scripts/build-llama-server or install Debian's llama.cpp package, and point here"

# Measured (bench/memory.py, bench/real_models.py and the server's log at -lv 4; llama.cpp
# 0c1e570 from scripts/build-llama-server, CPU, flash attention "auto" = on) on
# tools/make_model.py's models: tiny, small, medium (2026-12-02) and the 1b and 8b shapes
# (2026-12-06), 512 to 4096 tokens per slot, 1 and 2 slots. The log's compute buffer is 512
# (the batch, -ub) x (16 B x n_embd + 12 B x n_ff + 2 B x one slot's context: the f16
# attention mask), exactly on every model: medium (n_embd 1024, n_ff 2816) 25.01 MiB at
# 512, 1b (2048, 8192) 66.01/68.01 at 2048/4096, 8b (4096, 14336) 118.01/120.01 (48 B x
# n_embd alone, the first fit, missed 16 and 20 MiB on the last two). Its logits are one row
# per slot: not counted. The rest, the process itself, is RSS less weights, KV cache and
# that compute buffer once a prompt has filled the slot (all of it touched): 20 MiB on the
# tiny model (vocabulary 512; 16 MiB of it program and libraries, file-backed), 24.3 on the
# small (4,096), 30.0 on the medium (32,000), 58 on the 1b and 67 on the 8b (128,256):
# 28 MiB and 240 B per vocabulary entry (the tokenizer's tables, the samplers' candidates)
# cover all but the 8b, which it misses by 10 MiB of 5.0 GiB. Not in it: the prompt cache
# (below), which grows with use.
OVERHEAD = Overhead(runtime=28 << 20, per_embedding=16, per_feed_forward=12, per_vocab=0, per_context=2,
                    tokenizer=240)

# The prompt cache's limit unless --cache-ram says otherwise (its --help; -1: none, 0: off).
# When a slot takes a new prompt, the old one's state (its KV cells) is copied there, and
# kept until the limit: 24 distinct 370-610-token prompts to one slot of the small model
# left 85 MiB cached at 8192 and 29 MiB at 32 (-lv 4's "cache state", 2026-12-03), the
# process's RSS growing by the same. Per instance, so plan/memory_fit.py warns on it.
CACHE_RAM_MIB = 8192


def _prompt_cache(value: str | None) -> int | None:
    """--cache-ram's bytes: its default when absent or not a number (the server refuses
    that), None for a negative one (no limit)."""
    try:
        mib = int(value) if value is not None else CACHE_RAM_MIB
    except ValueError:
        mib = CACHE_RAM_MIB
    return None if mib < 0 else mib << 20


def _exists(host: HostAccess, path: str) -> bool:
    try:
        host.stat(path)
    except OSError:
        return False
    return True


class LlamaServer(Engine):
    name = "llama-server"
    own_keys: ClassVar[frozenset[str]] = frozenset({"llama_server", "parallel"})
    liveness_path = "/health"  # answered by its HTTP threads; 503 until the model is loaded
    key_env = "LLAMA_API_KEY"
    program_key = "llama_server"
    metrics_path = "/metrics"
    # Its /metrics no longer has the KV cache's use (llamacpp:kv_cache_usage_ratio is gone);
    # /slots (on unless --no-slots) says per slot its cells (`n_ctx`) and, once a task has
    # run in it, the tokens it holds (`n_prompt_tokens`: the prompt and what it generated).
    kv_cache_path = "/slots"
    slot_save_option = "--slot-save-path"
    overhead = OVERHEAD
    prompt_cache_args = '"--cache-ram", "MIB"'  # 0 turns it off
    prompt_cache_flags = ("-cram", "--cache-ram")
    cpu_fix = ("build server.llama_server with `NUMA_INFER_CPU_VARIANTS=all scripts/build-llama-server` (one CPU "
               "backend per x86 level, the best chosen at start), or with scripts/build-llama-server on this machine")

    def argv(self, view: ModelView, instance: Instance, key_from_credential: bool = False) -> list[str]:
        parallel = view.server.parallel
        return [
            view.server.llama_server,
            "--model", view.model.path,
            "--host", view.server.host,
            "--port", str(instance.port),
            # The context is shared by the slots: each gets context_size tokens.
            "--ctx-size", str(view.model.context_size * parallel),
            "--parallel", str(parallel),
            "--threads", str(instance.threads),
            "--threads-batch", str(instance.threads_batch),
            # Not mmap (this llama.cpp spells --no-mmap as a load mode): the weights are read
            # into the instance's own memory, allocated under its NUMA policy, on its node.
            "--load-mode", "mlock" if view.model.mlock else "none",
            "--metrics",
            "--no-webui",
            *(["--alias", view.model.name] if view.model.name else []),
            *(["--slot-prompt-similarity", "0"] if self._keeps_prompts(view, instance) else []),
            *view.server.extra_args,
        ]

    def _keeps_prompts(self, view: ModelView, instance: Instance) -> bool:
        """Whether numa-infer turns llama-server's slot pick by similarity off (`-sps 0`; an
        operator's extra_args, given after, can set it again): where the instance has one
        slot and keeps a prompt cache (its bound, `Engine.prompt_cache`, not 0: the
        operator's --cache-ram, else the plan's bound, else the server's default).

        Why: with the pick on, a request takes the slot that shares the most of its prompt,
        and the server looks in its prompt cache only when that would drop at least half
        of the slot's prompt (tools/server/server-context.cpp, get_available_slot: f_keep <
        0.5). A shared system prompt is most of a short history, so a conversation's slot
        was overwritten unsaved and no history ever came back from the cache: measured, one
        slot, three conversations of 4 turns behind a ~800-token system prompt, turns >= 2
        found the system prompt only (cached share 0.60), and 0.86 (the whole history before
        the new message) with -sps 0 (bench/slot_pick.py). With it off, each request saves
        the slot's prompt to the cache and takes the cached one that best matches its own:
        a copy of KV cells, not a prefill.

        Not with several slots: there the pick by least recent use moves a conversation out
        of its slot at the next request, and a restart keeps only what the slots hold
        (kept_slots.py saves slots, not the cache; tests/e2e/test_kept_slots.py caught it).
        With one slot every request takes that slot anyway."""
        if view.server.parallel != 1:
            return False
        return self.prompt_cache(view, instance.prompt_cache_mib).bytes != 0

    def slots(self, view: ModelView) -> int:
        return view.server.parallel

    def context(self, view: ModelView) -> EngineContext:
        # What argv asks, with server.extra_args given after it (the last one wins there):
        # --ctx-size cells in all, of the --cache-type-k/-v types (an unknown one counted as
        # f32, the largest: the server refuses it anyway). Each slot attends over its
        # n_ctx / parallel of them, or over all with --kv-unified.
        extra, parallel = view.server.extra_args, view.server.parallel
        tokens = positive(last_option(extra, "-c", "--ctx-size"), view.model.context_size * parallel)
        unified = any(a in ("-kvu", "--kv-unified") for a in extra)
        k, v = (last_option(extra, *flags) or DEFAULT_CACHE_TYPE for flags in (("-ctk", "--cache-type-k"),
                                                                              ("-ctv", "--cache-type-v")))
        return EngineContext(tokens, tokens if unified else tokens // parallel,
                             CACHE_TYPES.get(k.lower(), CACHE_TYPES["f32"]),
                             CACHE_TYPES.get(v.lower(), CACHE_TYPES["f32"]),
                             positive(last_option(extra, "-ub", "--ubatch-size"), 512),
                             self.prompt_cache(view).bytes)

    def own_prompt_cache(self, extra_args: Sequence[str]) -> int | None:
        return _prompt_cache(last_option(extra_args, *self.prompt_cache_flags))

    def credential_environment(self) -> dict[str, str]:
        # It reads the key from the file this variable names: the credential itself.
        return {"LLAMA_ARG_API_KEY_FILE": f"%d/{KEY_CREDENTIAL}"}

    def check_host(self, config: Config, source: str, host: HostAccess) -> list[str]:
        """server.llama_server is llama.cpp's server and the instances' user can run it."""
        path, key = config.server.llama_server, "server.llama_server"
        try:
            st = host.stat(path)
        except FileNotFoundError:
            # A configuration that names no engine gets this one: say so, and how to choose.
            chosen = ("" if "engine" in config.server.model_fields_set else
                      "; server.engine is not set, and the default engine is llama-server: set server.llama_server "
                      "to its binary, or server.engine = \"llama-cpp-python\" with server.python")
            raise ConfigError(source, key, f"no such file; {_HINT}{chosen}", path, True) from None
        except OSError as exc:
            raise ConfigError(source, key, f"cannot be read: {exc.strerror}", path, True) from None
        if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o111:
            raise ConfigError(source, key, f"is not an executable file (chmod 755 {path})", path, True)
        version = host.run([path, "--version"], 30.0)
        usage = host.run([path, "--help"], 30.0)
        if version is None or usage is None or version.returncode != 0:
            raise ConfigError(source, key, f"does not run{host.who} (`{path} --version` failed); check that this user "
                              f"can run it and that its libraries are installed; {_HINT}", path, True)
        # llama-server's --help lists its own options; llama-cli and the others print the same --version.
        if "version:" not in version.stdout + version.stderr or "--api-key-file" not in usage.stdout + usage.stderr:
            raise ConfigError(source, key, f"is not llama.cpp's llama-server (its --version and --help say otherwise); "
                              f"{_HINT}", path, True)
        return []

    def cpu(self, config: Config, host: HostAccess) -> EngineCpuReport:
        # --list-devices loads the backends (ggml_backend_load_all) and exits; at verbosity 4
        # ggml logs the libggml-cpu-<variant>.so it chose (scripts/build-llama-server's
        # build). A static build loads nothing and logs no variant; nor does it say its
        # ISA before it has loaded a model, so it stays unknown.
        path = config.server.llama_server
        asked = f"`{path} -lv 4 --list-devices`"
        done = host.run([path, "-lv", "4", "--list-devices"], 30.0,
                        until=lambda run: from_backend_log(run.stdout + run.stderr) is not None)
        if done is None:
            return EngineCpuReport(None, f"{asked} did not run{host.who}", self.cpu_fix)
        cpu = from_backend_log(done.stdout + done.stderr)
        if cpu is None:
            return EngineCpuReport(None, f"{asked} named no libggml-cpu variant (a build with one static CPU backend "
                                         "does not say which it uses)", self.cpu_fix)
        # The variants built beside it: a wider one it did not load is one this host cannot run.
        built = [name for name in VARIANT_FEATURES if _exists(host, f"{os.path.dirname(path)}/libggml-cpu-{name}.so")]
        return EngineCpuReport(declined_by(cpu, built), asked, self.cpu_fix)

    def no_stop_fields(self, stop_token_ids: tuple[int, ...]) -> dict[str, object]:
        # Its own switch: it knows every end-of-generation token of the model itself.
        return {"ignore_eos": True}

    def parse_metrics(self, text: str) -> EngineCounters | None:
        found: dict[str, float] = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            field = _COUNTERS.get(name) or _PROMPT_COUNTERS.get(name)
            if field is not None:
                try:
                    found[field] = float(value.split()[0])
                except (ValueError, IndexError):
                    return None
        if any(field not in found for field in _COUNTERS.values()):
            return None
        prompt = all(field in found for field in _PROMPT_COUNTERS.values())
        return EngineCounters(found["tokens_predicted"], int(found["busy_slots"]),
                              prompt_tokens_computed=found["prompt_tokens_computed"] if prompt else None,
                              prompt_tokens_cached=found["prompt_tokens_cached"] if prompt else None)

    def parse_kv_cache(self, text: str) -> KvCacheUse | None:
        """/slots -> the tokens held by the slots working on a request, of every slot's
        `n_ctx` cells. An idle slot keeps its last prompt for reuse (`n_prompt_tokens` stays),
        but the next request takes those cells back at once: counted free, as a scheduler
        should see them. Field names checked on the built server: tests/engines."""
        try:
            slots = json.loads(text)
        except ValueError:
            return None
        if not isinstance(slots, list) or not slots:
            return None
        tokens = size = 0
        for slot in slots:
            if not isinstance(slot, dict):
                return None
            n_ctx, held = slot.get("n_ctx"), slot.get("n_prompt_tokens", 0)
            if type(n_ctx) is not int or type(held) is not int or n_ctx < 0 or held < 0:
                return None
            size += n_ctx
            if slot.get("is_processing") is True:
                tokens += min(held, n_ctx)
        return KvCacheUse(tokens, size)
