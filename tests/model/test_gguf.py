"""numad_infer.model.gguf: the bytes a decoded token reads, counted from the GGUF tensor
table, against a hand count; and the table read the same as gguf-py reads it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from numad_infer.model.gguf import BLOCK, GgufError, decode_bytes, read_header

gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "make_model.py"


def make_model_module():
    spec = importlib.util.spec_from_file_location("make_model", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_decode_reads_every_layer_the_output_projection_and_one_embedding_row(tmp_path: Path) -> None:
    mm = make_model_module()
    # f16, 3 layers, GQA (kv 2 of 4 heads): every shape distinct, so a miscount shows.
    spec = mm.Spec(layers=3, embd=128, ff=352, heads=4, kv_heads=2, vocab=1000, ctx=256, dtype="f16")
    path = tmp_path / "m.gguf"
    mm.write_model(path, spec, 0, "m")
    e, ff, kv, f16, f32 = 128, 352, 64, 2, 4  # kv = kv_heads * head dim (128 / 4)
    per_layer = (e * f32  # attn_norm
                 + e * e * f16 + e * kv * f16 + e * kv * f16 + e * e * f16  # q, k, v, output
                 + e * f32  # ffn_norm
                 + 3 * e * ff * f16)  # gate, up, down
    hand = 3 * per_layer + e * f32 + 1000 * e * f16 + e * f16  # + output_norm + output + one token_embd row
    header = read_header(str(path))
    assert header.decode_bytes() == hand
    # The file holds the whole token_embd (1000 rows): decode reads 999 rows less than the weights.
    weights = sum(t.nbytes for t in header.tensors)
    assert weights - header.decode_bytes() == 999 * e * f16
    assert header.eos_token_id == mm.EOS
    assert decode_bytes(str(path)) == hand


def test_a_tied_embedding_is_read_whole_as_the_output_projection(tmp_path: Path) -> None:
    # No output.weight: llama.cpp multiplies by token_embd for the logits (tied weights).
    path = tmp_path / "tied.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_eos_token_id(7)
    w.add_tensor("token_embd.weight", np.zeros((500, 64), dtype=np.float16))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), dtype=np.float16))
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    header = read_header(str(path))
    assert header.decode_bytes() == 500 * 64 * 2 + 64 * 64 * 2 + 64 * 4
    assert header.eos_token_id == 7


def test_tensor_sizes_agree_with_gguf_py_for_quantized_files(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    mm = make_model_module()
    spec = mm.Spec(layers=2, embd=256, ff=768, heads=4, kv_heads=4, vocab=1024, ctx=256, dtype="f16")
    for quant in ("Q4_0", "Q8_0", "Q4_K_M"):
        path = tmp_path / f"{quant}.gguf"
        mm.write_quantized(path, spec, 0, "m", quant)
        ours = {t.name: t.nbytes for t in read_header(str(path)).tensors}
        theirs = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
        assert ours == theirs, quant
        embd_row = theirs["token_embd.weight"] // 1024
        assert read_header(str(path)).decode_bytes() == sum(theirs.values()) - theirs["token_embd.weight"] + embd_row


def test_the_block_table_matches_gguf_py() -> None:
    for type_id, sizes in BLOCK.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)] == sizes, type_id


def test_a_file_that_is_not_gguf_is_refused_by_the_reader_and_sized_by_decode_bytes(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x01")  # truncated after the version
    with pytest.raises(GgufError, match="truncated"):
        read_header(str(path))
    assert decode_bytes(str(path)) == path.stat().st_size  # the old estimate: the file
