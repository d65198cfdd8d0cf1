"""The inference engines an instance can run, behind one interface (`base.Engine`).

Built in: llama-cpp-python's server and llama.cpp's llama-server. This folder is the one
place that knows how they differ; the rest of numa-infer asks `engine_of(config)`.
"""

from numad_infer.engines.base import (
    KEY_CREDENTIAL,
    Engine,
    EngineCounters,
    HostAccess,
    KvCacheUse,
    engine_of,
    engines,
    get,
    names,
    register,
    unregister,
)
from numad_infer.engines.llama_cpp_python import LlamaCppPython
from numad_infer.engines.llama_server import LlamaServer

# llama-server is the default: parallel slots (more tokens/s under concurrency, bench/README.md)
# and the best CPU kernels for the machine chosen when it starts.
register(LlamaCppPython())
DEFAULT = register(LlamaServer()).name

__all__ = ["DEFAULT", "KEY_CREDENTIAL", "Engine", "EngineCounters", "HostAccess", "KvCacheUse", "LlamaCppPython",
           "LlamaServer", "engine_of", "engines", "get", "names", "register", "unregister"]
