"""Prompt caches kept across the restarts numa-infer makes: which slots to save before a
restart, which saved files a new process may take back, and whether a restore counts. Pure:
the engine's routes are engines/slot_cache.py's, the files and the moment of each call
supervision/slot_keeper.py's.

A restore counts only once a probe request on the restored slot reports cached prompt
tokens (`timings.cache_n` > 0): on some builds and models llama-server's restore answers
200 and keeps nothing, and such a restore must not be taken for a warm cache.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from numad_infer.model.identity import FileIdentity

# llama.cpp's sequence state file (src/llama-context.cpp, state_seq_save_file): the magic
# LLAMA_STATE_SEQ_MAGIC ("ggsq"), LLAMA_STATE_SEQ_VERSION, a count of 32-bit tokens, the
# tokens, then the KV cells. llama-server's tokens (tools/server/server-common.cpp,
# server_tokens::serialize) are themselves packed: LLAMA_TOKEN_NULL (-1), its version 1,
# the count and the prompt's token ids, then media; a plain list is an older server's.
SEQ_MAGIC = 0x67677371
SEQ_VERSION = 3
PACKED_MARK = -1
PACKED_VERSION = 1

# At most this much saved per instance (all its slots' files together): a slot of 8k
# tokens of an 8B model at f16 is about 1 GiB; more than this is disk the state directory
# may not have, and a restore that reads it takes longer than the recompute it saves.
MAX_KEPT_BYTES = 4 << 30


@dataclass(frozen=True)
class SlotUse:
    """One slot as the engine's /slots shows it: the prompt tokens it holds."""

    slot: int
    tokens: int
    processing: bool


@dataclass(frozen=True)
class SavedSlot:
    slot: int
    filename: str  # in the instance's save directory
    tokens: int
    size: int  # bytes written


@dataclass(frozen=True)
class Kept:
    """What one instance saved before its restart, and with which model file (another one
    makes every saved file invalid)."""

    model: FileIdentity
    slots: tuple[SavedSlot, ...]

    @property
    def size(self) -> int:
        return sum(s.size for s in self.slots)


def to_save(slots: list[SlotUse]) -> list[int]:
    """The slots worth saving: those holding a prompt (a request since the process started:
    busy recently), the most tokens first (the bound keeps the largest). A slot still
    processing is left out: after a drain none is, and the engine defers a save until it
    ends, which a restart cannot wait for."""
    held = [s for s in slots if s.tokens > 0 and not s.processing]
    return [s.slot for s in sorted(held, key=lambda s: (-s.tokens, s.slot))]


def within_bound(saved: list[SavedSlot], cap: int = MAX_KEPT_BYTES) -> tuple[list[SavedSlot], list[SavedSlot]]:
    """(kept, to erase): saved files in order, until the next would pass `cap` bytes."""
    kept: list[SavedSlot] = []
    total = 0
    for one in saved:
        if total + one.size > cap:
            return kept, [s for s in saved if s not in kept]
        kept.append(one)
        total += one.size
    return kept, []


def restorable(kept: Kept | None, model: FileIdentity | None) -> tuple[SavedSlot, ...]:
    """The saved slots a new process may take back: none for another model file (or one
    that cannot be read: its cache is invalid)."""
    if kept is None or model is None or kept.model != model:
        return ()
    return kept.slots


def saved_prompt(head: bytes) -> tuple[int, ...] | None:
    """The prompt's token ids at the start of a saved slot file (its first bytes suffice:
    12 + 4 x (tokens + 4)); None when it is no such file."""
    if len(head) < 12:
        return None
    magic, version, count = struct.unpack_from("<III", head, 0)
    if magic != SEQ_MAGIC or version != SEQ_VERSION or len(head) < 12 + 4 * count:
        return None
    tokens = struct.unpack_from(f"<{count}i", head, 12)
    if tokens and tokens[0] == PACKED_MARK:
        if len(tokens) < 3 or tokens[1] != PACKED_VERSION or tokens[2] < 0 or 3 + tokens[2] > len(tokens):
            return None
        tokens = tokens[3:3 + tokens[2]]
    return tokens if tokens and all(t >= 0 for t in tokens) else None


def restore_counts(restored: int | None, cached: int | None) -> str | None:
    """Why a restore does not count (None: it does). `restored`: the tokens the engine said
    it restored (None: it refused); `cached`: the probe's `timings.cache_n` (None: no probe
    answer)."""
    if restored is None:
        return "the engine refused the restore"
    if restored <= 0:
        return "the engine restored no tokens"
    if cached is None:
        return "the probe request got no answer"
    if cached <= 0:
        return "the probe request found no cached tokens (restore was a no-op)"
    return None
