"""haproxy.cfg as data: each section (the frontend, each model's backend, the hold frontend,
the tables) is a list of named phases in the order a request meets them, and each feature
contributes `Rules` to a phase; `render` writes the phases in their order, each phase's
rules in the order they were contributed. No one edits rendered lines.

HAProxy runs a section's `http-request` rules in the order they are written, and its
`use-server` / `use_backend` rules after them: the phases keep both orders. A section's
settings (`balance`, `option`, `timeout`, checks) sit in the phases they belong to; where
they are written does not change when HAProxy applies them. `http-response` rules run on the
answer, whatever their place: they sit in the backend's ANSWER phase. docs/request-path.md
(tools/request_path.py) walks one request through the phases. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    name: str
    meaning: str


@dataclass(frozen=True)
class Rules:
    """One feature's lines in one phase. `owner`: its module under numad_infer/frontdoor/."""

    phase: str
    owner: str
    lines: tuple[str, ...]


def rules(phase: str, owner: str, lines: Iterable[str]) -> Rules:
    return Rules(phase, owner, tuple(lines))


# The frontend: where a request arrives and is sent to its model's backend.
FRONTEND = (
    Phase("accept", "the listening socket, the request's log line, the bounds on a connection"),
    Phase("health", "frontend.health_path, answered here"),
    Phase("paths", "only the inference API goes further"),
    Phase("authenticate", "the key names the tenant; its limits, its class; the instances' key"),
    Phase("models", "GET /v1/models answered from the configuration"),
    Phase("route", "to the request's model's backend"),
)
# A model's backend: where a request waits for, and is given to, an instance.
BACKEND = (
    Phase("balance", "how a server is chosen when no rule chose one"),
    Phase("authorize", "a model the tenant may not use"),
    Phase("answer", "on the answer: its first byte timed, its tokens counted"),
    Phase("retry", "the body buffered; a refused connection retried elsewhere"),
    Phase("admit", "the bound on the queue; the tenant's request counted"),
    Phase("wait", "no server in rotation: the hold; a batch request: room"),
    Phase("check", "the servers' health checks and slots"),
    Phase("pick", "affinity: the server a request should go to"),
    Phase("admit again", "the bound on the queue, after a wait for a prefix home"),
    Phase("land", "a batch request let go counts at a server from here"),
    Phase("use", "the picked server, where it has room"),
    Phase("servers", "the instances, the spare, the hold server"),
)
# The hold frontend: the hold server's requests, back to their backend once one is in rotation.
HOLD = (
    Phase("accept", "one listener per backend's hold server"),
    Phase("wait", "until the backend has a server in rotation"),
    Phase("classify", "queued again in its class"),
    Phase("route", "back to its backend"),
)
SETTINGS = (Phase("settings", "the process's or the proxies' settings"),
            Phase("answers", "HAProxy's own answers, as JSON"))
TABLE = (Phase("table", "a stick table, alone in its backend"),)


@dataclass(frozen=True)
class Section:
    header: str  # "frontend openai", "backend instances", "global", ...
    phases: tuple[Phase, ...]
    parts: tuple[Rules, ...]

    def __post_init__(self) -> None:
        known = {phase.name for phase in self.phases}
        unknown = [part.phase for part in self.parts if part.phase not in known]
        if unknown:
            raise ValueError(f"{self.header}: no phase {unknown[0]!r}")

    def ordered(self) -> list[tuple[Phase, list[Rules]]]:
        """Each phase with its rules (those with lines), in order."""
        return [(phase, [part for part in self.parts if part.phase == phase.name and part.lines])
                for phase in self.phases]

    def lines(self) -> list[str]:
        return [self.header, *(line for _, parts in self.ordered() for part in parts for line in part.lines)]


def section(header: str, phases: tuple[Phase, ...], *parts: Rules) -> Section:
    return Section(header, phases, parts)


def render(marker: str, sections: Iterable[Section]) -> str:
    """The file: `marker`, then each section, a blank line between two."""
    blocks = ["\n".join(s.lines()) for s in sections]
    return marker + "\n" + "\n\n".join(blocks) + "\n"
