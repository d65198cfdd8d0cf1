"""The GGUF header as numa-infer needs it: the tensor table (how many bytes a decoded token
reads, how many the weights take), the end-of-sequence token id (what a measurement
suppresses) and the attention's shape (what the KV cache takes, model/memory.py).

Read with the standard library only (the daemon does not depend on gguf-py). Format:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3; little-endian).

The root daemon reads this header at every start, reload and command, from a file anyone
who can write the model's directory controls: every length in it is checked against what
a header can hold before anything is read, skipped or allocated, and whatever is wrong
comes out as one `GgufError` saying what, never another exception.
"""

from __future__ import annotations

import bisect
import os
import stat
import struct
from dataclasses import dataclass
from typing import BinaryIO

from numad_infer.errors import NumaInferError
from numad_infer.model.ggml import BLOCK
from numad_infer.model.memory import SHAPE_KEYS, ModelDims, model_dims

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# What a header can sensibly hold. The largest tokenizers published (Gemma 3: 262,144
# tokens; o200k-based and Command R models: about 200,000-256,000 tokens and as many BPE
# merges) make headers of 5-15 MiB; 64 MiB leaves room for one that also embeds a whole
# tokenizer.json (Gemma's is 33 MB) and bounds what a hostile file costs: values are skipped
# by seeking, never read into memory, so the cap bounds time (a few seconds at worst), not
# memory.
MAX_HEADER_BYTES = 64 << 20
MAX_KV = 1 << 16  # real models carry 20-100 keys
# Real models: a few hundred to ~1,000 tensors (experts merged into one tensor per layer);
# the largest with unmerged experts (DeepSeek-V3's 256 x 58 x 3) about 45,000. Each is kept
# in memory, so this also bounds what the daemon holds (a few hundred bytes each).
MAX_TENSORS = 1 << 17
MAX_ARRAY = 1 << 22  # elements of one array: 16 times the largest vocabulary or merge list
MAX_DEPTH = 8  # arrays of arrays (llama.cpp itself refuses any; gguf-py writes them)
MAX_KEY_BYTES = 65535  # the GGUF specification's limit on a key
MAX_NAME_BYTES = 64  # ggml's GGML_MAX_NAME: llama.cpp refuses a longer tensor name
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = (1 << 63) - 1  # ggml counts a tensor's elements in an int64

# GGUF metadata value types -> struct format of the scalars (8 string, 9 array: handled apart).
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# The fewest bytes one value of a type takes: an array's count times this must fit in the
# header before the array is walked, so a count of 2^60 is refused at once, not looped over.
_LEAST = {**{t: struct.calcsize(f) for t, f in _SCALAR.items()}, _STRING: 8, _ARRAY: 12}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

DAMAGED = "the file is damaged or was not written as GGUF: download or convert the model again"
COPYING = ("still being written, or cut short; let the copy finish (or copy it beside the model and `mv` it into "
           "place, which is atomic)")


class GgufError(NumaInferError):
    """The file is not a GGUF header this reader can take: `problem` says what is wrong
    (`str()` adds what to do)."""

    def __init__(self, problem: str, fix: str = DAMAGED) -> None:
        super().__init__(f"{problem}; {fix}" if fix else problem)
        self.problem, self.fix = problem, fix


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
    dims: ModelDims | None = None  # what sizes the KV cache; None: the header does not say

    def weight_bytes(self) -> int:
        """What the weights take once loaded: every tensor, as the engine allocates them."""
        return sum(t.nbytes for t in self.tensors)

    def missing_bytes(self) -> int:
        """How many bytes the tensor table says the file should have beyond its end: more
        than 0 is a file still being written (a `cp` over the model), or cut short."""
        ends = [t.offset + t.nbytes for t in self.tensors]
        return max(0, self.data_start + max(ends, default=0) - self.file_bytes)

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


class _Reader:
    """The header, read from the start of an open file, never past its end nor past
    MAX_HEADER_BYTES: each length is checked before its bytes are read or skipped."""

    def __init__(self, f: BinaryIO, file_bytes: int) -> None:
        self.f, self.file_bytes, self.pos = f, file_bytes, 0

    def room(self, n: int, what: str) -> None:
        """GgufError unless `n` more bytes (of `what`) lie within the file and the cap."""
        if self.pos + n > MAX_HEADER_BYTES:
            raise GgufError(f"{what} at byte {self.pos} needs {n} bytes, more than a GGUF header holds "
                            f"(at most {MAX_HEADER_BYTES >> 20} MiB)")
        if self.pos + n > self.file_bytes:
            raise GgufError(f"the file ({self.file_bytes} bytes) ends inside its GGUF header, in {what} at byte "
                            f"{self.pos}", COPYING)

    def take(self, n: int, what: str) -> bytes:
        self.room(n, what)
        data = self.f.read(n)
        if len(data) != n:
            raise self.cut(what)
        self.pos += n
        return data

    def cut(self, what: str) -> GgufError:
        """The file is shorter than fstat said: cut while it was read."""
        return GgufError(f"the file ends inside its GGUF header, in {what} at byte {self.pos}", COPYING)

    def skip(self, n: int, what: str) -> None:
        self.room(n, what)
        self.f.seek(n, os.SEEK_CUR)
        self.pos += n

    def skip_strings(self, count: int, what: str) -> None:
        """Past `count` strings in a row (a vocabulary: 100k-260k of them), the checks of
        `skip` inlined: this loop is most of the time a header takes to read."""
        f, unpack, end = self.f, _U64.unpack, min(self.file_bytes, MAX_HEADER_BYTES)
        for _ in range(count):
            if self.pos + 8 > end:
                self.room(8, what)  # past the file or the cap: raises
            length = f.read(8)
            if len(length) != 8:
                raise self.cut(what)
            n: int = unpack(length)[0]
            self.pos += 8
            if self.pos + n > end:
                self.room(n, what)
            f.seek(n, os.SEEK_CUR)
            self.pos += n

    def u32(self, what: str) -> int:
        value: int = _U32.unpack(self.take(4, what))[0]
        return value

    def u64(self, what: str) -> int:
        value: int = _U64.unpack(self.take(8, what))[0]
        return value

    def string(self, what: str, limit: int) -> str:
        n = self.u64(what)
        if n > limit:
            raise GgufError(f"{what} is {n} bytes long, at most {limit} in GGUF")
        return self.take(n, what).decode("utf-8", "replace")


def _skip_value(r: _Reader, vtype: int, what: str, depth: int = 0) -> None:
    """Past one metadata value (numa-infer needs no string's or array's contents)."""
    if vtype in _SCALAR:
        r.skip(_LEAST[vtype], what)
    elif vtype == _STRING:
        r.skip(r.u64(what), what)
    elif vtype == _ARRAY:
        if depth >= MAX_DEPTH:
            raise GgufError(f"{what} nests arrays more than {MAX_DEPTH} deep")
        item_type, count = r.u32(what), r.u64(what)
        if item_type not in _LEAST:
            raise GgufError(f"{what} is an array of unknown value type {item_type}")
        if count > MAX_ARRAY:
            raise GgufError(f"{what} is an array of {count} values, more than a GGUF header holds "
                            f"(at most {MAX_ARRAY})")
        r.room(count * _LEAST[item_type], what)
        if item_type in _SCALAR:  # skip in one seek: a vocabulary's scores are 100k+ floats
            r.skip(_LEAST[item_type] * count, what)
        elif item_type == _STRING:
            r.skip_strings(count, what)
        else:
            for _ in range(count):
                _skip_value(r, item_type, what, depth + 1)
    else:
        raise GgufError(f"{what} has unknown value type {vtype}")


def _metadata(r: _Reader) -> tuple[int, dict[str, int], str]:
    """The key-value section: the alignment, the integer values of the keys numa-infer reads
    (`_wanted`) and the architecture's name; the rest skipped."""
    n_kv = r.u64("the number of metadata keys")
    if n_kv > MAX_KV:
        raise GgufError(f"the header says it has {n_kv} metadata keys, at most {MAX_KV} here")
    alignment, numbers, architecture = DEFAULT_ALIGNMENT, {}, ""
    for _ in range(n_kv):
        key = r.string("a metadata key", MAX_KEY_BYTES)
        shown = _shown(key)
        vtype = r.u32(f"the type of {shown}")
        what = f"the value of {shown}"
        if key == "general.alignment":
            # llama.cpp reads it as a uint32 (and aborts on another type) and refuses one
            # that is not a power of two; the data section starts at the next multiple.
            if vtype != _UINT32:
                raise GgufError(f"general.alignment has value type {vtype}; GGUF stores it as a uint32 (type 4)")
            alignment = r.u32(what)
            if alignment == 0 or alignment & (alignment - 1):
                raise GgufError(f"general.alignment is {alignment}; a GGUF alignment must be a power of two")
        elif vtype in _SCALAR and _wanted(key):
            value = struct.unpack(_SCALAR[vtype], r.take(_LEAST[vtype], what))[0]
            if isinstance(value, int) and not isinstance(value, bool):
                numbers[key] = value
        elif key == "general.architecture" and vtype == _STRING:
            n = r.u64(what)
            if n <= MAX_NAME_BYTES:
                architecture = r.take(n, what).decode("utf-8", "replace")
            else:  # no architecture llama.cpp knows has a name this long: skipped, as before
                r.skip(n, what)
        else:
            _skip_value(r, vtype, what)
    return alignment, numbers, architecture


def _wanted(key: str) -> bool:
    """The stop ids, and any architecture's KV cache shape keys (its name may come later)."""
    return key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") or (
        key.partition(".")[2] in SHAPE_KEYS)


def _shown(text: str) -> str:
    """A key or name from the file as a message may show it: on one line, control
    characters escaped (as the config's values are), and not 64 KiB long."""
    text = text if text.isprintable() else repr(text)[1:-1]
    return text if len(text) <= 80 else text[:77] + "..."


def _tensor_info(r: _Reader, index: int) -> tuple[str, tuple[int, ...], int, int]:
    name = r.string(f"the name of tensor {index}", MAX_NAME_BYTES)
    shown = _shown(name)
    n_dims = r.u32(f"the dimensions of {shown}")
    if n_dims > MAX_DIMS:
        raise GgufError(f"tensor {shown} has {n_dims} dimensions, at most {MAX_DIMS} in ggml")
    shape = tuple(r.u64(f"the shape of {shown}") for _ in range(n_dims))
    elements = 1
    for n in shape:
        elements *= n
    if elements > MAX_ELEMENTS:
        raise GgufError(f"tensor {shown} has {elements} elements, more than ggml can count (2^63 - 1)")
    return name, shape, r.u32(f"the type of {shown}"), r.u64(f"the offset of {shown}")


def parse_header(f: BinaryIO, file_bytes: int) -> GgufHeader:
    """The tensor table, stop ids and dimensions of the GGUF file open as `f` (at its start), which
    fstat says is `file_bytes` long; GgufError says what is wrong with it otherwise."""
    r = _Reader(f, file_bytes)
    if file_bytes < 4 or r.take(4, "the magic") != GGUF_MAGIC:
        raise GgufError("is not a GGUF model file (llama.cpp loads only GGUF)", "")
    version = r.u32("the version")
    if version not in (2, 3):
        raise GgufError(f"GGUF version {version}; llama.cpp and this reader know versions 2 and 3")
    n_tensors = r.u64("the number of tensors")
    if n_tensors > MAX_TENSORS:
        raise GgufError(f"the header says it has {n_tensors} tensors, at most {MAX_TENSORS} here")
    alignment, numbers, architecture = _metadata(r)
    infos = [_tensor_info(r, i) for i in range(n_tensors)]
    data_start = -(-r.pos // alignment) * alignment
    vocab = next((shape[1] for name, shape, *_ in infos if name == "token_embd.weight" and len(shape) > 1), 0)
    return GgufHeader(file_bytes, _sized(infos, file_bytes - data_start), numbers.get("tokenizer.ggml.eos_token_id"),
                      numbers.get("tokenizer.ggml.eot_token_id"), data_start, model_dims(architecture, numbers, vocab))


def _sized(infos: list[tuple[str, tuple[int, ...], int, int]], data_bytes: int) -> tuple[Tensor, ...]:
    """Each tensor with its size in bytes: from the block table, or for a type it does not
    know, the gap to the next tensor's offset or the end of the data (padding included);
    0 for one that starts at or past the end (missing_bytes then says the file is short)."""
    ends = sorted({off for *_, off in infos} | {data_bytes})
    tensors = []
    for name, shape, gtype, off in infos:
        if gtype in BLOCK:
            per_block, block_bytes = BLOCK[gtype]
            elements = 1
            for n in shape:
                elements *= n
            nbytes = elements // per_block * block_bytes
        else:
            following = bisect.bisect_right(ends, off)
            nbytes = ends[following] - off if following < len(ends) else 0
        tensors.append(Tensor(name, shape, gtype, off, nbytes))
    return tuple(tensors)


def open_model(path: str) -> tuple[BinaryIO | None, os.stat_result]:
    """The file at `path`, open for every read that follows (size, magic, header), and its
    fstat; no file (None) unless it is a regular one: a FIFO, a device or a directory is
    never read. The fstat is the file that is read, whatever is at the path by then.

    O_NONBLOCK: opening a FIFO does not wait for a writer; O_NOCTTY: a terminal named by
    mistake does not become the daemon's. A symbolic link is followed (no O_NOFOLLOW), as
    the engine follows it: a model path is often one (the Hugging Face cache's snapshots
    link into its blobs; `current.gguf` switched with `ln -sfn`), and what a link to
    somewhere else could do is what the fstat check and this reader refuse."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            return None, info
        return os.fdopen(fd, "rb", buffering=1 << 20), info
    except BaseException:
        os.close(fd)
        raise


def read_header(path: str) -> GgufHeader:
    """The tensor table and EOS id of the GGUF file at `path` (GgufError if not readable as
    one, OSError if it cannot be opened)."""
    handle, info = open_model(path)
    if handle is None:
        raise GgufError("is not a regular file", "name the .gguf file itself")
    with handle:
        return parse_header(handle, info.st_size)


def stop_token_ids(path: str) -> tuple[int, ...]:
    """The model's end-of-sequence/turn token ids; none when the header cannot be read."""
    try:
        return read_header(path).stop_token_ids
    except (OSError, GgufError):
        return ()


def decode_bytes(path: str) -> int:
    """Bytes a decoded token reads (GgufHeader.decode_bytes); the file size when the header
    cannot be read (an upper bound: the model would not load anyway)."""
    try:
        return read_header(path).decode_bytes()
    except (OSError, GgufError):
        try:
            return os.stat(path).st_size
        except OSError:
            return 0
