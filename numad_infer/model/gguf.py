"""The GGUF header as numa-infer needs it: the tensor table (how many bytes a decoded token
reads) and the end-of-sequence token id (what a measurement suppresses).

Read with the standard library only (the daemon does not depend on gguf-py). Format:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3; little-endian).
"""

from __future__ import annotations

import io
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

from numad_infer.errors import NumaInferError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# ggml_type -> (elements per block, bytes per block), from ggml.c's type_traits. A type
# missing here is sized from the gap to the next tensor's offset instead.
BLOCK: dict[int, tuple[int, int]] = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    15: (256, 292),  # Q8_K
    16: (256, 66),  # IQ2_XXS
    17: (256, 74),  # IQ2_XS
    18: (256, 98),  # IQ3_XXS
    19: (256, 50),  # IQ1_S
    20: (32, 18),  # IQ4_NL
    21: (256, 110),  # IQ3_S
    22: (256, 82),  # IQ2_S
    23: (256, 136),  # IQ4_XS
    24: (1, 1),  # I8
    25: (1, 2),  # I16
    26: (1, 4),  # I32
    27: (1, 8),  # I64
    28: (1, 8),  # F64
    29: (256, 56),  # IQ1_M
    30: (1, 2),  # BF16
    34: (256, 54),  # TQ1_0
    35: (256, 66),  # TQ2_0
    39: (32, 17),  # MXFP4
}

# GGUF metadata value types -> struct format of the scalars (8 string, 9 array: handled apart).
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GgufError(NumaInferError):
    """The file is not a GGUF file this reader understands (the message says why)."""


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # ggml's ne: ne[0] is the row length
    ggml_type: int
    offset: int  # in the data section
    nbytes: int

    @property
    def row_bytes(self) -> int:
        rows = 1
        for n in self.shape[1:]:
            rows *= n
        return self.nbytes // max(rows, 1)


@dataclass(frozen=True)
class GgufHeader:
    file_bytes: int
    tensors: tuple[Tensor, ...]
    eos_token_id: int | None
    eot_token_id: int | None = None  # end of turn (chat models), also ends a completion
    data_start: int = 0  # where the tensor data begins (after the header, aligned)

    def missing_bytes(self) -> int:
        """How many bytes the tensor table says the file should have beyond its end: more
        than 0 is a file still being written (a `cp` over the model), or cut short."""
        known = [t.offset + t.nbytes for t in self.tensors if t.ggml_type in BLOCK]
        return max(0, self.data_start + max(known, default=0) - self.file_bytes)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(sorted({t for t in (self.eos_token_id, self.eot_token_id) if t is not None}))

    def decode_bytes(self) -> int:
        """Bytes of weights one decoded token reads: every tensor once, except the token
        embedding, of which decode reads one row, unless it doubles as the output
        projection (tied; no `output.weight`): then the output matmul reads all of it.

        Mixture-of-experts models read only the routed experts; this counts all of them
        (an upper bound for those)."""
        names = {t.name for t in self.tensors}
        tied = "output.weight" not in names
        total = 0
        for t in self.tensors:
            if t.name == "token_embd.weight" and not tied:
                total += t.row_bytes
            else:
                total += t.nbytes
        return total


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GgufError("truncated header")
    return data


def _u32(f: BinaryIO) -> int:
    value: int = struct.unpack("<I", _read(f, 4))[0]
    return value


def _u64(f: BinaryIO) -> int:
    value: int = struct.unpack("<Q", _read(f, 8))[0]
    return value


def _string(f: BinaryIO) -> str:
    return _read(f, _u64(f)).decode("utf-8", "replace")


def _value(f: BinaryIO, vtype: int) -> object:
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        item_type, count = _u32(f), _u64(f)
        if item_type in _SCALAR:  # skip in one read: a vocabulary's scores are 100k+ floats
            _read(f, struct.calcsize(_SCALAR[item_type]) * count)
        else:
            for _ in range(count):
                _value(f, item_type)
        return None  # numa-infer needs no array's contents
    if vtype not in _SCALAR:
        raise GgufError(f"unknown metadata value type {vtype}")
    fmt = _SCALAR[vtype]
    return struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]


def read_header(path: str) -> GgufHeader:
    """The tensor table and EOS id of the GGUF file at `path` (GgufError if not readable as one)."""
    with open(path, "rb") as raw:
        f = io.BufferedReader(raw, 1 << 20)
        if _read(f, 4) != GGUF_MAGIC:
            raise GgufError("not a GGUF file")
        version = _u32(f)
        if version not in (2, 3):
            raise GgufError(f"GGUF version {version}; this reader knows versions 2 and 3")
        n_tensors, n_kv = _u64(f), _u64(f)
        alignment, eos, eot = DEFAULT_ALIGNMENT, None, None
        for _ in range(n_kv):
            key, vtype = _string(f), _u32(f)
            value = _value(f, vtype)
            if key == "general.alignment" and isinstance(value, int):
                alignment = value
            elif key == "tokenizer.ggml.eos_token_id" and isinstance(value, int):
                eos = value
            elif key == "tokenizer.ggml.eot_token_id" and isinstance(value, int):
                eot = value
        infos = []
        for _ in range(n_tensors):
            name = _string(f)
            shape = tuple(_u64(f) for _ in range(_u32(f)))
            infos.append((name, shape, _u32(f), _u64(f)))
        data_start = -(-f.tell() // alignment) * alignment
        file_bytes = raw.seek(0, 2)
    # Unknown types: the gap to the next tensor (or the end of the file), padding included.
    ends = [*sorted(off for _, _, _, off in infos), file_bytes - data_start]
    tensors = []
    for name, shape, gtype, off in infos:
        if gtype in BLOCK:
            per_block, block_bytes = BLOCK[gtype]
            elements = 1
            for n in shape:
                elements *= n
            nbytes = elements // per_block * block_bytes
        else:
            nbytes = min(e for e in ends if e > off) - off
        tensors.append(Tensor(name, shape, gtype, off, nbytes))
    return GgufHeader(file_bytes, tuple(tensors), eos, eot, data_start)


def stop_token_ids(path: str) -> tuple[int, ...]:
    """The model's end-of-sequence/turn token ids; none when the header cannot be read."""
    try:
        return read_header(path).stop_token_ids
    except (OSError, GgufError, struct.error):
        return ()


def decode_bytes(path: str) -> int:
    """Bytes a decoded token reads (GgufHeader.decode_bytes); the file size when the header
    cannot be read (an upper bound: the model would not load anyway)."""
    try:
        return read_header(path).decode_bytes()
    except (OSError, GgufError, struct.error):
        try:
            return os.stat(path).st_size
        except OSError:
            return 0
