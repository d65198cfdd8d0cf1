"""The model file as the pipeline checks it (numad_infer/model/file.py): whole, and which
file it is, so that a replaced model is rolled out and a half-copied one is not loaded;
read from one open descriptor, so that nothing swapped in at the path hangs the daemon."""

from __future__ import annotations

import os
import shutil
import threading
import tracemalloc
from pathlib import Path

import pytest

from numad_infer.errors import ConfigError
from numad_infer.model import file
from numad_infer.model.file import artifact_id, file_identity, read_model
from numad_infer.model.identity import FileIdentity
from numad_infer.model.gguf import read_header
from tests.daemon_harness import generated_model
from tests.model import raw


@pytest.fixture
def model(tmp_path: Path) -> Path:
    pytest.importorskip("gguf")
    path = tmp_path / "model.gguf"
    shutil.copyfile(generated_model("tiny"), path)
    return path


def test_a_whole_model_passes_and_a_cut_one_names_the_missing_bytes_and_the_fix(model: Path) -> None:
    read_model(str(model), "cfg")
    assert read_header(str(model)).missing_bytes() == 0
    size = model.stat().st_size
    with open(model, "r+b") as handle:
        handle.truncate(size - 1000)
    with pytest.raises(ConfigError, match=r"model.path = .*is \d+ bytes, 1000 fewer than its tensor table says: "
                                          r"still being written.*`mv` it into place"):
        read_model(str(model), "cfg")


def test_the_artifact_id_changes_when_another_file_is_moved_in_or_the_file_is_rewritten(model: Path) -> None:
    first = artifact_id(str(model))
    assert artifact_id(str(model)) == first  # the same file: the same id
    staged = model.with_name("staged.gguf")
    shutil.copyfile(model, staged)
    os.replace(staged, model)
    moved = artifact_id(str(model))
    assert moved != first  # another inode at the same path
    data = model.read_bytes()
    model.write_bytes(data)  # rewritten in place (same inode, a new modification time)
    os.utime(model, ns=(model.stat().st_atime_ns, model.stat().st_mtime_ns + 1_000_000))
    assert artifact_id(str(model)) != moved


def test_one_identity_serves_the_roll_out_and_the_kept_prompt_caches(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x" * 10)
    link = tmp_path / "link.gguf"
    link.symlink_to(path)
    info = os.stat(path)
    # The roll-out's id: path as named, device, inode, size, modification time (as it always read).
    assert artifact_id(str(path)) == f"{path}: {info.st_dev}:{info.st_ino}:10:{info.st_mtime_ns}"
    assert artifact_id(str(path)) == FileIdentity.of(str(path), info).artifact_id
    # The caches': the same type, named by its real path, its change time counted too.
    seen = file_identity(str(link))
    assert seen == FileIdentity(str(path), 10, info.st_mtime_ns, info.st_ino, info.st_ctime_ns, info.st_dev)
    rewritten = FileIdentity(str(path), 10, info.st_mtime_ns, info.st_ino, info.st_ctime_ns + 1, info.st_dev)
    assert rewritten != seen and rewritten.artifact_id == seen.artifact_id  # a cache dropped, no roll-out
    assert file_identity(str(tmp_path / "gone.gguf")) is None


def _in_thread(call, timeout_s: float = 10.0):
    """`call()`'s result or exception, or a failure if it is still running after `timeout_s`
    (a daemon thread: a hang fails the test instead of holding pytest)."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # handed to the test, which asserts on it
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout_s)
    assert not worker.is_alive(), "still reading after 10 s: the daemon would hang"
    return outcome[0]


def test_a_fifo_at_the_path_or_behind_a_link_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    link = tmp_path / "current.gguf"
    link.symlink_to(fifo)
    for path in (fifo, link):
        refused = _in_thread(lambda p=path: read_model(str(p), "cfg"))
        assert isinstance(refused, ConfigError)
        assert str(refused) == f'cfg: model.path = "{path}": is not a regular file; name the .gguf file itself'


def test_size_header_and_identity_come_from_the_one_open_file(model: Path) -> None:
    """Before: the size was checked on the path, then the header read by opening it again: a
    FIFO swapped in between hung the daemon. Here one is swapped in right after the open."""
    opened = file.open_model
    before = artifact_id(str(model))

    def open_then_swap(path: str):
        handle = opened(path)
        os.replace(model, model.with_name("moved.gguf"))
        os.mkfifo(model)
        return handle

    read = _in_thread(lambda: read_model(str(model), "cfg", opener=open_then_swap))
    assert isinstance(read, file.ModelFile), read
    assert read.size == model.with_name("moved.gguf").stat().st_size and read.header.tensors
    assert read.artifact_id == before != artifact_id(str(model))  # the file read, not the FIFO now there


def test_a_model_behind_a_symbolic_link_is_read_as_the_engine_reads_it(model: Path) -> None:
    # The Hugging Face cache's snapshots/ link into blobs/; `ln -sfn` switches a current.gguf.
    link = model.with_name("current.gguf")
    link.symlink_to(model)
    assert read_model(str(link), "cfg").size == model.stat().st_size


def test_a_length_close_to_the_file_size_is_skipped_not_read_into_memory(tmp_path: Path) -> None:
    """Before: a string length near the file's size read the whole model into the root
    daemon's memory. Sparse files: the sizes cost no disk."""
    path = tmp_path / "m.gguf"
    head = b"GGUF" + raw.u32(3) + raw.u64(0) + raw.u64(1) + raw.string("general.blob") + raw.u32(raw.STRING)
    for file_bytes in (48 << 20, 1 << 40):
        with open(path, "wb") as handle:
            handle.write(head + raw.u64(file_bytes - len(head) - 8 - 24))  # ends 24 bytes before the file does
            handle.truncate(file_bytes)
        tracemalloc.start()
        try:
            outcome = _in_thread(lambda: read_model(str(path), "cfg"))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 << 20, f"{peak} bytes held reading a {file_bytes}-byte file"
        if file_bytes == 48 << 20:  # within what a header may hold: skipped, and the file is whole
            assert isinstance(outcome, file.ModelFile) and outcome.size == file_bytes
        else:  # 1 TiB: more than any header holds
            assert isinstance(outcome, ConfigError) and "more than a GGUF header holds (at most 64 MiB)" in str(outcome)


def test_a_missing_file_a_directory_and_a_non_gguf_file_are_refused_as_before(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found; put a GGUF model there"):
        read_model(str(tmp_path / "none.gguf"), "cfg")
    with pytest.raises(ConfigError, match=r"is a directory; name the \.gguf file itself"):
        read_model(str(tmp_path), "cfg")
    (tmp_path / "x.bin").write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ConfigError, match=r"is not a GGUF model file \(llama.cpp loads only GGUF\)$"):
        read_model(str(tmp_path / "x.bin"), "cfg")
