"""numad_infer.model.memory: the dimensions read from a GGUF header (gguf-py writes it) and
what one instance of the model holds, against hand counts; the KV cache as llama.cpp sizes
it (its own log's figure, where the built llama-server is on this machine)."""

from __future__ import annotations

import glob
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from numad_infer.config.load import parse_config
from numad_infer.engines import get as engine_named
from numad_infer.model.ggml import CACHE_TYPES
from numad_infer.model.gguf import read_header
from numad_infer.model.memory import EngineContext, MemoryEstimate, ModelDims, Overhead, estimate, model_dims
from numad_infer.plan.model import Instance, Policy
from tests.model import raw

gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")
F16, F32, Q8_0, Q4_0 = CACHE_TYPES["f16"], CACHE_TYPES["f32"], CACHE_TYPES["q8_0"], CACHE_TYPES["q4_0"]
MiB = 1 << 20


def write(path: Path, arch: str = "llama", **keys: int) -> Path:
    """A header with `keys` (under the architecture's name) and two small tensors."""
    w = gguf.GGUFWriter(path, arch)
    for key, value in keys.items():
        w.add_uint32(f"{arch}.{key.replace('__', '.')}", value)
    w.add_tensor("token_embd.weight", np.zeros((1000, 64), dtype=np.float16))  # vocab 1000
    w.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_dimensions_with_grouped_query_attention_and_their_kv_bytes(tmp_path: Path) -> None:
    # Llama 3 8B's shape: 32 layers, 4096 wide, 32 heads, 8 of them for K and V.
    header = read_header(str(write(tmp_path / "m.gguf", block_count=32, embedding_length=4096,
                                   attention__head_count=32, attention__head_count_kv=8)))
    assert header.dims == ModelDims(layers=32, embedding=4096, heads=32, kv_heads=8, key_length=128,
                                    value_length=128, vocab=1000)
    assert header.weight_bytes() == 1000 * 64 * 2 + 64 * 64 * 4
    # K and V, 8 heads x 128 each, f16, 32 layers: 128 KiB a token (llama.cpp's 1 GiB at 8192 cells).
    assert header.dims.kv_bytes_per_token(F16, F16) == 32 * 2 * 8 * 128 * 2 == 128 << 10
    # q8_0: blocks of 32 values in 34 bytes; q4_0 V: 18 bytes.
    assert header.dims.kv_bytes_per_token(Q8_0, Q4_0) == 32 * (1024 // 32 * 34 + 1024 // 32 * 18)


def test_head_sizes_given_apart_from_the_width_are_taken(tmp_path: Path) -> None:
    # Gemma's: head size 256 while 3072 / 16 would be 192.
    header = read_header(str(write(tmp_path / "g.gguf", "gemma", block_count=28, embedding_length=3072,
                                   attention__head_count=16, attention__key_length=256,
                                   attention__value_length=256)))
    assert header.dims is not None
    assert (header.dims.kv_heads, header.dims.key_length, header.dims.value_length) == (16, 256, 256)


@pytest.mark.parametrize("keys", [
    {},  # no dimensions at all (the test files' bare headers)
    {"block_count": 2, "embedding_length": 64},  # no heads: a recurrent model
    {"embedding_length": 64, "attention__head_count": 4},  # no layers
    {"block_count": 2, "embedding_length": 64, "attention__head_count": 0},
])
def test_a_header_without_the_attention_shape_has_no_dimensions(tmp_path: Path, keys: dict[str, int]) -> None:
    assert read_header(str(write(tmp_path / "m.gguf", **keys))).dims is None


def test_keys_of_another_architecture_are_not_taken() -> None:
    numbers = {"clip.block_count": 24, "clip.embedding_length": 1024, "clip.attention.head_count": 16}
    assert model_dims("llama", numbers, 0) is None
    assert model_dims("clip", numbers, 0) == ModelDims(24, 1024, 16, 16, 64, 64, 0)


def test_the_architecture_key_may_come_after_its_dimensions(tmp_path: Path) -> None:
    # Written by hand: general.architecture last, its dimensions read before it is known.
    kvs = [raw.kv("llama.block_count", raw.UINT32, raw.u32(2)),
           raw.kv("llama.embedding_length", raw.UINT32, raw.u32(64)),
           raw.kv("llama.attention.head_count", raw.UINT32, raw.u32(4)),
           raw.kv("general.architecture", raw.STRING, raw.string("llama"))]
    path = tmp_path / "late.gguf"
    path.write_bytes(raw.gguf(kvs))
    assert read_header(str(path)).dims == ModelDims(2, 64, 4, 4, 16, 16, 0)


def test_an_architecture_name_longer_than_any_is_skipped_not_refused(tmp_path: Path) -> None:
    path = tmp_path / "long.gguf"
    path.write_bytes(raw.gguf([raw.kv("general.architecture", raw.STRING, raw.string("x" * 100)),
                               raw.kv("general.alignment", raw.UINT32, raw.u32(64))], alignment=64))
    header = read_header(str(path))
    # The key after it still read: the 197-byte header aligned to 64 (to 32 it would end at 224).
    assert header.dims is None and header.data_start == 256


def test_the_estimate_adds_weights_kv_cache_and_overhead() -> None:
    dims = ModelDims(layers=12, embedding=1024, heads=16, kv_heads=16, key_length=64, value_length=64, vocab=32000)
    context = EngineContext(tokens=1024, slot_tokens=512, type_k=F16, type_v=F16)
    overhead = Overhead(runtime=24 * MiB, per_embedding=48, per_vocab=0, per_context=2)
    got = estimate(126 * MiB, dims, context, overhead)
    # llama.cpp's log for this model at -c 1024 -np 2: "KV buffer size = 48.00 MiB", and a
    # compute buffer of 25.01 MiB (512 x (48 x 1024 + 2 x 512) bytes = 24.5 MiB here).
    assert got.kv_cache == 48 * MiB
    assert got.overhead == 24 * MiB + 512 * (48 * 1024 + 2 * 512)
    assert got.total == 126 * MiB + 48 * MiB + got.overhead
    assert got.describe() == "weights 126 MiB + KV cache 48 MiB + overhead 48 MiB = 222 MiB"
    # llama-cpp-python's kept logits: n_ctx x n_vocab x 4 bytes on top.
    keeps = Overhead(runtime=0, per_embedding=0, per_vocab=0, per_context=0, kept_logits=4)
    assert estimate(0, dims, context, keeps).overhead == 512 * 32000 * 4


def test_an_estimate_without_dimensions_counts_weights_and_runtime_and_says_so() -> None:
    overhead = Overhead(runtime=24 * MiB, per_embedding=48, per_vocab=4, per_context=2)
    got = estimate(5 << 30, None, EngineContext(4096, 4096, F16, F16), overhead)
    assert got == MemoryEstimate(5 << 30, 0, 24 * MiB, dims_known=False)
    assert got.describe() == ("weights 5.0 GiB + overhead 24 MiB = 5.0 GiB, KV cache not counted: no attention "
                              "shape in the header")
    assert MemoryEstimate(20 << 30, 0, 0).describe().startswith("weights 20.0 GiB + KV cache 0 MiB")


def _built_llama_server() -> Path | None:
    """scripts/build-llama-server's cached build, if this machine has one (never built here:
    that takes minutes)."""
    cache = os.environ.get("NUMA_INFER_CACHE", os.path.expanduser("~/.cache/numa-infer"))
    found = sorted(glob.glob(f"{cache}/llama-server/*/llama-server"), key=os.path.getmtime)
    return Path(found[-1]) if found else None


def _load_log(binary: Path, argv: list[str]) -> str:
    """What llama-server, run as `argv` says, logs (at verbosity 4) while it loads its model,
    up to its first slot (a later --port wins over argv's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [*argv, "--port", str(port), "-lv", "4"]
    argv[0] = str(binary)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + 120
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "new slot" in line or time.monotonic() > deadline:
                break
    finally:
        proc.terminate()
        proc.wait(30)
    return "".join(lines)


@pytest.mark.skipif(_built_llama_server() is None, reason="no llama-server built by scripts/build-llama-server "
                                                            "on this machine (~/.cache/numa-infer/llama-server)")
@pytest.mark.parametrize("cache_args, kv_type", [((), "f16"), (("--cache-type-k", "q8_0", "-ctv", "q8_0"), "q8_0")])
def test_the_estimate_is_what_llama_server_allocates(tmp_path: Path, cache_args: tuple[str, ...], kv_type: str) -> None:
    """The generated small model (GQA: 6 heads, 2 for K/V), started as numa-infer starts it
    (Engine.argv) with context 512 x 3 slots: llama.cpp's own figures for the weights, the KV
    cache and the compute buffer, from its log, against the estimate's."""
    from tests.model.maker import make_model_module

    mm = make_model_module()
    model = tmp_path / "gqa.gguf"
    mm.write_model(model, mm.Spec(layers=3, embd=384, ff=1024, heads=6, kv_heads=2, vocab=4096, ctx=2048,
                                  dtype="f16"), 0, "gqa")
    extra = ", ".join(f'"{a}"' for a in cache_args)
    config = parse_config(f'[model]\npath = "{model}"\ncontext_size = 512\n[server]\nparallel = 3\n'
                          f'llama_server = "/bin/llama-server"\nextra_args = [{extra}]\n', "/etc/numa-infer.toml")
    engine = engine_named("llama-server")
    header = read_header(str(model))
    got = estimate(header.weight_bytes(), header.dims, engine.context(config), engine.overhead)
    instance = Instance("infer@0", 0, (0,), ((0,),), (0,), Policy.BIND, 1, 0, 1)
    binary = _built_llama_server()
    assert binary is not None
    log = _load_log(binary, engine.argv(config, instance))
    kv = re.search(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs\), "
                   rf"K \({kv_type}\):", log)
    assert kv, log[-2000:]
    cells, seqs = int(kv.group(2)), int(kv.group(5))
    assert cells * seqs == 512 * 3 and int(kv.group(3)) == 3  # context_size x parallel cells, in 3 streams
    assert float(kv.group(1)) == pytest.approx(got.kv_cache / MiB, abs=0.005)
    weights = sum(float(m) for m in re.findall(r"model buffer size =\s*([\d.]+) MiB", log))
    assert weights == pytest.approx(got.weights / MiB, abs=0.02)
    compute = float(re.search(r"CPU compute buffer size =\s*([\d.]+) MiB", log).group(1))  # type: ignore[union-attr]
    assert header.dims is not None
    once = (engine.overhead.runtime + engine.overhead.tokenizer * header.dims.vocab) / MiB
    assert compute == pytest.approx(got.overhead / MiB - once, rel=0.1)


@pytest.mark.skipif(_built_llama_server() is None, reason="no llama-server built by scripts/build-llama-server "
                                                            "on this machine (~/.cache/numa-infer/llama-server)")
def test_llama_servers_prompt_cache_grows_with_distinct_prompts_to_the_bound_counted(tmp_path: Path) -> None:
    """What the node check warns on (plan/memory_fit.py, growth_warnings): each distinct
    prompt a slot leaves is kept (its KV cells) until --cache-ram is reached, whatever the
    context. Started as numa-infer starts it, with a 1 MiB bound in server.extra_args; its
    own "cache state" lines at -lv 4 say what it holds."""
    import json
    import random
    import urllib.request

    from tests.model.maker import make_model_module

    mm = make_model_module()
    model = tmp_path / "gqa.gguf"
    mm.write_model(model, mm.Spec(layers=3, embd=384, ff=1024, heads=6, kv_heads=2, vocab=4096, ctx=2048,
                                  dtype="f16"), 0, "gqa")
    config = parse_config(f'[model]\npath = "{model}"\ncontext_size = 1024\n[server]\nllama_server = '
                          '"/bin/llama-server"\nextra_args = ["--cache-ram", "1"]\n', "/etc/numa-infer.toml")
    engine = engine_named("llama-server")
    header = read_header(str(model))
    assert estimate(header.weight_bytes(), header.dims, engine.context(config), engine.overhead).prompt_cache == MiB
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [*engine.argv(config, Instance("infer@0", 0, (0,), ((0,),), (0,), Policy.BIND, 1, port, 1)), "-lv", "4"]
    argv[0] = str(_built_llama_server())
    log = tmp_path / "log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "new slot" not in log.read_text() and "model loaded" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        rng = random.Random(7)
        for _ in range(8):  # distinct prompts, about 250 tokens (~375 KiB of K and V) each
            text = " ".join(f"{rng.choice(['alpha', 'beta', 'gamma', 'delta'])}{rng.randrange(1000)}" for _ in range(60))
            body = json.dumps({"prompt": text, "n_predict": 1}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                             {"Content-Type": "application/json"})
            for attempt in range(50):  # 503 while the model loads
                try:
                    urllib.request.urlopen(request, timeout=60).read()
                    break
                except OSError:
                    time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(30)
    states = [(int(n), float(size)) for n, size in
              re.findall(r"cache state: (\d+) prompts, ([\d.]+) MiB \(limits: 1\.000 MiB", log.read_text())]
    assert states, log.read_text()[-2000:]
    assert max(n for n, _ in states) >= 2  # it keeps several prompts: it grows with use
    assert max(size for _, size in states) <= 1.0  # never past the bound counted
    assert "removing oldest entry" in log.read_text()  # and it reached it
