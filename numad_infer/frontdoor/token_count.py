"""An answer's token counts as the engine reported them, for each tenant's usage:
a Lua filter on each model's backend reads the answer as it passes, sent whole or
streamed, and sets TOKEN_VARIABLES for the request's log line (request_log.py). Pure.

Why it is done this way:
- a stream's counts come in its last event, after the client has had every token: only a
  filter sees what HAProxy passes on without holding it. A `wait-for-body` rule would
  hold the answer (and gives up on one larger than HAProxy's buffer). The filter forwards
  each chunk as it comes (it returns nothing, which forwards all); it only looks.
- read where the engine puts them: OpenAI's `usage` (an answer sent whole, or a stream
  whose client asked for `stream_options.include_usage`), else llama-server's `timings`,
  which its last event always carries (`prompt_n` read + `cache_n` taken from the cache =
  the prompt's tokens; `predicted_n` made). An answer with neither (another engine's
  stream) is not counted: its log line says "-", and the tenant's counted answers say how
  many were.
- a key is matched only as JSON writes it outside a string (`"key": 12`, spaces or none): the
  model's own text cannot produce it, since inside a string its quotes are escaped
  (`\\"key\\": 12`).
- an event split between two chunks: the last TAIL bytes of a chunk are read again with the
  next one, and the last value seen wins (a number cut in two is read whole the second time).
- only with `[[tenants]]`: the counts feed nothing else, and the filter costs a Lua call per
  chunk (per token in a stream).
"""

from __future__ import annotations

from collections.abc import Sequence

from numad_infer.config.tenants import TenantEntry
from numad_infer.frontdoor import names

TOKEN_VARIABLES = (names.PROMPT_TOKENS, names.COMPLETION_TOKENS)
FILTER = names.TOKENS_FILTER
TAIL = 512  # bytes read again with the next chunk: more than one `usage` or `timings` object

# The filter's Lua (lua/numa-infer-tokens.lua) and what it reads from the data file (lua.py),
# besides the names it shares with the rules (names.py).
LUA_FILE = "numa-infer-tokens.lua"
LUA_DATA: dict[str, str | int] = {"tokens.tail": TAIL}


def rules(tenants: Sequence[TenantEntry]) -> list[str]:
    """A model's backend's line that reads its answers' token counts (with tenants only)."""
    return [f"    filter lua.{FILTER}"] if tenants else []


def global_rules(tenants: Sequence[TenantEntry]) -> list[str]:
    """One HAProxy thread where the filter runs. HAProxy 2.6 runs a Lua filter of the shared
    Lua state on several threads unsafely: under concurrent load it failed the filter
    ("attempt to index a thread value", "... a number value") and crashed the worker
    (SIGSEGV), in 1 run of 2 to 6 of the smoke test (tests/frontdoor/test_tenants.py); with
    one thread, 0 of 10. Every Lua action takes one global lock anyway, and an LLM's request
    rate is far below what one thread forwards."""
    return ["    nbthread 1"] if tenants else []
