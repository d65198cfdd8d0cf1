"""GGUF files built byte by byte, for headers no writer would produce: the tests of the
reader (tests/model) build what an attacker or a broken converter could put at model.path."""

from __future__ import annotations

import struct
from collections.abc import Sequence

UINT8, UINT32, STRING, ARRAY, UINT64 = 0, 4, 8, 9, 10


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def string(text: bytes | str, length: int | None = None) -> bytes:
    """A GGUF string: its length (`length`, to lie about it) and its bytes."""
    data = text.encode() if isinstance(text, str) else text
    return u64(len(data) if length is None else length) + data


def kv(key: str, vtype: int, value: bytes) -> bytes:
    """One metadata pair; `value` already encoded for `vtype`."""
    return string(key) + u32(vtype) + value


def nested_arrays(depth: int) -> bytes:
    """An array of one array of one array ... `depth` arrays, the innermost of no bytes."""
    return (u32(ARRAY) + u64(1)) * (depth - 1) + u32(UINT8) + u64(0)


def tensor(name: str, shape: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    return string(name) + u32(len(shape)) + b"".join(u64(n) for n in shape) + u32(ggml_type) + u64(offset)


def gguf(kvs: Sequence[bytes] = (), tensors: Sequence[bytes] = (), data: bytes = b"", alignment: int = 32,
         version: int = 3) -> bytes:
    """A whole file: header, padding to `alignment` (which the header must say, when not 32),
    then `data`."""
    header = b"GGUF" + u32(version) + u64(len(tensors)) + u64(len(kvs)) + b"".join(kvs) + b"".join(tensors)
    return header + bytes(-len(header) % alignment) + data
