"""numad_infer.model.gguf: the bytes a decoded token reads, counted from the GGUF tensor
table, against a hand count; and the table read the same as gguf-py reads it."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from numad_infer.errors import ConfigError
from numad_infer.model.file import read_model
from numad_infer.model.gguf import BLOCK, GgufError, decode_bytes, read_header
from tests.model import raw
from tests.model.maker import make_model_module

gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")


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
    with pytest.raises(GgufError, match=r"the file \(9 bytes\) ends inside its GGUF header, in the number of tensors"):
        read_header(str(path))
    assert decode_bytes(str(path)) == path.stat().st_size  # the old estimate: the file


# -- malformed headers (issue 30): each refused in one line naming the file, never a traceback --


def refusal(tmp_path: Path, data: bytes) -> str:
    """read_model's ConfigError for a file holding `data` (and the reader's own GgufError)."""
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    with pytest.raises(GgufError):
        read_header(str(path))
    with pytest.raises(ConfigError) as refused:
        read_model(str(path), "cfg")
    message = str(refused.value)
    assert message.startswith(f'cfg: model.path = "{path}": ') and "\n" not in message
    return message


def test_an_alignment_of_zero_or_not_a_power_of_two_or_not_a_uint32_is_refused(tmp_path: Path) -> None:
    # Before: alignment 0 raised ZeroDivisionError, and the daemon died at start.
    assert refusal(tmp_path, raw.gguf([raw.kv("general.alignment", raw.UINT32, raw.u32(0))])).endswith(
        "general.alignment is 0; a GGUF alignment must be a power of two; the file is damaged or was not written "
        "as GGUF: download or convert the model again")
    assert "general.alignment is 48; a GGUF alignment must be a power of two" in refusal(
        tmp_path, raw.gguf([raw.kv("general.alignment", raw.UINT32, raw.u32(48))]))
    # llama.cpp reads it as a uint32 and aborts on any other type.
    assert "general.alignment has value type 10; GGUF stores it as a uint32" in refusal(
        tmp_path, raw.gguf([raw.kv("general.alignment", raw.UINT64, raw.u64(64))]))
    path = tmp_path / "ok.gguf"
    path.write_bytes(raw.gguf([raw.kv("general.alignment", raw.UINT32, raw.u32(64))], alignment=64))
    assert read_header(str(path)).data_start == 64


def test_a_tensor_of_an_unknown_type_past_the_end_of_the_file_is_a_file_cut_short(tmp_path: Path) -> None:
    # Type 200 is no ggml type: sized by the gap to the next tensor or the end of the data.
    # Before: an offset past the end raised ValueError (min() of nothing).
    data = raw.gguf(tensors=[raw.tensor("a", (8,), 0, 0), raw.tensor("b", (8,), 200, 64),
                             raw.tensor("c", (8,), 201, 1 << 40)], data=bytes(96))
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    a, b, c = read_header(str(path)).tensors
    assert (a.nbytes, b.nbytes, c.nbytes) == (32, 32, 0)  # b: from 64 to the end of the 96 data bytes
    assert read_header(str(path)).missing_bytes() == (1 << 40) - 96
    with pytest.raises(ConfigError, match=rf"is {len(data)} bytes, {(1 << 40) - 96} fewer than its tensor table says"):
        read_model(str(path), "cfg")


def test_arrays_nested_2000_deep_are_refused_and_8_deep_are_read(tmp_path: Path) -> None:
    # Before: RecursionError. llama.cpp refuses any array of arrays; gguf-py writes them.
    message = refusal(tmp_path, raw.gguf([raw.kv("x.nested", raw.ARRAY, raw.nested_arrays(2000))]))
    assert "the value of x.nested nests arrays more than 8 deep" in message
    path = tmp_path / "ok.gguf"
    path.write_bytes(raw.gguf([raw.kv("x.nested", raw.ARRAY, raw.nested_arrays(8))]))
    assert read_header(str(path)).tensors == ()
    assert "nests arrays more than 8 deep" in refusal(
        tmp_path, raw.gguf([raw.kv("x.nested", raw.ARRAY, raw.nested_arrays(9))]))


def test_a_string_of_2_to_the_62_bytes_is_refused_without_allocating_it(tmp_path: Path) -> None:
    # Before: MemoryError (read() of 2^62 bytes).
    huge = raw.kv("tokenizer.chat_template", raw.STRING, raw.string(b"{{ x }}", length=1 << 62))
    tracemalloc.start()
    try:
        message = refusal(tmp_path, raw.gguf([huge]))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"the value of tokenizer.chat_template at byte 67 needs {1 << 62} bytes, more than a GGUF header holds " \
           "(at most 64 MiB)" in message
    assert peak < 8 << 20


def test_lengths_and_counts_no_header_holds_are_refused_before_anything_is_read(tmp_path: Path) -> None:
    # A key or a tensor name longer than GGUF allows, and counts no header holds.
    assert f"a metadata key is {1 << 62} bytes long, at most 65535 in GGUF" in refusal(
        tmp_path, raw.gguf([raw.string(b"k", length=1 << 62) + raw.u32(raw.UINT8) + b"\0"]))
    assert "the name of tensor 0 is 65 bytes long, at most 64" in refusal(
        tmp_path, raw.gguf(tensors=[raw.tensor("t" * 65, (8,), 0, 0)], data=bytes(32)))
    many = b"GGUF" + raw.u32(3) + raw.u64(1 << 62) + raw.u64(0)
    assert f"the header says it has {1 << 62} tensors, at most 131072 here" in refusal(tmp_path, many)
    tokens = raw.kv("tokenizer.ggml.tokens", raw.ARRAY, raw.u32(raw.STRING) + raw.u64(1 << 23))
    assert "the value of tokenizer.ggml.tokens is an array of 8388608 values, more than a GGUF header holds " \
           "(at most 4194304)" in refusal(tmp_path, raw.gguf([tokens]))
    # Fewer, but still more than this file could hold (8 bytes a string at least): refused before walking them.
    tokens = raw.kv("tokenizer.ggml.tokens", raw.ARRAY, raw.u32(raw.STRING) + raw.u64(1 << 21))
    assert "the file (96 bytes) ends inside its GGUF header, in the value of tokenizer.ggml.tokens at byte 69" in \
           refusal(tmp_path, raw.gguf([tokens]))
    assert "tensor t has 5 dimensions, at most 4 in ggml" in refusal(
        tmp_path, raw.gguf(tensors=[raw.tensor("t", (1, 1, 1, 1, 1), 0, 0)], data=bytes(32)))
    assert "GGUF version 0; llama.cpp and this reader know versions 2 and 3" in refusal(tmp_path, raw.gguf(version=0))


def test_keys_and_names_from_the_file_are_shown_on_one_line(tmp_path: Path) -> None:
    message = refusal(tmp_path, raw.gguf([raw.kv("evil\nkey", 77, b"")]))
    assert "the value of evil\\nkey has unknown value type 77" in message
