"""Several models on one host: the `[[models]]` tables, and the one list every later step
reads, `served_models(config)`, whichever form the file uses.

Each served model comes with its *view*: the whole configuration as that model's
instances see it (its `[model]`, its nodes and instances per node, its slots and
arguments). The engines, the units and the memory check take a view, so they read one
model's values the way they always read `[model]`, and the single-`[model]` form is the
view of itself (nothing about it changes).

Pure. Checks across models (names, aliases, engine keys) raise `ConfigError` naming the
`models[i]` key and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import Field, field_validator

from numad_infer.config.values import NodeSelection, SafeStr, Section
from numad_infer.errors import ConfigError

if TYPE_CHECKING:
    from numad_infer.config.schema import Config

# A name is a unit instance name's part (`infer@<name>-<node>`), an HAProxy backend name, a
# Prometheus label and what a client sends: letters, digits and `. _ : -` are valid in all
# four with no escaping. It starts with a letter so that no JSON number (`"model": 7`) reads
# as a name at the front door.
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9._:-]{0,63}")
NAME_RULE = ("1-64 letters, digits or . _ : -, starting with a letter, e.g. \"llama-3.1-8b\" (it becomes part of "
             "the unit names, the front door's routes and the metrics' `model` label)")


def _check_name(value: str) -> str:
    if not _NAME.fullmatch(value):
        raise ValueError(f"must be {NAME_RULE}")
    return value


class ModelEntry(Section):
    """One `[[models]]` table."""

    name: str = Field(
        description="the id clients send as `model`, and the model's part of its unit names; unique",
        json_schema_extra={"kind": "name"},
    )
    aliases: list[str] = Field(
        default_factory=list,
        description="other ids that route to this model at the front door, e.g. `[\"gpt-4o-mini\"]`",
        json_schema_extra={"kind": "list of names"},
    )
    path: SafeStr = Field(
        description="the GGUF file this model's instances load, as `model.path`",
        json_schema_extra={"kind": "absolute path"},
    )
    context_size: int = Field(4096, ge=64, le=1_048_576, description="as `model.context_size`, for this model")
    mlock: bool = Field(False, description="as `model.mlock`, for this model")
    nodes: NodeSelection = Field(
        "all",
        description="the nodes this model has instances on, as `placement.nodes`",
        json_schema_extra={"kind": "`\"all\"` or list of node ids"},
    )
    instances_per_node: int = Field(1, ge=1, le=256, description="this model's instances on each of its nodes")
    cores_per_instance: int = Field(
        0, ge=0, le=4096,
        description=(
            "physical cores per instance; `0`: an even share of what the models with a number leave on the node "
            "(split between every instance of the models with `0` there)"
        ),
    )
    parallel: int = Field(
        0, ge=0, le=64,
        description="llama-server only: this model's slots per instance; `0`: `server.parallel`",
    )
    extra_args: list[SafeStr] = Field(
        default_factory=list,
        description=(
            "more arguments for this model's instances, after `server.extra_args` (the last of an option wins); "
            "the same rules as `server.extra_args`"
        ),
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _check_name(value)

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, value: list[str]) -> list[str]:
        for alias in value:
            _check_name(alias)
        return value

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must be an absolute path, e.g. /var/lib/numa-infer/models/model.gguf")
        return value


@dataclass(frozen=True)
class ServedModel:
    """One model as the planner, the engines and the front door see it."""

    name: str  # what clients send; "" only in the single form without model.name
    aliases: tuple[str, ...]
    view: Config  # the configuration as this model's instances see it
    cores_per_instance: int  # 0: an even share of what is left
    key: str  # where it is configured, for messages: "model" or "models[1]"

    @property
    def ids(self) -> tuple[str, ...]:
        """Every id that routes to it."""
        return (self.name, *self.aliases) if self.name else self.aliases


def served_models(config: Config) -> tuple[ServedModel, ...]:
    """The models in the file's order: the single `[model]` as itself, or each `[[models]]`
    table with its view."""
    if config.model is not None:
        return (ServedModel(config.one_model.name, (), config, 0, "model"),)
    return tuple(_served(config, k, entry) for k, entry in enumerate(config.models))


def _served(config: Config, k: int, entry: ModelEntry) -> ServedModel:
    from numad_infer.config.schema import ModelSection

    server = config.server
    server_update: dict[str, object] = {"extra_args": [*server.extra_args, *entry.extra_args]}
    if entry.parallel:
        server_update["parallel"] = entry.parallel
    view = config.model_copy(update={
        "model": ModelSection(path=entry.path, name=entry.name, context_size=entry.context_size, mlock=entry.mlock),
        "models": [],
        "placement": config.placement.model_copy(update={"nodes": entry.nodes,
                                                          "instances_per_node": entry.instances_per_node}),
        "server": server.model_copy(update=server_update),
    })
    return ServedModel(entry.name, tuple(entry.aliases), view, entry.cores_per_instance, f"models[{k}]")


def multi(config: Config) -> bool:
    """The `[[models]]` form: names carry the model, the front door routes by `model`."""
    return config.model is None


def view_of(config: Config, model: str) -> Config:
    """The view of the model an instance serves (`Instance.model`)."""
    if config.model is not None:
        return config
    for served in served_models(config):
        if served.name == model:
            return served.view
    raise KeyError(f"no model {model!r} in the configuration")


def check_models(config: Config, source: str) -> None:
    """The checks across tables: one form, unique names and aliases (the engine keys of each
    table: engines/keys.py)."""
    if config.model is not None and config.models:
        raise ConfigError(source, "models", "and [model] are both set: use [model] for one model or [[models]] for "
                          "several (move [model]'s keys into a [[models]] table with a name), not both")
    if config.model is None and not config.models:
        raise ConfigError(source, "model", "is required: a [model] table with the GGUF file's path, or one "
                          "[[models]] table per model")
    if config.models:
        placement = config.placement
        for key in sorted(placement.model_fields_set & {"nodes", "instances_per_node"}):
            raise ConfigError(source, f"placement.{key}", f"is each model's own with [[models]]: move it into the "
                              f"[[models]] tables (models[i].{key})", getattr(placement, key), True)
        if placement.mode != "per-node":
            raise ConfigError(source, "placement.mode", "spreads one model over every node; with [[models]] each "
                              "model's instances are bound to their own nodes: use \"per-node\" (the default)",
                              placement.mode, True)
    seen: dict[str, str] = {}
    for k, entry in enumerate(config.models):
        for what, ident in (("name", entry.name), *(("aliases", a) for a in entry.aliases)):
            if ident in seen:
                raise ConfigError(source, f"models[{k}].{what}", f"\"{ident}\" is already {seen[ident]}; every name "
                                  "and alias must route to one model: rename one of them", ident, True)
            seen[ident] = f"models[{k}]'s " + ("name" if what == "name" else "alias")
