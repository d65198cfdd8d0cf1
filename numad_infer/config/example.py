"""etc/numa-infer.toml, the file the package installs as /etc/numa-infer.toml, generated from
the schema: the everyday keys only (`EVERYDAY`, in the schema's order), one line each with
a few words on what it is; numa-infer.toml(5) documents every key, the `[tuning]` table
and the arrays of tables. Each value is the schema's default unless `EVERYDAY` gives
another, and why. Pure.

`tools/config_reference.py` writes the file; tests/test_docs.py fails when it differs from
`example_toml()`, and tests/config/test_example.py loads it with the real loader.
"""

from __future__ import annotations

from dataclasses import dataclass

from numad_infer.config.reference import keys, table_of, tables

PATH = "etc/numa-infer.toml"  # in the source tree
WIDTH = 88  # a terminal's width, less an editor's line numbers
MAX_LINES = 60  # the everyday surface: what an operator reads before the man page

HEADER = (
    "numa-infer configuration: the everyday keys, each at its default unless it says",
    "otherwise. Every key is optional except model.path. numa-infer.toml(5) documents",
    "every key: each table's others, [tuning], [[models]] (several models: one table each",
    "in place of [model]) and [[tenants]] (clients with their own keys).",
    "Validate with `numa-infer check`.",
)


@dataclass(frozen=True)
class Shown:
    """An everyday key as the shipped file shows it."""

    note: str  # the line's comment: what the key is, in a few words (the man page has the rest)
    value: str | None = None  # TOML; None: the default
    why: str = ""  # why `value` or `commented`, for whoever changes it (the file shows only the default)
    commented: bool = False  # written as a comment: the key is not set


# Which keys are everyday, the rule: a key an operator sets for their host, their model or
# their clients (which file, which nodes and CPUs, which port, how many slots, the queue a
# client may meet, who may call) is shown; a key whose default is a measurement (a bench's
# figure) or a protocol's timing is [tuning]'s; the rest of a table (a key few hosts need,
# or one that only matters beside another) is in numa-infer.toml(5), not here.
EVERYDAY: dict[str, Shown] = {
    "model.path": Shown("the GGUF file; required", '"/var/lib/numa-infer/models/model.gguf"',
                        "required, so the schema has no default: the path README.md's install steps copy the "
                        "model to"),
    "model.name": Shown('the id clients send as "model"', '"model"',
                        'clients send one id, "model", whichever file is loaded; the default, the file\'s path, '
                        "names a directory layout and changes when the file moves"),
    "model.context_size": Shown("tokens per instance (per slot with llama-server)"),
    "model.mlock": Shown("lock the weights in RAM"),
    "placement.mode": Shown('or "interleave": one instance over all nodes'),
    "placement.nodes": Shown("or a list of node ids", why="with [[models]] each model has its own "
                             "(models[].nodes) and a set placement.nodes is refused", commented=True),
    "placement.smt": Shown("true: every logical CPU, not one per core"),
    "placement.reserve_cpus": Shown('CPUs kept for the OS and the daemon, e.g. "0"'),
    "placement.instances_per_node": Shown("instances on each node", why="with [[models]] each model has its "
                                          "own and a set one is refused", commented=True),
    "placement.threads": Shown("generation threads; `numa-infer tune` measures them"),
    "placement.threads_batch": Shown('prompt threads; "auto": as threads'),
    "server.engine": Shown('or "llama-cpp-python"'),
    "server.parallel": Shown("slots: requests one instance serves at once", "4",
                             "llama-server is the shipped engine for its slots (more tokens/s under concurrency, "
                             "bench/README.md); with one slot the front door would queue every request behind the "
                             "one in progress"),
    "server.host": Shown("the instances' address"),
    "server.base_port": Shown("instance k listens on base_port + k"),
    "server.api_key_file": Shown('file of the key clients send; "": none'),
    "server.extra_args": Shown("more arguments for the engine"),
    "monitor.interval_s": Shown("seconds between monitoring passes"),
    "monitor.startup_grace_s": Shown("model loading time"),
    "monitor.repair": Shown("false: report NUMA drift, never repair it"),
    "metrics.listen": Shown('Prometheus, e.g. "127.0.0.1:9464"; "": off'),
    "frontend.listen": Shown('the front door, one endpoint; "": off'),
    "frontend.queue_size": Shown("requests that may wait for an instance"),
    "frontend.queue_timeout_s": Shown("longest wait in that queue"),
    "frontend.affinity": Shown('or "header", "user", "none"'),
    "frontend.connections_per_source": Shown("per client address; 0: no cap"),
    "frontend.request_timeout_s": Shown("longest silence mid-request"),
    "frontend.health_path": Shown('answered by the front door; "": off'),
}


def _line(key: str, name: str, default: str | None) -> str:
    shown = EVERYDAY[key]
    value = shown.value if shown.value is not None else default
    if value is None:
        raise ValueError(f"{key} is required: EVERYDAY must give it a value")
    note = shown.note + (f" (default {default})" if default is not None and value != default else "")
    return f"{'# ' if shown.commented else ''}{name} = {value}  # {note}"


def example_toml() -> str:
    """The whole file."""
    lines = ["# " + line for line in HEADER]
    docs = keys()
    for table, _ in tables():
        if table_of(table)[1]:
            continue
        everyday = [doc for doc in docs if doc.section == table and doc.key in EVERYDAY]
        if everyday:
            lines += ["", f"[{table}]", *(_line(doc.key, doc.name, doc.default) for doc in everyday)]
    return "\n".join(lines) + "\n"
