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

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "make_model.py"


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


# --- quantized models (what tune and the engines bench measure) -------------------------------------------------
# Wide enough (embd and ff multiples of 256) that Q4_K_M really writes K-quant blocks
# instead of falling back to Q5_0/Q8_0 for every tensor; small enough to quantize in ~2 s.
QUANT_SHAPE = ["--size", "tiny", "--embd", "256", "--heads", "4", "--ff", "768", "--vocab", "1024", "--seed", "3"]
# What llama.cpp's quantizer writes for a per-layer matrix of each file type.
LAYER_TYPES = {"Q4_0": {"Q4_0"}, "Q8_0": {"Q8_0"}, "Q4_K_M": {"Q4_K", "Q6_K"}}


@pytest.fixture(scope="module", params=sorted(LAYER_TYPES))
def quantized_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    pytest.importorskip("llama_cpp")
    quant = request.param
    out = tmp_path_factory.mktemp("quant") / f"{quant}.gguf"
    subprocess.run([sys.executable, str(SCRIPT), str(out), *QUANT_SHAPE, "--quant", quant],
                   capture_output=True, text=True, timeout=120, check=True)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp file or directory left
    out.chmod(0o644)
    return quant, out


def test_quantized_files_hold_the_quantized_types(quantized_model: tuple[str, Path]) -> None:
    quant, path = quantized_model
    reader = gguf_reader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    layer = {types[n] for n in types if n.startswith("blk.") and not n.endswith("norm.weight")}
    assert layer <= LAYER_TYPES[quant] and layer, (quant, layer)
    assert {types[n] for n in types if n.endswith("norm.weight")} == {"F32"}
    # Quantizing shrinks the weights: Q8_0 ~ half of f16's bytes, the 4-bit types less.
    f16 = path.parent / "f16.gguf"
    if not f16.exists():
        subprocess.run([sys.executable, str(SCRIPT), str(f16), *QUANT_SHAPE, "--dtype", "f16"], check=True,
                       capture_output=True)
    assert path.stat().st_size < 0.6 * f16.stat().st_size


def gguf_reader(path: Path):
    import gguf
    return gguf.GGUFReader(path)


def test_quantized_model_answers_in_llama_cpp_python(quantized_model: tuple[str, Path]) -> None:
    # Never a crash: without mmap llama.cpp repacks Q4_0/Q8_0/Q4_K for the SIMD units it
    # picked, the path where a build that trusts cpuid alone dies with SIGILL. Run in a
    # child so a SIGILL fails this test instead of killing pytest.
    quant, path = quantized_model
    code = (
        "import json, llama_cpp, sys\n"
        f"llm = llama_cpp.Llama(model_path={str(path)!r}, n_ctx=256, n_threads=2, use_mmap=False, verbose=False)\n"
        "out = llm('Hello world, this is a prompt', max_tokens=8)\n"
        "print(json.dumps({'usage': out['usage'], 'text': out['choices'][0]['text']}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{quant}: exit {res.returncode}: {res.stderr[-2000:]}"
    got = __import__("json").loads(res.stdout.strip().splitlines()[-1])
    assert got["usage"]["completion_tokens"] == 8 and got["text"].strip()


def test_quantized_model_answers_in_llama_server(quantized_model: tuple[str, Path]) -> None:
    # The same through the llama-server build that numa-infer ships (all CPU variants, one
    # chosen at start): it must pick a variant this CPU and OS can run and answer.
    import json
    import urllib.request

    from tests.daemon_harness import free_port_block, llama_server_binary

    quant, path = quantized_model
    port = free_port_block(1)
    proc = subprocess.Popen(
        [str(llama_server_binary()), "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-t", "2",
         "-c", "256", "--load-mode", "none", "-np", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        body = json.dumps({"prompt": "Hello world, this is a prompt", "n_predict": 8, "temperature": 0}).encode()
        answer = None
        for _ in range(600):
            assert proc.poll() is None, f"{quant}: llama-server exited {proc.returncode}: {proc.communicate()[0][-3000:]}"
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as resp:
                    answer = json.load(resp)
                break
            except OSError:
                __import__("time").sleep(0.1)
        assert answer is not None, f"{quant}: no answer within 60 s"
        assert answer["tokens_predicted"] == 8 and answer["content"].strip()
        assert proc.poll() is None  # still serving after the answer
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
