"""A configuration's engine keys checked against the registered engines: the name is one
of them, no `extra_args` item hands any engine an API key, and no key of another engine is
set. The schema knows an engine by its name alone (it is an open set: a plugin registers
more), so these checks run here, once, in the validation pipeline that `check`, the
daemon and `tune --apply` share (validate/pipeline.py)."""

from __future__ import annotations

from numad_infer.config.schema import Config
from numad_infer.engines.base import engines, names
from numad_infer.errors import ConfigError


def check_engine_keys(config: Config, source: str) -> None:
    """ConfigError naming the key and the fix for the first problem; None when all hold."""
    server = config.server
    if server.engine not in names():
        choices = ", ".join(repr(name) for name in names())
        raise ConfigError(source, "server.engine", f"must be one of {choices}", server.engine, True)
    _check_key_flags(server.extra_args, source, "server.extra_args")
    # Each [[models]] table's engine keys, as server's: its extra_args reach the same argv.
    for k, entry in enumerate(config.models):
        _check_key_flags(entry.extra_args, source, f"models[{k}].extra_args")
    for engine in engines():
        if engine.name == server.engine:
            continue
        # A key of another engine is a mistake: it would silently do nothing.
        for key in sorted(server.model_fields_set & engine.own_keys):
            raise ConfigError(source, f"server.{key}", f"applies to server.engine = \"{engine.name}\" only, and "
                              f"server.engine is \"{server.engine}\"; remove the key or change the engine",
                              getattr(server, key), True)
        for k, entry in enumerate(config.models):
            for key in sorted(entry.model_fields_set & engine.own_keys):
                raise ConfigError(source, f"models[{k}].{key}", f"applies to server.engine = \"{engine.name}\" only, "
                                  f"and server.engine is \"{server.engine}\"; remove the key from this [[models]] "
                                  "table or change the engine", getattr(entry, key), True)


def _check_key_flags(extra_args: list[str], source: str, key: str) -> None:
    # Every engine's spellings, whichever engine is chosen: switching engines must not turn
    # a refused argument into an accepted one.
    flags = frozenset().union(*(engine.key_flags for engine in engines()))
    for index, arg in enumerate(extra_args):
        name = arg.partition("=")[0]
        # argparse (llama_cpp.server) also takes an unambiguous prefix such as --api_k.
        if len(name) >= len("--api") and any(flag.startswith(name) for flag in flags):
            # argv is world-readable (/proc/PID/cmdline) and so are the rendered units.
            # Only the flag's name is shown (never the value): its value, or the next
            # argument, may be the key.
            raise ConfigError(source, key,
                              f"item {index} is {name}, which hands the server an API key (or key file) on the "
                              "command line, where every user on the host can read it, and behind the daemon's "
                              "back; remove it and put the key in a root-only file (mode 600) named by "
                              "server.api_key_file")
