"""Every answer HAProxy gives itself, in one place: the JSON bodies (OpenAI's error shape for
a refusal, `{"error": {"message": "numa-infer: ...", "type": ..., "code": ...}}`; the model
list; the health path's), their status codes and headers (Retry-After on what a client may
retry), and the HAProxy lines that send them (`http-request return`, `http-error`). The
features say when (the condition); this module says what. Pure.

Why JSON everywhere: an OpenAI client parses the body of a failure, and HAProxy's default
pages are HTML. Every body is a single-quoted HAProxy string, so none may hold a '.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from numad_infer.config.models import ServedModel

MODELS_PATH = "/v1/models"
RETRY_AFTER = "Retry-After 1"


def compact(doc: object) -> str:
    """A JSON body as one HAProxy word (single-quoted: no ' allowed)."""
    text = json.dumps(doc, separators=(",", ":"))
    if "'" in text:
        raise ValueError(f"a ' would end HAProxy's string early: {text}")
    return text


def error(status: int, kind: str, message: str, code: str | None = None) -> str:
    """A body in OpenAI's error shape: `kind` is its "type", `code` its "code" (the status
    where none is given)."""
    return compact({"error": {"message": f"numa-infer: {message}", "type": kind,
                              "code": status if code is None else code}})


@dataclass(frozen=True)
class Reply:
    """One answer: its status, its JSON body, and headers sent with it (each `NAME VALUE`)."""

    status: int
    body: str
    headers: tuple[str, ...] = ()

    def _words(self) -> str:
        extra = "".join(f" hdr {header}" for header in self.headers)
        return f"status {self.status} content-type application/json string '{self.body}'{extra}"

    def rule(self, condition: str = "") -> str:
        """The `http-request return` line that answers with it, `if condition` (none: always)."""
        return f"    http-request return {self._words()}" + (f" if {condition}" if condition else "")

    def error_line(self) -> str:
        """The `http-error` line that makes it HAProxy's own answer with this status."""
        return f"    http-error {self._words()}"


BUSY = Reply(503, error(503, "server_busy", "no instance can take the request: every instance is busy, starting or "
                        "down, and the queue is full or the wait ran out; retry later"), (RETRY_AFTER,))
# Every status HAProxy 2.6 answers on its own (http-error accepts these). Its HTTP parser's
# 400 (malformed request, headers too large) and 408 (headers too slow) come before any
# stream and stay HTML: neither http-error nor errorfile reaches them; no OpenAI client
# provokes them. The 400 and 408 here are the stream's (a body sent too slowly).
ANSWERS = (
    Reply(400, error(400, "invalid_request_error", "the request is not valid")),
    Reply(408, error(408, "timeout", "the request did not arrive in full in time")),
    Reply(429, error(429, "rate_limit_exceeded", "too many requests; retry later"), (RETRY_AFTER,)),
    Reply(500, error(500, "server_error", "the front door failed on this request")),
    Reply(501, error(501, "invalid_request_error",
                     "the front door does not support this request (transfer encoding)")),
    Reply(502, error(502, "server_error", "the instance serving this request failed before it answered in full "
                     "(did the request crash it?); a request that reached an instance is not sent to another")),
    BUSY,
    Reply(504, error(504, "timeout", "the instance did not answer within frontend.request_timeout_s")),
)


def http_errors() -> list[str]:
    """The defaults' lines: each of ANSWERS as HAProxy's own answer with its status."""
    return [answer.error_line() for answer in ANSWERS]


def busy(condition: str) -> str:
    """The JSON 503 with Retry-After, `if condition`: a full queue, a wait that ran out."""
    return BUSY.rule(condition)


def queue_full(backend: str, queue_size: int, when: str) -> str:
    """The 503 for a request that finds `queue_size` waiting already, checked `when` (on
    arrival; again after a wait for a prefix home)."""
    return busy(f"{when} {{ queue({backend}) ge {queue_size} }}")


# -- the health path (frontend.health_path) -----------------------------------------------------
HEALTHY = Reply(200, compact({"status": "ok"}))


def no_instance(model: str | None = None) -> Reply:
    """503: no instance in rotation (of `model`, with several)."""
    reason = ("no instance in rotation (starting, draining or down)" if model is None
              else f"model {model} has no instance in rotation (starting, draining or down)")
    return Reply(503, compact({"status": "unavailable", "reason": reason}), (RETRY_AFTER,))


# -- paths (api_paths.py) -------------------------------------------------------------------------
# The connection closes with it: a client asking for a path not forwarded keeps no kept-alive one.
NO_SUCH_PATH = Reply(404, error(404, "invalid_request_error", "no such path at this front door: it forwards the "
                                "OpenAI API (POST /v1/chat/completions, /v1/completions, /v1/embeddings, GET "
                                "/v1/models, ...) and the llama.cpp inference paths; management paths are not "
                                "reachable here"), ("Connection close",))

# -- keys and limits (tenants.py) ---------------------------------------------------------------
# The connection closes with the 401: a client without a key holds no kept-alive one.
NO_KEY = Reply(401, error(401, "invalid_request_error", "this front door needs an API key: send Authorization: "
                          "Bearer KEY with the key your operator gave you (a missing, unknown or revoked key is "
                          "refused)"), ("WWW-Authenticate Bearer", "Connection close"))


def in_flight_limit(tenant: str, limit: int) -> Reply:
    return Reply(429, error(429, "rate_limit_exceeded", f"tenant {tenant} has {limit} request(s) in flight already, "
                            "its limit; retry when one is answered"), (RETRY_AFTER,))


def minute_limit(tenant: str, rpm: int) -> Reply:
    """429 with Retry-After: the seconds until the rate lets one more through, rounded up."""
    return Reply(429, error(429, "rate_limit_exceeded", f"tenant {tenant} sent {rpm} request(s) in the last minute, "
                            "its limit; retry later"), (f"Retry-After {max(1, -(-60 // rpm))}",))


def model_refused(model: str) -> Reply:
    return Reply(403, error(403, "permission_error", f"this key may not use model {model}; the operator lists the "
                            "models each tenant may use"))


# -- models (routing.py) ------------------------------------------------------------------------
Served = tuple[ServedModel, ...]


def _entry(ident: str) -> dict[str, object]:
    # `created` is fixed: the file is rendered on every pass and must not change by itself.
    return {"id": ident, "object": "model", "created": 0, "owned_by": "numa-infer"}


def model_entries(served: Served) -> list[dict[str, object]]:
    """Every name, then every alias (with its model as `parent`)."""
    data: list[dict[str, object]] = [_entry(s.name) for s in served]
    return data + [{**_entry(alias), "parent": s.name} for s in served for alias in s.aliases]


def models_list(served: Served) -> str:
    """GET /v1/models's body."""
    return compact({"object": "list", "data": model_entries(served)})


def model_list(served: Served) -> Reply:
    return Reply(200, models_list(served))


def model_entry(entry: dict[str, object]) -> Reply:
    """OpenAI's "retrieve model": one entry, by name or alias."""
    return Reply(200, compact(entry))


def _names(served: Served) -> str:
    return ", ".join(s.name for s in served)


def not_found(served: Served) -> str:
    return error(404, "invalid_request_error", "the request names no model served here: its JSON body needs a "
                 "`model` string that is one of the served models or their aliases (GET "
                 f"{MODELS_PATH} lists them); served models: {_names(served)}", "model_not_found")


def model_not_found(served: Served) -> Reply:
    return Reply(404, not_found(served))


def too_large(served: Served, buffer: int) -> Reply:
    return Reply(413, error(413, "invalid_request_error", f"the request body is longer than the {buffer} bytes the "
                            "front door reads to find `model`, and `model` is not within them: send `model` before "
                            f"`messages` (or `prompt`) in the JSON body; served models: {_names(served)}",
                            "request_too_large"))
