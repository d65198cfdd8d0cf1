"""The one line that sums up a daemon's status (`status: ...`, the state file's, systemd's
STATUS=), made from the same `Status` the tables, `health` and the metrics read, with the
same verdicts (records.serving, through the models' health): it cannot say a model is
served while the tables say it is not. Pure."""

from __future__ import annotations

from typing import TYPE_CHECKING

from numad_infer.lifecycle.states import State
from numad_infer.status.records import serving

if TYPE_CHECKING:
    from numad_infer.status.records import ReloadResult, Status


def summary_line(status: Status) -> str:
    """`2/2 instances healthy (1 starting, 1 drifting)`; with several models also
    `; 1/2 models serving (beta not)`; then what the configuration's last apply left."""
    instances = status.instances
    healthy = sum(i.state == State.HEALTHY for i in instances)
    text = f"{healthy}/{len(instances)} instances healthy"
    by_state: dict[str, int] = {}
    for i in instances:
        if i.state != State.HEALTHY:
            by_state[i.state.value] = by_state.get(i.state.value, 0) + 1
    drifting = sum(i.drifting for i in instances)
    extras = [f"{n} {s}" for s, n in sorted(by_state.items())] + ([f"{drifting} drifting"] if drifting else [])
    if extras:
        text += " (" + ", ".join(extras) + ")"
    served = _models_served(status)
    if len(served) > 1:  # a model not served answers nothing, whatever the others do
        down = [name for name, ok in served if not ok]
        text += f"; {len(served) - len(down)}/{len(served)} models serving" + (f" ({', '.join(down)} not)"
                                                                              if down else "")
    return text + config_words(status.daemon.last_reload)


def _models_served(status: Status) -> list[tuple[str, bool]]:
    """(name, served) per model: as published (ModelStatus.healthy), or, without the
    models (no configuration loaded), by the instances' model names."""
    if status.models:
        return [(m.name, m.healthy) for m in status.models]
    names = dict.fromkeys(i.model for i in status.instances if i.model)
    front = status.frontdoor
    up = front is None or front.up
    return [(name, up and serving((i for i in status.instances if i.model == name), front is not None))
            for name in names]


def config_words(last: ReloadResult | None) -> str:
    """What the configuration's last apply left, for the status line: nothing when applied;
    a refused start had nothing before it to keep running."""
    if last is None or last.ok:
        return ""
    if last.why == "start":
        return f"; not applied: {last.error}"
    return f"; config error, running previous plan: {last.error}"
