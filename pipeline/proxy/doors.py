"""Front doors other than chat completions: one request path, translated both ways.

A front door (:class:`Door`: the OpenAI Responses API in :mod:`pipeline.proxy.responses`, the
Anthropic Messages API in :mod:`pipeline.proxy.messages`) turns its API's request into a chat
completion request (:meth:`Door.translate`) and hands it to the proxy's own chat handler
(``ProxyApp.chat``) as if the client had sent it: the same validation, session metadata
(``X-Session-Id`` ...), weight-sync hold, engine call, recording of the ``turn`` with exact token
ids and log-probs, and durability rule (the response's last byte waits for the turn on disk).
The turn's ``messages`` are the translated chat messages, so the judge and the trainer see one
shape whatever door a client used.

What the chat handler answers is translated back on its way out (:class:`_Relay`, an ASGI
``send``): a JSON body by :meth:`Door.answer`, an SSE stream chunk by chunk by a
:class:`DoorStream`, an error (an OpenAI error body, or an ``error`` event in a stream) by
:meth:`Door.error_body` / :meth:`DoorStream.fail`, always with the status the chat handler chose.
Errors found while translating are answered in the door's own shape with 4xx, never 5xx.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import orjson

from pipeline.proxy import metrics as M
from pipeline.proxy.errors import ClientGone, ProxyError, bad_request
from pipeline.proxy.validate import SESSION_FIELDS, content_type_ok, json_body

log = logging.getLogger(__name__)

_JSON = b"application/json"
_SSE_HDRS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
             (b"x-accel-buffering", b"no")]
#: response headers of the chat handler that a door passes on (request id, session, turn index)
_PASSED = (b"x-request-id", b"x-session-id", b"x-turn-index", b"retry-after")
_DROPPED = (b"content-length", b"content-type", b"transfer-encoding")


@dataclass
class Call:
    """One translated request.

    Attributes:
        chat: the chat completion request (what the chat handler validates, serves and records).
        stream: the client asked for a stream.
        ctx: what the door needs to answer in its own shape (its request's echo fields ...).
        previous_session: the session of the stored response a request continues
            (``previous_response_id``), or None; the chat handler takes it after the client's own
            id (``session_source`` ``previous_response``).
        tenant: the request's tenant (None: none), as the chat handler decides it again from the
            same headers.
    """

    chat: dict
    stream: bool
    ctx: dict = field(default_factory=dict)
    previous_session: str | None = None
    tenant: str | None = None


@dataclass
class Served:
    """What the chat handler said about the request besides its body.

    Attributes:
        status: its HTTP status.
        request_id: the proxy's request id (``x-request-id``; ids of the answer derive from it).
        session_id: the session the turn was recorded in (``x-session-id``), or None.
        headers: the response headers passed on to the client.
    """

    status: int
    request_id: str
    session_id: str | None
    headers: list


class DoorStream:
    """Translates one chat SSE stream into a door's events (each method returns SSE bytes)."""

    def start(self) -> bytes:
        """The events sent before the first chunk."""
        return b""

    def chunk(self, obj: dict) -> bytes:
        """The events of one chat chunk (``choices[0].delta``, ``finish_reason``, ``usage``)."""
        raise NotImplementedError

    def done(self) -> bytes:
        """The closing events (the chat stream ended with ``[DONE]``, its turn already recorded)."""
        raise NotImplementedError

    def fail(self, err: dict) -> bytes:
        """The events of an OpenAI ``error`` object that ended the chat stream."""
        raise NotImplementedError


class Door:
    """A front door (subclasses: the API's translation). Serve with ``await door(scope, receive, send)``.

    Args:
        app: the :class:`pipeline.proxy.app.ProxyApp` whose chat path serves the request.

    Attributes:
        api: its name, the ``api`` label of ``pipeline_proxy_door_requests_total``.
    """

    api = "door"
    #: the prefix of the answer ids this door gives (``<prefix><request id>``; the turn records it)
    id_prefix = ""

    def __init__(self, app) -> None:
        self.app = app

    # ---- to implement -----------------------------------------------------------------------
    def auth_headers(self, headers: dict) -> None:
        """Map the API's credentials onto ``authorization: Bearer`` (in place) and check its headers.

        Raises:
            ProxyError: 400 on a malformed API header.
        """

    def translate(self, body: dict, headers: dict, tenant: str | None = None) -> Call:
        """The chat request of a parsed body (``headers``: lower-cased raw request headers;
        ``tenant``: the request's, so that nothing a door keeps crosses tenants).

        Raises:
            ProxyError: 4xx naming the offending field of this API.
        """
        raise NotImplementedError

    def error_body(self, status: int, err: dict) -> bytes:
        """This API's error body for an OpenAI ``error`` object (``message``, ``type``, ``param``, ``code``)."""
        raise NotImplementedError

    def answer(self, call: Call, resp: dict, served: Served) -> bytes:
        """This API's body for a non-stream chat completion ``resp``."""
        raise NotImplementedError

    def stream(self, call: Call, served: Served) -> DoorStream:
        """A translator for the chat stream of ``call``."""
        raise NotImplementedError

    # ---- serving ----------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        relay = _Relay(self, send)
        if scope["method"] != "POST":
            await relay.error(405, ProxyError(405, f"method {scope['method']} not allowed on {scope['path']}; use "
                                              "POST", code="method_not_allowed"), [(b"allow", b"POST")])
            M.DOOR_REQUESTS.labels(self.api, "405").inc()
            return
        headers = dict(scope["headers"])
        try:
            self.auth_headers(headers)
            tenant = self.app._auth(headers)  # 401/403 in this API's shape
            if not content_type_ok(headers.get(b"content-type")):
                raise ProxyError(415, "Content-Type must be application/json", code="unsupported_media_type")
            relay.call = self.translate(json_body(await self.app._read_body(headers, receive)), headers, tenant)
            relay.call.tenant = tenant
        except ProxyError as e:
            await relay.error(e.status, e)
            M.DOOR_REQUESTS.labels(self.api, str(e.status)).inc()
            return
        except ClientGone:
            return
        except Exception as e:  # a bug must still get an answer in the door's shape
            log.exception("%s request failed in translation", self.api)
            await relay.error(500, ProxyError(500, f"internal proxy error ({type(e).__name__})", "server_error",
                                              code="internal_error"))
            return
        await self._serve_chat(scope, headers, relay, receive)

    async def _serve_chat(self, scope, headers: dict, relay: "_Relay", receive) -> None:
        """Run the chat handler on the translated request, its answer going through ``relay``."""
        call = relay.call
        data = orjson.dumps(call.chat)
        hdrs = [(k, v) for k, v in headers.items() if k not in _DROPPED] + [(b"content-type", _JSON)]
        fed = False

        async def receive_chat() -> dict:
            nonlocal fed
            if not fed:
                fed = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()  # a disconnect, while a stream is served

        scope = dict(scope, headers=hdrs, path="/v1/chat/completions", previous_session=call.previous_session,
                     response_prefix=self.id_prefix)
        await self.app.chat(scope, receive_chat, relay)
        M.DOOR_REQUESTS.labels(self.api, str(relay.status)).inc()


def split_sse(buf: bytes) -> tuple[list[bytes], bytes]:
    """``(data payloads of the complete events, the incomplete rest)`` of SSE bytes."""
    *events, rest = buf.split(b"\n\n")
    out = []
    for ev in events:
        for line in ev.split(b"\n"):
            if line.startswith(b"data:"):
                out.append(line[5:].strip())
    return out, rest


def sse_event(name: str, obj: dict) -> bytes:
    """One named SSE event (``event: name`` + JSON ``data``)."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def error_object(status: int, data: bytes) -> dict:
    """The OpenAI ``error`` object of an error body the chat handler answered."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        obj = None
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        return err
    return {"message": data[:300].decode("utf-8", "replace") or f"HTTP {status}", "type": "server_error",
            "param": None, "code": None}


class _Relay:
    """The ASGI ``send`` the chat handler answers through: translates its answer for the door."""

    def __init__(self, door: Door, send) -> None:
        self.door = door
        self._send = send
        self.call: Call | None = None
        self.status = 500
        self._served: Served | None = None
        self._sse: DoorStream | None = None
        self._buf = b""
        self._ended = False

    async def error(self, status: int, e: ProxyError, extra: list | None = None) -> None:
        """Answer an error of the door itself (before the chat handler ran)."""
        self.status = status
        err = {"message": e.message, "type": e.type, "param": e.param, "code": e.code}
        await self._json(status, self.door.error_body(status, err), extra or [])

    async def _json(self, status: int, body: bytes, extra: list) -> None:
        await self._send({"type": "http.response.start", "status": status,
                          "headers": [(b"content-type", _JSON), (b"content-length", str(len(body)).encode())] + extra})
        await self._send({"type": "http.response.body", "body": body})

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            hdrs = dict(message.get("headers") or ())
            self.status = message["status"]
            self._served = Served(self.status, hdrs.get(b"x-request-id", b"").decode(),
                                  hdrs[b"x-session-id"].decode() if b"x-session-id" in hdrs else None,
                                  [(k, v) for k, v in hdrs.items() if k in _PASSED])
            if self.status < 400 and b"text/event-stream" in hdrs.get(b"content-type", b""):
                self._sse = self.door.stream(self.call, self._served)
                await self._send({"type": "http.response.start", "status": self.status,
                                  "headers": _SSE_HDRS + self._served.headers})
                await self._send({"type": "http.response.body", "body": self._sse.start(), "more_body": True})
            return
        if message["type"] != "http.response.body":
            return
        more = message.get("more_body", False)
        if self._sse is not None:
            await self._stream_body(message.get("body", b""), more)
            return
        self._buf += message.get("body", b"")
        if not more:
            await self._json(self.status, self._translate(self._buf), self._served.headers)

    def _translate(self, data: bytes) -> bytes:
        if self.status >= 400:
            return self.door.error_body(self.status, error_object(self.status, data))
        try:
            return self.door.answer(self.call, orjson.loads(data), self._served)
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError):
            self.status = 502
            return self.door.error_body(502, {"message": "the engine's answer could not be translated",
                                              "type": "upstream_error", "param": None, "code": "engine_error"})

    async def _stream_body(self, data: bytes, more: bool) -> None:
        payloads, self._buf = split_sse(self._buf + data)
        out = []
        for p in payloads:
            if self._ended:
                continue
            if p == b"[DONE]":
                out.append(self._sse.done())
                self._ended = True
                continue
            try:
                obj = orjson.loads(p)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(obj, dict):
                continue
            if isinstance(obj.get("error"), dict):
                out.append(self._sse.fail(obj["error"]))
                self._ended = True
            else:
                out.append(self._sse.chunk(obj))
        await self._send({"type": "http.response.body", "body": b"".join(out), "more_body": more})


def check_type(body: dict, key: str, types: tuple, what: str, param: str | None = None) -> Any:
    """``body[key]`` (None when absent or null) if it is of ``types``.

    Raises:
        ProxyError: 400 ``'<param>' must be <what>`` naming ``param`` (default ``key``).
    """
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
        raise bad_request(f"'{param or key}' must be {what}, got {type(v).__name__}", param=param or key)
    return v


def refuse_unknown(body: dict, known: frozenset, api: str) -> None:
    """400 on a top-level field this door does not know (as the API itself answers).

    Raises:
        ProxyError: 400 ``unknown_parameter`` naming the field.
    """
    for k in body:
        if k not in known and k not in SESSION_FIELDS:
            raise bad_request(f"unknown parameter '{k[:60]}' for the {api}", param=k[:60], code="unknown_parameter")


def function_tools(tools: Any, accepted: str, schema_key: str, why: str, default_kind: str | None = None,
                   schema_required: bool = False) -> list[dict] | None:
    """Chat function tools of a door's ``tools`` (None when there are none).

    Args:
        tools: the request's list; each entry ``{"type": accepted (or absent: default_kind),
            "name", "description", schema_key: JSON schema, "strict"}``.
        why: the reason other tool types are refused (the end of the 400 message).
    Raises:
        ProxyError: 400 naming the entry (``unsupported_value`` for another tool type).
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", param="tools")
    out = []
    for j, t in enumerate(tools):
        kind = t.get("type", default_kind) if isinstance(t, dict) else type(t).__name__
        if kind != accepted:
            raise bad_request(f"tools[{j}]: type {str(kind)[:40]!r} is not supported: {why}", param=f"tools[{j}].type",
                              code="unsupported_value")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request(f"tools[{j}].name must be a non-empty string", param=f"tools[{j}].name")
        schema = t.get(schema_key)
        if (schema is None and schema_required) or (schema is not None and not isinstance(schema, dict)):
            raise bad_request(f"tools[{j}].{schema_key} must be a JSON schema object", param=f"tools[{j}].{schema_key}")
        fn = {"name": t["name"], "description": t.get("description"), "parameters": schema, "strict": t.get("strict")}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out or None


def session_fields(body: dict) -> dict:
    """The proxy's session body fields (``session_id``, ``turn_type``, ``session_done``) a door
    request carries, passed on to the chat request."""
    return {k: body[k] for k in SESSION_FIELDS if k in body}


def json_object(text: Any) -> dict:
    """A tool call's ``arguments`` (JSON text) as an object; text that is not a JSON object is
    kept as ``{"_raw": text}`` (our engine only emits objects)."""
    if not isinstance(text, str) or not text.strip():
        return {}
    try:
        v = orjson.loads(text)
    except orjson.JSONDecodeError:
        return {"_raw": text}
    return v if isinstance(v, dict) else {"_raw": text}


__all__ = ["Call", "Door", "DoorStream", "Served", "check_type", "error_object", "function_tools", "json_object",
           "refuse_unknown", "session_fields", "split_sse", "sse_event"]
