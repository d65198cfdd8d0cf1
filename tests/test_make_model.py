"""tools/make_model.py: the generated tiny model loads in llama.cpp and is reproducible."""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numpy")
pytest.importorskip("gguf")

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "make_model.py"


def load_make_model():
    # tools/ is not a package; load the script as a module to call it in-process.
    spec = importlib.util.spec_from_file_location("make_model", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Through the real CLI, as the benchmarks and docs use it.
    out = tmp_path_factory.mktemp("model") / "tiny.gguf"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--size", "tiny", "--seed", "1"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert str(out) in res.stdout
    assert out.is_file()
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".tmp")]  # no temp file left behind
    return out


def test_tiny_loads_and_completes(tiny_model: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(tiny_model), n_ctx=256, use_mmap=False, verbose=False)
    try:
        assert llm.n_vocab() == load_make_model().PRESETS["tiny"].vocab
        out = llm("Hello", max_tokens=8)
        choice = out["choices"][0]
        assert isinstance(choice["text"], str)
        assert out["usage"]["prompt_tokens"] > 0
        # The generator steers sampling away from </s> and byte tokens, so a
        # completion is always exactly max_tokens long.
        assert out["usage"]["completion_tokens"] == 8
        assert choice["finish_reason"] == "length"
        assert choice["text"].strip()
    finally:
        llm.close()


def test_tiny_size_is_small(tiny_model: Path) -> None:
    assert 100_000 < tiny_model.stat().st_size < 1_500_000


def test_deterministic(tmp_path: Path) -> None:
    mm = load_make_model()
    spec = mm.PRESETS["tiny"]
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    mm.write_model(a, spec, 1, "t")
    mm.write_model(b, spec, 1, "t")
    mm.write_model(c, spec, 2, "t")
    assert sha256(a) == sha256(b)
    assert sha256(a) != sha256(c)


def test_cli_matches_in_process(tiny_model: Path, tmp_path: Path) -> None:
    # The CLI's preset resolution and write_model agree byte for byte.
    mm = load_make_model()
    out = tmp_path / "again.gguf"
    assert mm.main([str(out), "--size", "tiny", "--seed", "1"]) == 0
    assert sha256(out) == sha256(tiny_model)


def test_rejects_bad_shapes(tmp_path: Path) -> None:
    mm = load_make_model()
    assert mm.main([str(tmp_path / "x.gguf"), "--heads", "5"]) == 2  # 64 % 5 != 0
    assert not list(tmp_path.iterdir())  # nothing written, no temp file left
