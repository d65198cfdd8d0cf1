"""Which request paths the front door forwards to an instance: the inference API, and
nothing else. Pure.

Why a list, and why these:
- llama-server serves its management API on the same port as the inference API: `/slots`
  (erase a slot, save one to a file the daemon restores after a restart), `/props` (POST
  changes the server for every client), `/lora-adapters` (the same), `/metrics`, and
  by-id controls of other clients' completions (`/v1/chat/completions/control`) and
  streams (`/v1/stream`, `/v1/streams/lookup`). Behind the front door every request
  carries the instances' own key (tenants.py swaps it in), so whatever path reaches an
  instance is a privileged call. Deny by default: a path not listed gets a JSON 404 from
  HAProxy, and the instance never sees it. The daemon reaches the instances directly.
- matched exactly, byte for byte, on the path as sent (HAProxy's `path`, not decoded):
  `/v1//chat/completions`, `/v1/../slots`, `/slots%2F0` or a trailing `/` match nothing.
  The query string is not part of it.
- forwarded: OpenAI's `/v1/...` paths that llama-server serves (chat, completions,
  responses, embeddings, models, its token counts, Anthropic's messages, rerank and
  transcriptions), and llama.cpp's own inference paths without `/v1` (`/completion`,
  `/completions`, `/chat/completions`, `/infill`, `/embedding(s)`, `/rerank(ing)`,
  `/tokenize`, `/detokenize`, `/apply-template`): each is one request answered from the
  model and its template, as any `/v1` request is, and llama.cpp's own clients (editor
  plugins use `/infill`; scripts `/completion` and `/tokenize`) speak them.
- not forwarded, besides the management paths: `/health` (the front door answers its
  own `frontend.health_path`), the web UI (`/`), and anything a newer llama-server adds
  until it is listed here.
"""

from __future__ import annotations

from numad_infer.frontdoor import answers

# Sorted for a stable haproxy.cfg. Paths only: llama-server itself answers a wrong method.
OPENAI = (
    "/v1/audio/transcriptions",
    "/v1/chat/completions",
    "/v1/chat/completions/input_tokens",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/models",
    "/v1/rerank",
    "/v1/reranking",
    "/v1/responses",
    "/v1/responses/input_tokens",
)
LLAMA_CPP = (
    "/apply-template",
    "/chat/completions",
    "/completion",
    "/completions",
    "/detokenize",
    "/embedding",
    "/embeddings",
    "/infill",
    "/rerank",
    "/reranking",
    "/tokenize",
)
FORWARDED = OPENAI + LLAMA_CPP
# Named in docs and tests as never forwarded, whatever the list above becomes.
NEVER = ("/slots", "/slots/0", "/props", "/metrics", "/lora-adapters", "/v1/chat/completions/control",
         "/v1/stream", "/v1/streams/lookup", "/health", "/v1/health")

_ACL = "inference_path"
MODELS_PATH = answers.MODELS_PATH


def not_found() -> str:
    """The 404's body, in OpenAI's error shape (answers.py makes it)."""
    return answers.NO_SUCH_PATH.body


def rules(models_by_id: bool) -> list[str]:
    """The frontend's rules, before the key is read: any other path gets a JSON 404.
    `models_by_id`: the front door answers `/v1/models/ID` itself further on (several
    models, routing.py), naming an unknown model as such."""
    by_id = [f"    acl {_ACL} path_beg {MODELS_PATH}/"] if models_by_id else []  # an ACL named twice: either
    return [f"    acl {_ACL} path -m str {' '.join(FORWARDED)}", *by_id,
            answers.NO_SUCH_PATH.rule(f"!{_ACL}")]


def forwarded(path: str) -> bool:
    """Would HAProxy forward this path (the query string cut off)? For tests and docs."""
    return path.partition("?")[0] in FORWARDED
