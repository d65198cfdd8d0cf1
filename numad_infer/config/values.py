"""The value types the TOML file's sections share: text without control characters, node
selections, thread counts, program paths, IP addresses and `ADDRESS:PORT`; and the base
of every section (unknown keys refused, strict types, frozen)."""

from __future__ import annotations

import ipaddress
import os
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict

# C0 and C1 controls and Unicode's line and paragraph separators: none has a use in a path,
# an argument or a header, each is invisible in an editor, and Python's `splitlines` (and
# editors) break a line at U+0085, U+2028 and U+2029 where systemd does not.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _no_control_chars(value: str) -> str:
    if _CONTROL.search(value):
        raise ValueError("contains a control character (newline, CR, tab, NUL...); remove it")
    return value


SafeStr = Annotated[str, AfterValidator(_no_control_chars)]

# The one rule for a model's name (`model.name`, `models[].name`, `models[].aliases`): it is
# a unit instance name's part (`infer@<name>-<node>`), an HAProxy backend name, a Prometheus
# label and what a client sends: letters, digits and `. _ : -` are valid in all four with no
# escaping. It starts with a letter so that no JSON number (`"model": 7`) reads as a name at
# the front door. One rule for both forms, so that moving `[model]` into `[[models]]` (the
# fix `check` suggests) never meets a refusal the single form did not have.
_MODEL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9._:-]{0,63}")
MODEL_NAME_RULE = ("1-64 letters, digits or . _ : -, starting with a letter, e.g. \"llama-3.1-8b\" (it becomes part "
                   "of the unit names, the front door's routes and the metrics' `model` label)")


def check_model_name(value: str) -> str:
    """`value` if it keeps the model-name rule (ValueError naming the rule otherwise)."""
    if not _MODEL_NAME.fullmatch(value):
        raise ValueError(f"must be {MODEL_NAME_RULE}")
    return value


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


def _absolute_model_path(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError("must be an absolute path, e.g. /var/lib/numa-infer/models/model.gguf")
    return value


# A model file's path (`model.path`, `models[k].path`): absolute, so that it means the same
# file to the daemon, the units and the instances, whatever their working directory.
ModelPath = Annotated[SafeStr, AfterValidator(_absolute_model_path)]
NodeSelection = Annotated[Literal["all"] | list[int], BeforeValidator(_node_selection)]
# "auto" (threads = the instance's CPUs: today's rule) or a count, which the planner checks
# against each instance's CPUs.
def _thread_count(value: Any) -> Any:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 4096):
        return value
    raise ValueError('must be "auto" or a number of threads from 1 to 4096')


ThreadCount = Annotated[Literal["auto"] | int, BeforeValidator(_thread_count)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)



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

