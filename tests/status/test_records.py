"""status/records.py: instances grouped by model, each model's health, the JSON's `models`."""

from __future__ import annotations

import json
from dataclasses import replace

from numad_infer.cli.present import format_status
from numad_infer.lifecycle.states import State
from numad_infer.status.records import (
    DaemonState,
    DaemonStatus,
    FrontdoorStatus,
    InstanceStatus,
    Status,
    group_models,
    prompt_cache_share,
)


def _inst(name: str, model: str, state: State = State.HEALTHY, rotation: str | None = "UP") -> InstanceStatus:
    return InstanceStatus(name=name, node=0, cpus=(0,), mems=(0,), threads=1, port=8080, pid=1, state=state,
                          model=model, rotation=rotation, in_flight=0, queued=0)


SERVED = (("chat", "chat", ("gpt-4o",)), ("small", "small", ()))


def test_a_model_is_healthy_while_one_of_its_instances_is_in_rotation_and_says_why_when_not() -> None:
    instances = (_inst("infer@chat-0", "chat"), _inst("infer@chat-1", "chat", State.FAILED, "MAINT"),
                 _inst("infer@small-0", "small", State.HEALTHY, "DRAIN"),
                 _inst("infer@small-1", "small", State.STARTING, "DOWN"))
    chat, small = group_models(SERVED, instances, True, {"chat": (3, 1)})
    assert (chat.name, chat.aliases, chat.instances, chat.healthy) == ("chat", ("gpt-4o",),
                                                                       ("infer@chat-0", "infer@chat-1"), True)
    assert (chat.queued, chat.in_flight) == (3, 1)
    assert not small.healthy and small.problem == "no instance in rotation (1 healthy, out of rotation, 1 starting)"
    # Without a front door, a healthy instance is enough.
    assert group_models(SERVED, instances, False)[1].healthy


def test_status_json_carries_the_models_and_keeps_the_flat_instances_list() -> None:
    instances = (_inst("infer@chat-0", "chat"), _inst("infer@small-0", "small", State.FAILED, "MAINT"))
    status = Status(DaemonStatus(DaemonState.RUNNING, "/etc/numa-infer.toml"), instances,
                    FrontdoorStatus("127.0.0.1:8000", True, 0, 0), group_models(SERVED, instances, True))
    data = json.loads(json.dumps(status.to_json()))
    assert [i["name"] for i in data["instances"]] == ["infer@chat-0", "infer@small-0"]
    assert [(m["name"], m["aliases"], m["healthy"], m["instances"]) for m in data["models"]] == [
        ("chat", ["gpt-4o"], True, ["infer@chat-0"]), ("small", [], False, ["infer@small-0"])]
    assert Status.from_json(data) == status


def test_status_groups_by_model_only_with_models_and_the_single_form_reads_as_before() -> None:
    instances = (_inst("infer@chat-0", "chat"), _inst("infer@small-0", "small", State.FAILED, "MAINT"))
    daemon = DaemonStatus(DaemonState.RUNNING, "/etc/numa-infer.toml")
    text = format_status(Status(daemon, instances, None, group_models(SERVED, instances, True)))
    lines = text.splitlines()
    at = lines.index("model chat (aliases: gpt-4o): healthy")
    assert lines[at + 2].startswith("  infer@chat-0 ")
    assert "model small: NOT SERVING: no instance in rotation (1 failed)" in lines
    single = tuple(replace(i, model="") for i in instances)
    plain = format_status(Status(daemon, single, None, group_models((("", "", ()),), single, True)))
    assert format_status(Status(daemon, single)) == plain and "model " not in plain


def test_the_single_form_says_when_its_model_is_not_served_and_that_requests_are_held() -> None:
    # Issue 40: while the only instance restarts, status says the model's requests wait (hold).
    daemon = DaemonStatus(DaemonState.RUNNING, "/etc/numa-infer.toml")
    restarting = (replace(_inst("infer@0", ""), state=State.RESTARTING, rotation="MAINT"),)
    models = group_models((("", "", ()),), restarting, True, hold_s=30.0)
    text = format_status(Status(daemon, restarting, FrontdoorStatus("127.0.0.1:8000", True, 0, 0), models))
    assert "model: NOT SERVING: no instance in rotation (1 restarting); its requests wait up to 30s for one " \
           "(hold), then 503" in text.splitlines()
    serving = (_inst("infer@0", ""),)
    text = format_status(Status(daemon, serving, FrontdoorStatus("127.0.0.1:8000", True, 0, 0),
                                group_models((("", "", ()),), serving, True, hold_s=30.0)))
    assert "model" not in text


def test_status_shows_the_share_of_prompt_tokens_taken_from_the_cache_per_instance_and_per_model() -> None:
    chat0 = replace(_inst("infer@chat-0", "chat"), slots=1, busy_slots=0, prompt_tokens_cached=3000,
                    prompt_tokens_computed=1000)
    chat1 = replace(_inst("infer@chat-1", "chat"), slots=1, busy_slots=0, prompt_tokens_cached=0,
                    prompt_tokens_computed=1000)
    small = replace(_inst("infer@small-0", "small"), slots=1, busy_slots=0)  # nothing reported yet
    assert chat0.prompt_cache_share == 0.75 and small.prompt_cache_share is None
    assert prompt_cache_share((chat0, chat1)) == 0.6
    status = Status(DaemonStatus(DaemonState.RUNNING, "/etc/numa-infer.toml"), (chat0, chat1, small), None,
                    group_models(SERVED, (chat0, chat1, small), True))
    lines = format_status(status).splitlines()
    assert "model chat (aliases: gpt-4o): healthy, prompt tokens cached 60% of 5.0k" in lines
    assert "model small: healthy" in lines
    header = next(line for line in lines if "PROMPT-CACHED" in line)
    column = header.index("PROMPT-CACHED")
    rows = {line.split()[0]: line[column:].strip() for line in lines if line.startswith("  infer@")}
    assert rows == {"infer@chat-0": "75% of 4.0k", "infer@chat-1": "0% of 1.0k", "infer@small-0": "-"}
    assert Status.from_json(json.loads(json.dumps(status.to_json()))) == status


def test_a_front_door_reload_not_yet_taken_is_said_in_json_and_text() -> None:
    # Until HAProxy takes the reload (frontdoor/reload_watch.py) it routes by the previous
    # plan: a model the status no longer lists is still answered. The status says so.
    instances = (_inst("infer@0", ""),)
    daemon = DaemonStatus(DaemonState.RUNNING, "/etc/numa-infer.toml")
    status = Status(daemon, instances, FrontdoorStatus("127.0.0.1:8000", True, 0, 0, reloading=True))
    data = json.loads(json.dumps(status.to_json()))
    assert data["frontdoor"]["reloading"] is True and Status.from_json(data) == status
    assert "reloading (still routing by the previous plan)" in format_status(status)
    settled = replace(status, frontdoor=FrontdoorStatus("127.0.0.1:8000", True, 0, 0))
    assert "reloading" not in format_status(settled)
