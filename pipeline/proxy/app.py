"""The proxy's ASGI application: a lean chat-completions handler in front of a FastAPI app.

``POST /v1/chat/completions`` is handled by :meth:`ProxyApp.chat`, a plain ASGI coroutine (no
pydantic model, no middleware stack: the request is parsed once with orjson and validated by
:mod:`pipeline.proxy.validate`). Every other route (``/v1/models``, ``/healthz``, ``/readyz``,
``/metrics``, ``POST /v1/sessions/{id}/end``) is an ordinary FastAPI app. Serve it with
``uvicorn.run(ProxyApp(config), loop="uvloop", http="httptools")`` (what ``pipeline proxy`` does).
``POST /v1/responses`` and ``POST /v1/messages`` are translated into a chat request and served by
:meth:`ProxyApp.chat` too (:mod:`pipeline.proxy.doors`): same validation, sessions and turns.

Per request (main turn of a known session):

1. API key check (401) and the request's tenant (``proxy.tenants`` or ``X-Tenant-Id``: 403 for
   a header that disagrees with the key; ``docs/tenants.md``), body size (413), JSON (400),
   fields (400), session metadata (400); the session by the rules of :mod:`pipeline.proxy.identity` (``docs/sessions.md``);
2. weight-sync hold (bounded; 503 only with ``proxy.sync_strict``);
3. turn index reserved; the previous turn's ``next_state`` is published once the engine accepted
   the request (a request it refuses or never answers is undone: no turn, no index, no next state);
4. forward with ``logprobs``/``return_token_ids``/``return_prompt_token_ids`` added; the user gets
   the answer without the extras it did not ask for (streams are forwarded chunk by chunk).
   In front of SGLang (no token ids on streamed chat, log-prob ``bytes`` of decoded text) a
   recorded stream goes through ``/v1/tokenize`` + ``/generate`` (every chat field carried over
   as SGLang's chat path would, or refused naming it), and shown log-probs get each token's raw
   bytes from the served model's tokenizer (``proxy.tokenizer``, default ``engine.model``);
5. ``turn`` published once the engine's answer is complete, then ``session_end`` on
   ``X-Session-Done``; the response's last body message waits until these events are committed
   to the proxy's disk buffer (:class:`pipeline.proxy.publisher.DurableSend`, a group commit of
   well under a millisecond), so an answered request is never lost by a crash of the proxy.
   Publishing itself only appends to :class:`pipeline.proxy.publisher.EventPublisher`. The turn
   records the prompt options (``chat_options``) and the distribution its log-probs are of
   (``logprob_temperature``, ``logprob_processors``; :mod:`pipeline.sampling`).

A generation that does not finish (the engine aborts it, the client disconnects, the engine
stream breaks or times out) is recorded with ``finish_reason: "abort"`` (the judge never trains
it as an answer) and counted in ``pipeline_proxy_unfinished_generations_total{cause}``; the
client gets an OpenAI-style error (503 ``generation_aborted``, or that body as the last SSE
event of a stream), never ``finish_reason: "abort"``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline import events
from pipeline.config import Config
from pipeline.engine_api.backend import adapter_model, engine_client
from pipeline.engine_api.client import EngineClient
from pipeline.engine_api.errors import EngineError
from pipeline.engine_api.render import chat_options
from pipeline.engine_api.sglang import generate_path_refusal
from pipeline.engine_api.tokenbytes import TokenBytesError, load_token_bytes
from pipeline.engine_api.transport import Transport, sse_batches
from pipeline.engine_api.vllm import RECORDED_SAMPLING
from pipeline.models import ModelNotFound, resolve_model
from pipeline.proxy import metrics as M
from pipeline.proxy.adapters import route_to, shown, wrong_adapter
from pipeline.proxy.canary import FULL_WEIGHTS
from pipeline.proxy.control import ControlFollower, ControlState, SyncGate
from pipeline.proxy.errors import ClientGone as _ClientGone
from pipeline.proxy.errors import (ProxyError, bad_request, engine_failure, error_body, generation_aborted,
                                   upstream_error)
from pipeline.proxy.feedback import IndexedTurn, TurnIndex, answer, feedback_event, not_found, parse_feedback
from pipeline.proxy.housekeeping import recognise
from pipeline.proxy.identity import Chain, Conversations, Tenants, claim, prompt_chain
from pipeline.proxy.messages import MessagesDoor
from pipeline.proxy.names import ServedModels, base_cards
from pipeline.proxy.publisher import DurableSend, EventPublisher
from pipeline.proxy.record import (Recorded, StreamRecorder, from_response, policy_version, repair_logprob_bytes,
                                   strip_response)
from pipeline.proxy.responses import ResponsesDoor
from pipeline.proxy.sessions import MainTurn, SessionTable
from pipeline.proxy.validate import SAMPLING_KEYS, SessionMeta, check_request, content_type_ok, session_meta
from pipeline.proxy.validate import json_body, parse_outcome
from pipeline.sampling import (CHAT_DEFAULTED, effective_temperature, generation_defaults, logprob_processors,
                               with_generation_defaults)

log = logging.getLogger(__name__)

_CHAT = "/v1/chat/completions"
_JSON_HDR = (b"content-type", b"application/json")
_SSE_HDRS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
             (b"x-accel-buffering", b"no")]
_DONE = b"data: [DONE]\n\n"


def _nothing() -> None:
    pass


def _mark_housekeeping(meta: SessionMeta, messages: list) -> None:
    """An agent's own housekeeping call (:mod:`pipeline.proxy.housekeeping`) is a side turn
    whatever the client said: ``meta`` says so, and it is counted."""
    hk = recognise(messages)
    if hk is not None:
        meta.housekeeping, meta.turn_type = hk, "side"
        M.HOUSEKEEPING.labels(hk.agent, hk.kind).inc()


@dataclass(slots=True)
class _Route:
    """Where one request's turn goes: its session, the rule that decided (``source``), whether the
    session is new for it (``fresh``), the recorded turn it continues (``hit``), its prefix
    digests (``chain``) and its ``tenant`` (the session is ``(tenant, sid)``); ``mt`` and
    ``admitted`` track its reserved index until the engine takes it; ``adapter`` is the tenant's
    LoRA adapter it is served by (:mod:`pipeline.proxy.adapters`) and ``canary`` its arm while the
    tenant's canary is open (:mod:`pipeline.proxy.canary`)."""

    sid: str
    source: str
    fresh: bool
    hit: Any
    chain: Chain | None
    rid: str
    created: int
    tenant: str | None = None
    mt: MainTurn | None = None
    admitted: bool = False
    adapter: dict | None = None  # the tenant's adapter the request was routed to (None: the base model)
    canary: str | None = None  # "candidate" / "incumbent" while the tenant's canary is open
    upstream: Transport | None = None  # the canary engines (a full-weight candidate session); None: engine.url
    version_before: str | None = None  # vLLM: its weight version read just before the request was sent
    response_prefix: str = "chatcmpl-"  # the answer's id is <prefix><rid> (a front door's: resp_, msg_)

    @property
    def key(self) -> str:
        """The Kafka key of the session's records (:func:`pipeline.events.session_key`)."""
        return events.session_key(self.tenant, self.sid)


def _is_abort_chunk(data: bytes) -> bool:
    """Does an SSE chunk end a choice with the non-OpenAI ``finish_reason: "abort"``?"""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and any(isinstance(c, dict) and c.get("finish_reason") == "abort"
                                         for c in obj.get("choices") or ())


async def _watch_disconnect(receive, gone: asyncio.Event, on_gone=None) -> None:
    """Read ASGI messages until ``http.disconnect``; then set ``gone`` and call ``on_gone()``."""
    while True:
        m = await receive()
        if m["type"] == "http.disconnect":
            gone.set()
            if on_gone is not None:
                on_gone()
            return


_DRAINING: set = set()  # _keep_alive's tasks (a reference until they end)


def _keep_alive(resp, timeout_s: float = 2.0) -> None:
    """Release an engine stream read up to its ``[DONE]`` so that its connection goes back to
    the pool: at once when its end is already there, else once its last bytes (the chunked
    body's end, usually a write after ``[DONE]``) arrive, within ``timeout_s``, in a task: the
    client's response does not wait. Released before that end, the connection is closed and
    the next stream opens a new one (a TCP connect before it can be forwarded)."""
    if resp.content.at_eof():
        resp.release()
        return

    async def drain() -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while await resp.content.readany():  # anything after [DONE] is not forwarded
                    pass
        except (TimeoutError, aiohttp.ClientError):
            pass
        finally:
            resp.release()  # at its end: back to the pool; else closed

    task = asyncio.ensure_future(drain())
    _DRAINING.add(task)
    task.add_done_callback(_DRAINING.discard)


def _names_distribution(sampling: dict) -> bool:
    """The request set every parameter a model's generation_config could default."""
    return all(sampling.get(k) is not None for k in CHAT_DEFAULTED)


def _continued_prefix(user_view: dict) -> str | None:
    """The text of the trailing assistant message a ``continue_final_message`` request continued
    (the start of the turn's reply), or None."""
    msgs = user_view.get("messages") or []
    if not (user_view.get("chat_options") or {}).get("continue_final_message") or not msgs:
        return None
    last = msgs[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return None
    content = last.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else None


class ProxyApp:
    """OpenAI-compatible proxy that records every turn on Kafka (see the module docstring).

    Args:
        config: the process config (``proxy``, ``engine.url``, ``kafka``, ``topics``).
        engine_url: overrides ``config.engine.url``.
        publisher: an :class:`EventPublisher` to use (default: one built from ``config.proxy``).
        follow_control: follow the control topic for weight-sync holds and versions.
    """

    def __init__(self, config: Config, engine_url: str | None = None, publisher: EventPublisher | None = None,
                 follow_control: bool = True) -> None:
        pc = config.proxy
        self.config = config
        self.pc = pc
        self.topic = config.topics.name("turns")
        self.sessions = SessionTable(pc.max_sessions, pc.session_idle_s)
        self.convs = Conversations(pc.session_prefixes)
        self.publisher = publisher or EventPublisher(
            config, max_buffer=pc.buffer_max_events, buffer_dir=pc.buffer_dir, buffer_max_bytes=pc.buffer_max_bytes,
            buffer_fsync=pc.buffer_fsync, delivery_timeout_ms=pc.publish_delivery_timeout_ms,
            linger_s=pc.publish_linger_ms / 1000, kafka_client=pc.kafka_client)
        self.upstream = Transport(engine_url or config.engine.url, pc.engine_timeout_s, pc.max_connections)
        # rollout.canary_engines: a full-weight candidate's sessions go there (docs/rollout.md)
        self.canary_upstream = Transport(pc.canary_engine_url, pc.engine_timeout_s, pc.max_connections) \
            if config.rollout.enabled and config.rollout.canary_engines else None
        self.names = ServedModels(lambda: self._call("GET", "/v1/models"), pc.model_aliases, pc.unknown_model)
        self.gate = SyncGate(pc.sync_hold_timeout_s, pc.sync_max_pause_s, config.rollout.share, pc.max_sessions)
        self.follower = ControlFollower(config, self._on_control) if follow_control else None
        self._keys = {k.get_secret_value().encode() for k in pc.api_keys}
        self.tenants = Tenants(pc.tenants, self._keys)
        # response id / (session, turn index) -> turn, for POST /v1/feedback (kept beside a durable buffer)
        durable_index = bool(pc.buffer_dir and self.publisher.durable_enabled)
        self.turn_index = TurnIndex(pc.feedback_index_max, pc.buffer_dir if durable_index else None,
                                    deferred=durable_index)
        if durable_index:  # written with each group commit, before the responses waiting for it complete
            self.publisher.add_commit_hook(self.turn_index.flush)
            self.publisher.add_housekeeping_hook(self.turn_index.maintain)  # its rewrite: off the event loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._ready_cache = (0.0, 0)
        self._caps: tuple[bool, bool] | None = None  # engine streams chat token ids, sends raw log-prob bytes
        self._model_files: tuple[Any, dict] | None = None  # (TokenBytes or None, chat defaults) of the served model
        self._model_files_lock = asyncio.Lock()
        self._gen_defaults: dict | None = None  # the served model's generation_config chat defaults
        self._gen_unreadable = False  # it could not be read: a turn's distribution may be unknown
        # request ids: <random process prefix>-<counter> (no syscall per request); 64 random bits so
        # two proxy processes (replicas, restarts) never issue the same id: sample ids derive from it
        self._rid_prefix = os.urandom(8).hex() + "-"
        self._seq = 0
        self.on_started = None  # optional callable run once serving starts (the CLI prints a line)
        self._clients: dict[str, EngineClient] = {}  # upstream URL -> its EngineClient (SGLang streaming path)
        self.kind = config.engine.kind
        # vLLM: its answers carry no weight version: read before each recorded request and after its answer
        self._vllm = engine_client("vllm", self.upstream.base_url, pc.engine_timeout_s, transport=self.upstream,
                                   initial_version=config.engine.weight_version) if self.kind == "vllm" else None
        self.api = self._build_api()
        self.doors = {"/v1/responses": ResponsesDoor(self), "/v1/messages": MessagesDoor(self)}  # same turns

    # ---- ASGI entry -----------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "http" and scope["path"] == _CHAT:
            if scope["method"] == "POST":
                await self.chat(scope, receive, send)
            else:
                await self._send_json(send, 405, error_body(f"method {scope['method']} not allowed on {_CHAT}; use POST",
                                                            code="method_not_allowed"), [(b"allow", b"POST")])
        elif kind == "http" and scope["path"] in self.doors:  # other APIs, translated to chat
            await self.doors[scope["path"]](scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        else:
            await self.api(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            m = await receive()
            if m["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as e:
                    log.exception("proxy start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif m["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> None:
        """Open the engine pool, start publishing and following the control topic."""
        self._loop = asyncio.get_running_loop()
        await self.upstream.start()
        if self.canary_upstream is not None:
            await self.canary_upstream.start()
        self.publisher.start()
        if self.follower is not None:
            self.follower.start()
        self._tasks.append(asyncio.ensure_future(self._housekeeping()))
        if self.on_started is not None:
            self.on_started()
        log.info("proxy: engine %s, turns -> %s, %d API key(s), %s, anonymous=%s, buffer %d events%s",
                 self.upstream.base_url, self.topic, len(self._keys),
                 f"{len(self.pc.tenants)} tenant key(s)" if self.pc.tenants else "tenants from X-Tenant-Id",
                 self.pc.anonymous, self.pc.buffer_max_events,
                 f", durable in {self.pc.buffer_dir}" if self.publisher.durable_enabled else " (memory only)")

    async def shutdown(self) -> None:
        """Stop following, close the pool, deliver what is buffered (the rest stays on disk)."""
        for t in self._tasks:
            t.cancel()
        if self.follower is not None:
            await asyncio.to_thread(self.follower.stop)
        await self.upstream.close()
        if self.canary_upstream is not None:
            await self.canary_upstream.close()
        for client in self._clients.values():
            await client.aclose()
        await asyncio.to_thread(self.publisher.close, self.pc.shutdown_flush_s)
        self.turn_index.close()
        log.info("proxy stopped: %s", self.publisher.stats())

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(10.0)
            n = self.sessions.expire()
            if n:
                log.debug("expired %d idle sessions", n)
            M.SESSIONS.set(len(self.sessions))

    def _on_control(self, state: ControlState) -> None:  # follower thread
        M.SYNC_PAUSED.set(1 if state.paused else 0)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.gate.update, state)

    # ---- helpers --------------------------------------------------------------------------------
    def _auth(self, headers: dict) -> str | None:
        """Check the request's key and return its tenant (:class:`~pipeline.proxy.identity.Tenants`:
        401, 403 or 400 as a :class:`ProxyError`)."""
        return self.tenants.resolve(headers)

    async def _read_body(self, headers: dict, receive) -> bytes:
        limit = self.pc.max_body_bytes
        cl = headers.get(b"content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                raise bad_request("invalid Content-Length header") from None
            if n > limit:
                raise ProxyError(413, f"request body of {n} bytes exceeds the limit of {limit} bytes",
                                 code="request_too_large")
        m = await receive()
        if m["type"] == "http.disconnect":
            raise _ClientGone()
        body = m.get("body", b"")
        if not m.get("more_body"):
            if len(body) > limit:
                raise ProxyError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            return body
        parts = [body]
        size = len(body)
        while True:
            m = await receive()
            if m["type"] == "http.disconnect":
                raise _ClientGone()
            b = m.get("body", b"")
            size += len(b)
            if size > limit:
                raise ProxyError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            parts.append(b)
            if not m.get("more_body"):
                return b"".join(parts)

    @staticmethod
    async def _send_json(send, status: int, body: bytes, extra: list | None = None) -> None:
        headers = [_JSON_HDR, (b"content-length", str(len(body)).encode())]
        if extra:
            headers.extend(extra)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _call(self, method: str, path: str, body: bytes | None = None,
                    upstream: Transport | None = None) -> tuple[int, bytes]:
        """One engine call through the pool (``upstream``; None: :attr:`upstream`, ``engine.url``):
        ``(status, body)`` whatever the status; an engine that did not answer is a 502/504
        :class:`ProxyError` (:func:`engine_failure`)."""
        try:
            status, data, _ = await (upstream or self.upstream).call(method, path, body)
        except EngineError as e:
            raise engine_failure(e) from None
        return status, data

    def _engine_error(self, status: int, data: bytes) -> ProxyError:
        msg = None
        try:
            obj = orjson.loads(data)
            err = obj.get("error", obj) if isinstance(obj, dict) else None
            if isinstance(err, dict):
                msg = err.get("message") or err.get("detail")
            elif isinstance(err, str):
                msg = err
        except orjson.JSONDecodeError:
            pass
        msg = str(msg)[:2000] if msg else data[:300].decode("utf-8", "replace")
        if 400 <= status < 500 and status not in (401, 403, 407, 408, 429):
            return ProxyError(status, f"the engine rejected the request: {msg}", code="engine_rejected")
        if status == 429:
            return ProxyError(429, f"the engine is overloaded: {msg}", "rate_limit_error", code="engine_overloaded")
        if status in (408, 504):
            return upstream_error(f"the engine timed out: {msg}", 504)
        return upstream_error(f"the engine failed with HTTP {status}: {msg}")

    def _publish(self, ev: events.Event, key: str) -> None:
        self.publisher.publish(self.topic, ev, key)

    def _version(self, rec: Recorded, route: _Route) -> int:
        """The policy version a turn of ``rec`` is recorded with: the engine's ``weight_version``.

        Without one, on one upstream: the highest version an engine applied (``control``). With
        ``rollout.canary_engines`` the two upstreams serve different versions, so the highest
        applied would tag an incumbent engine's turn with the candidate's version: the turn is
        version-unknown instead (``rec.version_unknown``: recorded without token ids, so the fold
        counts none of its samples) and carries the version of the arm it was routed to.
        """
        v = policy_version(rec.weight_version, None)
        if v is None and self.canary_upstream is not None:
            rec.version_unknown = True
            arms = (self.gate.state.serving or {}).get(FULL_WEIGHTS)
            routed = None if arms is None else arms.candidate if route.upstream is self.canary_upstream \
                else arms.incumbent
            return routed if isinstance(routed, int) else 0
        if v is None:
            v = max(self.gate.state.applied_version, 0)
        M.POLICY_VERSION.set(v)
        return v

    # ---- the chat route ---------------------------------------------------------------------------
    async def chat(self, scope, receive, send) -> None:
        """ASGI handler of ``POST /v1/chat/completions`` (see the module docstring)."""
        t0 = time.perf_counter()
        send = DurableSend(send, self.publisher)  # the last byte waits for this request's events on disk
        created = events.now_ms()
        self._seq += 1
        rid = f"{self._rid_prefix}{self._seq:x}"
        stream = False
        status = 500
        try:
            headers = dict(scope["headers"])
            tenant = self._auth(headers)
            if not content_type_ok(headers.get(b"content-type")):
                raise ProxyError(415, "Content-Type must be application/json", code="unsupported_media_type")
            req = json_body(await self._read_body(headers, receive))
            meta = session_meta(headers, req, self.pc.default_turn_type, scope.get("previous_session"))
            check_request(req)
            _mark_housekeeping(meta, req["messages"])
            served = await self.names.resolve(req.get("model"))  # 404 model_not_found for other names
            if served is not None:
                req["model"] = served  # what the turn records: the id the engine serves
            stream = req.get("stream") is True
            status = await self._serve(req, meta, rid, created, t0, stream, receive, send, tenant,
                                       scope.get("response_prefix") or "chatcmpl-")
        except ProxyError as e:
            status = e.status
            extra = [(b"x-request-id", rid.encode())]
            if e.status == 503:
                extra.append((b"retry-after", b"1"))
            await self._send_json(send, e.status, e.body(), extra)
        except _ClientGone:
            status = 499
        except Exception as e:  # a bug must still give the client an answer, not a dropped connection
            log.exception("request %s failed", rid)
            status = 500
            try:
                await self._send_json(send, 500, error_body(f"internal proxy error ({type(e).__name__})",
                                                            "server_error", code="internal_error"))
            except Exception:
                pass
        M.CACHE.request(status, stream).inc()
        M.CACHE.latency[stream].observe(time.perf_counter() - t0)

    def _route(self, req: dict, meta: SessionMeta, rid: str, created: int,
               tenant: str | None = None) -> tuple[_Route | None, list]:
        """The session of a request of ``tenant`` by the rules of :mod:`pipeline.proxy.identity`
        (None: not recorded, ``proxy.anonymous=skip``) and the ``(field, reason)`` of each ignored value."""
        warnings = list(meta.warnings)
        claimed, source = claim(meta.session_id, meta.source, req["messages"], req.get("user"), warnings)
        for f, why in warnings:
            M.SESSION_IDS_IGNORED.labels(f, why).inc()
        if claimed is None and meta.housekeeping is not None:  # never a conversation of its own
            if self.pc.anonymous == "skip":
                return None, warnings
            claimed, source = meta.housekeeping.session_id, "housekeeping"
        if claimed is None:
            M.WITHOUT_SESSION.inc()
            if self.pc.anonymous == "reject":
                raise bad_request("X-Session-Id is required by this proxy (proxy.anonymous=reject)",
                                  param="X-Session-Id", code="missing_session_id")
            if self.pc.anonymous == "skip":
                return None, warnings
        if meta.turn_type == "side" and claimed is not None:  # touches no state: the id as given
            route = _Route(claimed, source, True, None, None, rid, created, tenant)
        else:
            chain = prompt_chain(req["messages"], req.get("continue_final_message") is True, tenant)
            sid, fresh, hit = self.sessions.route(claimed, chain, rid, self.convs, tenant)
            if claimed is None:
                source = "new" if fresh else "continuation"
            route = _Route(sid, source, fresh, hit, chain, rid, created, tenant)
        M.CACHE.child(M.SESSION_SOURCE, source).inc()
        return route, warnings

    def _admit(self, route: _Route) -> None:
        """The engine accepted the request: publish the previous turn's next state now (once)."""
        if route.admitted:
            return
        route.admitted = True
        mt = route.mt
        if mt is None:
            return
        self.convs.accepted(route.hit, route.chain)
        if self.sessions.accept(route.sid, mt, route.tenant):
            self._publish(events.NextState(session_id=route.sid, messages=mt.next_state,
                                           after_turn_index=mt.after_turn_index, request_id=route.rid,
                                           created_at=route.created, after_request_id=mt.after_request_id,
                                           tenant=route.tenant),
                          route.key)

    def _unadmit(self, route: _Route | None, why: str) -> None:
        """A main request the engine refused or never answered: as if it had not been sent."""
        if route is not None and route.mt is not None and not route.admitted:
            self.sessions.cancel(route.sid, route.mt, route.tenant)
            M.REFUSED.labels(why).inc()

    async def _serve(self, req: dict, meta: SessionMeta, rid: str, created: int, t0: float, stream: bool,
                     receive, send, tenant: str | None = None, response_prefix: str = "chatcmpl-") -> int:
        if self._vllm is not None:
            ignored = self._vllm.ignored(req)
            if ignored:  # vLLM would answer 200 without applying them: never recorded as applied
                raise bad_request(f"'{ignored[0]}' is not supported by the engine (vLLM ignores it); use "
                                  "response_format / structured outputs instead", param=ignored[0],
                                  code="unsupported_field")
        route, warnings = self._route(req, meta, rid, created, tenant)
        record = route is not None
        if record:
            route.response_prefix = response_prefix
        await self._hold(rid, tenant)
        turn_index = None
        if record and meta.turn_type == "main":
            route.mt = self.sessions.begin(route.sid, req["messages"], fresh=route.fresh,
                                           continued=route.hit[1].request_of(route.sid) if route.hit else None,
                                           continue_final=req.get("continue_final_message") is True,
                                           tenant=tenant)
            turn_index = route.mt.turn_index
        # after the hold: what the tenant's sync resumed with (rollout: the session's canary arm)
        adapter, canary = self.gate.serve(tenant, route.sid if record else None, turn_index == 0)
        to_canary, full_arm = self.gate.serve_full(tenant, route.sid if record else None, turn_index == 0)
        if record:  # a full-weight canary's arm (rollout.canary_engines); never both kinds (config)
            route.adapter, route.canary = adapter, full_arm if full_arm is not None else canary
            route.upstream = self.canary_upstream if to_canary else None
        extra = [(b"x-request-id", rid.encode())]
        if record:
            extra += [(b"x-session-id", route.sid.encode()), (b"x-session-source", route.source.encode())]
        if warnings:
            extra.append((b"x-session-warning", "; ".join(f"{f} ignored ({w})" for f, w in warnings).encode()))
        if turn_index is not None:
            extra.append((b"x-turn-index", str(turn_index).encode()))
        keep = (req.get("logprobs") is True, req.get("return_token_ids") is True,
                req.get("return_token_ids") is True or req.get("return_prompt_token_ids") is True,
                req.get("return_meta_info") is True)
        if req.get("temperature") is None and self.pc.default_temperature is not None:
            req["temperature"] = self.pc.default_temperature  # the log-probs refer to it: make it explicit
        user_view = {"messages": req["messages"], "tools": req.get("tools"), "model": req.get("model"),
                     "sampling": {k: req[k] for k in SAMPLING_KEYS if k in req}, "chat_options": chat_options(req)}
        route_to(req, adapter, lambda base, name: adapter_model(self.kind, base, name))  # the turn keeps the user's
        if record:  # exact ids and log-probs (return_token_ids also gives prompt_token_ids)
            req["logprobs"] = True
            req["return_token_ids"] = True
        if record and meta.done:  # published before the response completes
            send.before_final = lambda: self._end(route.sid, "header", route.tenant, meta.outcome)
        admit = (lambda: self._admit(route)) if record else _nothing
        if self._vllm is not None:
            self._vllm.shape(req)
            if record:
                route.version_before = await self._vllm_version()
        try:
            if stream:
                async def recorded(rec: Recorded, cause: str | None = None) -> None:
                    await self._settle_version(rec, route)
                    self._record(rec, meta, route, turn_index, user_view, cause, await self._defaults_for(rec))

                on_done = recorded if record else None
                status = await self._stream(req, keep, extra, t0, receive, send, on_done, admit,
                                            f"chatcmpl-{rid}" if record else None,
                                            route.upstream if record else None)
            else:
                repair = keep[0] and not (await self._engine_caps())[1]
                if repair:  # SGLang's log-prob bytes: the ids let the proxy give each token's raw bytes
                    req["return_token_ids"] = True
                    if req.get("top_logprobs"):
                        req["return_meta_info"] = True
                status = await self._unary(orjson.dumps(req), keep, extra, send, meta, route, turn_index,
                                           user_view, admit, repair)
        except BaseException as e:
            self._unadmit(route, str(e.status) if isinstance(e, ProxyError) else type(e).__name__)
            if record and meta.done:  # the client said the session is over
                send.run_before_final()
            send.before_final = None
            raise
        self._unadmit(route, str(status))
        send.run_before_final()  # the response did not complete (client gone): end the session anyway
        return status

    async def _vllm_version(self) -> str | None:
        """vLLM's weight version now (None: it could not be read)."""
        try:
            return await self._vllm.weight_version()
        except EngineError as e:
            log.warning("vLLM's /weight_info failed (%s): the turn's version is unknown", e)
            return None

    async def _settle_version(self, rec: Recorded, route: _Route) -> None:
        """vLLM: the answer was served by the version read before it was sent when the engine still
        reports it (:meth:`pipeline.engine_api.vllm.VllmClient.bracket`), else by an unknown one
        (``rec.weight_version`` None, ``rec.version_unknown``: recorded without ids); its log-probs
        are raw (:data:`pipeline.engine_api.vllm.RECORDED_SAMPLING`)."""
        if self._vllm is None:
            return
        rec.sampling_params = dict(RECORDED_SAMPLING)
        after = await self._vllm_version()
        same = route.version_before is not None and after == route.version_before
        rec.weight_version = route.version_before if same else None
        rec.version_unknown = not same

    async def _hold(self, rid: str, tenant: str | None = None) -> None:
        """Wait out a full-weight sync, or a sync of ``tenant``'s adapter, announced on ``control``
        (bounded; 503 with ``sync_strict``). Another tenant's adapter sync holds nothing."""
        try:
            held = await self.gate.wait(tenant)
        except TimeoutError as e:
            M.SYNC_HOLD.observe(self.pc.sync_hold_timeout_s)
            if self.pc.sync_strict:
                raise ProxyError(503, f"{e}; retry shortly", "server_error", code="weight_sync") from None
            log.warning("request %s: %s, serving it anyway", rid, e)
        else:
            if held:
                M.SYNC_HOLD.observe(held)

    def _end(self, sid: str, reason: str, tenant: str | None = None, outcome: float | None = None) -> None:
        self._publish(events.SessionEnd(session_id=sid, reason=reason, created_at=events.now_ms(), tenant=tenant,
                                        outcome=outcome),
                      events.session_key(tenant, sid))
        self.sessions.end(sid, tenant)

    @staticmethod
    def _distribution(rec: Recorded, sampling: dict, defaults: dict | None = None) -> tuple[float, list[str]]:
        """(effective temperature, logprob processors) of a turn's log-probs: what the engine
        reported (``metadata.sampling_params``: the CPU engine, and EngineClient's ``/generate``
        chat path, which reports what it sent), else the request as an engine's chat path
        completes it: absent temperature / top_p / top_k / min_p / repetition_penalty from
        ``defaults`` (the served model's generation_config), then SGLang's rules (greedy -> 1.0;
        still unset -> 1.0; ``proxy.default_temperature`` is already in the request)."""
        sp = rec.sampling_params
        if sp is not None and isinstance(sp.get("temperature"), (int, float)):
            try:
                return effective_temperature(sp["temperature"]), logprob_processors(sp)
            except ValueError:
                pass
        used = with_generation_defaults(sampling, defaults)
        try:
            temp = effective_temperature(used.get("temperature"))
        except ValueError:
            temp = 1.0
        return temp, logprob_processors(used)

    async def _defaults_for(self, rec: Recorded) -> dict | None:
        """The served model's generation_config defaults when the engine did not report the
        parameters it sampled with (they complete the request, as the engine's chat path does);
        None when they are needed and could not be read (the distribution is then unknown)."""
        if rec.sampling_params is not None:
            return {}
        if self._gen_defaults is None:
            await asyncio.to_thread(self._read_generation_defaults)
        return None if self._gen_unreadable else self._gen_defaults

    def _record(self, rec: Recorded, meta: SessionMeta, route: _Route, turn_index: int | None, user_view: dict,
                cause: str | None, defaults: dict | None) -> None:
        """Publish the turn of one answer. A generation that did not finish (``cause`` names why,
        or the engine gave no OpenAI finish reason) is recorded with ``finish_reason`` ``abort``
        (or its own non-OpenAI value) and does not become the session's latest completed turn.
        ``defaults``: :meth:`_defaults_for`; None (the engine reported no sampling parameters and
        the model's generation_config is unreadable) records the turn without token ids and
        log-probs (as an engine that gave none): the distribution they came from is unknown, and
        a guessed temperature would look like data; it trains nothing."""
        finished = cause is None and rec.finished
        version = self._version(rec, route)  # before the ids: it may find the version unknown
        if not finished:
            M.UNFINISHED.labels(cause or ("engine_abort" if rec.finish_reason == "abort" else "no_finish_reason")).inc()
        if defaults is None and rec.complete and not _names_distribution(user_view["sampling"]):
            M.TURNS_WITHOUT_IDS.inc()
            log.warning("request %s: the engine reported no sampling parameters and the model's generation_config "
                        "is unreadable: recorded without token ids and log-probs (unknown distribution)", route.rid)
            token_ids, logprobs = [], []
        elif rec.version_unknown:
            M.TURNS_WITHOUT_IDS.inc()
            log.warning("request %s: the version that served it is unknown (a weight sync while the engine "
                        "answered it, or an engine that reported none beside the canary engines): recorded "
                        "without token ids and log-probs", route.rid)
            token_ids, logprobs = [], []
        elif not rec.complete:
            M.TURNS_WITHOUT_IDS.inc()
            log.warning("request %s: engine answer lacks token ids or log-probs (%d ids, %d log-probs, prompt %s);"
                        " recorded without them", route.rid, len(rec.token_ids), len(rec.logprobs),
                        "present" if rec.prompt_ids is not None else "missing")
            token_ids, logprobs = [], []
        else:
            token_ids, logprobs = rec.token_ids, rec.logprobs
        adapter, wrong = route.adapter, wrong_adapter(rec, route.adapter)
        if wrong is not None:  # never a turn that names an adapter that did not serve it
            M.ADAPTER_MISMATCH.inc()
            log.error("request %s (tenant %s): %s: recorded without token ids, log-probs and adapter", route.rid,
                      route.tenant, wrong)
            token_ids, logprobs, adapter = [], [], None
        temperature, processors = self._distribution(rec, user_view["sampling"], defaults or {})
        reason = rec.finish_reason if finished else (
            rec.finish_reason if isinstance(rec.finish_reason, str) and rec.finish_reason and cause is None else "abort")
        sid = route.sid
        turn = events.Turn(
            session_id=sid, turn_type=meta.turn_type, turn_index=turn_index, request_id=route.rid,
            created_at=route.created,
            policy_version=version, model=user_view["model"] or rec.model,
            messages=user_view["messages"], tools=user_view["tools"], sampling=user_view["sampling"],
            prompt_token_ids=rec.prompt_ids or [], response_token_ids=token_ids, response_logprobs=logprobs,
            response=rec.response, finish_reason=reason, source="proxy", chat_options=user_view["chat_options"],
            logprob_temperature=temperature if logprobs else None, logprob_processors=processors,
            session_source=route.source, tenant=route.tenant, adapter=adapter, canary=route.canary,
            response_id=route.response_prefix + route.rid,
            housekeeping=meta.housekeeping.label if meta.housekeeping is not None else None)
        if finished and turn_index is not None:
            content, calls, prefix = rec.response.get("content"), rec.response.get("tool_calls"), _continued_prefix(user_view)
            self.sessions.complete(sid, turn_index, content, calls, prefix=prefix, request_id=route.rid,
                                   tenant=route.tenant)
            if prefix:
                content = prefix + (content if isinstance(content, str) else "")
            self.convs.record(route.chain.with_answer(content, calls), sid, route.rid)
        self._publish(turn, route.key)
        if finished and turn_index is not None:  # POST /v1/feedback finds it (an unfinished one was never answered)
            self.turn_index.add(IndexedTurn(route.tenant, sid, turn_index, route.rid, turn.response_id))
        M.CACHE.child(M.TURNS, meta.turn_type).inc()

    async def _unary(self, body: bytes, keep: tuple, extra: list, send, meta: SessionMeta, route: _Route | None,
                     turn_index: int | None, user_view: dict, admit, repair: bool = False) -> int:
        status, data = await self._call("POST", _CHAT, body, route.upstream if route is not None else None)
        if status >= 400:
            raise self._engine_error(status, data)
        data = shown(data)
        admit()
        record = route is not None
        if record or repair or b'"abort"' in data:
            try:
                resp = orjson.loads(data)
            except orjson.JSONDecodeError:
                raise upstream_error("the engine returned a body that is not JSON") from None
            if not isinstance(resp, dict) or not isinstance(resp.get("choices"), list):
                raise upstream_error("the engine returned no 'choices'")
            rec = from_response(resp)
            if record:
                await self._settle_version(rec, route)
                self._record(rec, meta, route, turn_index, user_view, None, await self._defaults_for(rec))
            elif rec.finish_reason == "abort":
                M.UNFINISHED.labels("engine_abort").inc()
            if rec.finish_reason == "abort":  # not an OpenAI value: the client gets an error to retry
                raise generation_aborted()
            if repair:
                repair_logprob_bytes(resp, (await self._served_model())[0])
            strip_response(resp, *keep)
            if record:  # the proxy's id of the answer (what POST /v1/feedback resolves)
                resp["id"] = f"chatcmpl-{route.rid}"
            data = orjson.dumps(resp)
        await self._send_json(send, status, data, extra)
        return status

    async def _engine_caps(self) -> tuple[bool, bool]:
        """``(streams token ids on chat, sends raw log-prob bytes)`` of the engine, from its
        ``/server_info`` (``chat_stream_token_ids``, ``logprob_token_bytes``: our engine's; SGLang
        has neither). Cached once answered; an engine without ``/server_info`` counts as both."""
        if self._caps is None and self._vllm is not None:  # streams ids on chat; bytes of decoded text
            self._caps = (self._vllm.chat_stream_token_ids, self._vllm.logprob_token_bytes)
        if self._caps is None:
            status, data = await self._call("GET", "/server_info")
            if status != 200:  # unknown: try the native way (our engine, vLLM); ask again unless there is none
                if status in (404, 405):
                    self._caps = (True, True)
                return True, True
            try:
                info = orjson.loads(data)
            except orjson.JSONDecodeError:
                info = {}
            info = info if isinstance(info, dict) else {}
            self._caps = (bool(info.get("chat_stream_token_ids")), bool(info.get("logprob_token_bytes")))
            if not self._caps[0]:
                log.warning("the engine does not stream token ids on chat (SGLang): streamed turns use "
                            "EngineClient's /v1/tokenize + /generate path")
            if not self._caps[1]:
                log.info("the engine's log-prob bytes are those of decoded text (SGLang): the proxy sets each "
                         "token's raw bytes from the tokenizer of %s", self.pc.tokenizer or self.config.engine.model)
        return self._caps

    async def _served_model(self) -> tuple[Any, dict]:
        """``(TokenBytes or None, generation_config chat defaults)`` of the served model, read once
        from ``proxy.tokenizer`` (default ``engine.model``) in a thread; None when unreadable."""
        if self._model_files is None:
            async with self._model_files_lock:
                if self._model_files is None:
                    self._model_files = await asyncio.to_thread(self._read_model_files)
        return self._model_files

    def _read_model_files(self) -> tuple[Any, dict]:
        name, cache = self.pc.tokenizer or self.config.engine.model, self.config.engine.cache_dir
        try:
            tb = load_token_bytes(name, cache)
        except TokenBytesError as e:
            log.error("no tokenizer for %s (%s): log-prob bytes of partial characters are sent as null", name, e)
            tb = None
        return tb, self._read_generation_defaults()

    def _read_generation_defaults(self) -> dict:
        """The served model's generation_config chat defaults (read once; ``{}`` when unreadable)."""
        if self._gen_defaults is None:
            name, cache = self.pc.tokenizer or self.config.engine.model, self.config.engine.cache_dir
            try:
                self._gen_defaults = generation_defaults(resolve_model(name, cache))
            except (ModelNotFound, OSError) as e:
                log.error("no generation_config for %s (%s): turns of an engine that does not report its "
                          "sampling parameters are recorded without token ids and log-probs unless the request "
                          "names its sampling (set proxy.tokenizer to the served model's folder)", name, e)
                self._gen_defaults, self._gen_unreadable = {}, True
        return self._gen_defaults

    async def _stream(self, req: dict, keep: tuple, extra: list, t0: float, receive, send, on_done, admit,
                      answer_id: str | None = None, upstream: Transport | None = None) -> int:
        """Forward a stream chunk by chunk; ``on_done(record)`` (a coroutine; None: not recorded) runs before ``[DONE]``
        is forwarded (so the turn is queued and the session updated before the client can send its next
        request). Against an engine that cannot stream token ids on chat, a recorded turn or one whose
        log-probs are shown goes through :meth:`_stream_via_client` (ids, raw log-prob bytes)."""
        if on_done is not None or keep[0]:
            native, raw = await self._engine_caps()
            if not native and (on_done is not None or not raw):
                return await self._stream_via_client(req, keep, extra, t0, receive, send, on_done, admit, answer_id,
                                                     upstream)
        try:
            resp = await (upstream or self.upstream).open_stream(_CHAT, orjson.dumps(req))
        except EngineError as e:
            raise engine_failure(e) from None
        watcher = None
        done = False  # the engine's stream was read up to its [DONE]
        try:
            await self._check_stream(resp)
            admit()
            recorder = StreamRecorder(*keep[:3], answer_id) if on_done is not None else None
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HDRS + extra})
            gone = asyncio.Event()
            watcher = asyncio.ensure_future(_watch_disconnect(receive, gone, resp.close))
            try:
                finished, aborted = await self._relay(resp, recorder, send, t0)
            except (ProxyError, EngineError) as e:
                if not gone.is_set():  # else the break is the client leaving (resp.close): 499 below
                    e = e if isinstance(e, ProxyError) else engine_failure(e)
                    return await self._stream_broke(e, recorder, send, on_done)
            if gone.is_set():
                await self._unfinished(recorder, "client_disconnect", on_done)  # what the user saw before leaving
                return 499
            done = finished
            return await self._stream_end(recorder, finished, aborted, send, on_done)
        finally:
            if watcher is not None:
                watcher.cancel()
            if done:
                _keep_alive(resp)
            else:
                resp.release()

    async def _check_stream(self, resp) -> None:
        """Raise the engine's error for an error answer to a stream request, and a 502 for an
        answer that is not an event stream."""
        if resp.status >= 400:
            raise self._engine_error(resp.status, await resp.read())
        ctype = resp.headers.get("Content-Type", "")
        if "text/event-stream" not in ctype:
            raise upstream_error(f"the engine answered a stream request with {ctype or 'no content type'}")

    @staticmethod
    async def _relay(resp, recorder: StreamRecorder | None, send, t0: float) -> tuple[bool, bool]:
        """Forward the engine's SSE events to the client, one body message per batch read (each
        event through ``recorder`` when the turn is recorded), until ``[DONE]``, an ``abort``
        chunk (never forwarded: the client gets an error event instead) or the stream's end; the
        first body message sent is the time to first token. Returns ``(finished, aborted)``:
        ``[DONE]`` was read, the engine aborted the generation. Raises EngineError
        (:func:`pipeline.engine_api.transport.sse_batches`) when the engine's stream breaks or times out."""
        first = True
        finished = aborted = False
        async for batch in sse_batches(resp):
            parts = []
            for data in batch:
                if data == b"[DONE]":
                    finished = True
                    break
                data = shown(data)
                if recorder is not None:
                    data = recorder.feed(data)
                    aborted = recorder.aborted
                else:
                    aborted = b'"abort"' in data and _is_abort_chunk(data)
                if aborted:
                    break
                parts.append(b"data: " + data + b"\n\n")
            if parts:
                await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
                if first:
                    first = False
                    M.TTFT.observe(time.perf_counter() - t0)
            if finished or aborted:
                break
        return finished, aborted

    async def _stream_broke(self, e: ProxyError, recorder: StreamRecorder | None, send, on_done) -> int:
        """The engine's stream broke (``e``; a 504 is a timeout) while the client listened: what
        was generated is recorded as unfinished, the client gets ``e`` as the last event (502)."""
        cause = "timeout" if e.status == 504 else "engine_error"
        await self._unfinished(recorder, cause, on_done)
        await self._sse_error(send, e)
        log.warning("stream broke: %s", e.message)
        return 502

    async def _stream_end(self, recorder: StreamRecorder | None, finished: bool, aborted: bool, send,
                          on_done) -> int:
        """The engine's stream ended (``finished``: with ``[DONE]``): the turn is recorded (an
        unfinished one when the engine aborted it, sent an error event or closed the stream
        before the generation finished), then the client's stream is closed with ``[DONE]``
        (200, or 502 after an engine error event), or with a ``generation_aborted`` error event
        (503 for an engine abort, 502 for a stream closed early). Returns the status counted."""
        cause = ("engine_abort" if aborted else
                 "engine_error" if recorder is not None and recorder.error is not None else
                 "truncated" if not finished and (recorder is None or recorder.rec.finish_reason is None) else None)
        if cause is not None:
            await self._unfinished(recorder, cause, on_done)
        elif recorder is not None:
            await on_done(recorder.finish(), cause)
        if cause in ("engine_abort", "truncated"):
            await self._sse_error(send, generation_aborted(
                "the engine aborted the generation before it finished" if aborted else
                "the engine closed the stream before the generation finished"))
            return 503 if aborted else 502
        await send({"type": "http.response.body", "body": _DONE, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return 502 if cause == "engine_error" else 200

    @staticmethod
    async def _sse_error(send, e: ProxyError) -> None:
        """End an SSE response with an OpenAI-style error event, then ``[DONE]``."""
        await send({"type": "http.response.body", "more_body": True, "body": b"data: " + e.body() + b"\n\n" + _DONE})
        await send({"type": "http.response.body", "body": b""})

    async def _stream_via_client(self, req: dict, keep: tuple, extra: list, t0: float, receive, send,
                                 on_done, admit, answer_id: str | None = None,
                                 upstream: Transport | None = None) -> int:
        """Streaming against an engine without chat token-id streaming (SGLang): EngineClient's
        ``chat_stream(token_ids=True)`` renders the prompt and streams ``/generate``. A chat field
        that path cannot serve as the engine's own chat path would is refused (400 naming it).
        A client that leaves mid-stream is handled as on the native path: reading stops, the
        engine's generation is aborted (``/abort_request``, by closing the client's stream), the
        tokens sent so far are recorded as an ``abort`` turn and ``client_disconnect`` is counted."""
        body = {k: v for k, v in req.items() if k not in ("return_token_ids", "stream")}
        refused = generate_path_refusal(body)
        if refused is not None:
            raise bad_request(refused[1], param=refused[0], code="unsupported_on_stream")
        client = self._engine_client(upstream)
        client.token_bytes, client.chat_defaults = await self._served_model()
        recorder = StreamRecorder(*keep[:3], answer_id)
        gen = client.chat_stream(body, token_ids=True)
        gone = asyncio.Event()
        watcher = asyncio.ensure_future(_watch_disconnect(receive, gone))
        started: list[bool] = []  # one entry once the response has started
        try:
            await self._forward_chunks(gen, recorder, gone, send, extra, t0, started, admit)
        except EngineError as e:
            err = (self._engine_error(e.status, orjson.dumps({"message": e.message})) if e.status else
                   engine_failure(e))
            if not started:  # refused or failed before any answer: no generation to record
                raise err from None
            await self._unfinished(recorder, "timeout" if err.status == 504 else "engine_error", on_done)
            await self._sse_error(send, err)
            return 502
        finally:
            watcher.cancel()
            await gen.aclose()  # a stream closed before its end aborts the engine's generation
        if gone.is_set():
            await self._unfinished(recorder, "client_disconnect", on_done)  # what the user saw
            return 499
        if not started:
            admit()
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HDRS + extra})
        rec = recorder.finish()
        if recorder.aborted or rec.finish_reason is None:
            await self._unfinished(recorder, "engine_abort" if recorder.aborted else "truncated", on_done)
            await self._sse_error(send, generation_aborted())
            return 503
        if on_done is not None:
            await on_done(rec)
        await send({"type": "http.response.body", "body": _DONE})
        return 200

    def _engine_client(self, upstream: Transport | None) -> EngineClient:
        """The :class:`EngineClient` over ``upstream`` (None: :attr:`upstream`; else the canary
        engines'), created on first use (one per upstream)."""
        upstream = upstream if upstream is not None else self.upstream
        url = upstream.base_url
        if url not in self._clients:
            self._clients[url] = EngineClient(url, timeout_s=self.pc.engine_timeout_s, transport=upstream)
        return self._clients[url]

    @staticmethod
    async def _forward_chunks(gen, recorder: StreamRecorder, gone: asyncio.Event, send, extra: list, t0: float,
                              started: list, admit) -> None:
        """Forward ``gen``'s chat chunks through ``recorder`` until it ends, the engine aborts
        or ``gone`` is set (then the pending read is cancelled: ``gen`` is closed mid-stream);
        ``admit()`` runs when the engine's first chunk arrives (it accepted the request)."""
        it = gen.__aiter__()
        left = asyncio.ensure_future(gone.wait())
        try:
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                await asyncio.wait((nxt, left), return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():  # the client left while the engine was generating
                    nxt.cancel()
                    await asyncio.gather(nxt, return_exceptions=True)
                    return
                try:
                    chunk = nxt.result()
                except StopAsyncIteration:
                    return
                if not started:
                    admit()
                    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HDRS + extra})
                    started.append(True)
                    M.TTFT.observe(time.perf_counter() - t0)
                out = recorder.feed(orjson.dumps(chunk))
                if recorder.aborted or gone.is_set():
                    return
                await send({"type": "http.response.body", "body": b"data: " + out + b"\n\n", "more_body": True})
        finally:
            left.cancel()

    @staticmethod
    async def _unfinished(recorder: StreamRecorder | None, cause: str, on_done) -> None:
        """A generation that did not finish: recorded as an ``abort`` turn when it is recorded and
        produced tokens (``_record`` counts it), else only counted (``cause``; ``recorder``: None
        when the turn is not recorded)."""
        if on_done is not None and recorder is not None and recorder.rec.token_ids:
            await on_done(recorder.finish(), cause)
        else:
            M.UNFINISHED.labels(cause).inc()

    # ---- feedback and outcomes -------------------------------------------------------------------
    async def _json_request(self, request: Request, headers: dict, empty_ok: bool = False) -> dict:
        """The JSON object body of a FastAPI request (400/413/415 as on chat; ``{}`` for an empty
        body when ``empty_ok``)."""
        raw = await request.body()
        if (raw.strip() or not empty_ok) and not content_type_ok(headers.get(b"content-type")):
            raise ProxyError(415, "Content-Type must be application/json", code="unsupported_media_type")
        if len(raw) > self.pc.max_body_bytes:
            raise ProxyError(413, f"request body exceeds the limit of {self.pc.max_body_bytes} bytes",
                             code="request_too_large")
        return {} if empty_ok and not raw.strip() else json_body(raw)

    async def _outcome(self, request: Request, headers: dict) -> float | None:
        """The outcome a session end carries (body ``{"outcome": x}`` or ``X-Session-Outcome``), or None."""
        body = await self._json_request(request, headers, empty_ok=True)
        unknown = sorted(k for k in body if k != "outcome")
        if unknown:
            raise bad_request(f"unknown field {unknown[0]!r} (a session end takes 'outcome')", param=unknown[0])
        h = headers.get(b"x-session-outcome")
        raw = body.get("outcome") if body.get("outcome") is not None else None if h is None else h.decode("latin-1")
        return None if raw is None else parse_outcome(raw)

    async def _feedback(self, request: Request) -> dict:
        """``POST /v1/feedback`` (:mod:`pipeline.proxy.feedback`): the turn of this tenant the body
        names gets a ``feedback`` event, keyed like the turn."""
        headers = {k.lower(): v for k, v in request.headers.raw}
        tenant = self._auth(headers)
        ref = parse_feedback(await self._json_request(request, headers))
        turn = self.turn_index.find(tenant, ref)
        if turn is None:
            M.FEEDBACK.labels("not_found").inc()
            raise not_found(ref)
        self._seq += 1
        ev = feedback_event(turn, ref, f"{self._rid_prefix}{self._seq:x}", events.now_ms())
        self._publish(ev, events.session_key(turn.tenant, turn.session_id))
        await self.publisher.durable()
        M.FEEDBACK.labels(ev.source).inc()
        return answer(ev)

    # ---- the FastAPI part -------------------------------------------------------------------------
    def _build_api(self) -> FastAPI:
        api = FastAPI(title="pipeline proxy", docs_url=None, redoc_url=None, openapi_url=None)

        @api.exception_handler(ProxyError)
        async def _proxy_error(_req: Request, e: ProxyError):
            return Response(e.body(), status_code=e.status, media_type="application/json")

        @api.exception_handler(StarletteHTTPException)
        async def _http_error(req: Request, e: StarletteHTTPException):
            msg = (f"no route {req.method} {req.url.path}" if e.status_code == 404 else
                   f"method {req.method} not allowed on {req.url.path}" if e.status_code == 405 else str(e.detail))
            return Response(error_body(msg, code=e.status_code), status_code=e.status_code,
                            media_type="application/json")

        @api.exception_handler(RequestValidationError)
        async def _validation(_req: Request, e: RequestValidationError):
            return Response(error_body(f"invalid request: {e.errors()}"), status_code=400,
                            media_type="application/json")

        @api.get("/v1/models")
        async def models(request: Request):
            self._auth({k.lower(): v for k, v in request.headers.raw})
            status, data = await self._call("GET", "/v1/models")
            if status >= 400:
                raise self._engine_error(status, data)
            try:
                body = orjson.loads(data)
            except orjson.JSONDecodeError:
                raise self._engine_error(502, data) from None
            if isinstance(body, dict) and isinstance(body.get("data"), list):
                body["data"] = base_cards(body)  # adapters are per tenant: never listed to a client
            return Response(orjson.dumps(body), status_code=status, media_type="application/json")

        @api.post("/v1/feedback")
        async def feedback(request: Request):
            return await self._feedback(request)

        @api.post("/v1/sessions/{session_id}/end")
        async def end_session(session_id: str, request: Request):
            headers = {k.lower(): v for k, v in request.headers.raw}
            tenant = self._auth(headers)
            outcome = await self._outcome(request, headers)
            headers[b"x-session-id"] = session_id.encode("utf-8", "replace")
            meta = session_meta(headers, {}, "main")
            if meta.session_id is None:  # an unfilled template is no session to end
                raise bad_request(f"{session_id[:60]!r} is not a session id ({meta.warnings[0][1]})",
                                  param="session_id", code="invalid_session_id")
            self._end(meta.session_id, "api", tenant, outcome)
            await self.publisher.durable()
            return {"session_id": meta.session_id, "ended": True, **({} if outcome is None else {"outcome": outcome})}

        @api.get("/healthz")
        async def healthz():
            return {"status": "ok"}

        @api.get("/readyz")
        async def readyz():
            now = time.monotonic()
            if now - self._ready_cache[0] > 1.0:
                self._ready_cache = (now, await self.upstream.probe("/health"))
            engine = self._ready_cache[1]
            st = self.publisher.stats()
            body = {"status": "ready" if engine == 200 else "engine unavailable", "engine_status": engine,
                    "broker_connected": st["broker_connected"], "events_buffered": st["buffered"],
                    "events_dropped": st["dropped_total"], "sync_paused": self.gate.paused,
                    "sync_paused_tenants": sum(map(self.gate.tenant_paused, self.gate.state.tenants))}
            return JSONResponse(body, status_code=200 if engine == 200 else 503)

        @api.get("/metrics")
        async def metrics():
            M.EVENTS_BUFFERED.set(self.publisher.buffered)
            return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

        return api
