"""One `[[tenants]]` table: a client of the front door with its own key and limits
(frontdoor/tenants.py turns them into HAProxy's rules). Pure.

A tenant's name is a Prometheus label value and a word in haproxy.cfg, so it keeps the
model-name rule's characters; it comes from this file only, never from a request."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated

from pydantic import AfterValidator, Field, field_validator

from numad_infer.config.values import SafeStr, Section, check_model_name
from numad_infer.errors import ConfigError

Name = Annotated[str, AfterValidator(check_model_name)]


@dataclass(frozen=True)
class TenantKey:
    """A tenant and its key as validation read it (frontdoor/tenants.py writes it for HAProxy)."""

    tenant: str
    key: str = field(repr=False)  # never in a repr: not in a log line, a traceback or a test's diff


class Priority(str, Enum):
    """Which requests a busy front door's queue serves first (frontdoor/tenants.py)."""

    INTERACTIVE = "interactive"  # in arrival order
    BATCH = "batch"  # after the interactive requests of the next tuning.batch_delay_s


class TenantEntry(Section):
    """One `[[tenants]]` table."""

    name: Name = Field(
        description=(
            "the tenant, as the logs, metrics and `status` name it: 1-64 letters, digits or `. _ : -`, starting "
            "with a letter; unique"
        ),
        json_schema_extra={"kind": "name"},
    )
    key_file: SafeStr = Field(
        description=(
            "the file holding this tenant's API key (what its clients send as `Authorization: Bearer KEY`), under "
            "the same rules as `server.api_key_file`: owned by the daemon's user, mode 600, in a directory only "
            "that user can write, or a Kubernetes Secret volume. The front door gets the key through a file only "
            "HAProxy's user can read; a reload rotates or revokes it without restarting an instance"
        ),
        json_schema_extra={"kind": "absolute path"},
    )
    max_in_flight: int | None = Field(
        None, ge=1, le=100_000,
        description=(
            "requests of this tenant answered or queued at once; one more gets `429` with `Retry-After: 1`; unset: "
            "no limit but the front door's"
        ),
        json_schema_extra={"kind": "integer", "default": "no limit"},
    )
    requests_per_minute: int | None = Field(
        None, ge=1, le=1_000_000,
        description=(
            "requests of this tenant let through per minute (a sliding average; refused ones do not count); one "
            "more gets `429` with `Retry-After` of about one request's share of the minute; unset: no limit"
        ),
        json_schema_extra={"kind": "integer", "default": "no limit"},
    )
    # Not strict: TOML gives a string, which pydantic's strict mode would refuse for an enum.
    priority: Priority = Field(
        Priority.INTERACTIVE, strict=False,
        description=(
            "when every instance is busy and requests wait in the front door's queue: `\"interactive\"` ones are "
            "served in arrival order, and a `\"batch\"` one as if it had arrived `tuning.batch_delay_s` "
            "later, so interactive requests pass it, and none waits more than that delay longer than it would "
            "in arrival order (batch never starves)"
        ),
    )
    models: list[Name] | None = Field(
        None,
        description=(
            "the models (names or aliases) this tenant may use; a request for another gets `403`; unset: every "
            "model"
        ),
        json_schema_extra={"kind": "list of names", "default": "every model"},
    )

    @field_validator("key_file")
    @classmethod
    def _key_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must be an absolute path, e.g. /etc/numa-infer/tenants/team-a.key")
        return value


def check_tenants(tenants: list[TenantEntry], served_ids: tuple[str, ...], frontdoor: bool, source: str) -> None:
    """The checks across tables: unique names, known models, a front door to gate.
    `served_ids`: every name and alias a request may ask for."""
    if tenants and not frontdoor:
        raise ConfigError(source, "tenants", "needs the front door, which checks their keys: set frontend.listen "
                          "(e.g. \"127.0.0.1:8000\"), or remove the [[tenants]] tables")
    seen: set[str] = set()
    for k, tenant in enumerate(tenants):
        if tenant.name in seen:
            raise ConfigError(source, f"tenants[{k}].name", "is already another tenant's: every tenant needs its "
                              "own name", tenant.name, True)
        seen.add(tenant.name)
        for m, model in enumerate(tenant.models or ()):
            if model not in served_ids:
                served = ", ".join(served_ids) or "none by name (the single [model] has no model.name: set one)"
                raise ConfigError(source, f"tenants[{k}].models[{m}]", f"is not a model served here; served: "
                                  f"{served}", model, True)
        if tenant.models == []:
            raise ConfigError(source, f"tenants[{k}].models", "is empty, which would refuse every request of "
                              "this tenant: list its models, or leave it unset for every model", [], True)
