#!/usr/bin/env python3
"""Generate a small random-weight LLaMA-architecture GGUF model.

The weights are noise, so the model "talks" gibberish, but it is a real model
as far as llama.cpp is concerned: it loads, tokenizes, decodes and streams
tokens at the speed its size dictates. That is all the tests and the
memory-bandwidth benchmarks need, without downloading anything.

    python tools/make_model.py OUT.gguf [--size tiny|small|medium|large]
        [--layers N --embd N --ff N --heads N --kv-heads N --vocab N --ctx N]
        [--seed N] [--dtype f32|f16] [--quant Q4_0|Q8_0|Q4_K_M] [--draw-eos]

--quant writes the random f16/f32 model to a temporary file and quantizes it with
llama.cpp's own quantizer (llama_model_quantize, the code behind llama-quantize, from
the libllama of the pinned llama-cpp-python: the same vendored tree as
scripts/build-llama-server), so tests and benches run the formats operators deploy.

Same arguments -> byte-identical file. The file is written to a temporary
name next to OUT and renamed into place, so readers never see half a model.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import signal
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

try:
    import gguf
except ImportError:  # pragma: no cover - depends on the environment
    sys.exit("make_model.py needs the 'gguf' package (pip install gguf numpy)")


@dataclass(frozen=True)
class Spec:
    layers: int
    embd: int
    ff: int
    heads: int
    kv_heads: int
    vocab: int
    ctx: int
    dtype: str  # "f32" or "f16": storage type of the 2-D weight matrices
    # The opposite steering for </s>: every completion ends at its first token, as a random
    # model sometimes does by chance. What a measurement must survive (issue 20, item 5).
    draw_eos: bool = False


# Sizes are for the file on disk (weights dominate). tiny/small stay f32 so
# they run on any CPU build without f16 paths; medium/large are f16 like a
# real unquantised checkpoint, sized for memory-bound decode benchmarks.
PRESETS: dict[str, Spec] = {
    # ~0.7 MB: functional tests, loads and answers in milliseconds.
    "tiny": Spec(layers=2, embd=64, ff=176, heads=4, kv_heads=4, vocab=512, ctx=512, dtype="f32"),
    # ~40 MB
    "small": Spec(layers=4, embd=384, ff=1024, heads=6, kv_heads=6, vocab=4096, ctx=2048, dtype="f32"),
    # ~430 MB
    "medium": Spec(layers=12, embd=1024, ff=2816, heads=16, kv_heads=16, vocab=32000, ctx=2048, dtype="f16"),
    # ~1.2 GB
    "large": Spec(layers=18, embd=1536, ff=4096, heads=24, kv_heads=24, vocab=32000, ctx=4096, dtype="f16"),
    # The shapes operators run, for bench/real_models.py (never CI: minutes to make).
    # 1B-class (Llama 3.2 1B's shape: 16 x 2048, ff 8192, 32 query and 8 key/value heads, a
    # 128k vocabulary; its output matrix untied here): ~3.0 GB f16, ~0.9 GB at Q4_K_M.
    "1b": Spec(layers=16, embd=2048, ff=8192, heads=32, kv_heads=8, vocab=128256, ctx=8192, dtype="f16"),
    # 8B-class (Llama 3.1 8B's shape: 32 x 4096, ff 14336, 32 and 8 heads, 128k vocabulary):
    # ~16 GB f16 (written beside the output while quantizing), ~4.9 GB at Q4_K_M.
    "8b": Spec(layers=32, embd=4096, ff=14336, heads=32, kv_heads=8, vocab=128256, ctx=8192, dtype="f16"),
}

INIT_STD = 0.02  # small weights keep activations and logits finite through all layers
# Steering: pure noise would sample </s> (ends completions early) and byte
# tokens >= 0x80 (llama-cpp-python then keeps generating past max_tokens to
# finish the UTF-8 sequence), so token counts would vary from run to run.
# So embedding column STEER_COL is a large constant that no layer reads or
# writes (that column of every layer input matrix and that row of every
# layer output matrix is zero). It stays constant in the residual stream and
# dominates the final RMSNorm, so the final hidden state is ~sqrt(embd) on
# that axis whatever the layers do; a negative output weight on it gives the
# specials and byte tokens logits of about STEER_SUPPRESS*sqrt(embd) (-32 at embd 64),
# so completions are always exactly max_tokens of plain word pieces.
STEER_COL = 0
STEER_SCALE = 64.0  # constant = STEER_SCALE*sqrt(embd): keeps the other axes, hence layer inputs, tiny
STEER_SUPPRESS = -4.0
STEER_DRAW = 4.0  # --draw-eos: </s>'s logit about +STEER_DRAW*sqrt(embd), above every other
LAYER_IN = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight", "ffn_up.weight")
LAYER_OUT = ("attn_output.weight", "ffn_down.weight")
ROPE_BASE = 10000.0
RMS_EPS = 1e-5
# llama.cpp's file types for the quantizations operators deploy most (llama.h's
# LLAMA_FTYPE_MOSTLY_*): Q4_K_M first, then Q8_0 and Q4_0.
QUANT_FTYPES: dict[str, int] = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15}
CHUNK_ELEMS = 1 << 22  # ~16 MB of float32 per generation chunk bounds peak memory

# SentencePiece conventions: llama.cpp's SPM tokenizer needs these exact ids
# and the 256 byte-fallback tokens (it looks up '\n' as <0x0A>).
UNK, BOS, EOS = 0, 1, 2
N_SPECIAL = 3
N_BYTES = 256
SPM_SPACE = "\u2581"  # "▁": SentencePiece's word-start marker
SEED_WORDS = (
    "the of and to in is that it for on with as was he be at by this have from or one had not but what all "
    "were when we there can an your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who now "
    "people my made over did down only way find use may water long little very after words called just where "
    "most know hello hi world model server token node memory test"
).split()
LETTERS = "etaoinshrdlucmfwypvbgkjqxz"


def build_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """Deterministic SPM vocabulary: specials, byte tokens, then word pieces."""
    min_vocab = N_SPECIAL + N_BYTES + 1
    if n_vocab < min_vocab:
        raise ValueError(f"--vocab must be at least {min_vocab} (3 specials + 256 byte tokens + 1 piece)")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(N_BYTES)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * N_BYTES
    scores = [0.0] * len(tokens)

    def pieces():
        yield SPM_SPACE
        for w in SEED_WORDS:
            yield SPM_SPACE + w
        for n in itertools.count(1):  # then every letter n-gram, with and without word start
            for combo in itertools.product(LETTERS, repeat=n):
                s = "".join(combo)
                yield SPM_SPACE + s
                yield s

    seen = set(tokens)
    for piece in pieces():
        if len(tokens) == n_vocab:
            break
        if piece in seen:
            continue
        seen.add(piece)
        tokens.append(piece)
        # SPM merges prefer higher scores; earlier (more "common") pieces win.
        scores.append(-float(len(tokens)))
        types.append(gguf.TokenType.NORMAL)
    return tokens, scores, [int(t) for t in types]


def tensor_plan(s: Spec) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape, is_norm) in file order.

    gguf-py takes numpy (row-major) shapes and reverses them into ggml's ne,
    so a weight llama.cpp declares as ne={n_in, n_out} is numpy (n_out, n_in).
    """
    hd = s.embd // s.heads
    q_dim, kv_dim = s.heads * hd, s.kv_heads * hd
    plan: list[tuple[str, tuple[int, ...], bool]] = [("token_embd.weight", (s.vocab, s.embd), False)]
    for i in range(s.layers):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (s.embd,), True),
            (p + "attn_q.weight", (q_dim, s.embd), False),
            (p + "attn_k.weight", (kv_dim, s.embd), False),
            (p + "attn_v.weight", (kv_dim, s.embd), False),
            (p + "attn_output.weight", (s.embd, q_dim), False),
            (p + "ffn_norm.weight", (s.embd,), True),
            (p + "ffn_gate.weight", (s.ff, s.embd), False),
            (p + "ffn_up.weight", (s.ff, s.embd), False),
            (p + "ffn_down.weight", (s.embd, s.ff), False),
        ]
    plan += [("output_norm.weight", (s.embd,), True), ("output.weight", (s.vocab, s.embd), False)]
    return plan


def tensor_seed(seed: int, name: str) -> np.random.SeedSequence:
    # One independent stream per tensor name, so a tensor's values do not
    # depend on which or how many tensors were generated before it.
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.SeedSequence([seed, digest])


def write_tensor(fout, name: str, shape: tuple[int, ...], is_norm: bool, dtype: np.dtype, seed: int,
                 draw_eos: bool = False) -> None:
    if is_norm:
        # RMSNorm gains of 1 are the identity scale; llama.cpp wants them f32.
        np.ones(shape, dtype=np.float32).tofile(fout)
        return
    rows, cols = shape
    rng = np.random.default_rng(tensor_seed(seed, name))
    step = max(1, CHUNK_ELEMS // cols)
    for r0 in range(0, rows, step):
        # Generate in float32 (fast ziggurat path) and scale in place; only one
        # chunk (plus its f16 copy) lives at a time even for 100+ MB tensors.
        chunk = rng.standard_normal((min(step, rows - r0), cols), dtype=np.float32)
        chunk *= INIT_STD
        if name == "token_embd.weight":
            chunk[:, STEER_COL] = STEER_SCALE * np.sqrt(cols)
        elif name.endswith(LAYER_IN):
            chunk[:, STEER_COL] = 0.0
        elif name.endswith(LAYER_OUT) and r0 <= STEER_COL < r0 + len(chunk):
            chunk[STEER_COL - r0, :] = 0.0
        elif name == "output.weight" and r0 < N_SPECIAL + N_BYTES:
            chunk[: N_SPECIAL + N_BYTES - r0, STEER_COL] = STEER_SUPPRESS
            if draw_eos:
                chunk[EOS - r0, STEER_COL] = STEER_DRAW
        (chunk if dtype == np.float32 else chunk.astype(dtype)).tofile(fout)


def write_model(out: Path, s: Spec, seed: int, name: str) -> None:
    if s.embd % s.heads or s.heads % s.kv_heads:
        raise ValueError("--embd must be divisible by --heads, and --heads by --kv-heads")
    head_dim = s.embd // s.heads
    if head_dim % 2:
        raise ValueError("head dimension (embd/heads) must be even for RoPE")
    wdtype = np.dtype(np.float16 if s.dtype == "f16" else np.float32)
    tokens, scores, types = build_vocab(s.vocab)

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)  # GGUFWriter opens the path itself
    tmp = Path(tmp_name)
    try:
        w = gguf.GGUFWriter(tmp, "llama")
        w.add_name(name)
        w.add_context_length(s.ctx)
        w.add_embedding_length(s.embd)
        w.add_block_count(s.layers)
        w.add_feed_forward_length(s.ff)
        w.add_head_count(s.heads)
        w.add_head_count_kv(s.kv_heads)
        w.add_layer_norm_rms_eps(RMS_EPS)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(ROPE_BASE)
        w.add_vocab_size(s.vocab)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if s.dtype == "f16" else gguf.LlamaFileType.ALL_F32)

        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(BOS)
        w.add_eos_token_id(EOS)
        w.add_unk_token_id(UNK)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)

        plan = tensor_plan(s)
        for tname, shape, is_norm in plan:
            dt = np.dtype(np.float32) if is_norm else wdtype
            w.add_tensor_info(tname, shape, dt, int(np.prod(shape)) * dt.itemsize)

        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        # Stream the data section ourselves instead of handing GGUFWriter whole
        # arrays: it would keep every tensor in memory until close().
        fout = w.fout[0]
        w.write_padding(fout, fout.tell())
        for tname, shape, is_norm in plan:
            write_tensor(fout, tname, shape, is_norm, np.dtype(np.float32) if is_norm else wdtype, seed, s.draw_eos)
            w.write_padding(fout, fout.tell())
        fout.flush()
        os.fsync(fout.fileno())
        w.close()

        _publish(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _publish(tmp: Path, out: Path) -> None:
    """Put the finished temporary file in place. mkstemp makes 0600: give the model the
    permissions the umask would have given a plain new file."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, out)


def quantize_model(src: Path, out: Path, quant: str, threads: int = 0) -> None:
    """Quantize the GGUF `src` into `out` (atomically) with llama.cpp's quantizer."""
    try:
        import llama_cpp
    except ImportError:  # pragma: no cover - depends on the environment
        raise ValueError("--quant needs llama-cpp-python (pip install -e .[server])") from None
    if quant not in QUANT_FTYPES:
        raise ValueError(f"--quant must be one of {', '.join(QUANT_FTYPES)}, not {quant!r}")
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = QUANT_FTYPES[quant]
        params.nthread = threads
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
        if rc != 0:
            raise ValueError(f"llama_model_quantize({src} -> {quant}) failed with {rc}")
        _publish(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_quantized(out: Path, s: Spec, seed: int, name: str, quant: str) -> None:
    """The random model of `s`, quantized to `quant`: same weights as the unquantized file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmpdir:
        src = Path(tmpdir) / "unquantized.gguf"
        write_model(src, s, seed, name)
        quantize_model(src, out, quant)


def parse_args(argv: list[str] | None) -> tuple[Path, Spec, int, str, str | None]:
    ap = argparse.ArgumentParser(description="Generate a random-weight LLaMA GGUF model for tests and benchmarks.")
    ap.add_argument("output", type=Path, help="path of the .gguf file to write")
    ap.add_argument("--size", choices=sorted(PRESETS, key=list(PRESETS).index), default="tiny",
                    help="preset (default: tiny); explicit flags below override it")
    for flag, helptext in (
        ("layers", "transformer blocks"),
        ("embd", "embedding width"),
        ("ff", "feed-forward width"),
        ("heads", "attention heads"),
        ("kv-heads", "key/value heads (GQA; default: same as --heads)"),
        ("vocab", "vocabulary size (>= 260)"),
        ("ctx", "trained context length written to metadata"),
    ):
        ap.add_argument(f"--{flag}", type=int, help=helptext)
    ap.add_argument("--seed", type=int, default=0, help="RNG seed (default: 0)")
    ap.add_argument("--dtype", choices=("f32", "f16"), help="weight matrix type (default: per preset)")
    ap.add_argument("--draw-eos", action="store_true",
                    help="make </s> the likeliest token everywhere: completions end at once unless it is suppressed")
    ap.add_argument("--quant", choices=tuple(QUANT_FTYPES),
                    help="quantize the generated weights with llama.cpp's quantizer (default: none)")
    a = ap.parse_args(argv)

    spec = PRESETS[a.size]
    overrides = {k: getattr(a, k) for k in ("layers", "embd", "ff", "heads", "kv_heads", "vocab", "ctx", "dtype")}
    # --heads alone should not leave the preset's kv_heads dangling.
    if a.heads is not None and a.kv_heads is None:
        overrides["kv_heads"] = a.heads
    spec = replace(spec, **{k: v for k, v in overrides.items() if v is not None}, draw_eos=a.draw_eos)
    for k in ("layers", "embd", "ff", "heads", "kv_heads", "vocab", "ctx"):
        if getattr(spec, k) <= 0:
            ap.error(f"--{k.replace('_', '-')} must be positive")
    if a.seed < 0:
        ap.error("--seed must be non-negative")
    return a.output, spec, a.seed, f"numa-infer-random-{a.size}", a.quant


def main(argv: list[str] | None = None) -> int:
    out, spec, seed, name, quant = parse_args(argv)
    # Turn SIGTERM into an exception so the temp file is removed, not leaked;
    # restore the old handler after, in case main() is called in-process.
    old_handler = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        if quant is None:
            write_model(out, spec, seed, name)
        else:
            write_quantized(out, spec, seed, name, quant)
    except ValueError as e:
        print(f"make_model.py: error: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, old_handler)
    size = out.stat().st_size
    print(f"{out} {size} bytes ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
