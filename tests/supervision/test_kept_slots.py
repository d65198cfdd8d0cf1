"""Prompt caches kept across a restart: the pure rules (kept_slots) as tables, and the
keeper against a real llama-server: saved before a restart, restored and verified after
(the first turn finds its history cached), and a restore that fails served cold."""

from __future__ import annotations

import json
import struct
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from numad_infer.supervision.kept_slots import (
    MAX_KEPT_BYTES,
    Kept,
    SavedSlot,
    SlotUse,
    restorable,
    restore_counts,
    saved_prompt,
    to_save,
    within_bound,
)
from numad_infer.model.identity import FileIdentity
from numad_infer.engines.slot_cache import make_slot_directory
from numad_infer.engines.slot_names import file_name
from numad_infer.model.file import file_identity
from numad_infer.supervision.slot_keeper import SlotKeeper

MODEL = FileIdentity("/m/a.gguf", 100, 1)


def test_the_slots_saved_are_those_holding_a_prompt_and_not_processing_largest_first() -> None:
    assert to_save([SlotUse(0, 0, False), SlotUse(1, 50, False), SlotUse(2, 80, False), SlotUse(3, 90, True)]) == [2, 1]
    assert to_save([]) == []


@pytest.mark.parametrize(("sizes", "cap", "kept"), [
    ((10, 20), 30, 2), ((10, 20), 29, 1), ((40,), 30, 0), ((), 30, 0)])
def test_saved_files_past_the_bound_are_erased(sizes: tuple[int, ...], cap: int, kept: int) -> None:
    saved = [SavedSlot(i, f"f{i}", 1, size) for i, size in enumerate(sizes)]
    keep, erase = within_bound(saved, cap)
    assert keep == saved[:kept] and erase == saved[kept:]
    assert MAX_KEPT_BYTES == 4 << 30


def test_a_saved_cache_is_never_restored_for_another_model_file() -> None:
    kept = Kept(MODEL, (SavedSlot(0, "a", 5, 10),))
    assert restorable(kept, MODEL) == kept.slots
    assert restorable(kept, FileIdentity("/m/a.gguf", 100, 2)) == ()  # rewritten in place
    assert restorable(kept, FileIdentity("/m/b.gguf", 100, 1)) == ()
    assert restorable(kept, None) == () and restorable(None, MODEL) == ()


def test_file_names_are_ones_llama_server_takes() -> None:
    assert file_name("infer@chat-0", 3) == "infer-chat-0.slot3.bin"
    assert file_name("../x", 0) == "---x.slot0.bin"


def _file(tokens: list[int]) -> bytes:
    return struct.pack(f"<III{len(tokens)}i", 0x67677371, 3, len(tokens), *tokens) + b"kv cells"


@pytest.mark.parametrize(("raw", "prompt"), [
    (_file([-1, 1, 3, 1, 259, 300, 0]), (1, 259, 300)),  # llama-server's packed tokens, no media
    (_file([1, 259]), (1, 259)),  # an older server's plain list
    (_file([-1, 2, 3, 1, 2, 3, 0]), None),  # a packing it does not know
    (_file([-1, 1, 9, 1]), None),  # a count past the tokens
    (_file([]), None),
    (b"ggsq", None),
    (struct.pack("<III", 0x67677371, 2, 0), None),  # another version of llama.cpp's file
    (_file([1, 2])[:16], None),  # cut short
])
def test_the_prompt_is_read_from_the_head_of_a_saved_file(raw: bytes, prompt: tuple[int, ...] | None) -> None:
    assert saved_prompt(raw) == prompt


@pytest.mark.parametrize(("restored", "cached", "counts"), [
    (352, 351, True), (None, None, False), (0, None, False), (352, None, False), (352, 0, False)])
def test_a_restore_counts_only_when_the_probe_finds_cached_tokens(restored: int | None, cached: int | None,
                                                                  counts: bool) -> None:
    assert (restore_counts(restored, cached) is None) == counts


# -- a real llama-server ---------------------------------------------------------------------------

PREFIX = "You are a careful assistant who answers in one short sentence. " * 8


class Server:
    def __init__(self, save_path: str) -> None:
        from tests.daemon_harness import free_port_block, generated_model, llama_server_binary
        self.port = free_port_block(1)
        self.argv = [str(llama_server_binary()), "--model", str(generated_model("tiny")), "--host", "127.0.0.1",
                     "--port", str(self.port), "--ctx-size", "2048", "--parallel", "2", "--threads", "1",
                     "--metrics", "--no-webui", "--slot-save-path", save_path]
        self.model = generated_model("tiny")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise AssertionError("llama-server did not come up")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def turn(self, prompt: str) -> dict:
        body = json.dumps({"prompt": prompt, "n_predict": 4, "cache_prompt": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body)
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert answer.status == 200
            return json.loads(answer.read())


@pytest.fixture
def server(tmp_path: Path):
    keeper = SlotKeeper(tmp_path / "slots", "127.0.0.1")
    # --slot-save-path as the backends give it (engines/slot_cache.py): the instance's own directory.
    running = Server(f"{make_slot_directory(keeper.root, 'infer@0')}/")
    running.start()
    yield keeper, running
    running.stop()


def test_a_restart_with_save_and_restore_finds_the_conversation_cached_on_its_first_turn(server) -> None:
    keeper, srv = server
    first = srv.turn(PREFIX + "Q: what is a NUMA node?\nA:")
    model = file_identity(str(srv.model))
    kept = keeper.save("infer@0", srv.port, None, model, 10.0)
    assert kept is not None and len(kept.slots) == 1 and kept.slots[0].tokens > 300
    saved = keeper.directory("infer@0") / kept.slots[0].filename
    assert saved.stat().st_mode & 0o777 == 0o600 and keeper.directory("infer@0").stat().st_mode & 0o777 == 0o700
    srv.stop()
    srv.start()  # a new process: its cache is empty
    warm = keeper.restore("infer@0", srv.port, None, model, 10.0)
    assert warm > 300
    assert not saved.exists()  # one restart's worth
    after = srv.turn(PREFIX + "Q: what is a NUMA node?\nA:" + first["content"] + "\nQ: and a page cache?\nA:")
    assert after["timings"]["cache_n"] > 300, after["timings"]
    print(f"first turn after the restart: {after['timings']['cache_n']} prompt tokens cached, "
          f"{after['timings']['prompt_n']} computed")


@pytest.mark.parametrize("fault", ["engine refuses", "file cut short"])
def test_a_restore_forced_to_fail_is_erased_and_served_cold(server, fault: str) -> None:
    keeper, srv = server
    srv.turn(PREFIX + "Q: what is a NUMA node?\nA:")
    model = file_identity(str(srv.model))
    kept = keeper.save("infer@0", srv.port, None, model, 10.0)
    assert kept is not None
    saved = keeper.directory("infer@0") / kept.slots[0].filename
    srv.stop()
    if fault == "engine refuses":  # slots of 128 tokens: the saved prompt of ~350 does not fit
        srv.argv[srv.argv.index("--ctx-size") + 1] = "256"
    else:  # its tokens still readable, its KV cells cut short: llama-server would abort on it
        saved.write_bytes(saved.read_bytes()[: kept.slots[0].size // 2])
    srv.start()
    started = time.monotonic()
    assert keeper.restore("infer@0", srv.port, None, model, 10.0) == 0
    assert time.monotonic() - started < 10.0 and not saved.exists()
    after = srv.turn("Q: what is a NUMA node?\nA:")
    assert after["timings"]["cache_n"] == 0, after["timings"]  # served cold, and served
    assert srv.proc is not None and srv.proc.poll() is None


def test_a_cache_saved_with_another_model_file_is_not_restored(server) -> None:
    keeper, srv = server
    srv.turn(PREFIX + "Q: what is a NUMA node?\nA:")
    model = file_identity(str(srv.model))
    assert model is not None
    kept = keeper.save("infer@0", srv.port, None, model, 10.0)
    assert kept is not None
    newer = FileIdentity(model.path, model.size, model.mtime_ns + 1)
    assert keeper.restore("infer@0", srv.port, None, newer, 10.0) == 0
    assert not any(keeper.directory("infer@0").iterdir())


def test_the_daemons_first_apply_removes_what_a_previous_daemon_left_and_later_ones_keep_what_is_kept(
        tmp_path: Path) -> None:
    from numad_infer.supervision.kept_slots import Kept, SavedSlot

    keeper = SlotKeeper(tmp_path / "slots", "127.0.0.1")
    for name in ("infer@0", "infer@1", "infer@9"):
        keeper.directory(name).mkdir(parents=True)
        (keeper.directory(name) / file_name(name, 0)).write_bytes(b"ggsq")
    # A daemon killed (or a host rebooted) between a save and its restore: no one will restore these.
    keeper.forget_all_but({"infer@0", "infer@1"})
    assert not (tmp_path / "slots/infer-9").exists()  # no longer planned
    assert not list(keeper.directory("infer@0").iterdir()) and not list(keeper.directory("infer@1").iterdir())
    # Later applies (a reload) leave a save waiting for its restore alone.
    (keeper.directory("infer@0") / file_name("infer@0", 0)).write_bytes(b"ggsq")
    keeper.kept["infer@0"] = Kept(FileIdentity("/m.gguf", 4, 1, 1, 1), (SavedSlot(0, file_name("infer@0", 0), 1, 4),))
    keeper.forget_all_but({"infer@0", "infer@1"})
    assert [p.name for p in keeper.directory("infer@0").iterdir()] == [file_name("infer@0", 0)]
