"""Validation of ``POST /v1/chat/completions`` bodies and of the session metadata.

:data:`pipeline.engine_api.schema.CHAT_FIELDS` lists every chat field the package knows, each with its
type/range check; the proxy adds its own rule (``n`` must be 1) and forwards unknown fields untouched. Every failure raises :class:`pipeline.proxy.errors.ProxyError` (400) naming
the field, e.g. ``messages[2].role: unknown role 'robot'``.

Session metadata comes from the headers ``X-Session-Id``, ``X-Turn-Type`` (``main``/``side``)
and ``X-Session-Done`` (``true``/``false``, also ``1``/``0``/``yes``/``no``), or from the body
fields ``session_id``, ``turn_type`` and ``session_done`` (for clients that can only set
``extra_body``). A header wins over a body field; body fields are always removed before the
request is forwarded. A session id that is an unfilled template or empty
(:func:`pipeline.proxy.identity.unfilled`) is not an error: it is ignored (listed in
``SessionMeta.warnings``) and the next rule decides (:mod:`pipeline.proxy.identity`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from pipeline.engine_api.schema import CHAT_FIELDS, ROLES, ChatBodyError, check_chat_body
from pipeline.proxy.errors import ProxyError, bad_request
from pipeline.proxy.identity import SESSION_ID, unfilled

SESSION_FIELDS = ("session_id", "turn_type", "session_done", "session_outcome")
#: request fields recorded as the turn's sampling parameters: the table's ``recorded`` fields, and two
#: SGLang extensions outside it (forwarded untouched) that constrain decoding (no OPD term then)
SAMPLING_KEYS = tuple(k for k, f in CHAT_FIELDS.items() if f.recorded) + ("json_schema", "structural_tag")
#: chat fields that choose a LoRA adapter (SGLang's chat reads ``lora_path``): refused, as a ``model``
#: naming an adapter is (:mod:`pipeline.proxy.names`), since the proxy chooses each tenant's adapter
ADAPTER_FIELDS = ("lora_path",)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(slots=True)
class SessionMeta:
    """Who a request belongs to.

    Attributes:
        session_id: the client's id, or None when it sent none.
        turn_type: ``main`` (part of the trajectory) or ``side`` (auxiliary call, no turn index).
        done: the client says this request ends the session.
        source: ``header`` or ``body`` (where ``session_id`` came from), None without one.
        warnings: ``(field, reason)`` of each session id ignored (``empty``, ``template``).
        outcome: the session's outcome score in [-1, 1] (``X-Session-Outcome`` or the body's
            ``session_outcome``, read only with ``done``); None: none reported.
        housekeeping: the agent's own upkeep the request was recognised as
            (:mod:`pipeline.proxy.housekeeping`; then ``turn_type`` is ``side``), None otherwise.
    """

    session_id: str | None
    turn_type: str
    done: bool
    source: str | None = None
    warnings: list = field(default_factory=list)
    outcome: float | None = None
    housekeeping: Any = None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_bool(raw: Any, name: str) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE:
        return True
    if isinstance(raw, str) and raw.strip().lower() in _FALSE:
        return False
    raise bad_request(f"{name} must be true or false, got {str(raw)[:40]!r}", param=name)


def session_meta(headers: dict[bytes, bytes], body: dict, default_turn_type: str,
                 previous_session: str | None = None) -> SessionMeta:
    """Read (and strip from ``body``) the session metadata.

    Args:
        headers: lower-cased raw header names -> raw values.
        body: the parsed request; ``session_id``/``turn_type``/``session_done`` are popped.
        default_turn_type: used when a session id is given without a turn type.
        previous_session: the session of the stored response the request continues (a front
            door's ``previous_response_id``), taken when the client gives no id of its own.
    Raises:
        ProxyError: 400 on an unusable session id, turn type or done flag.
    """
    b_sid = body.pop("session_id", None)
    b_type = body.pop("turn_type", None)
    b_done = body.pop("session_done", None)
    b_outcome = body.pop("session_outcome", None)
    h = headers.get(b"x-session-id")
    sid = source = None
    warnings: list = []
    for name, src, raw in (("X-Session-Id", "header", None if h is None else h.decode("latin-1")),
                           ("session_id", "body", b_sid),
                           ("previous_response_id", "previous_response", previous_session)):
        if raw is None:
            continue
        why = unfilled(raw)
        if why is not None:
            warnings.append((name, why))
            continue
        if not isinstance(raw, str) or not SESSION_ID.match(raw.strip()):
            raise bad_request(f"session id ({name}) must be 1-256 printable ASCII characters without spaces",
                              param=name, code="invalid_session_id")
        sid, source = raw.strip(), src
        break
    h = headers.get(b"x-turn-type")
    tt: Any = h.decode("latin-1").strip().lower() if h is not None else b_type
    if tt is None or tt == "":
        tt = default_turn_type
    if tt not in ("main", "side"):
        raise bad_request(f"X-Turn-Type must be 'main' or 'side', got {str(tt)[:40]!r}", param="X-Turn-Type",
                          code="invalid_turn_type")
    h = headers.get(b"x-session-done")
    raw_done = h.decode("latin-1") if h is not None else b_done
    done = False if raw_done is None else _parse_bool(raw_done, "X-Session-Done")
    h = headers.get(b"x-session-outcome")
    raw_outcome = h.decode("latin-1") if h is not None else b_outcome
    outcome = None if raw_outcome is None else parse_outcome(raw_outcome, "X-Session-Outcome")
    if outcome is not None and not done:
        raise bad_request("X-Session-Outcome is the outcome of a session that ends: send it with X-Session-Done: "
                          "true (or POST /v1/sessions/{id}/end)", param="X-Session-Outcome", code="invalid_outcome")
    return SessionMeta(sid, tt, done, source, warnings, outcome)


def parse_outcome(raw: Any, name: str = "outcome") -> float:
    """A session outcome: a number in [-1, 1] (a JSON number, or its text in a header).

    Raises:
        ProxyError: 400 ``invalid_outcome`` naming ``name``.
    """
    v = raw
    if isinstance(raw, str):
        try:
            v = float(raw.strip())
        except ValueError:
            v = None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not -1.0 <= v <= 1.0:
        raise bad_request(f"{name} must be a number in [-1, 1], got {str(raw)[:40]!r}", param=name,
                          code="invalid_outcome")
    return float(v)


def check_request(body: Any) -> None:
    """Validate a parsed chat-completion request in place (nothing is changed): ``n`` must be 1
    (each recorded turn is one sample), no field of :data:`ADAPTER_FIELDS`, then every field of
    :data:`pipeline.engine_api.schema.CHAT_FIELDS` that is present.

    Raises:
        ProxyError: 400 with the offending field in ``param``.
    """
    n = body.get("n") if isinstance(body, dict) else None
    if n is not None:
        if not _is_int(n):
            raise bad_request(f"'n' must be an integer, got {type(n).__name__}", param="n")
        if n != 1:
            raise bad_request("'n' must be 1 through the proxy (each recorded turn is one sample)", param="n",
                              code="unsupported_value")
    for key in ADAPTER_FIELDS:
        if isinstance(body, dict) and key in body:
            raise bad_request(f"'{key}' chooses a LoRA adapter: adapters are chosen by this proxy for each tenant, "
                              "never by the request", param=key, code="model_not_allowed")
    try:
        check_chat_body(body)
    except ChatBodyError as e:
        raise bad_request(e.message, param=e.param, code=e.code) from None


def json_body(raw: bytes) -> dict:
    """A request body parsed as a JSON object.

    Raises:
        ProxyError: 400 ``invalid_json`` when it is not JSON, 400 when it is not an object.
    """
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def content_type_ok(value: bytes | None) -> bool:
    """True for a missing Content-Type or any ``application/json`` variant."""
    if value is None:
        return True
    v = value.split(b";", 1)[0].strip().lower()
    return v in (b"application/json", b"") or v.endswith(b"+json")


__all__ = ["SessionMeta", "session_meta", "check_request", "content_type_ok", "ProxyError", "SAMPLING_KEYS", "CHAT_FIELDS",
           "SESSION_FIELDS", "ROLES"]
