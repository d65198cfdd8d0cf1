"""What `reload` prints: the instances it changed, and a front-door-only change named as one
(before: `added none, changed none, removed none` after a tenant's key was rotated)."""

from __future__ import annotations

from numad_infer.cli.daemon_client import _what_changed
from numad_infer.status.records import ReloadResult


def test_a_front_door_only_change_is_named() -> None:
    result = ReloadResult(0.0, True, "reload", unchanged=("infer@0", "infer@1"), frontdoor_reloaded=True)
    assert _what_changed(result) == "no instance changed; front door: tenants, keys or routing changed, HAProxy reloaded"


def test_instance_changes_are_listed_and_nothing_is_nothing() -> None:
    result = ReloadResult(0.0, True, "reload", added=("infer@2",), unchanged=("infer@0",))
    assert _what_changed(result) == "added infer@2, changed none, removed none"
    assert _what_changed(ReloadResult(0.0, True, "reload", unchanged=("infer@0",))) == "nothing changed"
