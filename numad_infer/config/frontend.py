"""The `[frontend]` table: the front door (HAProxy over every instance): its address,
queue, timeouts, affinity and body limits."""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated

from pydantic import AfterValidator, Field, ValidationInfo, field_validator

from numad_infer.config.tuning import Tuned
from numad_infer.config.values import (
    SafeStr,
    executable_path,
    parse_listen,
)


class Affinity(str, Enum):
    """Which instance a request goes to when it belongs to a conversation."""

    NONE = "none"  # least connections only
    PREFIX = "prefix"  # a hash of the prompt's first bytes picks the instance, within a load bound
    HEADER = "header"  # a request header (frontend.affinity_header) names the conversation
    USER = "user"  # the OpenAI "user" field of the JSON body names it


_HEADER_NAME = re.compile(r"^[A-Za-z0-9-]{1,64}$")


_HEALTH_PATH = re.compile(r"^/[A-Za-z0-9._~/-]{0,127}$")


def _listen(value: str) -> str:
    if value:
        parse_listen(value, example="127.0.0.1:8000")
    return value


def _header(value: str) -> str:
    if not _HEADER_NAME.match(value):
        raise ValueError("must be an HTTP header name: 1-64 of a-z A-Z 0-9 -, e.g. X-Session-Id")
    return value


# Checked as their own types, which keeps the section's class short enough to read.
ListenAddress = Annotated[SafeStr, AfterValidator(_listen)]
HaproxyBinary = Annotated[SafeStr, AfterValidator(lambda value: executable_path(value, "/usr/sbin/haproxy"))]
HeaderName = Annotated[SafeStr, AfterValidator(_header)]


class FrontendSection(Tuned):
    """The front door: one HAProxy endpoint over every instance (see numad_infer.frontdoor.control).
    Its tuning knobs are `[tuning]`'s, still read here (`front.prefix_wait_s`): `Tuned`."""

    # "" turns the front door off: clients then talk to the instances' own ports. On a
    # loopback address (or a wildcard) it listens on the other loopback address's port too:
    # `localhost` names both (util/addresses.py says why that is a credential matter).
    listen: ListenAddress = Field(
        "127.0.0.1:8000",
        description=(
            "the front door: one OpenAI endpoint (HAProxy) over every instance; `\"\"` turns it off (clients "
            "then use the instances' ports). On `127.0.0.1` or `0.0.0.0` it also listens on `[::1]` at the same "
            "port, on `::1` or `::` also on `127.0.0.1`: `localhost` names both, and a client that says it must "
            "not reach another user's socket there. Under systemd, `numa-infer-port.socket` holds the port from "
            "boot and while the daemon is stopped"
        ),
        json_schema_extra={"kind": "`\"ADDRESS:PORT\"` or `\"\"`"},
    )
    haproxy: HaproxyBinary = Field(
        "/usr/sbin/haproxy",
        description="the HAProxy binary (2.6 or newer; Debian's `haproxy` package)",
        json_schema_extra={"kind": "absolute path"},
    )
    queue_size: int = Field(
        64, ge=1, le=100_000,
        description=(
            "requests that may wait for a free instance; one more gets `503` (JSON body, `Retry-After: 1`) at"
            " once"
        ),
    )
    queue_timeout_s: float = Field(
        30.0, gt=0, le=3600,
        description="longest wait in that queue before a `503`",
    )
    # 0 by default: one deadline for both classes, as before. Never below queue_timeout_s:
    # an interactive request passes every batch one in the queue, so a shorter deadline for
    # batch would refuse requests that the queue's order would serve later anyway.
    batch_queue_timeout_s: float = Field(
        0.0, ge=0, le=3600,
        description=(
            "longest wait of a `[[tenants]]` request of priority `\"batch\"` (or sent with `X-Priority: batch`) "
            "before a `503`, at least `queue_timeout_s` (which then bounds the interactive requests' wait); a batch "
            "request waits in the front door until an instance has room, then enters the queue; `0`: "
            "`queue_timeout_s` for both"
        ),
    )
    # Not strict: TOML gives a string, which pydantic's strict mode would refuse for an enum.
    affinity: Affinity = Field(
        # The default: later turns up to 2x faster than least connections at p50, no cost
        # where nothing is shared (bench/README.md, "Prefix routing"); idle beside a waiting request
        # for prefix_wait_s at most, and the load bound keeps a hot prompt spread.
        Affinity.PREFIX, strict=False,
        description=(
            "keep the turns of a conversation on the instance that holds its prompt prefix. `\"prefix\"`: a "
            "hash of the prompt's start (chat: the first message, and the second too when the first "
            "is the system prompt; completions: `prompt`; the `affinity_header` instead when a request sends "
            "it) picks the instance, but never one above `tuning.prefix_balance_factor` x the mean load. "
            "`\"header\"`, `\"user\"`: a stick table on a request header or on the OpenAI `user` field, the "
            "first turn to the least busy instance. `\"none\"`: least connections only. The body is read from "
            "bodies up to `model.context_size` x 8 bytes (which sizes HAProxy's buffers); a longer body or one "
            "without a key is still served"
        ),
    )
    affinity_header: HeaderName = Field(
        "X-Session-Id",
        description=(
            "the header the `\"header\"` affinity reads; under the `\"prefix\"` affinity a request that "
            "sends it is hashed by it instead of by its prompt"
        ),
        json_schema_extra={"kind": "header name"},
    )
    drain_timeout_s: float = Field(
        120.0, ge=0, le=3600,
        description=(
            "before a restart the daemon makes, how long it waits for the instance's requests to finish; on a "
            "stop (SIGTERM), how long the closed front door waits for the requests it carries (0: no wait)"
        ),
    )
    surge: bool = Field(
        True,
        description=(
            "for a restart the daemon makes on purpose of a model's only instance in rotation, start a second copy "
            "beside it (same CPUs, another port) that serves until it is back, where its nodes' free memory fits one; "
            "false: requests wait for it (the hold)"
        ),
    )
    # 0: behind a load balancer every client shares its address (docs/security.md).
    connections_per_source: int = Field(
        0, ge=0, le=1_000_000,
        description="connections one client address may hold open at once, one more is refused; `0`: no cap",
    )
    request_timeout_s: float = Field(
        600.0, gt=0, le=86400,
        description="longest silence from a client or an instance in the middle of a request",
    )

    # Answered by HAProxy itself, never queued behind a busy instance: what an outer load
    # balancer or a Kubernetes probe checks (an engine's own /health through the front door
    # is one instance's, and waits in the queue with the completions).
    health_path: SafeStr = Field(
        "/healthz",
        description=(
            "answered by the front door itself, without waiting for an instance: `200` while at least one "
            "instance is in rotation (with several `[[models]]`: one of every model), `503` when none is (naming "
            "the model); for outer load balancers and probes; `\"\"`: off"
        ),
        json_schema_extra={"kind": "URL path or `\"\"`"},
    )

    @field_validator("batch_queue_timeout_s")
    @classmethod
    def _batch_deadline(cls, value: float, info: ValidationInfo) -> float:
        interactive = info.data.get("queue_timeout_s")
        if value and interactive is not None and value < interactive:
            raise ValueError(f"must be at least queue_timeout_s ({interactive:g}): a batch request may wait longer "
                             "than an interactive one, never less; raise it, or lower queue_timeout_s")
        return value

    @field_validator("health_path")
    @classmethod
    def _health_path(cls, value: str) -> str:
        if value and not _HEALTH_PATH.match(value):
            raise ValueError("must be a URL path: / then letters, digits and . _ ~ / -, e.g. \"/healthz\", "
                             "or \"\" (off)")
        if (value.rstrip("/") in ("/v1", "") and value) or value.startswith("/v1/"):
            raise ValueError("would answer in place of the OpenAI API (/v1/...); choose another, e.g. \"/healthz\"")
        return value

    @property
    def batch_deadline_s(self) -> float:
        """How long a batch request may wait for an instance (batch_queue_timeout_s, or the
        one queue deadline)."""
        return self.batch_queue_timeout_s or self.queue_timeout_s

    @property
    def enabled(self) -> bool:
        return bool(self.listen)

    @property
    def address(self) -> tuple[str, int]:
        return parse_listen(self.listen)

    @property
    def interactive_reserve(self) -> int:
        """`tuning.interactive_reserve`."""
        return self._tuning.interactive_reserve

    @property
    def batch_delay_s(self) -> float:
        """`tuning.batch_delay_s`."""
        return self._tuning.batch_delay_s

    @property
    def prefix_bytes(self) -> int:
        """`tuning.prefix_bytes`."""
        return self._tuning.prefix_bytes

    @property
    def prefix_balance_factor(self) -> float:
        """`tuning.prefix_balance_factor`."""
        return self._tuning.prefix_balance_factor

    @property
    def prefix_wait_s(self) -> float:
        """`tuning.prefix_wait_s`."""
        return self._tuning.prefix_wait_s

    @property
    def affinity_expire_s(self) -> float:
        """`tuning.affinity_expire_s`."""
        return self._tuning.affinity_expire_s

    @property
    def header_timeout_s(self) -> float:
        """`tuning.header_timeout_s`."""
        return self._tuning.header_timeout_s
