"""JSON read back from a file -> frozen dataclasses, every field checked against its annotation.

The state file and hold files sit on disk where a bug, an older version or another user
may have written them: `"pid": "1"` must be one clear "not a numa-infer state file", not
a TypeError three calls later. So nothing read from them reaches the code untyped: this
walks the dataclass's annotations (int, float, str, bool, enums, X | None, tuple[X, ...],
dict[str, X], nested dataclasses) and refuses the first value that does not fit, naming
its path in the document.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from enum import Enum
from typing import Any, TypeVar, Union

from numad_infer.errors import NumaInferError

T = TypeVar("T")


class DecodeError(NumaInferError):
    """A value of the wrong type or shape; the message names where it is ("instances[0].pid")."""


def decode(cls: type[T], data: Any, where: str = "") -> T:
    """`data` (parsed JSON) as an instance of the dataclass `cls`, or DecodeError."""
    return typing.cast(T, _value(cls, data, where or cls.__name__))


def _fields(cls: type) -> dict[str, Any]:
    module = sys.modules[cls.__module__]
    return typing.get_type_hints(cls, vars(module))


def _dataclass(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise DecodeError(f"{where}: an object expected, not {type(data).__name__}")
    hints = _fields(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise DecodeError(f"{where}: unknown field {unknown[0]!r}")
    values: dict[str, Any] = {}
    for name, spec in known.items():
        if name in data:
            values[name] = _value(hints[name], data[name], f"{where}.{name}")
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise DecodeError(f"{where}: field {name!r} is missing")
    return cls(**values)


def _value(hint: Any, data: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return _union(typing.get_args(hint), data, where)
    if origin is tuple:
        item, *rest = typing.get_args(hint)
        if rest != [Ellipsis] or not isinstance(data, list):
            raise DecodeError(f"{where}: a list expected, not {type(data).__name__}")
        return tuple(_value(item, v, f"{where}[{i}]") for i, v in enumerate(data))
    if origin is dict:
        key_type, value_type = typing.get_args(hint)
        if key_type is not str or not isinstance(data, dict):
            raise DecodeError(f"{where}: an object expected, not {type(data).__name__}")
        return {k: _value(value_type, v, f"{where}[{k!r}]") for k, v in data.items()}
    if hint is Any:
        return data
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _dataclass(hint, data, where)
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(data)
        except ValueError:
            raise DecodeError(f"{where}: {data!r} is not one of {[m.value for m in hint]}") from None
    return _scalar(hint, data, where)


def _union(options: tuple[Any, ...], data: Any, where: str) -> Any:
    if data is None:
        if type(None) in options:
            return None
        raise DecodeError(f"{where}: null is not allowed")
    errors = []
    for option in options:
        if option is type(None):
            continue
        try:
            return _value(option, data, where)
        except DecodeError as exc:
            errors.append(str(exc))
    raise DecodeError(errors[0])


def _scalar(hint: Any, data: Any, where: str) -> Any:
    # bool is an int in Python, but never one in a state file; an int is a fine float.
    if hint is bool:
        ok = isinstance(data, bool)
    elif hint is int:
        ok = isinstance(data, int) and not isinstance(data, bool)
    elif hint is float:
        ok = isinstance(data, (int, float)) and not isinstance(data, bool)
        data = float(data) if ok else data
    elif hint is str:
        ok = isinstance(data, str)
    else:  # pragma: no cover - a new annotation this module does not know yet
        raise DecodeError(f"{where}: cannot check a value of type {hint!r}")
    if not ok:
        raise DecodeError(f"{where}: {_kind(hint)} expected, not {type(data).__name__} {data!r:.40}")
    return data


def _kind(hint: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]
