"""What one instance holds in memory once its model is loaded: the weights, the KV cache and
the engine's own overhead. Pure: the model's dimensions (from its GGUF header), what the
engine's command line allocates and the engine's measured overhead in, bytes out.

Per instance, so that a node's instances can be summed whatever model each runs
(plan/memory_fit.py checks the sum against the node's memory). The instances run with
mmap off: each holds its own copy of the weights, on its node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from numad_infer.model.ggml import row_bytes

# The metadata keys, under the architecture's name (`llama.block_count`), that size the KV
# cache: model/gguf.py reads these (integers) and skips every other value.
SHAPE_KEYS = ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
              "attention.key_length", "attention.value_length", "feed_forward_length")


@dataclass(frozen=True)
class ModelDims:
    """The model's dimensions the estimate needs (llama.cpp's hparams of the same names)."""

    layers: int  # n_layer
    embedding: int  # n_embd
    heads: int  # n_head
    kv_heads: int  # n_head_kv (fewer than n_head: grouped-query attention)
    key_length: int  # n_embd_head_k
    value_length: int  # n_embd_head_v
    vocab: int  # rows of token_embd.weight (0: the table has none)
    # n_ff: the feed-forward's width, what its activations take per batch token. A header
    # without it (or one giving it per layer) counts 4 x n_embd, above the usual 2.7-3.5.
    feed_forward: int = 0

    @property
    def feed_forward_or_guess(self) -> int:
        return self.feed_forward or 4 * self.embedding

    def kv_bytes_per_token(self, type_k: int, type_v: int) -> int:
        """One token's K and V over every layer (llama_kv_cache: ggml_row_size per layer)."""
        return self.layers * (row_bytes(type_k, self.kv_heads * self.key_length)
                              + row_bytes(type_v, self.kv_heads * self.value_length))


def model_dims(architecture: str, numbers: Mapping[str, int], vocab: int) -> ModelDims | None:
    """The dimensions from the header's `<architecture>.*` keys (SHAPE_KEYS), with llama.cpp's
    defaults: n_head_kv = n_head, head size = n_embd / n_head. None when the header lacks
    the layers, width or heads (a recurrent model, or one that gives them per layer, as an
    array): its KV cache is then not counted, and the estimate says so."""
    def number(key: str, default: int = 0) -> int:
        value = numbers.get(f"{architecture}.{key}", default)
        return value if value > 0 else 0

    layers, embedding, heads = number("block_count"), number("embedding_length"), number("attention.head_count")
    if not (architecture and layers and embedding and heads):
        return None
    kv_heads = number("attention.head_count_kv", heads)
    key_length = number("attention.key_length", embedding // heads)
    value_length = number("attention.value_length", embedding // heads)
    if not (kv_heads and key_length and value_length):
        return None
    return ModelDims(layers, embedding, heads, kv_heads, key_length, value_length, max(vocab, 0),
                     number("feed_forward_length"))


@dataclass(frozen=True)
class EngineContext:
    """What an instance's command line asks of the engine (Engine.context)."""

    tokens: int  # KV cells, every slot's together (llama-server's --ctx-size)
    slot_tokens: int  # one slot's context: what one sequence attends over
    type_k: int  # ggml types of the cache (model/ggml.py, CACHE_TYPES)
    type_v: int
    batch: int = 512  # tokens the engine computes at once (llama.cpp's n_ubatch): its buffers scale with it
    # What it may keep besides, growing with use rather than at load: llama-server's cache of
    # idle slots' prompts (--cache-ram), in bytes; None: no limit.
    prompt_cache: int | None = 0


@dataclass(frozen=True)
class Overhead:
    """An engine's own memory besides weights and KV cache, measured with bench/memory.py
    and stated with its figures where the engine is defined (engines/). Per token of a
    batch, llama.cpp's compute buffers hold activations (per unit of the model's width and
    of its feed-forward's), logits (per vocabulary entry) and the attention's mask or
    scores (per token of a slot's context); an engine may also keep logits per token of its
    context."""

    runtime: int  # the process itself: program, libraries, heap, threads, HTTP server
    per_embedding: int  # bytes per batch token per unit of n_embd
    per_vocab: int  # bytes per batch token per vocabulary entry
    per_context: int  # bytes per batch token per token of one slot's context
    per_feed_forward: int = 0  # bytes per batch token per unit of n_ff
    kept_logits: int = 0  # bytes per context token per vocabulary entry
    tokenizer: int = 0  # bytes per vocabulary entry, once: the tokenizer's tables, the samplers' candidates

    def bytes(self, dims: ModelDims | None, context: EngineContext) -> int:
        if dims is None:
            return self.runtime
        per_batch_token = (self.per_embedding * dims.embedding + self.per_feed_forward * dims.feed_forward_or_guess
                           + self.per_vocab * dims.vocab + self.per_context * context.slot_tokens)
        return (self.runtime + self.tokenizer * dims.vocab + context.batch * per_batch_token
                + self.kept_logits * context.slot_tokens * dims.vocab)


@dataclass(frozen=True)
class MemoryEstimate:
    """What one instance holds once loaded, in bytes."""

    weights: int  # every tensor of the file (mmap off: the instance's own copy)
    kv_cache: int  # 0 when the header does not give the attention's shape (dims_known)
    overhead: int
    dims_known: bool = True
    # Not in `total`: a bound on what use adds (EngineContext.prompt_cache), None for none.
    # The node check warns on it rather than refusing (plan/memory_fit.py, growth_warnings).
    prompt_cache: int | None = 0
    # One slot's KV cells at its full context: the largest prompt state its prompt cache
    # would keep (a cache bounded below it skips such a state: plan/memory_fit.py's floor).
    slot_state: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.overhead

    def describe(self) -> str:
        """`weights 126 MiB + KV cache 48 MiB + overhead 48 MiB = 222 MiB, and a prompt cache
        of up to 8.0 GiB with use` (one line)."""
        if not self.dims_known:
            return (f"weights {mib(self.weights)} + overhead {mib(self.overhead)} = {mib(self.total)}, KV cache not "
                    f"counted: no attention shape in the header{self.describe_growth()}")
        return (f"weights {mib(self.weights)} + KV cache {mib(self.kv_cache)} + overhead {mib(self.overhead)} = "
                f"{mib(self.total)}{self.describe_growth()}")

    def describe_growth(self) -> str:
        if self.prompt_cache is None:
            return ", and a prompt cache with no limit"
        return f", and a prompt cache of up to {mib(self.prompt_cache)} with use" if self.prompt_cache else ""


def estimate(weights: int, dims: ModelDims | None, context: EngineContext, overhead: Overhead) -> MemoryEstimate:
    """One instance of a model whose tensors take `weights` bytes, run as `context` says, by
    an engine with `overhead`."""
    if dims is None:
        return MemoryEstimate(weights, 0, overhead.bytes(dims, context), dims_known=False,
                              prompt_cache=context.prompt_cache)
    per_token = dims.kv_bytes_per_token(context.type_k, context.type_v)
    return MemoryEstimate(weights, max(context.tokens, 0) * per_token, overhead.bytes(dims, context),
                          prompt_cache=context.prompt_cache, slot_state=max(context.slot_tokens, 0) * per_token)


def mib(n: int) -> str:
    """Bytes as an operator reads them (and plan/memory_fit.py shows them): MiB below 1 GiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 1 << 30 else f"{n / 2**20:.0f} MiB"
