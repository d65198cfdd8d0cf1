"""Tenants at the front door: each `[[tenants]]` table's key, limits and models
as HAProxy's rules, and the two files that carry keys to HAProxy. Pure.

Why it is done this way:
- a key names its tenant through a map file (`tenant-keys.map`, one `KEY TENANT` line
  each) beside haproxy.cfg: HAProxy reads it on every start and reload, as its own user,
  and nobody else can (mode 640, HAProxy's group). haproxy.cfg, world-readable and shown by
  `check`, names only the file. A key changed, added or revoked is a new file and a
  seamless reload: no instance restarts, no request in flight is dropped, and the next
  request is judged by the new keys.
- the key is read from `Authorization` whole (`req.fhdr`: a key may hold a comma) and
  must be a Bearer token (RFC 6750's token68), so it is one word in the map file.
- a request without a known key gets a JSON 401 before anything else runs: `/v1/models`
  included. The front door's health path is answered before, for probes without a key.
- per tenant, a stick table entry keyed by the tenant's name (from the map, so from the
  configuration, never from the request: the table holds at most one entry per tenant).
  `sc0_trackers` counts its requests in flight (answered or queued: the entry is tracked
  for the request's life); `gpc0_rate(60s)` its requests let through in the last minute
  (a request refused with 429 is not counted, so a tenant that floods gets its rate, no
  less). Counters start again at zero when HAProxy reloads: a limit is exact between
  reloads, not across them.
- priority: a `batch` tenant's request, or any request with `X-Priority: batch`, goes
  into a busy backend's queue as if it had come `tuning.batch_delay_s` later
  (`set-priority-offset`), not in a lower class (`set-priority-class`, which a steady
  interactive load would starve it with): interactive
  requests pass it, and it waits at most that much longer than in arrival order. The
  queue's deadline (`frontend.queue_timeout_s`) is the same for both: HAProxy 2.6 has one
  queue timeout per backend, not per request.
- a model the tenant may not use gets a JSON 403 in that model's backend (one rule per
  backend): the model is known there in both forms, without reading the body again.
- the instances' own key (`server.api_key_file`), when set, replaces the tenant's key on
  the way to them, from a second file (`upstream-key.map`) as private as the first: a
  client never learns it, and instances reached without the front door still require it.
  Two files, not one: no client-sent word can look up the instances' key as a tenant.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from numad_infer.config.models import ServedModel
from numad_infer.config.tenants import Priority, TenantEntry, TenantKey
from numad_infer.frontdoor import answers, names, routing

KEYS_NAME = "tenant-keys.map"
UPSTREAM_NAME = "upstream-key.map"
TABLE = names.TENANT_USAGE  # the backend that only holds the tenants' stick table
_UPSTREAM_ENTRY = "instances"  # upstream-key.map's one key
HEADER = "# numa-infer: written by the daemon from the [[tenants]] key files; do not edit\n"
# A request's own class, when lower than its tenant's (docs/frontdoor.md, "Priority").
PRIORITY_HEADER = "x-priority"
VARIABLE = names.TENANT  # the tenant's name, once its key is known (request_log.py may log it)
# Set on a batch request by the gate: what its offset in the queue, its header on to the hold
# frontend, its hold and its own deadline (batch_wait.py) go by, whatever batch_delay_s is.
BATCH_VARIABLE = names.BATCH
IS_BATCH = f"{{ var({BATCH_VARIABLE}) -m bool }}"
# The same on the hold frontend, which sees the request in a new stream: the gate's header
# (any client's own was removed before it was set).
HELD_BATCH = f"{{ req.hdr({PRIORITY_HEADER}) -m str {Priority.BATCH.value} }}"
ARRIVED = names.ARRIVED_MS  # when the gate saw the request (ms since the epoch): a batch deadline counts from it


def keys_text(keys: Sequence[TenantKey]) -> str:
    """tenant-keys.map: one `KEY TENANT` line per tenant."""
    return HEADER + "".join(f"{k.key} {k.tenant}\n" for k in keys)


def upstream_text(api_key: str | None) -> str:
    """upstream-key.map: the Authorization value the instances require, or nothing."""
    return HEADER + (f"{_UPSTREAM_ENTRY} Bearer {api_key}\n" if api_key else "")


# The one form a key is read from: exactly one Authorization header, `Bearer KEY` (the
# scheme in any case, one space, the key a token68 as config/tenants.py requires); a second
# header, another scheme or words after the key are a 401, never a guess at which counts.
_BEARER = r"^bearer [A-Za-z0-9._~+/-]+=*$"


def gate(tenants: Sequence[TenantEntry], keys: str, upstream: str, instance_key: bool,
         batch_delay_s: float = 0.0) -> list[str]:
    """The frontend's rules, before any routing: the key names the tenant, its limits and
    priority hold. `keys`, `upstream`: the two files' paths as HAProxy words; `instance_key`:
    the instances require their own key, which replaces the tenant's."""
    if not tenants:
        return []
    lines = [f"    http-request set-var({ARRIVED}) date(0,ms)",
             f"    http-request set-var({VARIABLE}) req.fhdr(authorization),word(2,' '),map({keys}) "
             f"if {{ req.fhdr_cnt(authorization) eq 1 }} {{ req.fhdr(authorization) -m reg -i '{_BEARER}' }}",
             # The connection closes with the 401: a client without a key holds no kept-alive one.
             answers.NO_KEY.rule(f"!{{ var({VARIABLE}) -m found }}"),
             f"    http-request track-sc0 var({VARIABLE}) table {TABLE}"]
    for tenant in tenants:
        me = f"{{ var({VARIABLE}) -m str {tenant.name} }}"
        if tenant.max_in_flight is not None:
            lines.append(answers.in_flight_limit(tenant.name, tenant.max_in_flight).rule(
                f"{me} {{ sc0_trackers gt {tenant.max_in_flight} }}"))
        if tenant.requests_per_minute is not None:
            rpm = tenant.requests_per_minute
            lines.append(answers.minute_limit(tenant.name, rpm).rule(f"{me} {{ sc0_gpc0_rate ge {rpm} }}"))
    # In the backend's queue as if it came batch_delay later: no class, so never starved. A
    # batch tenant's requests, and any request that asks for it (a nightly job of an
    # interactive tenant): a header lowers a request's class, never raises it.
    batch = [t.name for t in tenants if t.priority == Priority.BATCH]
    own = f"{{ var({VARIABLE}) -m str {' '.join(batch)} }} || " if batch else ""
    lines += [f"    http-request set-var({BATCH_VARIABLE}) bool(true) "
              f"if {own}{{ req.hdr({PRIORITY_HEADER}) -m str -i {Priority.BATCH.value} }}",
              f"    http-request set-priority-offset int({int(batch_delay_s * 1000)}) if {IS_BATCH}",
              f"    http-request del-header {PRIORITY_HEADER}",
              # Said again, as the class decided, for a request the hold lets go (hold.py): it
              # enters the backend's queue again from the hold frontend, where no key is read.
              f"    http-request set-header {PRIORITY_HEADER} {Priority.BATCH.value} if {IS_BATCH}"]
    lines.append(f"    http-request set-header Authorization %[str({_UPSTREAM_ENTRY}),map({upstream})]" if instance_key
                 else "    http-request del-header Authorization")
    # llama-server also takes a key from X-Api-Key (Anthropic's header): a tenant's key sent
    # there too would reach the instances, which never see one.
    lines.append("    http-request del-header X-Api-Key")
    return lines


def held_priority(tenants: Sequence[TenantEntry], batch_delay_s: float) -> list[str]:
    """The hold frontend's rules: a request let go after a hold queues in its backend again,
    as the batch it was (the gate's header, set after any client's own was removed)."""
    if not tenants:
        return []
    return [f"    http-request set-priority-offset int({int(batch_delay_s * 1000)}) if {HELD_BATCH}"]


def table(tenants: Sequence[TenantEntry]) -> list[tuple[str, str]]:
    """The tenants' counters (its backend, its line): one entry per tenant, never more."""
    if not tenants:
        return []
    return [(TABLE, f"    stick-table type string len 64 size {len(tenants)} store gpc0,gpc0_rate(60s)")]


def _may_use(tenant: TenantEntry, model: ServedModel) -> bool:
    return tenant.models is None or bool(set(tenant.models) & set(model.ids))


def model_rule(tenants: Sequence[TenantEntry], model: ServedModel) -> list[str]:
    """A model's backend's first rule: 403 for the tenants that may not use it."""
    refused = [t.name for t in tenants if not _may_use(t, model)]
    if not refused:
        return []
    who = f"{{ var({VARIABLE}) -m str {' '.join(refused)} }}"
    return [answers.model_refused(model.name or "served here").rule(who)]


def counted(tenants: Sequence[TenantEntry]) -> list[str]:
    """A request let through counts against its tenant's requests_per_minute from here: in
    its model's backend, after the 403 of a model it may not use and the 503 of a full
    queue, so a refused request never costs its tenant a later one (the frontend's 404 of
    an unknown model, and its 401 and 429, come before too). The tenant's entry is tracked
    in the frontend; a request let go after a hold enters the backend again from the hold
    frontend, where nothing is tracked, and is not counted twice."""
    return ["    http-request sc-inc-gpc0(0)"] if tenants else []


def model_lists(tenants: Sequence[TenantEntry], served: tuple[ServedModel, ...]) -> list[str]:
    """`GET /v1/models` as a tenant limited to some models sees it: those models only, and
    `/v1/models/ID` of another is a 404 as for a model not served, so the list and a request
    agree. Before the answers for everyone (routing.route) and, with one model, before the
    instance's own list."""
    lines = []
    for tenant in tenants:
        mine = tuple(s for s in served if _may_use(tenant, s))
        if len(mine) == len(served):
            continue
        me = f"{{ var({VARIABLE}) -m str {tenant.name} }}"
        lines.append(answers.model_list(mine).rule(f"{{ path {routing.MODELS_PATH} }} METH_GET {me}"))
        hidden = " ".join(f"{routing.MODELS_PATH}/{ident}" for s in served if s not in mine for ident in s.ids)
        lines.append(answers.model_not_found(mine).rule(f"{{ path {hidden} }} {me}"))
    return lines


@dataclass(frozen=True)
class TenantCount:
    """A tenant's entry in the stick table, read each pass: its requests now, and lately."""

    in_flight: int  # answered or queued now (the entry's trackers)
    last_minute: int  # let through in the last 60 s (gpc0_rate), the figure its limit is held to


# One `show table` line: "0x55d0...: key=team-a use=2 exp=0 gpc0=10 gpc0_rate(60000)=3".
_ENTRY = re.compile(r"\bkey=(\S+) use=(\d+)\b.*\bgpc0_rate\(\d+\)=(\d+)")


def parse_usage(text: str) -> dict[str, TenantCount]:
    """HAProxy's `show table tenant-usage` -> tenant -> its counts (a tenant with no request
    since HAProxy started has no entry)."""
    return {m[1]: TenantCount(int(m[2]), int(m[3])) for m in map(_ENTRY.search, text.splitlines()) if m}


def files(directory: Path) -> tuple[Path, Path]:
    """tenant-keys.map and upstream-key.map, beside haproxy.cfg."""
    return directory / KEYS_NAME, directory / UPSTREAM_NAME
