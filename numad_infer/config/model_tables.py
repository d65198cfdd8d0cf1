"""One `[[models]]` table: a model's file, its names, its placement and its engine keys.
What the served models become (each with its view of the configuration) is
config/models.py. Pure."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field, field_validator

from numad_infer.config.values import ModelPath, NodeSelection, SafeStr, Section, ThreadCount, check_model_name

# Checked item by item, so that a refusal names `models[0].aliases[1]`, not the whole list.
Name = Annotated[str, AfterValidator(check_model_name)]


class ModelEntry(Section):
    """One `[[models]]` table."""

    name: str = Field(
        description=(
            "the id clients send as `model`, and the model's part of its unit names: 1-64 letters, digits or "
            "`. _ : -`, starting with a letter; unique among every model's name and aliases"
        ),
        json_schema_extra={"kind": "name"},
    )
    aliases: list[Name] = Field(
        default_factory=list,
        description="other ids that route to this model at the front door, e.g. `[\"gpt-4o-mini\"]`",
        json_schema_extra={"kind": "list of names"},
    )
    path: ModelPath = Field(
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
    # Threads are the model's own: its instances have their own number of cores, and `tune --model`
    # measures and writes each model's.
    threads: ThreadCount | None = Field(
        None,
        description="as `placement.threads`, for this model's instances; `numa-infer tune --model NAME` writes it",
        json_schema_extra={"kind": '`"auto"` or int >= 1', "default": "placement.threads"},
    )
    threads_batch: ThreadCount | None = Field(
        None,
        description="as `placement.threads_batch`, for this model's instances",
        json_schema_extra={"kind": '`"auto"` or int >= 1', "default": "placement.threads_batch"},
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
        return check_model_name(value)

