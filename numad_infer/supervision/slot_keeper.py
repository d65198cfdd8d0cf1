"""Prompt caches kept across a restart numa-infer makes: before it, each slot holding a
prompt is saved to a file of the instance's own (STATE_DIR/slots/NAME/, the server's
--slot-save-path); once the new process is healthy, and before it is back in rotation,
each is restored and checked by a probe request that must report cached tokens. The
decisions are kept_slots.py's; the engine's routes engines/slot_cache.py's.

Every step is bounded by the time given (at most frontend.drain_timeout_s) and never
raises: a save that fails saves nothing, a restore that fails or does not count is logged,
its slot erased and served cold. A saved file serves one restart: it is removed once
restored (or refused), when the model file changed, and when the instance goes away.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from numad_infer.engines import slot_cache
from numad_infer.engines.slot_names import file_name, slot_directory
from numad_infer.model.file import file_identity
from numad_infer.model.identity import FileIdentity
from numad_infer.supervision.kept_slots import (
    Kept,
    SavedSlot,
    SlotUse,
    restorable,
    restore_counts,
    saved_prompt,
    to_save,
    within_bound,
)

log = logging.getLogger(__name__)

# The head of a saved file that holds its prompt's tokens: 12 bytes and 4 a token, for a
# slot of at most this many tokens (server.parallel x context past it is refused).
MAX_PROMPT_TOKENS = 1 << 20


class SlotKeeper:
    """`root`: STATE_DIR/slots; `owner`: (uid, gid) of the servers' user, who writes the
    files (None: the daemon's own user, as under the process backend run unprivileged)."""

    def __init__(self, root: Path, host: str, owner: tuple[int, int] | None = None) -> None:
        self.root, self.host, self.owner = root, host, owner
        self.kept: dict[str, Kept] = {}
        self.loaded_with: dict[str, FileIdentity | None] = {}  # the model file each current process loaded
        self.swept = False  # the files a previous daemon left: removed at the first apply

    def directory(self, name: str) -> Path:
        return slot_directory(self.root, name)

    # -- the supervisor's two moments ------------------------------------------------------------------
    def after_start(self, name: str, port: int, key: str | None, model_path: str, timeout_s: float) -> int:
        """The new process is up (its first good probe), not yet in rotation: note the model
        file it loaded, and restore what was saved before its restart."""
        model = self.loaded_with[name] = file_identity(model_path)
        return self.restore(name, port, key, model, timeout_s)

    def before_restart(self, name: str, port: int, key: str | None, model_path: str, timeout_s: float) -> None:
        """Drained, about to restart: save its slots, tied to the model file the process
        loaded; nothing when that file changed since (a roll-out onto a new file)."""
        model = self.loaded_with.get(name)
        if model is None or file_identity(model_path) != model:
            log.info("%s: its model file changed since it loaded it: restarting cold", name)
            self.forget(name)
            return
        self.save(name, port, key, model, timeout_s)

    # -- before the restart --------------------------------------------------------------------------
    def save(self, name: str, port: int, key: str | None, model: FileIdentity | None, timeout_s: float) -> Kept | None:
        """Save what the instance's slots hold; None when nothing was (none held anything, no
        model file to tie them to, the engine refused). Replaces what an earlier save kept."""
        self.forget(name)
        if model is None:
            return None
        deadline = time.monotonic() + timeout_s
        found = slot_cache.slots(self.host, port, key, timeout_s)
        if found is None:
            log.warning("%s: no /slots answer: restarting without saving its prompt cache", name)
            return None
        uses = [SlotUse(s["id"], s.get("n_prompt_tokens", 0), s.get("is_processing") is True) for s in found
                if type(s.get("id")) is int and type(s.get("n_prompt_tokens", 0)) is int]
        saved: list[SavedSlot] = []
        for slot in to_save(uses):
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("%s: out of time after saving %d slot(s)", name, len(saved))
                break
            filename = file_name(name, slot)
            answer = slot_cache.save(self.host, port, key, slot, filename, left)
            tokens, size = answer.number("n_saved"), answer.number("n_written")
            if tokens is None or size is None:
                log.warning("%s: slot %d not saved: %s", name, slot, answer.error or "no counts in the answer")
                continue
            self._private(self.directory(name) / filename)
            saved.append(SavedSlot(slot, filename, tokens, size))
        kept, dropped = within_bound(saved)
        for one in dropped:
            log.warning("%s: slot %d's %d bytes are past the bound on saved caches: not kept", name, one.slot,
                        one.size)
            self._remove(name, one)
        if not kept:
            return None
        self.kept[name] = Kept(model, tuple(kept))
        log.info("%s: saved %d slot(s) of prompt cache (%d tokens, %d bytes) before its restart", name, len(kept),
                 sum(s.tokens for s in kept), sum(s.size for s in kept))
        return self.kept[name]

    # -- after it, before traffic ----------------------------------------------------------------------
    def restore(self, name: str, port: int, key: str | None, model: FileIdentity | None, timeout_s: float) -> int:
        """Restore what `save` kept, each slot checked by a probe; the tokens found cached in
        the slots that count. A failure is logged, its slot erased: served cold."""
        kept = self.kept.pop(name, None)
        if kept is None:
            return 0
        slots = restorable(kept, model)
        if not slots:
            log.info("%s: the model file changed since its prompt cache was saved: not restored", name)
        deadline = time.monotonic() + timeout_s
        warm = 0
        for one in slots:
            left = deadline - time.monotonic()
            why = self._restore_one(name, port, key, one, left) if left > 0 else "out of time"
            if isinstance(why, int):
                warm += why
                continue
            log.warning("%s: slot %d's prompt cache not restored (%s): served cold", name, one.slot, why)
            erase_left = max(0.5, deadline - time.monotonic())
            erased = slot_cache.erase(self.host, port, key, one.slot, erase_left)
            if erased.document is None:
                log.warning("%s: slot %d not erased: %s", name, one.slot, erased.error)
        for one in kept.slots:
            self._remove(name, one)
        if warm:
            log.info("%s: prompt cache restored: %d tokens found cached by the probe", name, warm)
        return warm

    def _restore_one(self, name: str, port: int, key: str | None, one: SavedSlot, timeout_s: float) -> int | str:
        path = self.directory(name) / one.filename
        # Not the size written: llama-server asserts (and dies) on a slot file cut short.
        if not path.is_file() or path.is_symlink() or path.stat().st_size != one.size:
            return "the saved file is gone or not the size that was written"
        prompt = saved_prompt(self._head(path))
        if prompt is None:
            return "the saved file is unreadable or not a slot file"
        deadline = time.monotonic() + timeout_s
        answer = slot_cache.restore(self.host, port, key, one.slot, one.filename, timeout_s)
        restored = answer.number("n_restored")
        cached = None
        if restored:
            left = deadline - time.monotonic()
            cached = slot_cache.probe_cached(self.host, port, key, one.slot, prompt, left) if left > 0 else None
        why = restore_counts(restored, cached)
        if why is not None:
            return why + (f": {answer.error}" if answer.error else "")
        assert cached is not None
        return cached

    def forget(self, name: str) -> None:
        """Remove what the instance kept (a new model file, the instance gone, a new save)."""
        self.kept.pop(name, None)
        where = self.directory(name)
        if where.is_dir():
            for entry in where.iterdir():
                if entry.is_file() and not entry.is_symlink():
                    entry.unlink(missing_ok=True)

    def forget_all_but(self, names: set[str]) -> None:
        """Remove the directories of instances no longer planned; on the first call (the
        daemon's first apply), also every file of the planned ones: what a daemon killed or
        a host rebooted between a save and its restore left behind, which no one will
        restore (what was kept is known in memory only). A saved file serves one restart."""
        if not self.swept:
            self.swept = True
            for name in names - set(self.kept):
                self.forget(name)
        for name in [n for n in self.kept if n not in names]:
            del self.kept[name]
        if not self.root.is_dir():
            return
        keep = {self.directory(n).name for n in names}
        for entry in self.root.iterdir():
            if entry.is_dir() and not entry.is_symlink() and entry.name not in keep:
                shutil.rmtree(entry, ignore_errors=True)

    # -- files ---------------------------------------------------------------------------------------
    def _head(self, path: Path) -> bytes:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return b""
        try:
            head = os.read(fd, 12)
            if len(head) < 12:
                return head
            count = min(int.from_bytes(head[8:12], "little"), MAX_PROMPT_TOKENS + 4)
            return head + os.read(fd, 4 * count)
        finally:
            os.close(fd)

    def _private(self, path: Path) -> None:
        """The server wrote it with its umask: only its owner may read a conversation's cache.
        Under systemd the file is a DynamicUser's, which the daemon (no CAP_FOWNER) may not
        chmod; there its directory (root's and the servers' group's, mode 770) keeps everyone
        else out, and the daemon must be able to read it (units/render.py)."""
        theirs = False
        try:
            theirs = os.stat(path, follow_symlinks=False).st_uid != os.geteuid()
            os.chmod(path, 0o600, follow_symlinks=False)
        except PermissionError:
            if not theirs:
                log.warning("%s: cannot make it private: permission denied", path)
            # else: root without CAP_FOWNER (the systemd daemon), as above
        except (OSError, NotImplementedError) as exc:
            log.warning("%s: cannot make it private: %s", path, exc)

    def _remove(self, name: str, one: SavedSlot) -> None:
        (self.directory(name) / one.filename).unlink(missing_ok=True)
