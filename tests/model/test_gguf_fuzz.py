"""Property-based: any model file, damaged or hostile, is read or refused in one line
(hypothesis). The root daemon reads the header at every start, reload and command; an
exception other than ConfigError there stopped it (issue 30).

A valid file written by gguf-py is cut short, has bits flipped and has its lengths,
counts, types and alignment replaced by values no writer would write; headers are also
built with arrays nested deeper than any reader should follow.
"""

from __future__ import annotations

import contextlib
import struct
import tempfile
from itertools import accumulate
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from numad_infer.errors import ConfigError
from numad_infer.model.file import ModelFile, read_model
from numad_infer.model.gguf import BLOCK, GgufError, read_header
from tests.model import raw

gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

# One base file for every example: a refusal must come from the mutation.
BASE_DIR = Path(tempfile.mkdtemp(prefix="numa-infer-gguf-fuzz-"))
TARGET = BASE_DIR / "m.gguf"


def _base() -> tuple[bytes, list[int]]:
    """A small valid file with every kind of value (strings, arrays of strings and floats,
    a nested array, the alignment, stop ids, tensors), and the offsets at which its
    lengths, counts, types and values start (where a mutation hurts most)."""
    path = BASE_DIR / "base.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(3)
    writer.add_token_list(["<s>", "a", "bb", "ccc"])
    writer.add_token_scores([0.0, 1.0, 2.0, 3.0])
    writer.add_array("x.nested", [[1, 2], [3]])
    writer.add_string("tokenizer.chat_template", "{{ messages }}")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float16))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), dtype=np.float16))
    writer.add_tensor("output.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(path)
    fields = [*reader.fields.values(), *(t.field for t in reader.tensors)]
    starts = {f.offset + skip for f in fields for skip in accumulate((p.nbytes for p in f.parts), initial=0)}
    data = path.read_bytes()
    return data, sorted(s for s in starts if s < len(data))


BASE, FIELDS = _base()
# Edges of the reader's limits, the file's size, and any number.
HUGE = st.sampled_from([0, 1, 3, 7, 48, 255, 2**31, 2**32 - 1, 2**62, 2**63, 2**64 - 1, len(BASE), len(BASE) - 1,
                        64 << 20, (64 << 20) + 1, 1 << 22, (1 << 22) + 1, 1 << 17, (1 << 17) + 1])
HUGE |= st.integers(0, 2**64 - 1)
WHERE = st.sampled_from(FIELDS) | st.integers(0, len(BASE) - 1)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(BASE)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["cut", "flip", "u64", "u32"]))
        if kind == "cut":
            del data[draw(st.integers(0, max(len(data) - 1, 0))):]
        elif kind == "flip":
            bit = draw(st.integers(0, max(len(data) * 8 - 1, 0)))
            if data:
                data[bit // 8] ^= 1 << (bit % 8)
        else:
            size, value = (8, draw(HUGE)) if kind == "u64" else (4, draw(HUGE) % 2**32)
            at = draw(WHERE)
            data[at:at + size] = struct.pack("<Q" if size == 8 else "<I", value)
    return bytes(data)


@st.composite
def built(draw: st.DrawFn) -> bytes:
    """A header no writer makes: nesting up to 3000 deep, any alignment, a tensor of any
    type at any offset (and as often ones that pass, so that the rest is read too)."""
    alignment = draw(st.sampled_from([0, 1, 3, 32, 48, 64, 4096, 2**31, 2**32 - 1]) | st.integers(0, 2**32 - 1))
    depth = draw(st.integers(1, 9) | st.integers(1, 3000))
    kvs = [raw.kv("general.alignment", raw.UINT32, raw.u32(alignment)),
           raw.kv("x.nested", raw.ARRAY, raw.nested_arrays(depth))]
    ggml_type = draw(st.sampled_from(sorted(BLOCK)) | st.integers(0, 2**32 - 1))
    offset = draw(st.integers(0, 4096) | st.integers(0, 2**64 - 1))
    tensors = [raw.tensor("t", (draw(st.integers(0, 2**20)),), ggml_type, offset)]
    padding = alignment if alignment in (64, 4096) else 32
    return raw.gguf(kvs, tensors, bytes(draw(st.integers(0, 4096))), alignment=padding)


def _read(data: bytes) -> None:
    """Read or refused, and nothing else: a ConfigError (GgufError from the reader alone)."""
    TARGET.write_bytes(data)
    try:
        model = read_model(str(TARGET), "cfg")
    except ConfigError as exc:
        assert str(exc).startswith(f'cfg: model.path = "{TARGET}": ') and "\n" not in str(exc)
        event("refused")
    else:
        event("read")
        assert isinstance(model, ModelFile) and model.size == len(data)
        assert model.header.decode_bytes() >= 0 and model.header.missing_bytes() == 0
    with contextlib.suppress(GgufError):
        read_header(str(TARGET))


def test_the_base_file_is_read() -> None:
    TARGET.write_bytes(BASE)
    model = read_model(str(TARGET), "cfg")
    assert model.header.stop_token_ids == (2, 3) and model.header.data_start % 64 == 0
    assert [t.name for t in model.header.tensors] == ["token_embd.weight", "blk.0.attn_q.weight", "output.weight"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_a_damaged_or_hostile_file_is_read_or_refused_in_one_line(data: bytes) -> None:
    _read(data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(built())
def test_deep_nesting_any_alignment_and_any_tensor_type_are_read_or_refused_in_one_line(data: bytes) -> None:
    _read(data)
