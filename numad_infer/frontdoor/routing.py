"""Several models behind one front door (`[[models]]`): one HAProxy backend per
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

from numad_infer.config.models import ServedModel
from numad_infer.frontdoor import answers, hold, names
from numad_infer.frontdoor.answers import models_list as models_list  # GET /v1/models's body, named here too

BACKEND = "instances"  # the backend of the model whose key is "" (the single `[model]` form's)
_BACKEND_PREFIX = "model-"
MODELS_PATH = answers.MODELS_PATH
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


def not_found(served: Served) -> str:
    """The 404's body for a model not served (answers.py makes it)."""
    return answers.not_found(served)


def model_answers(served: Served) -> list[str]:
    """The frontend's lines that answer GET /v1/models, and each model by name or alias."""
    return [answers.model_list(served).rule(f"{{ path {MODELS_PATH} }} METH_GET"),
            # OpenAI's "retrieve model": one entry, by name or alias.
            *(answers.model_entry(entry).rule(f"{{ path {MODELS_PATH}/{entry['id']} }} METH_GET")
              for entry in answers.model_entries(served))]


def to_backend(served: Served, buffer: int) -> list[str]:
    """The frontend's lines that send each request to its model's backend (only when `routed`)."""
    every = " ".join(ident for s in served for ident in s.ids)
    # The whole body (up to tune.bufsize) is read before the rules below run. Not
    # `option http-buffer-request`: in a frontend it waits only the frontend's
    # `timeout http-request`, which bounds the headers alone (haproxy_config.py).
    lines = [f"    http-request wait-for-body time {BODY_TIMEOUT}",
             f"    http-request set-var({names.MODEL}) req.body,json_query('$.model')",
             f"    http-request set-var({names.BODY_READ}) req.body_len",
             f"    acl served_model var({names.MODEL}) -m str {every}",
             # HAProxy read less than the body announced (Content-Length): `model` may lie beyond.
             f"    acl body_cut req.body_size,sub({names.BODY_READ}) gt 0",
             answers.too_large(served, buffer).rule("!served_model body_cut"),
             answers.model_not_found(served).rule("!served_model")]
    for s in served:
        lines.append(f"    use_backend {backend_of(s)} if {{ var({names.MODEL}) -m str {' '.join(s.ids)} }}")
    return lines


def route(served: Served, buffer: int) -> list[str]:
    """The frontend's lines that answer GET /v1/models and send each request to its model's
    backend (only when `routed`)."""
    return [*model_answers(served), *to_backend(served, buffer)]


def health(served: Served, path: str) -> list[str]:
    """frontend.health_path: 200 only while every model has a server in rotation (up, not
    drained, not in maintenance: what the hold waits for, hold.py), else 503 naming the
    first model without one (the names are public: GET /v1/models lists them)."""
    when = f"{{ path {path} }}"
    lines = [answers.no_instance(None if len(served) == 1 else s.name).rule(
        f"{when} !{hold.in_rotation(backend_of(s))}") for s in served]
    return [*lines, answers.HEALTHY.rule(when)]
