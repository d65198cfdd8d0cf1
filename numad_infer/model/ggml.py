"""ggml's data types as numa-infer sizes them: elements and bytes per block, by the type id a
GGUF tensor table carries and by the name llama.cpp's KV cache options take. Pure data.

From ggml.c's type_traits (tests/model/test_gguf.py holds the table to gguf-py's)."""

from __future__ import annotations

# ggml_type -> (elements per block, bytes per block). A type missing here is sized from the
# gap to the next tensor's offset instead (model/gguf.py).
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

# The types llama.cpp's --cache-type-k/-v (llama-server) take, by name -> ggml_type (its
# common/arg.cpp kv_cache_types); llama-cpp-python's --type_k/--type_v take the id itself.
CACHE_TYPES: dict[str, int] = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20,
                               "q5_0": 6, "q5_1": 7}
DEFAULT_CACHE_TYPE = "f16"  # llama.cpp's default for both K and V


def row_bytes(ggml_type: int, elements: int) -> int:
    """Bytes of `elements` values of a type in BLOCK (ggml_row_size: whole blocks)."""
    per_block, block_bytes = BLOCK[ggml_type]
    return -(-elements // per_block) * block_bytes
