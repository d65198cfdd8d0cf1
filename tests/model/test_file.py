"""The model file as the pipeline checks it (numad_infer/model/file.py): whole, and which
file it is, so that a replaced model is rolled out and a half-copied one is not loaded."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from numad_infer.errors import ConfigError
from numad_infer.model.file import artifact_id, check_whole
from numad_infer.model.gguf import read_header
from tests.daemon_harness import generated_model


@pytest.fixture
def model(tmp_path: Path) -> Path:
    pytest.importorskip("gguf")
    path = tmp_path / "model.gguf"
    shutil.copyfile(generated_model("tiny"), path)
    return path


def test_a_whole_model_passes_and_a_cut_one_names_the_missing_bytes_and_the_fix(model: Path) -> None:
    check_whole(str(model), "cfg")
    assert read_header(str(model)).missing_bytes() == 0
    size = model.stat().st_size
    with open(model, "r+b") as handle:
        handle.truncate(size - 1000)
    with pytest.raises(ConfigError, match=r"model.path = .*is \d+ bytes, 1000 fewer than its tensor table says: "
                                          r"still being written.*`mv` it into place"):
        check_whole(str(model), "cfg")


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
