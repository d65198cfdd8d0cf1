"""Errors an operator sees: each carries a message that says what to do, never a traceback.

One hierarchy: every error numa-infer raises for an operator derives from `NumaInferError`,
so `cli.main` catches them all in one place (tests/test_layers.py checks it).
"""

from __future__ import annotations

from typing import Any


class NumaInferError(Exception):
    """Base of every error the CLI turns into `numa-infer: <message>` and exit status 1."""

    # Several problems in one error, a line each (config/load.ConfigProblems); empty: the error is one.
    problems: tuple[NumaInferError, ...] = ()


class TopologyError(NumaInferError):
    """The sysfs tree cannot be understood as a NUMA machine."""


class ConfigError(NumaInferError):
    """An invalid setting, rendered as `FILE: KEY = VALUE: PROBLEM`.

    Here, not in config/schema.py, so edges that refuse a setting (the model file, the unit
    directory, haproxy) need not import the schema (pydantic) to say so.
    """

    def __init__(self, source: str, key: str | None, problem: str, value: Any = None, has_value: bool = False) -> None:
        self.source, self.key, self.problem, self.value = source, key, problem, value
        where = source if key is None else f"{source}: {key}"
        if has_value:
            where += f" = {_show(value)}"
        super().__init__(f"{where}: {problem}")


def _show(value: Any) -> str:
    # repr() makes control characters visible: an operator must see the "\n" they typed.
    if isinstance(value, str):
        return '"' + repr(value)[1:-1].replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)
