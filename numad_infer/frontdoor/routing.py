"""Several models behind one front door (`[[models]]`, issue 31): one HAProxy backend per
model, and the frontend's lines that send a request to it by its JSON body's `model`. Pure.

Why it is done this way:
- one backend per model, so each model has its own least-connections balance, queue limit
  (the 503), per-server `maxconn` (that model's slots) and affinity table: a queue of
  requests for one model never holds back another's.
- the frontend reads `model` with `json_query` from the body HAProxy has buffered
  (`option http-buffer-request`); the buffer holds the longest prompt of the model with the
  largest context (haproxy_config.body_buffer), so `model` after a long prompt is still read.
- a body longer than that buffer whose `model` lies beyond it gets a JSON 413, and a request
  whose `model` is missing, unknown, not a string, or whose body is not JSON, a JSON 404 in
  OpenAI's shape naming the served models: never a guess. Names start with a letter, so no
  number or `true` read from the body can match one.
- `GET /v1/models` is answered by HAProxy from the configuration: it lists every model even
  while all instances are stopped or busy. Aliases are listed too, each as its own entry with
  `"parent"` naming the model: clients that check an id against this list before they use it
  (UIs, proxies) accept an alias, and the parent tells that it is the same model.
- with one model (the single `[model]` form, or one `[[models]]` table) nothing is read from
  the body: every request goes to it, as before `[[models]]` existed.
"""

from __future__ import annotations

import json

from numad_infer.config.models import ServedModel
from numad_infer.frontdoor import hold

BACKEND = "instances"  # the backend of the model whose key is "" (the single `[model]` form's)
_BACKEND_PREFIX = "model-"
MODELS_PATH = "/v1/models"
BODY_TIMEOUT = "30s"  # how long a request's body may take to arrive whole, after its headers


Served = tuple[ServedModel, ...]


def backend_of(model: ServedModel) -> str:
    """The backend that holds the servers of this model's instances, named by its key
    (`ServedModel.ident`, what its instances carry as `Instance.model`)."""
    return f"{_BACKEND_PREFIX}{model.ident}" if model.ident else BACKEND


def backends(served: Served) -> dict[str, str]:
    """Model key (`Instance.model`) -> its backend, in the file's order."""
    return {model.ident: backend_of(model) for model in served}


def routed(served: Served) -> bool:
    """Requests are routed by `model`: several models are served."""
    return len(served) > 1


def _compact(doc: object) -> str:
    text = json.dumps(doc, separators=(",", ":"))
    # The body is a single-quoted HAProxy string; names and aliases cannot hold a '.
    assert "'" not in text, text
    return text


def models_list(served: Served) -> str:
    """GET /v1/models's body: every name, then every alias (with its model as `parent`)."""
    return _compact({"object": "list", "data": _entries(served)})


def _entries(served: tuple[ServedModel, ...]) -> list[dict[str, object]]:
    data: list[dict[str, object]] = [_entry(s.name) for s in served]
    return data + [{**_entry(alias), "parent": s.name} for s in served for alias in s.aliases]


def _entry(ident: str) -> dict[str, object]:
    # `created` is fixed: the file is rendered on every pass and must not change by itself.
    return {"id": ident, "object": "model", "created": 0, "owned_by": "numa-infer"}


def _error(message: str, code: str) -> str:
    return _compact({"error": {"message": f"numa-infer: {message}", "type": "invalid_request_error", "code": code}})


def _names(served: tuple[ServedModel, ...]) -> str:
    return ", ".join(s.name for s in served)


def not_found(served: Served) -> str:
    return _error("the request names no model served here: its JSON body needs a `model` string that is one of "
                  f"the served models or their aliases (GET {MODELS_PATH} lists them); served models: "
                  f"{_names(served)}", "model_not_found")


def too_large(served: Served, buffer: int) -> str:
    return _error(f"the request body is longer than the {buffer} bytes the front door reads to find `model`, and "
                  "`model` is not within them: send `model` before `messages` (or `prompt`) in the JSON body; "
                  f"served models: {_names(served)}", "request_too_large")


def route(served: Served, buffer: int) -> list[str]:
    """The frontend's lines that answer GET /v1/models and send each request to its model's
    backend (only when `routed`)."""
    every = " ".join(ident for s in served for ident in s.ids)
    lines = [f"    http-request return status 200 content-type application/json string '{models_list(served)}' "
             f"if {{ path {MODELS_PATH} }} METH_GET",
             # OpenAI's "retrieve model": one entry, by name or alias.
             *(f"    http-request return status 200 content-type application/json string '{_compact(entry)}' "
               f"if {{ path {MODELS_PATH}/{entry['id']} }} METH_GET" for entry in _entries(served)),
             # The whole body (up to tune.bufsize) is read before the rules below run. Not
             # `option http-buffer-request`: in a frontend it waits only the frontend's
             # `timeout http-request`, which bounds the headers alone (haproxy_config.py).
             f"    http-request wait-for-body time {BODY_TIMEOUT}",
             "    http-request set-var(txn.model) req.body,json_query('$.model')",
             "    http-request set-var(txn.body_read) req.body_len",
             f"    acl served_model var(txn.model) -m str {every}",
             # HAProxy read less than the body announced (Content-Length): `model` may lie beyond.
             "    acl body_cut req.body_size,sub(txn.body_read) gt 0",
             f"    http-request return status 413 content-type application/json string '{too_large(served, buffer)}' "
             "if !served_model body_cut",
             f"    http-request return status 404 content-type application/json string '{not_found(served)}' "
             "if !served_model"]
    for s in served:
        lines.append(f"    use_backend {backend_of(s)} if {{ var(txn.model) -m str {' '.join(s.ids)} }}")
    return lines


def health(served: Served, path: str, healthy: str, none: str) -> list[str]:
    """frontend.health_path: 200 only while every model has a server in rotation (up, not
    drained, not in maintenance: what the hold waits for, hold.py), else 503 naming the
    first model without one (the names are public: GET /v1/models lists them); with one
    model, `none` says it."""
    when = f"{{ path {path} }}"
    lines = []
    for s in served:
        body = none if len(served) == 1 else _compact(
            {"status": "unavailable", "reason": f"model {s.name} has no instance in rotation (starting, draining or "
             "down)"})
        lines.append(f"    http-request return status 503 content-type application/json string '{body}' "
                     f"hdr Retry-After 1 if {when} !{hold.in_rotation(backend_of(s))}")
    lines.append(f"    http-request return status 200 content-type application/json string '{healthy}' if {when}")
    return lines
