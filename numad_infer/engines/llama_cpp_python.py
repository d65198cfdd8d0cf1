"""llama-cpp-python's OpenAI server (`python -m llama_cpp.server`): one request at a time
per instance (it serialises on its model lock)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from numad_infer.engines.base import KEY_CREDENTIAL, Engine, HostAccess, last_option, positive
from numad_infer.host.cpufeatures import EngineCpuReport, from_system_info
from numad_infer.model.ggml import CACHE_TYPES, DEFAULT_CACHE_TYPE
from numad_infer.model.memory import EngineContext, Overhead

if TYPE_CHECKING:
    from numad_infer.config.schema import Config, ModelView
    from numad_infer.plan.model import Instance

# llama_cpp.server reads its settings from the environment (pydantic-settings): under
# systemd a small bootstrap copies the credential into API_KEY and runs the server.
_FROM_CREDENTIAL = ("import os, runpy; "
                    "os.environ['API_KEY'] = open(os.path.join(os.environ['CREDENTIALS_DIRECTORY'], "
                    f"'{KEY_CREDENTIAL}')).read().strip(); "
                    "runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)")

# Measured once (bench/memory.py and its log, 2026-12-02; llama-cpp-python 0.3.36, its
# server's defaults: flash attention off, logits_all on) on tools/make_model.py's models.
# Per batch token: its compute buffer holds every token's logits (4 B x n_vocab: 62.5 of the
# medium model's 66.5 MiB at context 512) and the attention's scores without flash attention
# (+15.5 MiB from context 512 to 2048 at 16 heads: 21 B per context token; 24 counted);
# llama.cpp's output buffer grows to every token's logits once a prompt asks for them (4 B x
# n_vocab more); activations as llama-server's (48 B x n_embd). It also keeps every context
# token's logits (numpy, n_ctx x n_vocab x 4 B, resident as the context fills). The process
# itself (Python, FastAPI, uvicorn, the library) was 72-78 MiB on the tiny model after a
# completion: 80 MiB, and llama-server's 160 B per vocabulary entry.
OVERHEAD = Overhead(runtime=80 << 20, per_embedding=48, per_vocab=8, per_context=24, kept_logits=4, tokenizer=160)


def _prompt_cache(extra: Sequence[str]) -> int:
    """Its cache of evaluated prompts: off unless `--cache true`; in memory (LlamaRAMCache)
    up to --cache_size bytes (2 GiB unless set) with `--cache_type ram`, its default. A
    disk cache holds its states in files, not in the process."""
    on = (last_option(extra, "--cache") or "").strip().lower() in {"1", "on", "t", "true", "y", "yes"}
    if not on or (last_option(extra, "--cache_type") or "ram") != "ram":
        return 0
    return positive(last_option(extra, "--cache_size"), 2 << 30)


def _cache_type(value: str | None) -> int:
    """--type_k/--type_v's ggml type id: unset, f16; one no cache takes, f32 (the largest)."""
    if value is None:
        return CACHE_TYPES[DEFAULT_CACHE_TYPE]
    try:
        ggml_type = int(value)
    except ValueError:
        return CACHE_TYPES["f32"]
    return ggml_type if ggml_type in CACHE_TYPES.values() else CACHE_TYPES["f32"]


# find_spec only locates the package: importing llama_cpp would load the C library (slow).
_FIND_LLAMA_CPP = "import importlib.util, sys; sys.exit(importlib.util.find_spec('llama_cpp') is None)"

# The wheel has one CPU backend (no GGML_BACKEND_DL): ask its libggml-cpu.so what it was
# compiled for, in system_info's words, through ctypes (importing llama_cpp costs ~0.6 s).
_ASK_GGML_CPU = (
    "import ctypes, importlib.util, os, sys\n"
    "lib = os.path.join(os.path.dirname(importlib.util.find_spec('llama_cpp').origin), 'lib')\n"
    "ctypes.CDLL(os.path.join(lib, 'libggml-base.so'), mode=ctypes.RTLD_GLOBAL)\n"
    "cpu = ctypes.CDLL(os.path.join(lib, 'libggml-cpu.so'))\n"
    "names = ('SSE3', 'AVX', 'AVX2', 'F16C', 'FMA', 'BMI2', 'AVX_VNNI', 'AVX512', 'AVX512_VBMI', 'AVX512_VNNI',"
    " 'AVX512_BF16', 'AMX_INT8')\n"
    "sys.stdout.write('CPU : ' + ''.join(f'{n} = {getattr(cpu, \"ggml_cpu_has_\" + n.lower())()} | ' for n in names"
    " if hasattr(cpu, 'ggml_cpu_has_' + n.lower())))\n"
)


class LlamaCppPython(Engine):
    name = "llama-cpp-python"
    own_keys: ClassVar[frozenset[str]] = frozenset({"python"})
    # It has no /health, and /v1/models waits on the model lock; FastAPI's /docs never does.
    liveness_path = "/docs"
    key_env = "API_KEY"
    program_key = "python"
    overhead = OVERHEAD
    prompt_cache_args = '"--cache_size", "BYTES"'
    cpu_fix = ("reinstall llama-cpp-python into server.python built for this CPU (CMAKE_ARGS='-DGGML_NATIVE=ON' pip "
               "install --force-reinstall --no-binary :all: llama-cpp-python), or use server.engine = \"llama-server\" "
               "with scripts/build-llama-server's build")

    def argv(self, view: ModelView, instance: Instance, key_from_credential: bool = False) -> list[str]:
        start = (["-c", _FROM_CREDENTIAL] if key_from_credential and view.server.api_key_file
                 else ["-m", "llama_cpp.server"])
        return [
            view.server.python, *start,
            "--model", view.model.path,
            "--host", view.server.host,
            "--port", str(instance.port),
            "--n_ctx", str(view.model.context_size),
            "--n_threads", str(instance.threads),
            "--n_threads_batch", str(instance.threads_batch),
            # With mmap every instance would share one page cache of the file, on whichever
            # node read it first: each instance must own a copy of the weights on its node.
            "--use_mmap", "false",
            "--use_mlock", "true" if view.model.mlock else "false",
            # The default (true) ends a running stream whenever another request arrives:
            # concurrent clients, or a probe, would cut answers short.
            "--interrupt_requests", "false",
            *(["--model_alias", view.model.name] if view.model.name else []),
            *view.server.extra_args,
        ]

    def context(self, view: ModelView) -> EngineContext:
        # One sequence of --n_ctx tokens; server.extra_args come after argv's and win.
        extra = view.server.extra_args
        tokens = positive(last_option(extra, "--n_ctx"), view.model.context_size)
        return EngineContext(tokens, tokens, _cache_type(last_option(extra, "--type_k")),
                             _cache_type(last_option(extra, "--type_v")),
                             positive(last_option(extra, "--n_ubatch"), 512), self.prompt_cache(view).bytes)

    def own_prompt_cache(self, extra_args: Sequence[str]) -> int | None:
        return _prompt_cache(extra_args)

    def cpu(self, config: Config, host: HostAccess) -> EngineCpuReport:
        python = config.server.python
        done = host.run([python, "-I", "-c", _ASK_GGML_CPU], 30.0)
        if done is None or done.returncode != 0:
            return EngineCpuReport(None, f"{python} cannot load llama_cpp's libggml-cpu.so{host.who}", self.cpu_fix)
        cpu = from_system_info(done.stdout)
        if cpu is None:
            return EngineCpuReport(None, f"llama_cpp's libggml-cpu.so in {python} said {done.stdout[:80]!r}, naming no "
                                         "CPU features", self.cpu_fix)
        return EngineCpuReport(cpu, f"llama_cpp's libggml-cpu.so in {python}", self.cpu_fix)

    def check_host(self, config: Config, source: str, host: HostAccess) -> list[str]:
        """A warning, not a refusal: the interpreter may be installed into after the check."""
        python = config.server.python
        done = host.run([python, "-I", "-c", _FIND_LLAMA_CPP], 30.0)
        if done is not None and done.returncode == 0:
            return []
        return [f"server.python = {python} cannot import llama_cpp{host.who}: install llama-cpp-python[server] "
                "into it (e.g. python3 -m venv /opt/llm && /opt/llm/bin/pip install 'llama-cpp-python[server]')"
                + (", where that user can read and run it" if host.who else "")]
