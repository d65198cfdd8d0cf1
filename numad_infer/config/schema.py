"""/etc/numa-infer.toml: the whole schema, table by table (`[server]` and `[frontend]`,
the two biggest, have their own modules). Parsing and its operator-facing messages are
config/load.py.

Pure. Checks that need the machine (node ids, CPUs, model size) live in
`numad_infer.plan.placement`, and those that need the engine registry in
`numad_infer.engines.keys`; both report with the same `ConfigError` shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator, model_validator

from numad_infer.config.frontend import FrontendSection
from numad_infer.config.model_tables import ModelEntry
from numad_infer.config.server import ServerSection
from numad_infer.config.tenants import TenantEntry
from numad_infer.config.tuning import Tuned, TuningSection
from numad_infer.config.values import (
    ModelPath,
    NodeSelection,
    SafeStr,
    Section,
    ThreadCount,
    check_model_name,
    parse_listen,
)
from numad_infer.util.cpuset import CpuListError, parse_list


class ModelSection(Section):
    path: ModelPath = Field(
        description="GGUF model every instance loads; must be a readable regular file, also for the instances' user",
        json_schema_extra={"kind": "absolute path"},
    )
    # The id clients send: without it the engines report the file's path, which names a
    # directory layout rather than a model and changes when the file moves.
    name: str = Field(
        "",
        description=(
            "the model's id: what clients send as `model` and what `/v1/models` lists (llama-server `--alias`, "
            "llama-cpp-python `--model_alias`); 1-64 letters, digits or `. _ : -`, starting with a letter; "
            "`\"\"`: the engine's "
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

    @field_validator("name")
    @classmethod
    def _model_name(cls, value: str) -> str:
        return check_model_name(value) if value else value


class PlacementSection(Section):
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




@dataclass(frozen=True)
class SystemdSection:
    """What the systemd backend reads, from `[tuning]` (`unit_dir`, `unit_template`): no
    longer a table of the file, `config.systemd` keeps its old spelling."""

    unit_dir: str
    template: str


class MonitorSection(Tuned):
    """`[monitor]`. Its tuning knobs are `[tuning]`'s, still read here: `Tuned`."""

    interval_s: float = Field(
        5.0, gt=0, le=3600,
        description="seconds between monitoring passes",
    )
    startup_grace_s: float = Field(
        300.0, ge=0, le=86400,
        description="model loading time during which failed probes do not count",
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
    min_local_fraction: float = Field(
        0.9, ge=0, le=1,
        description="anonymous memory on the instance's `mems` below this is memory drift",
    )
    repair: bool = Field(
        True,
        description="false: report drift, never re-pin or migrate",
    )

    @property
    def probe_timeout_s(self) -> float:
        """`tuning.probe_timeout_s`."""
        return self._tuning.probe_timeout_s

    @property
    def unhealthy_after(self) -> int:
        """`tuning.unhealthy_after`."""
        return self._tuning.unhealthy_after

    @property
    def restart_backoff_s(self) -> float:
        """`tuning.restart_backoff_s`."""
        return self._tuning.restart_backoff_s

    @property
    def numa_maps_interval_s(self) -> float:
        """`tuning.numa_maps_interval_s`."""
        return self._tuning.numa_maps_interval_s


class MetricsSection(Section):
    # Off by default; an address other than loopback only when the operator writes one.
    listen: SafeStr = Field(
        "",
        description=(
            "Prometheus endpoint `/metrics`: per-instance health, state, restarts, probe latency, local "
            "memory fraction, threads, requests in flight and queued, llama-server's decode tokens/s, busy "
            "slots and slots, drift events and repairs by kind, the pass duration, the front door's state and"
            " queue; e.g. `\"127.0.0.1:9464\"`; `\"\"`: off; loopback unless you write another address"
        ),
        json_schema_extra={"kind": "`\"ADDRESS:PORT\"` or `\"\"`"},
    )

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        if value:
            parse_listen(value)
        return value




# Each table's description heads its section of numa-infer.toml(5) and of the shipped file.
class Config(Section):
    model: ModelSection | None = Field(
        None,
        description=(
            "the model every instance serves; each instance reads its own copy of the weights into its nodes' "
            "memory (mmap is off, so no page of them lands on another node). For several models, use `[[models]]` "
            "instead"
        ),
    )
    models: list[ModelEntry] = Field(
        default_factory=list,
        description=(
            "several models on one host, one `[[models]]` table each, instead of `[model]`: each gets its own "
            "instances on its own cores of its nodes (`placement`'s other keys apply to all), its units are "
            "`<template>@<name>-<node>`, and the front door routes each request by its JSON `model` (or an alias) "
            "to that model's instances"
        ),
    )
    placement: PlacementSection = Field(
        default_factory=PlacementSection,
        description="which NUMA nodes and cores the instances get; `numa-infer plan` shows the result",
    )
    server: ServerSection = Field(
        default_factory=ServerSection,
        description=(
            "what every instance runs (the engine, its program, slots and arguments), where it listens, the "
            "API key it requires and, under the process backend, its user"
        ),
    )
    monitor: MonitorSection = Field(
        default_factory=MonitorSection,
        description="health probes, restarts, and NUMA drift (threads or memory off their nodes) and its repair",
    )
    metrics: MetricsSection = Field(
        default_factory=MetricsSection,
        description="the Prometheus endpoint",
    )
    frontend: FrontendSection = Field(
        default_factory=FrontendSection,
        description=(
            "the front door: one OpenAI endpoint over every instance, an HAProxy that the daemon configures "
            "and drives"
        ),
    )
    tenants: list[TenantEntry] = Field(
        default_factory=list,
        description=(
            "clients of the front door, one `[[tenants]]` table each, with their own key and limits: once one is "
            "set, every request through the front door needs one of their keys (`401` without), and is held to "
            "its tenant's limits (`429`) and models (`403`). Needs the front door (`frontend.listen`). The "
            "instances' own key (`server.api_key_file`) is then sent to them by the front door"
        ),
    )
    # Last: the man page documents its knobs after every everyday key.
    tuning: TuningSection = Field(
        default_factory=TuningSection,
        description=(
            "knobs an operator should not need: benchmarked or protocol defaults of the front door, the monitor "
            "and the systemd backend, kept settable for benchmark sweeps and unusual hosts. Each was once a key "
            "of another table; written there, it is refused with its new place"
        ),
    )

    @model_validator(mode="after")
    def _bind_tuning(self) -> Config:
        """Give `[frontend]` and `[monitor]` this file's `[tuning]` (each a copy of its own, so a
        section object shared with another `Config` keeps that one's)."""
        self.__dict__["frontend"] = self.frontend.tuned(self.tuning)
        self.__dict__["monitor"] = self.monitor.tuned(self.tuning)
        return self

    @property
    def systemd(self) -> SystemdSection:
        """The systemd backend's unit directory and template name (`[tuning]`'s)."""
        return SystemdSection(self.tuning.unit_dir, self.tuning.unit_template)


class ModelView(Config):
    """One model's view of the configuration: the whole file as that model's instances see
    it (its `[model]`, its nodes, instances per node, slots and arguments), with `model`
    always set. What reads one model's keys takes a `ModelView`, so the type checker refuses
    a whole `Config` there (a `[[models]]` file as a whole has no single model).

    Never parsed from a file: config/models.py's `served_models` builds one per model with
    `of`, for `[model]` and `[[models]]` alike."""

    model: ModelSection  # narrowed: a view always has its model

    @classmethod
    def of(cls, config: Config, model: ModelSection) -> ModelView:
        """`config`'s values with `model` as its `[model]`: the same objects, not validated
        again (they were, as `config`)."""
        values = dict(config)
        values["model"] = model
        return cls.model_construct(_fields_set=config.model_fields_set | {"model"}, **values)
