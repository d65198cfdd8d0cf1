"""The `[server]` table: which engine every instance runs, its program, ports, slots, user,
API key file and extra arguments."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from numad_infer.config.defaults import INSTANCE_USER
from numad_infer.config.values import (
    SafeStr,
    Section,
    executable_path,
    plain_ip,
)


class ServerSection(Section):
    # A registered engine's name: an open set (a plugin registers more), so a string that
    # engines/keys.py checks against the registry in the validation pipeline.
    engine: SafeStr = Field(
        "llama-server",
        description=(
            "the inference server every instance runs: llama.cpp's native `llama-server` (the default: "
            "`parallel` slots with continuous batching, more tokens/s under concurrency, see "
            "`bench/README.md`; the best CPU kernels for the machine chosen when it starts) or "
            "llama-cpp-python's (`python -m llama_cpp.server`, one request at a time). A key of the engine not "
            "chosen is refused: `llama_server` and `parallel` are llama-server's, `python` llama-cpp-python's; "
            "to switch engines, remove the old one's keys and set the new one's"
        ),
        json_schema_extra={"kind": '`"llama-cpp-python"` or `"llama-server"`'},
    )
    # llama-server: its binary, and how many requests one instance serves at once (each
    # slot has its own context_size, so the instance's context is context_size x parallel).
    llama_server: SafeStr = Field(
        "/usr/bin/llama-server",
        description=(
            "llama-server only: the binary (Debian's `llama.cpp` package ships one where the release has it; "
            "else `scripts/build-llama-server`, in numa-infer's source tree, builds it from the pinned sdist's "
            "vendored llama.cpp: README.Debian says how); `check` refuses one that is missing, not executable "
            "or not llama-server"
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
                     "instance keeps its port when a cgroup takes other nodes away, and across a reload while it "
                     "runs; a new one takes the lowest free port)"),
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
            "more arguments for the chosen engine's server, each passed as one argument, e.g. "
            "`[\"--batch-size\", \"256\"]` (llama-server); an API key option "
            "(`--api-key`, `--api_key`, `--api-key-file`, any spelling, with or without `=`) is refused: argv and "
            "the units are world-readable, use `server.api_key_file`. Errors name an item, never show it"
        ),
    )
    # A root-only file holding the API key the instances require (Authorization: Bearer).
    api_key_file: SafeStr = Field(
        "",
        description=(
            "a root-only file (mode 600), e.g. `\"/etc/numa-infer/api-key\"`, holding the API key every instance "
            "requires: clients then send `Authorization: Bearer KEY` (also through the front door). A regular "
            "file (not a symlink), owned by the daemon's user "
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
            "and `check` says so when not; `\"root\"` keeps them root, with a warning. The default is the "
            "package's own user (sysusers.d), not `nobody`: other daemons run as `nobody` and could then read "
            "the servers' memory; where it does not exist (a source tree), the servers run as `nobody`, with a "
            "warning naming the fix. Under systemd the instances always get a `DynamicUser`"
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
                             "e.g. \"numa-infer\"")
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
