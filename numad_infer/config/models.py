"""Several models on one host: the `[[models]]` tables, and the one list every later step
reads, `served_models(config)`, whichever form the file uses.

Each served model comes with its *view*: the whole configuration as that model's
instances see it (its `[model]`, its nodes and instances per node, its slots and
arguments), a `ModelView` (config/schema.py) whose `model` is always set. The engines, the
units and the memory check take a view, so they read one model's values the way they
always read `[model]`, and the type checker refuses them a whole `Config`. The single
`[model]` form's view is built the same way, with the same values (nothing about it
changes).

Pure. Checks across models (names, aliases, engine keys) raise `ConfigError` naming the
`models[i]` key and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from numad_infer.config.model_tables import ModelEntry
from numad_infer.config.schema import Config, ModelSection, ModelView
from numad_infer.config.tenants import check_tenants
from numad_infer.errors import ConfigError

__all__ = ["ModelEntry", "ModelView", "ServedModel", "check_models", "find", "served_models"]


@dataclass(frozen=True)
class ServedModel:
    """One model as the planner, the engines and the front door see it, whichever form
    configured it: the single `[model]` is the one-entry list of itself."""

    name: str  # what clients send; "" only in the single form without model.name
    aliases: tuple[str, ...]
    view: ModelView  # the configuration as this model's instances see it, its `model` set
    cores_per_instance: int  # 0: an even share of what is left
    key: str  # the table that configures it, for messages: "model" or "models[1]"
    # The model's one key: what its instances carry as `Instance.model`, what memory needs,
    # backends, the front door and status are looked up by. "" in the single form (its unit
    # names carry no model, whatever model.name says), else its name.
    ident: str = ""
    # The view's keys that its own table sets (`placement.nodes` is `models[k].nodes`): where
    # a refusal of that value sends the operator.
    own: frozenset[str] = frozenset()
    # The view's keys its own table could set (a fix may name `models[k].parallel` though
    # the value came from `server.parallel`).
    settable: frozenset[str] = frozenset()

    @property
    def own_table(self) -> bool:
        """A `[[models]]` table configures it (its keys are `models[k].*`, its units carry its
        name); False for the single `[model]`, whose keys and unit names are as they were."""
        return self.key != "model"

    @property
    def ids(self) -> tuple[str, ...]:
        """Every id that routes to it."""
        return (self.name, *self.aliases) if self.name else self.aliases

    def key_for(self, view_key: str, *, fix: bool = False) -> str:
        """The key that sets the value its view reads at `view_key`: its own table's
        (`model.path` -> `models[1].path`, `placement.nodes` -> `models[1].nodes`) where that
        table sets it, else the shared one; `fix`: the key to set for this model alone, its
        table's wherever it has one. The single form is its own view."""
        section, _, field = view_key.partition(".")
        own = self.settable if fix else self.own
        return f"{self.key}.{field}" if section == "model" or view_key in own else view_key

    def rekeyed(self, exc: ConfigError) -> ConfigError:
        """A refusal raised while reading this model's view, naming the key in its own
        table where it sets the value (the only place that maps view keys to file keys)."""
        if exc.key is None or (key := self.key_for(exc.key)) == exc.key:
            return exc
        return ConfigError(exc.source, key, exc.problem.replace(exc.key, key), exc.value, exc.value is not None)


def served_models(config: Config) -> tuple[ServedModel, ...]:
    """The models in the file's order: the single `[model]` as itself, or each `[[models]]`
    table with its view. Called once per load (validate/pipeline.py): everything after
    takes the result, carried in `Loaded`."""
    if config.model is not None:
        return (ServedModel(config.model.name, (), ModelView.of(config, config.model), 0, "model"),)
    return tuple(_served(config, k, entry) for k, entry in enumerate(config.models))


# The view keys a [[models]] table always sets (its nodes and instances per node; its
# extra_args follow server's), and those it can set (threads and slots when given).
_ALWAYS_OWN = frozenset({"placement.nodes", "placement.instances_per_node", "server.extra_args"})
_SETTABLE = _ALWAYS_OWN | {"placement.threads", "placement.threads_batch", "server.parallel"}


def _served(config: Config, k: int, entry: ModelEntry) -> ServedModel:
    server = config.server
    server_update: dict[str, object] = {"extra_args": [*server.extra_args, *entry.extra_args]}
    own = set(_ALWAYS_OWN)
    if entry.parallel:
        server_update["parallel"] = entry.parallel
        own.add("server.parallel")
    placement_update: dict[str, object] = {"nodes": entry.nodes, "instances_per_node": entry.instances_per_node}
    for key in ("threads", "threads_batch"):
        if getattr(entry, key) is not None:
            placement_update[key] = getattr(entry, key)
            own.add(f"placement.{key}")
    view = ModelView.of(config.model_copy(update={
        "models": [],
        "placement": config.placement.model_copy(update=placement_update),
        "server": server.model_copy(update=server_update),
    }), ModelSection(path=entry.path, name=entry.name, context_size=entry.context_size, mlock=entry.mlock))
    return ServedModel(entry.name, tuple(entry.aliases), view, entry.cores_per_instance, f"models[{k}]",
                       entry.name, frozenset(own), _SETTABLE)


def find(served: tuple[ServedModel, ...], ident: str) -> ServedModel:
    """The served model whose key is `ident` (`Instance.model`); KeyError for none."""
    for model in served:
        if model.ident == ident:
            return model
    raise KeyError(f"no model {ident!r} is served")


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
    ids = tuple(seen) if config.models else ((config.model.name,) if config.model and config.model.name else ())
    check_tenants(config.tenants, ids, config.frontend.enabled, source)
