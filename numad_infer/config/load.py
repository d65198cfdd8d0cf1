"""Reading /etc/numa-infer.toml: TOML parsed, validated against the schema, and pydantic's
errors turned into one operator-facing line that names the file, the key and the fix.

`parse_config(text, source)` validates a document; `load_config(path)` only adds reading
the file."""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from numad_infer.config.defaults import DEFAULT_CONFIG_PATH
from numad_infer.config.models import check_models
from numad_infer.config.schema import Config
from numad_infer.errors import ConfigError


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


# Keys whose values an error never shows: every argument list (server's, and each [[models]] table's).
_UNSHOWN_KEYS = re.compile(r"(server|models\[\d+\])\.extra_args\b")


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
    if _UNSHOWN_KEYS.match(key):
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
    check_models(config, source)
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

