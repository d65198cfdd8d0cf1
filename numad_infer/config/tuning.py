"""The `[tuning]` table: the knobs an operator should never need, each with a default that
benchmarks or the protocol chose, kept settable for benchmark sweeps and odd hosts; and
`MOVED`, where each of them used to live (config/load.py refuses a knob in its old place,
naming the new one). Pure.

Three tiers: the everyday keys (config/example.py's `EVERYDAY`, all the shipped file shows),
the rest of each table (documented in numa-infer.toml(5) only), and these. A knob is here
when its default was measured or follows from the protocol and a wrong value only costs
latency or throughput: the prefix-affinity and priority knobs (bench/README.md swept them),
the monitor's probe deadline, failure count, back-off and numa_maps interval, and the
systemd backend's unit directory and name. Judgement calls:
- `header_timeout_s` is here: a protocol deadline (a request's headers come in a packet or
  a few) whose 5 s default already bounds an idle connection; raising it only weakens that.
- `connections_per_source` stays in `[frontend]` (and is everyday): its right value is a
  deployment fact (clients direct, or all behind one load balancer's address), not a
  measurement, and an operator opening the door to a network must decide it.
- `server.python` stays in `[server]`: it is llama-cpp-python's program, as
  `server.llama_server` is llama-server's; the engines name their own keys in `[server]`
  (engines/*: `own_keys`, `program_key`). It is not everyday: the shipped file omits it.
- `monitor.min_local_fraction`, `max_restarts`, `restart_window_s` stay in `[monitor]`:
  policy (what counts as drift, when to give up), not a measured default."""

from __future__ import annotations

import re
from typing import Self

from pydantic import Field, PrivateAttr, field_validator

from numad_infer.config.values import SafeStr, Section

_UNIT_PREFIX = re.compile(r"^[A-Za-z][A-Za-z0-9_.:-]{0,63}$")
# Template units that systemd or common packages ship: a rendered `<name>@.service` in
# /run/systemd/system would shadow theirs (`user@` would break every login session).
_FOREIGN_TEMPLATES = frozenset({
    "user", "user-runtime-dir", "getty", "serial-getty", "container-getty", "console-getty", "autovt", "modprobe",
    "systemd-fsck", "systemd-backlight", "systemd-journald", "systemd-udevd", "systemd-cryptsetup", "capsule",
    "dbus", "openvpn", "wg-quick", "postgresql", "ssh", "sshd", "haproxy", "nginx", "lvm2-pvscan", "mdmon",
    "dhcpcd", "wpa_supplicant", "ifup", "rescue", "emergency", "kmod-static-nodes", "numa-infer",
})

# Each knob's old place (`table.key`) -> its name in [tuning].
MOVED: dict[str, str] = {
    **{f"frontend.{key}": key for key in (
        "interactive_reserve", "batch_delay_s", "prefix_bytes", "prefix_balance_factor", "prefix_wait_s",
        "affinity_expire_s", "header_timeout_s")},
    **{f"monitor.{key}": key for key in (
        "probe_timeout_s", "unhealthy_after", "restart_backoff_s", "numa_maps_interval_s")},
    "systemd.unit_dir": "unit_dir",
    "systemd.template": "unit_template",
}
# Tables that moved whole: a file that still has one is refused key by key.
MOVED_TABLES = frozenset({"systemd"})


class TuningSection(Section):
    """`[tuning]`: front door, monitor and systemd knobs (MOVED says which table each was in)."""

    # 1 by default: with a batch class, the queue's order alone leaves an interactive request
    # waiting for the next slot a batch request frees (bench/README.md, Tenants: 181 ms
    # against batch's 555 at p50 over real engines). One slot held while interactive
    # requests come costs batch that slot, and only then.
    interactive_reserve: int = Field(
        1, ge=0, le=1024,
        description=(
            "front door: slots of a model's instances kept free for interactive requests while that model had one "
            "in the last 5 to 10 s, with `[[tenants]]`: a batch request waits in the front door while only these "
            "are free (up to its deadline); never every slot: batch keeps at least one; `0`: batch takes any free "
            "slot"
        ),
    )
    batch_delay_s: float = Field(
        10.0, ge=0, le=3600,
        description=(
            "front door: how far back in the queue a `[[tenants]]` request of priority `\"batch\"` waits: it is "
            "served as if it had arrived this much later (HAProxy's `set-priority-offset`)"
        ),
    )
    # 256: ~50 words of a first message tell conversations apart (each message cut on its own).
    prefix_bytes: int = Field(
        256, ge=16, le=65536,
        description=(
            "front door: the bytes of each hashed message (or of `prompt`) that make the key of the `\"prefix\"` "
            "affinity (`frontend.affinity`); conversations that agree on them share an instance"
        ),
    )
    # 1.25: the tightest bound with the full gain (bench/README.md, "Prefix routing").
    prefix_balance_factor: float = Field(
        1.25, ge=1.01, le=10.0,
        description=(
            "front door: the load bound of the `\"prefix\"` affinity: no instance takes a request that would bring "
            "its load (requests served and waiting for it) above this many times the mean of its model's "
            "instances (rounded up, and never below 2 requests); the request goes to the next instance in its key's "
            "order instead"
        ),
    )
    # 1.0: longer waits gained nothing, none read histories again (bench/README.md, "Prefix
    # routing"); waiting with no limit left instances idle beside waiting requests.
    prefix_wait_s: float = Field(
        1.0, ge=0, le=30,
        description=(
            "front door: under the `\"prefix\"` affinity, how long a chat's later turn waits for its own instance "
            "(the one that holds its history) when that instance is busy, before it runs on another (or waits in "
            "the queue for any) and reads its history again there; 0: never waits"
        ),
    )
    affinity_expire_s: float = Field(
        1800.0, gt=0, le=86400 * 7,
        description="front door: a conversation idle this long may land elsewhere",
    )
    # 5 s: a request's line and headers come in one packet or a few; a connection that sends
    # nothing holds HAProxy's room for others this long at most (docs/security.md).
    header_timeout_s: float = Field(
        5.0, gt=0, le=300,
        description=(
            "front door: longest wait for a request's line and headers, on a new connection or a kept-alive one; "
            "the body then has 30 s more to arrive whole; a client that sends nothing is closed after this"
        ),
    )
    probe_timeout_s: float = Field(
        2.0, gt=0, le=600,
        description=(
            "monitor: deadline of the health probe, connecting and the whole answer together (a route that never "
            "waits on the model, so a busy server answers at once: `GET /docs` for llama-cpp-python, `GET /health` "
            "for llama-server); also of the engine's counters read and of each command to the front door's runtime "
            "API. A pass waits for the probes this long plus 1 s, then counts a probe not in as failed"
        ),
    )
    unhealthy_after: int = Field(
        3, ge=1, le=1000,
        description="monitor: consecutive failed probes before a restart",
    )
    restart_backoff_s: float = Field(
        5.0, ge=0, le=3600,
        description=(
            "monitor: the first restart in the window (`monitor.restart_window_s`) is immediate; each later one "
            "waits this long, doubled each time (state `backoff`)"
        ),
    )
    numa_maps_interval_s: float = Field(
        300.0, gt=0,
        description=(
            "monitor: without cgroup v2 `memory.numa_stat`, how often `/proc/PID/numa_maps` (which walks all page "
            "tables) may be read"
        ),
    )
    unit_dir: SafeStr = Field(
        "/run/systemd/system",
        description=(
            "systemd backend: where units are rendered; as root it must be owned by root and not writable by others"
        ),
        json_schema_extra={"kind": "absolute path"},
    )
    unit_template: SafeStr = Field(
        "infer",
        description=(
            "systemd backend: units are `<unit_template>@<instance>.service`; names of units systemd or common "
            "packages ship are refused"
        ),
        json_schema_extra={"kind": "unit-name prefix"},
    )

    @field_validator("unit_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must be an absolute directory such as /run/systemd/system")
        return value

    @field_validator("unit_template")
    @classmethod
    def _unit_name(cls, value: str) -> str:
        if not _UNIT_PREFIX.match(value):
            raise ValueError(
                "must start with a letter, then up to 63 of a-z A-Z 0-9 _ . : - "
                "(it becomes <unit_template>@<n>.service), e.g. \"infer\""
            )
        if value in _FOREIGN_TEMPLATES or value.startswith("systemd-"):
            raise ValueError("names a unit systemd or another package ships; pick a name of your own, e.g. \"infer\"")
        return value


class Tuned(Section):
    """A table some of whose knobs moved to `[tuning]` (`[frontend]`, `[monitor]`): it still
    reads them, as properties, from the `[tuning]` its `Config` binds on validation (an
    unbound one reads the defaults)."""

    _tuning: TuningSection = PrivateAttr(default_factory=TuningSection)

    def tuned(self, tuning: TuningSection) -> Self:
        """A copy that reads `tuning`'s knobs."""
        copy = self.model_copy()
        copy._tuning = tuning
        return copy
