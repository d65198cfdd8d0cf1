"""/etc/numa-infer.toml: schema, parsing and operator-facing error messages.

Pure: `parse_config(text, source)` validates a document; `load_config(path)` only adds
reading the file. Checks that need the machine (node ids, CPUs, model size) live in
`numad_infer.plan.placement`, which reports them with the same `ConfigError` shape.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from numad_infer.config.defaults import DEFAULT_CONFIG_PATH as DEFAULT_CONFIG_PATH  # re-exported (`as` says so to mypy)
from numad_infer.config.defaults import INSTANCE_USER
from numad_infer.errors import ConfigError as ConfigError  # re-exported: the one ConfigError, see errors.py
from numad_infer.util.cpuset import CpuListError, parse_list

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _no_control_chars(value: str) -> str:
    if _CONTROL.search(value):
        raise ValueError("contains a control character (newline, CR, tab, NUL...); remove it")
    return value


SafeStr = Annotated[str, AfterValidator(_no_control_chars)]


def _node_selection(value: Any) -> Any:
    # Checked before pydantic's union so the operator gets one message, not one per branch.
    usage = 'must be "all" or a list of node ids such as [0, 1]'
    if value == "all":
        return value
    if not isinstance(value, list):
        raise ValueError(usage)
    if not value:
        raise ValueError(f"is empty; {usage}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ValueError(f"{usage} (node ids are whole numbers >= 0)")
    if len(set(value)) != len(value):
        raise ValueError("lists a node more than once")
    return value


NodeSelection = Annotated[Literal["all"] | list[int], BeforeValidator(_node_selection)]
# "auto" (threads = the instance's CPUs: today's rule) or a count, which the planner checks
# against each instance's CPUs.
def _thread_count(value: Any) -> Any:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 4096):
        return value
    raise ValueError('must be "auto" or a number of threads from 1 to 4096')


ThreadCount = Annotated[Literal["auto"] | int, BeforeValidator(_thread_count)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelSection(_Section):
    path: SafeStr = Field(
        description="GGUF model every instance loads; must be a readable regular file, also for the instances' user",
        json_schema_extra={"kind": "absolute path"},
    )
    # The id clients send: without it the engines report the file's path, which names a
    # directory layout rather than a model and changes when the file moves.
    name: str = Field(
        "",
        description=(
            "the model's id: what clients send as `model` and what `/v1/models` lists (llama-server `--alias`, "
            "llama-cpp-python `--model_alias`); letters, digits and `. _ : -`, at most 64; `\"\"`: the engine's "
            "own id, the file's path"
        ),
        json_schema_extra={"kind": "name or `\"\"`"},
    )
    context_size: int = Field(
        4096, ge=64, le=1_048_576,
        description="context window (tokens) per instance; with llama-server, per slot",
    )
    mlock: bool = Field(
        False,
        description="lock the weights in RAM; the units then get `LimitMEMLOCK=infinity`",
    )

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must be an absolute path, e.g. /var/lib/numa-infer/models/model.gguf")
        return value

    @field_validator("name")
    @classmethod
    def _model_name(cls, value: str) -> str:
        if value and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}", value):
            raise ValueError("must be 1-64 letters, digits or . _ : - (starting with a letter or digit), "
                             "e.g. \"llama-3.1-8b\"")
        return value


class PlacementSection(_Section):
    mode: Literal["per-node", "interleave"] = Field(
        "per-node",
        description=(
            "one instance per node, or one over all selected nodes with `NUMAPolicy=interleave` (models "
            "bigger than a node)"
        ),
    )
    nodes: NodeSelection = Field(
        "all",
        description=(
            "nodes to use; CPU-less nodes never host an instance (listing one is an error in per-node mode; "
            "in interleave mode its memory is used)"
        ),
        json_schema_extra={"kind": "`\"all\"` or list of node ids"},
    )
    smt: bool = Field(
        False,
        description="false: one thread per physical core (lowest sibling); true: every logical CPU",
    )
    reserve_cpus: SafeStr = Field(
        "",
        description=(
            "CPUs kept for the OS and the daemon, e.g. `\"0\"`, `\"0,64\"`; reserving a CPU reserves its whole "
            "core"
        ),
        json_schema_extra={"kind": "CPU list"},
    )
    instances_per_node: int = Field(
        1, ge=1, le=256,
        description=(
            "split each node's cores into this many instances (along shared-L3 boundaries when they divide "
            "evenly); names become `infer@<node>.<k>`"
        ),
    )
    threads: ThreadCount = Field(
        "auto",
        description=(
            "threads per instance for generation (decoding): `\"auto\"` is one per CPU of the instance (one per "
            "physical core unless `smt = true`); a number takes that many, the instance's first CPUs in order. "
            "`numa-infer tune` measures which is fastest"
        ),
        json_schema_extra={"kind": '`"auto"` or int >= 1'},
    )
    threads_batch: ThreadCount = Field(
        "auto",
        description=(
            "threads per instance for prompt processing (compute-bound, where SMT siblings may help): "
            "`\"auto\"` is the same as `threads`"
        ),
        json_schema_extra={"kind": '`"auto"` or int >= 1'},
    )

    @field_validator("reserve_cpus")
    @classmethod
    def _cpu_list(cls, value: str) -> str:
        try:
            parse_list(value)
        except CpuListError as exc:
            raise ValueError(f"not a CPU list ({exc}); write e.g. \"0\", \"0,64\" or \"0-1\"") from exc
        return value

    @property
    def reserved(self) -> frozenset[int]:
        return parse_list(self.reserve_cpus)


class ServerSection(_Section):
    # A registered engine's name: an open set (a plugin registers more), so a string that
    # engines/keys.py checks against the registry in the validation pipeline.
    engine: SafeStr = Field(
        "llama-server",
        description=(
            "the inference server every instance runs: llama.cpp's native `llama-server` (the default: "
            "`parallel` slots with continuous batching, more tokens/s under concurrency, see "
            "`bench/README.md`; the best CPU kernels for the machine chosen when it starts) or "
            "llama-cpp-python's (`python -m llama_cpp.server`, one request at a time); keys of the other "
            "engine are refused"
        ),
        json_schema_extra={"kind": '`"llama-cpp-python"` or `"llama-server"`'},
    )
    # llama-server: its binary, and how many requests one instance serves at once (each
    # slot has its own context_size, so the instance's context is context_size x parallel).
    llama_server: SafeStr = Field(
        "/usr/bin/llama-server",
        description=(
            "llama-server only: the binary (`scripts/build-llama-server` builds it from the pinned sdist's "
            "vendored llama.cpp; Debian's `llama.cpp` package ships one where the release has it); `check` "
            "refuses one that is missing, not executable or not llama-server"
        ),
        json_schema_extra={"kind": "absolute path"},
    )
    parallel: int = Field(
        1, ge=1, le=64,
        description=(
            "llama-server only: requests one instance works on at once (its slots); each slot gets "
            "`model.context_size` tokens, so the instance's context is `context_size x parallel`; the front "
            "door sends each instance at most this many requests at once"
        ),
    )
    host: SafeStr = Field(
        "127.0.0.1",
        description="listen address of every instance",
        json_schema_extra={"kind": "IP address"},
    )
    base_port: int = Field(
        8080, ge=1, le=65535,
        description=("the k-th instance of the plan listens on `base_port + k` (k counted on the whole machine: an "
                     "instance keeps its port when a cgroup takes other nodes away)"),
    )
    python: SafeStr = Field(
        "/usr/bin/python3",
        description=(
            "llama-cpp-python only: the interpreter that has llama-cpp-python (no `$ \" ' \\` : systemd refuses"
            " them in an executable path)"
        ),
        json_schema_extra={"kind": "absolute path"},
    )
    extra_args: list[SafeStr] = Field(
        default_factory=list,
        description=(
            "more server arguments (of the chosen engine), each passed as one argument; an API key option "
            "(`--api-key`, `--api_key`, `--api-key-file`, any spelling, with or without `=`) is refused: argv and "
            "the units are world-readable, use `server.api_key_file`. Errors name an item, never show it"
        ),
    )
    # A root-only file holding the API key the instances require (Authorization: Bearer).
    api_key_file: SafeStr = Field(
        "",
        description=(
            "a root-only file (mode 600) holding the API key every instance requires (`Authorization: Bearer "
            "KEY`, also through the front door): a regular file (not a symlink), owned by the daemon's user "
            "(root), in a directory no one else can write (not /tmp), under directories others cannot rename it "
            "out of; it reaches the servers as a systemd credential (process "
            "backend: their environment), never argv or a unit file; an instance that refuses the key is "
            "reported as such, not restarted; `\"\"`: no key"
        ),
        json_schema_extra={"kind": "absolute path or `\"\"`"},
    )
    # Process backend, daemon run as root: the user the servers are dropped to (systemd
    # units always get a DynamicUser instead). "root" keeps them root, with a warning.
    # Not `nobody` by default: other daemons share it, and could read the servers' memory.
    user: SafeStr = Field(
        INSTANCE_USER,
        description=(
            "process backend only, daemon run as root: the user the servers run as (switched between fork and"
            " exec, with that user's own groups only); the model and `server.python` must be readable by it, "
            "and `check` says so when not; `\"root\"` keeps them root, with a warning. The default user is "
            "made by the package (sysusers.d); where it does not exist (a source tree), the servers run as "
            "`nobody`, with a warning naming the fix. Under systemd the instances always get a `DynamicUser`"
        ),
        json_schema_extra={"kind": "user name"},
    )

    @field_validator("engine")
    @classmethod
    def _engine_name(cls, value: str) -> str:
        # Which names exist is the registry's business (engines/keys.py, run by the
        # validation pipeline); here only the shape of a name.
        if not _ENGINE_NAME.match(value):
            raise ValueError("must be an engine's name, such as \"llama-server\" or \"llama-cpp-python\"")
        return value

    @field_validator("user")
    @classmethod
    def _user_name(cls, value: str) -> str:
        if not _USER_NAME.match(value):
            raise ValueError("must be a user name (letters, digits, _ . -; not starting with - or a digit), "
                             "e.g. \"nobody\"")
        return value

    @field_validator("host")
    @classmethod
    def _ip(cls, value: str) -> str:
        plain_ip(value, "must be an IP address such as 127.0.0.1, 0.0.0.0 or ::1")
        return value

    @field_validator("python")
    @classmethod
    def _absolute(cls, value: str) -> str:
        return executable_path(value, "/opt/llm/bin/python3")

    @field_validator("llama_server")
    @classmethod
    def _server_binary(cls, value: str) -> str:
        return executable_path(value, "/usr/local/bin/llama-server")

    @field_validator("api_key_file")
    @classmethod
    def _key_path(cls, value: str) -> str:
        if value and not value.startswith("/"):
            raise ValueError("must be an absolute path, e.g. /etc/numa-infer/api-key, or \"\" (no key)")
        if value and any(c in value for c in ":%$\\\" "):
            # It goes into LoadCredential=ID:PATH, where these would need quoting systemd lacks.
            raise ValueError("may not contain : % $ \\ \" or spaces; use a plain path")
        return value


_USER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")
_ENGINE_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_UNIT_PREFIX = re.compile(r"^[A-Za-z][A-Za-z0-9_.:-]{0,63}$")
# Template units that systemd or common packages ship: a rendered `<name>@.service` in
# /run/systemd/system would shadow theirs (`user@` would break every login session).
_FOREIGN_TEMPLATES = frozenset({
    "user", "user-runtime-dir", "getty", "serial-getty", "container-getty", "console-getty", "autovt", "modprobe",
    "systemd-fsck", "systemd-backlight", "systemd-journald", "systemd-udevd", "systemd-cryptsetup", "capsule",
    "dbus", "openvpn", "wg-quick", "postgresql", "ssh", "sshd", "haproxy", "nginx", "lvm2-pvscan", "mdmon",
    "dhcpcd", "wpa_supplicant", "ifup", "rescue", "emergency", "kmod-static-nodes", "numa-infer",
})


class SystemdSection(_Section):
    unit_dir: SafeStr = Field(
        "/run/systemd/system",
        description="where units are rendered; as root it must be owned by root and not writable by others",
        json_schema_extra={"kind": "absolute path"},
    )
    template: SafeStr = Field(
        "infer",
        description=(
            "units are `<template>@<instance>.service`; names of units systemd or common packages ship are "
            "refused"
        ),
        json_schema_extra={"kind": "unit-name prefix"},
    )

    @field_validator("unit_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must be an absolute directory such as /run/systemd/system")
        return value

    @field_validator("template")
    @classmethod
    def _unit_name(cls, value: str) -> str:
        if not _UNIT_PREFIX.match(value):
            raise ValueError(
                "must start with a letter, then up to 63 of a-z A-Z 0-9 _ . : - "
                "(it becomes <template>@<n>.service), e.g. \"infer\""
            )
        if value in _FOREIGN_TEMPLATES or value.startswith("systemd-"):
            raise ValueError("names a unit systemd or another package ships; pick a name of your own, e.g. \"infer\"")
        return value


class MonitorSection(_Section):
    interval_s: float = Field(
        5.0, gt=0, le=3600,
        description="seconds between monitoring passes",
    )
    probe_timeout_s: float = Field(
        2.0, gt=0, le=600,
        description=(
            "timeout of the health probe (a route that never waits on the model, so a busy server answers at "
            "once: `GET /docs` for llama-cpp-python, `GET /health` for llama-server)"
        ),
    )
    startup_grace_s: float = Field(
        300.0, ge=0, le=86400,
        description="model loading time during which failed probes do not count",
    )
    unhealthy_after: int = Field(
        3, ge=1, le=1000,
        description="consecutive failed probes before a restart",
    )
    max_restarts: int = Field(
        5, ge=1, le=1000,
        description=(
            "restarts within `restart_window_s` before the instance is marked failed (left alone until a "
            "reload)"
        ),
    )
    restart_window_s: float = Field(
        900.0, gt=0,
        description="window for `max_restarts`",
    )
    restart_backoff_s: float = Field(
        5.0, ge=0, le=3600,
        description=(
            "the first restart in the window is immediate; each later one waits this long, doubled each time "
            "(state `backoff`)"
        ),
    )
    min_local_fraction: float = Field(
        0.9, ge=0, le=1,
        description="anonymous memory on the instance's `mems` below this is memory drift",
    )
    numa_maps_interval_s: float = Field(
        300.0, gt=0,
        description=(
            "without cgroup v2 `memory.numa_stat`, how often `/proc/PID/numa_maps` (which walks all page "
            "tables) may be read"
        ),
    )
    repair: bool = Field(
        True,
        description="false: report drift, never re-pin or migrate",
    )


def executable_path(value: str, example: str) -> str:
    """A program systemd will run (ExecStart=): absolute, normalized, a file name at the end."""
    if not value.startswith("/"):
        raise ValueError(f"must be an absolute path to the program, e.g. {example}")
    bad = sorted(set(value) & set("$\"'\\"))
    if bad:
        # systemd refuses quotes and backslashes in an executable name outright, and
        # expands "$" in argv[0] but not in the path: no quoting makes it safe.
        raise ValueError(f"may not contain {' '.join(bad)}; use a path (or symlink) without them")
    if value.endswith("/") or "//" in value or os.path.normpath(value) != value:
        # systemd refuses a path that names a directory or is not normalized (found by fuzzing).
        raise ValueError(f"must be a plain path to the program file (no trailing /, //, /./ or /../), e.g. {example}")
    return value


def plain_ip(text: str, usage: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IP address with nothing else in it, as haproxy.cfg, unit files and URLs take it."""
    if "%" in text:
        # Python accepts any text after the % (spaces, "#", "]"): it would reach haproxy.cfg
        # verbatim, and a link-local address is no place for a server anyway.
        raise ValueError("has an IPv6 zone ID (%...), which numa-infer does not take; use an address without "
                         "one: [::1], or a global or unique-local IPv6 address")
    try:
        return ipaddress.ip_address(text)
    except ValueError as exc:
        raise ValueError(usage) from exc


def parse_listen(value: str, example: str = "127.0.0.1:9464") -> tuple[str, int]:
    """ "127.0.0.1:9464" or "[::1]:9464" -> (address, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f'must be "ADDRESS:PORT", e.g. "{example}", or "" (off)')
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    address = plain_ip(host, f'{host!r} is not an IP address; write e.g. "{example}"')
    if address.version == 6 and not bracketed:
        raise ValueError(f'write an IPv6 address in brackets, e.g. "[{host}]:{port}"')
    return host, int(port)


class MetricsSection(_Section):
    # Off by default; an address other than loopback only when the operator writes one.
    listen: SafeStr = Field(
        "",
        description=(
            "Prometheus endpoint `/metrics`: per-instance health, state, restarts, probe latency, local "
            "memory fraction, threads, requests in flight and queued, llama-server's decode tokens/s, busy "
            "slots and slots, drift events and repairs by kind, the pass duration, the front door's state and"
            " queue; `\"\"`: off; loopback unless you write another address"
        ),
        json_schema_extra={"kind": "`\"ADDRESS:PORT\"` or `\"\"`"},
    )

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        if value:
            parse_listen(value)
        return value


class Affinity(str, Enum):
    """Which instance a request goes to when it belongs to a conversation."""

    NONE = "none"  # least connections only
    HEADER = "header"  # a request header (frontend.affinity_header) names the conversation
    USER = "user"  # the OpenAI "user" field of the JSON body names it


_HEADER_NAME = re.compile(r"^[A-Za-z0-9-]{1,64}$")


class FrontendSection(_Section):
    """The front door: one HAProxy endpoint over every instance (see numad_infer.frontdoor.control)."""

    # "" turns the front door off: clients then talk to the instances' own ports.
    listen: SafeStr = Field(
        "127.0.0.1:8000",
        description=(
            "the front door: one OpenAI endpoint (HAProxy) over every instance; `\"\"` turns it off (clients "
            "then use the instances' ports)"
        ),
        json_schema_extra={"kind": "`\"ADDRESS:PORT\"` or `\"\"`"},
    )
    haproxy: SafeStr = Field(
        "/usr/sbin/haproxy",
        description="the HAProxy binary (2.6 or newer; Debian's `haproxy` package)",
        json_schema_extra={"kind": "absolute path"},
    )
    queue_size: int = Field(
        64, ge=1, le=100_000,
        description=(
            "requests that may wait for a free instance; one more gets `503` (JSON body, `Retry-After: 1`) at"
            " once"
        ),
    )
    queue_timeout_s: float = Field(
        30.0, gt=0, le=3600,
        description="longest wait in that queue before a `503`",
    )
    # Not strict: TOML gives a string, which pydantic's strict mode would refuse for an enum.
    affinity: Affinity = Field(
        Affinity.NONE, strict=False,
        description=(
            "keep the turns of a conversation on the instance that holds its prompt prefix: by a request "
            "header, or by the OpenAI `user` field of the JSON body (read from bodies up to "
            "`model.context_size` x 8 bytes, which sizes HAProxy's buffers); the first turn goes to the least "
            "busy instance"
        ),
    )
    affinity_header: SafeStr = Field(
        "X-Session-Id",
        description="the header `affinity = \"header\"` reads",
        json_schema_extra={"kind": "header name"},
    )
    affinity_expire_s: float = Field(
        1800.0, gt=0, le=86400 * 7,
        description="a conversation idle this long may land elsewhere",
    )
    drain_timeout_s: float = Field(
        120.0, ge=0, le=3600,
        description=(
            "before a restart the daemon makes, how long it waits for the instance's requests to finish; on a "
            "stop (SIGTERM), how long the closed front door waits for the requests it carries (0: no wait)"
        ),
    )
    request_timeout_s: float = Field(
        600.0, gt=0, le=86400,
        description="longest silence from a client or an instance in the middle of a request",
    )

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        if value:
            parse_listen(value, example="127.0.0.1:8000")
        return value

    @field_validator("haproxy")
    @classmethod
    def _binary(cls, value: str) -> str:
        return executable_path(value, "/usr/sbin/haproxy")

    @field_validator("affinity_header")
    @classmethod
    def _header(cls, value: str) -> str:
        if not _HEADER_NAME.match(value):
            raise ValueError("must be an HTTP header name: 1-64 of a-z A-Z 0-9 -, e.g. X-Session-Id")
        return value

    @property
    def enabled(self) -> bool:
        return bool(self.listen)

    @property
    def address(self) -> tuple[str, int]:
        return parse_listen(self.listen)


class Config(_Section):
    model: ModelSection
    placement: PlacementSection = Field(default_factory=PlacementSection)
    server: ServerSection = Field(default_factory=ServerSection)
    systemd: SystemdSection = Field(default_factory=SystemdSection)
    monitor: MonitorSection = Field(default_factory=MonitorSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    frontend: FrontendSection = Field(default_factory=FrontendSection)


def _section_fields(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] | None = Config
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return []
        annotation = model.model_fields[part].annotation
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return list(model.model_fields) if model is not None else []


_TYPE_NAMES = {
    "int_type": "a whole number", "float_type": "a number", "bool_type": "true or false",
    "string_type": "a string in quotes", "list_type": "a list such as [0, 1]", "model_type": "a [table]",
    "dict_type": "a [table]",
}


# Keys whose values an error never shows.
_UNSHOWN_KEYS = ("server.extra_args",)


def _error_to_config_error(source: str, raw: dict[str, Any], error: Mapping[str, Any]) -> ConfigError:
    loc = tuple(error["loc"])
    # A union (nodes = "all" | [..]) reports each branch; the key is what matters.
    loc = tuple(p for p in loc
                if not (isinstance(p, str) and (p.startswith(("literal[", "list[")) or p in ("str", "int"))))
    key = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in loc).replace(".[", "[")
    kind = error["type"]
    if kind == "extra_forbidden":
        allowed = _section_fields(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f'; did you mean "{close[0]}"?' if close else ""
        return ConfigError(source, key, f"unknown key{hint} (allowed here: {', '.join(allowed)})")
    if kind == "missing":
        return ConfigError(source, key, "is required")
    if key.startswith(_UNSHOWN_KEYS):
        # An argument list may hold a secret (an API key typed into it): name the key, never the value.
        return ConfigError(source, key, error["msg"].removeprefix("Value error, "))
    value = error.get("input")
    ctx = error.get("ctx") or {}
    bounds = {"less_than_equal": "at most {le}", "greater_than_equal": "at least {ge}",
              "less_than": "less than {lt}", "greater_than": "greater than {gt}"}
    if kind in bounds:
        return ConfigError(source, key, "must be " + bounds[kind].format(**ctx), value, True)
    if kind in _TYPE_NAMES:
        return ConfigError(source, key, f"must be {_TYPE_NAMES[kind]}, not {type(value).__name__}", value, True)
    if kind in ("literal_error", "enum"):
        return ConfigError(source, key, f"must be one of {error['ctx']['expected']}", value, True)
    message = error["msg"].removeprefix("Value error, ")
    return ConfigError(source, key, message, value, True)


def parse_config(text: str, source: str = DEFAULT_CONFIG_PATH) -> Config:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        detail = str(exc).replace("at end of document", f"at line {text.count(chr(10)) + 1}, the end of the file")
        raise ConfigError(source, None, f"invalid TOML: {detail}") from None
    except RecursionError:
        # tomllib recurses once per nested array or inline table.
        raise ConfigError(source, None, "invalid TOML: arrays or tables nested too deeply") from None
    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        # An unknown key first: a typo ("modle") also explains the "missing" that follows.
        errors = sorted(exc.errors(include_url=False), key=lambda e: e["type"] != "extra_forbidden")
        # One clear message beats a wall: report the first, say how many more.
        first = _error_to_config_error(source, raw, errors[0])
        if len(errors) > 1:
            first = ConfigError(source, None,
                                f"{first.args[0].removeprefix(source + ': ')} (and {len(errors) - 1} more problem(s))")
        raise first from None
    return config


def load_config(path: str | os.PathLike[str] = DEFAULT_CONFIG_PATH) -> Config:
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(source, None, "file not found; copy /usr/share/doc/numa-infer/examples/numa-infer.toml "
                          "or pass --config") from None
    except PermissionError:
        raise ConfigError(source, None, f"permission denied to uid {os.geteuid()}; make it readable by that user "
                          "(chmod a+r, or the ConfigMap's defaultMode) or pass --config") from None
    except IsADirectoryError:
        # A volume mounted where the file belongs (a ConfigMap without subPath, a hostPath typo).
        raise ConfigError(source, None, "is a directory, not a file; mount or copy the TOML file itself there, "
                          "or pass --config") from None
    except UnicodeDecodeError:
        raise ConfigError(source, None, "is not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(source, None, f"cannot read: {exc.strerror}") from None
    return parse_config(text, source)
