"""llama-server's slot routes, each one call within one deadline: what each slot holds
(GET /slots), save and restore a slot's KV cache to and from a file in its
--slot-save-path (POST /slots/ID?action=save|restore|erase), and a probe request on one
slot that says how many of its prompt tokens it found cached (POST /completion with
`id_slot`: its `timings.cache_n`). Route and field names read from the built server
(tools/server/server-context.cpp) and checked on it in tests/supervision/test_kept_slots.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from numad_infer.engines.slot_names import slot_directory
from numad_infer.util.addresses import connect_host
from numad_infer.util.peer import PeerError, http_get, http_post_json

# /slots is about 1.5 KiB a slot; a /completion answer of one token about 3 KiB.
ANSWER_CAP = 1 << 20



def make_slot_directory(root: Path, instance: str, uid: int = -1, gid: int = -1, mode: int = 0o700) -> Path:
    """The instance's directory under `root`, made (with `root`) and given `mode` and owner
    (-1: unchanged). The server writes there and no one else may read: its files hold
    conversations. Raises OSError."""
    where = slot_directory(root, instance)
    where.mkdir(mode=mode, parents=True, exist_ok=True)
    if (uid, gid) != (-1, -1):
        os.chown(where, uid, gid, follow_symlinks=False)
    os.chmod(where, mode, follow_symlinks=False)
    return where


@dataclass(frozen=True)
class SlotAnswer:
    """An answer of a slot route: its JSON object, or why there is none."""

    document: dict[str, Any] | None
    error: str = ""

    def number(self, name: str) -> int | None:
        value = None if self.document is None else self.document.get(name)
        return value if type(value) is int else None


def _headers(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def _answer(status: int, body: bytes) -> SlotAnswer:
    try:
        document = json.loads(body)
    except ValueError:
        return SlotAnswer(None, f"HTTP {status}, not JSON")
    if status != 200:
        message = document.get("error", {}).get("message") if isinstance(document, dict) else None
        return SlotAnswer(None, f"HTTP {status}: {message or 'error'}")
    return SlotAnswer(document, "") if isinstance(document, dict) else SlotAnswer(None, "not a JSON object")


def slots(host: str, port: int, key: str | None, timeout_s: float) -> list[dict[str, Any]] | None:
    """GET /slots: one object per slot, None without an answer."""
    try:
        answer = http_get(connect_host(host), port, "/slots", _headers(key), timeout_s, ANSWER_CAP)
        found = json.loads(answer.body) if answer.status == 200 else None
    except (OSError, PeerError, ValueError):
        return None
    return found if isinstance(found, list) and all(isinstance(s, dict) for s in found) else None


def _post(host: str, port: int, path: str, key: str | None, timeout_s: float, document: object) -> SlotAnswer:
    try:
        answer = http_post_json(connect_host(host), port, path, _headers(key), timeout_s, ANSWER_CAP, document)
    except (OSError, PeerError) as exc:
        return SlotAnswer(None, str(exc) or type(exc).__name__)
    return _answer(answer.status, answer.body)


def save(host: str, port: int, key: str | None, slot: int, filename: str, timeout_s: float) -> SlotAnswer:
    """The slot's cache to `filename` in --slot-save-path: `n_saved` tokens, `n_written` bytes."""
    return _post(host, port, f"/slots/{slot}?action=save", key, timeout_s, {"filename": filename})


def restore(host: str, port: int, key: str | None, slot: int, filename: str, timeout_s: float) -> SlotAnswer:
    """`filename` back into the slot: `n_restored` tokens, `n_read` bytes."""
    return _post(host, port, f"/slots/{slot}?action=restore", key, timeout_s, {"filename": filename})


def erase(host: str, port: int, key: str | None, slot: int, timeout_s: float) -> SlotAnswer:
    """Empty the slot's cache (after a restore that did not count: served cold)."""
    return _post(host, port, f"/slots/{slot}?action=erase", key, timeout_s, {})


def probe_cached(host: str, port: int, key: str | None, slot: int, prompt: tuple[int, ...],
                 timeout_s: float) -> int | None:
    """One request on `slot` with the restored prompt's own tokens and one token to
    generate: the prompt tokens it found cached (`timings.cache_n`), None without an answer.
    The whole prompt, not a part: a shorter one would cut the slot's cache down to it."""
    answer = _post(host, port, "/completion", key, timeout_s,
                   {"prompt": list(prompt), "n_predict": 1, "id_slot": slot, "cache_prompt": True})
    timings = None if answer.document is None else answer.document.get("timings")
    cached = timings.get("cache_n") if isinstance(timings, dict) else None
    return cached if type(cached) is int else None
