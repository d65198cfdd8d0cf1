"""The `[frontend]` table: the front door (HAProxy over every instance): its address,
queue, timeouts, affinity and body limits."""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated

from pydantic import AfterValidator, Field, ValidationInfo, field_validator

from numad_infer.config.values import (
    SafeStr,
    Section,
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


class FrontendSection(Section):
    """The front door: one HAProxy endpoint over every instance (see numad_infer.frontdoor.control)."""

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
    # 1 by default: with a batch class, the queue's order alone leaves an interactive request
    # waiting for the next slot a batch request frees (bench/README.md, Tenants: 181 ms
    # against batch's 555 at p50 over real engines). One slot held while interactive
    # requests come costs batch that slot, and only then.
    interactive_reserve: int = Field(
        1, ge=0, le=1024,
        description=(
            "slots of a model's instances kept free for interactive requests while that model had one in the "
            "last 5 to 10 s, with `[[tenants]]`: a batch request waits in the front door while only these are free "
            "(up to its deadline); never every slot: batch keeps at least one; `0`: batch takes any free slot"
        ),
    )
    batch_delay_s: float = Field(
        10.0, ge=0, le=3600,
        description=(
            "how far back in the queue a `[[tenants]]` request of priority `\"batch\"` waits: it is served as if it "
            "had arrived this much later (HAProxy's `set-priority-offset`)"
        ),
    )
    # Not strict: TOML gives a string, which pydantic's strict mode would refuse for an enum.
    affinity: Affinity = Field(
        # The default: later turns 1.08-2.11x faster than least connections at p50, no cost
        # where nothing is shared (bench/README.md, run 7); idle beside a waiting request
        # for prefix_wait_s at most, and the load bound keeps a hot prompt spread.
        Affinity.PREFIX, strict=False,
        description=(
            "keep the turns of a conversation on the instance that holds its prompt prefix. `\"prefix\"`: a "
            "hash of the prompt's start (chat: the first message, and the second too when the first "
            "is the system prompt; completions: `prompt`; the `affinity_header` instead when a request sends "
            "it) picks the instance, but never one above `prefix_balance_factor` x the mean load. "
            "`\"header\"`, `\"user\"`: a stick table on a request header or on the OpenAI `user` field, the "
            "first turn to the least busy instance. `\"none\"`: least connections only. The body is read from "
            "bodies up to `model.context_size` x 8 bytes (which sizes HAProxy's buffers); a longer body or one "
            "without a key is still served"
        ),
    )
    # 256: ~50 words of a first message tell conversations apart (each message cut on its own).
    prefix_bytes: int = Field(
        256, ge=16, le=65536,
        description=(
            "the bytes of each hashed message (or of `prompt`) that make the key of the `\"prefix\"` "
            "affinity; conversations that agree on them share an instance"
        ),
    )
    # 1.25: swept in bench/README.md run 8 (1.1: later turns 1.92x; 1.25-2: 2.24-2.32x).
    prefix_balance_factor: float = Field(
        1.25, ge=1.01, le=10.0,
        description=(
            "the load bound of the `\"prefix\"` affinity: no instance takes a request that would bring its load "
            "(requests served and waiting for it) above this many times the mean of its model's instances; the "
            "request goes to the next instance in its key's order instead"
        ),
    )
    # 1.0 (bench/README.md run 7; 3 and 10 no better, 0 read histories again: 0.70-0.91x;
    # waiting with no limit left instances idle beside waiting requests).
    prefix_wait_s: float = Field(
        1.0, ge=0, le=30,
        description=(
            "under the `\"prefix\"` affinity, how long a chat's later turn waits for its own instance (the one "
            "that holds its history) when that instance is busy, before it runs on another (or waits in the "
            "queue for any) and reads its history again there; 0: never waits"
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
    affinity_expire_s: float = Field(
        1800.0, gt=0, le=86400 * 7,
        description="a conversation idle this long may land elsewhere",
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
    # 5 s: a request's line and headers come in one packet or a few; a connection that sends
    # nothing holds HAProxy's room for others this long at most (docs/security.md).
    header_timeout_s: float = Field(
        5.0, gt=0, le=300,
        description=(
            "longest wait for a request's line and headers, on a new connection or a kept-alive one; the body "
            "then has 30 s more to arrive whole; a client that sends nothing is closed after this"
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


