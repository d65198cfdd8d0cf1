"""Reading /etc/numa-infer.toml: TOML parsed, validated against the schema, and pydantic's
errors turned into operator-facing lines, one per problem, each naming the file, the key
and the fix.

What a table allows, where a key belongs and which table a key is in are read from the
schema (the pydantic models' fields), never from a list of names kept by hand.

`parse_config(text, source)` validates a document; `load_config(path)` only adds reading
the file."""

from __future__ import annotations

import datetime
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
from numad_infer.config.reference import heading, table_of
from numad_infer.config.schema import Config
from numad_infer.config.tuning import MOVED, MOVED_TABLES
from numad_infer.errors import ConfigError


class ConfigProblems(ConfigError):
    """Every problem of one file, one line each (`FILE: KEY: problem; fix`); its key,
    problem and value are the first's."""

    def __init__(self, problems: list[ConfigError]) -> None:
        first = problems[0]
        super().__init__(first.source, first.key, first.problem, first.value, first.value is not None)
        self.problems = tuple(problems)
        self.args = ("\n".join(str(p) for p in problems),)


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The table at `loc`: `()` is the file's top, `("server",)` its [server] table and
    `("models", 1)` its second [[models]] table (each read from the schema: reference.table_of)."""
    if not loc:
        return Config
    if not isinstance(loc[0], str) or loc[0] not in Config.model_fields:
        return None
    model, array = table_of(loc[0])
    rest = loc[1:]
    return model if (not rest and not array) or (array and len(rest) == 1 and isinstance(rest[0], int)) else None


def _header(loc: tuple[Any, ...]) -> str:
    """The header of the table at `loc`, as the file writes it."""
    return heading(loc[0]) if loc else "the top of the file"


def _unknown_key(loc: tuple[Any, ...], raw: Mapping[str, Any]) -> str:
    """An unknown key's problem and fix: the table it belongs in, if another table has it,
    else the nearest key of its own table and every key that table allows."""
    name, model = str(loc[-1]), _model_at(loc[:-1])
    # One model form or the other: the file's own, when it uses one.
    skip = {"models"} if "model" in raw and "models" not in raw else {"model"} if "models" in raw else set()
    homes = [heading(section) for section in Config.model_fields
             if section not in skip and (table := table_of(section)[0]) is not model and name in table.model_fields]
    if homes:
        return f"unknown key; it belongs in {' or '.join(homes)}: move it there"
    allowed = list(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(name, allowed, n=1)
    hint = f'; did you mean "{close[0]}"?' if close else ""
    return f"unknown key{hint} (allowed here: {', '.join(allowed)})" if allowed else f"unknown key{hint}"


def _moved(key: str) -> str | None:
    """A knob in its old table (`frontend.prefix_wait_s`): its new place, or None for another key."""
    name = MOVED.get(key)
    return f"moved to [tuning] as {name}; move it there" if name is not None else None


def _moved_table(source: str, error: Mapping[str, Any]) -> list[ConfigError] | None:
    """A table that moved whole (`[systemd]`): one line for each of its keys, or None for
    another error."""
    loc = tuple(error["loc"])
    if error["type"] != "extra_forbidden" or len(loc) != 1 or loc[0] not in MOVED_TABLES:
        return None
    table, value = str(loc[0]), error.get("input")
    names = [old.partition(".")[2] for old in MOVED if old.startswith(f"{table}.")]
    if not isinstance(value, dict) or not value:
        return [ConfigError(source, table, f"moved into [tuning] ({', '.join(MOVED[f'{table}.{n}'] for n in names)}): "
                            "set those keys there, and remove this table")]
    problems = []
    for key in value:
        close = difflib.get_close_matches(str(key), names, n=1)
        problem = _moved(f"{table}.{key}") or (
            f"unknown key; [{table}] moved into [tuning]" + (f': did you mean {MOVED[f"{table}.{close[0]}"]} there?'
                                                           if close else ": see numa-infer.toml(5)"))
        problems.append(ConfigError(source, f"{table}.{key}", problem))
    return problems


def _missing(loc: tuple[Any, ...]) -> str:
    model = _model_at(loc[:-1])
    field = model.model_fields.get(str(loc[-1])) if model is not None else None
    extra = field.json_schema_extra if field is not None else None
    kind = extra.get("kind") if isinstance(extra, dict) else None
    value = f"<{kind}>" if isinstance(kind, str) else "..."
    table = "that " + _header(loc[:-1]) + " table" if loc[:-1] and isinstance(loc[-2], int) else _header(loc[:-1])
    return f"is required; add {loc[-1]} = {value} to {table}"


def _toml_type(value: Any) -> str:
    """What TOML calls the value's type, as an operator wrote it."""
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return "an array of tables"
    names = ((bool, "true or false"), (int, "a whole number"), (float, "a number"), (str, "a string"),
             (list, "a list"), (dict, "a table"), (datetime.date, "a date"), (datetime.time, "a time"))
    return next((word for kind, word in names if isinstance(value, kind)), "another type")


def _plain(value: Any) -> bool:
    """A value an error can show as written: no table, no date (their Python form is not TOML's)."""
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return isinstance(value, (str, int, float))


def _wrong_form(loc: tuple[Any, ...], kind: str, value: Any) -> str | None:
    """`[models]` written for `[[models]]` (or `[[server]]` for `[server]`): the fix, or None."""
    if len(loc) != 1 or loc[0] not in Config.model_fields:
        return None
    name, array = loc[0], table_of(loc[0])[1]
    if array and kind == "list_type" and isinstance(value, dict):
        return (f"is a single [{name}] table; write [[{name}]] (an array of tables), one [[{name}]] table for each "
                f"{name.removesuffix('s')}, not [{name}]")
    if not array and kind in ("model_type", "dict_type") and isinstance(value, list):
        return f"is an array of tables [[{name}]]; write one [{name}] table, not [[{name}]]"
    return None


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
        return ConfigError(source, key, _moved(key) or _unknown_key(loc, raw))
    if kind == "missing":
        return ConfigError(source, key, _missing(loc))
    value = error.get("input")
    form = _wrong_form(loc, kind, value)
    if form is not None:
        return ConfigError(source, key, form)
    # A table or a date is named by its type, never shown as Python writes it; an argument list
    # may hold a secret (an API key typed into it): the key is named, never the value.
    shown = _plain(value) and not _UNSHOWN_KEYS.match(key)
    ctx = error.get("ctx") or {}
    bounds = {"less_than_equal": "at most {le}", "greater_than_equal": "at least {ge}",
              "less_than": "less than {lt}", "greater_than": "greater than {gt}"}
    if kind in bounds:
        return ConfigError(source, key, "must be " + bounds[kind].format(**ctx), value, shown)
    if kind in _TYPE_NAMES:
        return ConfigError(source, key, f"must be {_TYPE_NAMES[kind]}, not {_toml_type(value)}", value, shown)
    if kind in ("literal_error", "enum"):
        return ConfigError(source, key, f"must be one of {ctx['expected']}", value, shown)
    message = error["msg"].removeprefix("Value error, ")
    if not _plain(value):
        message = f"is {_toml_type(value)}: {message}"
    return ConfigError(source, key, message, value, shown)


_HEADER = re.compile(r"\s*(\[\[?)\s*([A-Za-z0-9_-]+)\s*\]\]?\s*(#.*)?")


def _declared_twice(text: str, detail: str, source: str) -> ConfigError | None:
    """A table TOML refused to declare again (`[tenants]` beside `[[tenants]]`, `[server]`
    twice): the file's line of each and the fix, or None for another TOML error."""
    at = re.search(r"at line (\d+)", detail)
    lines = text.splitlines()
    if at is None or not 0 < int(at[1]) <= len(lines):
        return None
    here = _HEADER.fullmatch(lines[int(at[1]) - 1])
    if here is None:
        return None
    name = here[2]
    earlier = [(n, h[1]) for n, line in enumerate(lines[:int(at[1]) - 1], 1)
               if (h := _HEADER.fullmatch(line)) is not None and h[2] == name]
    if not earlier:
        return None
    line, form = earlier[0]
    listed = table_of(name)[1] if name in Config.model_fields else form == "[["
    one, many = f"[{name}]", f"[[{name}]]"
    this, that = (f"{bracket}{name}{bracket.replace('[', ']')}" for bracket in (here[1], form))
    where = (f"{this} at line {line} and again at line {at[1]}" if this == that
             else f"{this} at line {at[1]} beside {that} at line {line}")
    if listed:
        fix = f"write {many} for each {name.removesuffix('s')}, no {one}"
    elif form == here[1] == "[":
        fix = f"merge the two into one {one} table"
    else:
        fix = f"write one {one} table, no {many}"
    return ConfigError(source, name, f"{where}; {fix}")


def parse_config(text: str, source: str = DEFAULT_CONFIG_PATH) -> Config:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        detail = str(exc).replace("at end of document", f"at line {text.count(chr(10)) + 1}, the end of the file")
        raise _declared_twice(text, detail, source) or ConfigError(source, None, f"invalid TOML: {detail}") from None
    except RecursionError:
        # tomllib recurses once per nested array or inline table.
        raise ConfigError(source, None, "invalid TOML: arrays or tables nested too deeply") from None
    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        # An unknown key first: a typo ("modle") also explains the "missing" that follows.
        errors = sorted(exc.errors(include_url=False), key=lambda e: e["type"] != "extra_forbidden")
        # Every problem, one line each: an operator fixes them all in one edit.
        found = [p for e in errors for p in (_moved_table(source, e) or [_error_to_config_error(source, raw, e)])]
        problems = list({str(p): p for p in found}.values())
        raise (problems[0] if len(problems) == 1 else ConfigProblems(problems)) from None
    check_models(config, source)
    return config


# Where an example lies: the .deb's, then a source tree's (a clone, an editable install).
_EXAMPLES = (Path("/usr/share/doc/numa-infer/examples/numa-infer.toml"),
             Path(__file__).resolve().parents[2] / "etc" / "numa-infer.toml")


def _example_hint() -> str:
    """Name an example this install has, never one it lacks."""
    found = next((path for path in _EXAMPLES if path.is_file()), None)
    if found is not None:
        return f"copy {found} there and set its model path"
    return ("write one: a [model] table with path = \"/path/to/model.gguf\" is enough; numa-infer.toml(5) lists "
            "every key")


def load_config(path: str | os.PathLike[str] = DEFAULT_CONFIG_PATH) -> Config:
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(source, None, f"file not found; {_example_hint()}, or pass --config") from None
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

