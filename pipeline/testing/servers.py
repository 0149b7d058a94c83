"""Stand-in HTTP servers for tests and benchmarks: scripted answers, NOT models.

One way to serve, two stand-ins:

- :func:`serve_app`: run any ASGI app with uvicorn in a daemon thread on a free 127.0.0.1
  port; yield its base URL. Every stand-in (and the real proxy, see ``pipeline/testing/proxy.py``)
  is served by it.
- :class:`StandInEngine`: a stand-in inference engine (OpenAI-compatible chat completions in
  the shapes of our engine and SGLang: ``token_ids``, ``prompt_token_ids``,
  ``logprobs.content``, ``metadata.weight_version``; streamed chunks with tool-call deltas by
  index, a usage chunk when asked). Every answer comes from a *script* ``request -> Reply``
  with deterministic token ids and log-probs. Tests check exactly what the proxy forwards and
  records, the simulator's conversations (request headers are kept), retries (scripted
  statuses) and concurrency (``peak_in_flight``); ``bench/proxy.py`` uses it as the fast upstream.
- :class:`StandInJudge`: a stand-in judge LLM and teacher (``POST /v1/chat/completions``,
  ``POST /generate``, ``GET /health``) whose votes and hints are scripted in the conversation
  itself (directives below), so a test controls every vote through the next-state text it
  publishes; ``/generate`` scores input ids with deterministic log-probs, or with fixed logits
  (``teacher_logits``). ``instant=True`` answers every chat call with ``\\boxed{1}`` at once
  (benchmark baseline).

StandInJudge script directives (anywhere in the prompt text the judge sends):

- ``<<score: A || B || C>>``: answers to PRM (score) prompts; the n-th call for the same prompt
  gets item ``n mod len``. Items are raw completion texts (e.g. ``\\boxed{1.0}``, ``no box``).
- ``<<hint: A || B>>``: the same for OPD hint prompts (recognised by ``[HINT_START]`` in the system prompt).
- Special items: ``!500`` (HTTP 500), ``!400`` (HTTP 400), ``!hang`` (sleep ``hang_s``
  seconds before answering), ``!sleep S TEXT`` (answer TEXT after S seconds).
- ``<<choice: X>>`` (``/generate`` with a ``tokenizer`` given): the scored continuation whose text
  contains ``\\boxed{X}`` gets log-prob 0 per token, the others -5.

Without a directive, score prompts get ``\\boxed{0}`` and hint prompts ``\\boxed{-1}``.

Both stand-ins are ASGI apps (``with serve_app(StandInEngine()) as url``) and context managers
(``with StandInJudge() as judge: judge.url``). For a benchmark in another process:
``python -m pipeline.testing.servers judge|instant-judge|engine`` prints ``PORT <n>`` and
serves until its stdin closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import socket
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import orjson


def listening_socket(host: str = "127.0.0.1", backlog: int = 1024) -> socket.socket:
    """A TCP socket bound to a free port on ``host`` and listening (no race for the port).
    ``IPPROTO_TCP`` given explicitly: only then does asyncio set ``TCP_NODELAY`` on it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(backlog)
    return sock


@contextlib.contextmanager
def serve_app(app, host: str = "127.0.0.1", *, loop: str = "auto", http: str = "auto",
              start_timeout_s: float = 30.0) -> Iterator[str]:
    """Run an ASGI app with uvicorn in a daemon thread on a free port; yield its base URL.

    Raises:
        RuntimeError: the server did not start (the lifespan start-up failed or timed out).
    """
    import uvicorn

    cfg = uvicorn.Config(app, log_level="warning", access_log=False, loop=loop, http=http, lifespan="auto",
                         timeout_graceful_shutdown=5)
    with serve_server(uvicorn.Server(cfg), host, start_timeout_s=start_timeout_s) as url:
        yield url


@contextlib.contextmanager
def serve_server(server, host: str = "127.0.0.1", *, start_timeout_s: float = 30.0, backlog: int = 1024,
                 config_loop: bool = True) -> Iterator[str]:
    """Run a configured ``uvicorn.Server`` in a daemon thread on a free port of ``host``; yield its
    base URL; on exit ask it to stop and join it.

    ``config_loop``: run it as ``server.run`` does (the event loop its config names, e.g. uvloop);
    False: a plain ``asyncio.run`` loop.

    Raises:
        RuntimeError: the server did not start (its start-up failed or timed out).
    """
    sock = listening_socket(host, backlog)
    port = sock.getsockname()[1]
    errors: list[BaseException] = []

    def _run() -> None:
        try:
            if config_loop:
                server.run(sockets=[sock])
            else:
                asyncio.run(server.serve(sockets=[sock]))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    t = threading.Thread(target=_run, name=f"http-{port}", daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            if errors or not t.is_alive():
                raise RuntimeError(f"server failed to start: {errors[:1]}")
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start in time")
            time.sleep(0.01)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        t.join(20)
        sock.close()


async def send_raw(send, status: int, data: bytes, content_type: bytes = b"application/json") -> None:
    """Send a whole ASGI response."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def send_json(send, status: int, obj: Any) -> None:
    """Send ``obj`` as a JSON response."""
    await send_raw(send, status, orjson.dumps(obj))


class StandInServer:
    """ASGI plumbing shared by the stand-ins: lifespan (:meth:`startup` / :meth:`shutdown`
    hooks), the whole request body, dispatch to :meth:`handle`; and serving as a context
    manager (:func:`serve_app`), with :attr:`url` and :attr:`port` while served.

    Attributes:
        calls: requests per path.
    """

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.url: str | None = None
        self._serving: contextlib.AbstractContextManager | None = None

    @property
    def port(self) -> int:
        """The port it is served on (only while served as a context manager)."""
        return int(self.url.rsplit(":", 1)[1])

    async def startup(self) -> None:
        """Called at the lifespan start-up (inside the server's loop)."""

    async def shutdown(self) -> None:
        """Called at the lifespan shutdown."""

    async def handle(self, scope, body: bytes, send, receive) -> None:
        """Answer one HTTP request (``body``: the whole request body)."""
        raise NotImplementedError

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                m = await receive()
                if m["type"] == "lifespan.startup":
                    await self.startup()
                    await send({"type": "lifespan.startup.complete"})
                elif m["type"] == "lifespan.shutdown":
                    await self.shutdown()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        self.calls[scope["path"]] += 1
        await self.handle(scope, body, send, receive)

    def __enter__(self):
        self._serving = serve_app(self)
        self.url = self._serving.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._serving is not None:
            self._serving.__exit__(*exc)
            self._serving = None


# ---- the stand-in engine ---------------------------------------------------------------------


@dataclass
class Reply:
    """One scripted answer of :class:`StandInEngine`.

    Attributes:
        content: assistant text (split into one token per character group when streamed).
        tool_calls: ``[(name, arguments_json), ...]``.
        reasoning: reasoning text, or None.
        finish_reason: default ``tool_calls`` when there are tool calls, else ``stop``.
        status: HTTP status to answer with instead (an error body is sent).
        break_after: streaming only: drop the connection after this many chunks.
        delay_s: wait this long before answering (time-outs; overlapping requests).
        cut: streaming only: end the response cleanly after the content, without a finish
            chunk or ``[DONE]`` (an engine that closed the stream early).
    """

    content: str = "ok"
    tool_calls: list = field(default_factory=list)
    reasoning: str | None = None
    finish_reason: str | None = None
    status: int = 200
    break_after: int | None = None
    delay_s: float = 0.0
    cut: bool = False


def _tokens(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or []


class StandInEngine(StandInServer):
    """Stand-in engine (see the module docstring). Not thread-safe beyond its server's loop.

    Args:
        script: ``request_dict -> Reply | str`` (a string is ``Reply(content=...)``; default:
            always ``Reply()``).
        weight_version: reported in ``metadata.weight_version``; None leaves ``metadata`` out.
        token_interval_s: streaming: pause between chunks (0 = as fast as possible).
        fixed: cache the answer bytes by (stream, include_usage) — for benchmarks, where the
            script and the prompt do not change.
        record: keep :attr:`requests`, :attr:`headers` and :attr:`answers`.
        always_extras: answer as if ``logprobs`` and ``return_token_ids`` were asked (benchmarks:
            every client gets the same bytes).
        update_statuses: the HTTP statuses of successive ``POST /update_weights_from_disk`` calls
            (then 200; the served ``weight_version`` does not change); ``calls`` counts them.

    Attributes:
        requests: every chat request body received (parsed).
        headers: for each request, its headers (names lower-cased).
        answers: for each request, ``{"prompt_token_ids", "token_ids", "logprobs", "reply"}``.
        in_flight / peak_in_flight: chat requests being answered now / the most at once.
        disconnects: streams cut short because the client hung up.
    """

    def __init__(self, script: Callable[[dict], Reply | str] | None = None, weight_version: str | None = "0",
                 token_interval_s: float = 0.0, fixed: bool = False, record: bool = True,
                 always_extras: bool = False, update_statuses=()) -> None:
        super().__init__()
        self.script = script or (lambda req: Reply())
        self.update_statuses = list(update_statuses)
        self.weight_version = weight_version
        self.token_interval_s = token_interval_s
        self.fixed = fixed
        self.record = record
        self.always_extras = always_extras
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.answers: list[dict] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self.disconnects = 0
        self._cache: dict = {}

    # ---- deterministic ids -------------------------------------------------------------------
    @staticmethod
    def prompt_ids(req: dict) -> list[int]:
        """Stand-in prompt token ids: a function of the message texts."""
        text = orjson.dumps(req.get("messages"))
        return [b % 251 + 3 for b in text[:400]]

    @staticmethod
    def pieces(reply: Reply) -> list[tuple[str, str, Any]]:
        """(kind, text, extra) per sampled token: kind in reasoning/content/tool."""
        out: list[tuple[str, str, Any]] = []
        for t in _tokens(reply.reasoning or ""):
            out.append(("reasoning", t, None))
        for t in _tokens(reply.content or ""):
            out.append(("content", t, None))
        for k, (name, args) in enumerate(reply.tool_calls):
            out.append(("tool_head", name, k))
            for t in _tokens(args, 5):
                out.append(("tool_args", t, k))
        if not out:
            out.append(("content", "", None))
        return out

    def _answer(self, req: dict) -> tuple[Reply, list[int], list[int], list[float], list]:
        reply = self.script(req)
        if isinstance(reply, str):
            reply = Reply(content=reply)
        pieces = self.pieces(reply)
        n = len(pieces)
        pids = self.prompt_ids(req)
        seed = sum(pids) % 1000
        ids = [(seed * 31 + 7 * i) % 49000 + 100 for i in range(n)]
        lps = [-round(0.01 * ((seed + 13 * i) % 300) + 0.001, 4) for i in range(n)]
        return reply, pids, ids, lps, pieces

    def _metadata(self) -> dict:
        return {} if self.weight_version is None else {"metadata": {"weight_version": self.weight_version}}

    # ---- ASGI --------------------------------------------------------------------------------
    async def handle(self, scope, body: bytes, send, receive) -> None:
        path = scope["path"]
        if path == "/v1/chat/completions" and scope["method"] == "POST":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
            await self._chat(orjson.loads(body), headers, send, receive)
        elif path == "/v1/models":
            await send_json(send, 200, {"object": "list", "data": [{"id": "scripted", "object": "model",
                                                                    "owned_by": "stand-in"}]})
        elif path == "/health":
            await send_json(send, 200, {})
        elif path in ("/server_info", "/model_info"):
            await send_json(send, 200, {"chat_stream_token_ids": True, "weight_version": self.weight_version})
        elif path == "/update_weights_from_disk" and scope["method"] == "POST":
            status = self.update_statuses.pop(0) if self.update_statuses else 200
            await send_json(send, status, {"success": status == 200,
                                           "message": "ok" if status == 200 else f"refused ({status})"})
        else:
            await send_json(send, 404, {"object": "error", "message": f"no route {path}", "code": 404})

    async def _chat(self, req: dict, headers: dict, send, receive=None) -> None:
        if self.always_extras:
            req = dict(req, logprobs=True, return_token_ids=True)
        stream = bool(req.get("stream"))
        usage = bool((req.get("stream_options") or {}).get("include_usage"))
        if self.fixed and (stream, usage) in self._cache:
            if self.record:
                self.requests.append(req)
                self.headers.append(headers)
            await self._send_cached(self._cache[(stream, usage)], stream, send, receive)
            return
        if self.record:  # recorded before the script runs: a script may look at what came before
            self.requests.append(req)
            self.headers.append(headers)
        reply, pids, ids, lps, pieces = self._answer(req)
        if self.record:
            self.answers.append({"prompt_token_ids": pids, "token_ids": ids, "logprobs": lps, "reply": reply})
        self.in_flight += 1  # one event loop: no lock needed
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
        finally:
            self.in_flight -= 1
        if reply.status != 200:
            await send_json(send, reply.status, {"object": "error", "message": f"scripted failure {reply.status}",
                                                 "type": "Bad Request" if reply.status < 500 else "server_error",
                                                 "code": reply.status})
            return
        if stream:
            chunks = self._chunks(req, reply, pids, ids, lps, pieces, usage)
            if self.fixed:
                self._cache[(stream, usage)] = chunks
            await self._send_stream(chunks, reply.break_after, send, receive)
        else:
            data = orjson.dumps(self._full(req, reply, pids, ids, lps))
            if self.fixed:
                self._cache[(stream, usage)] = data
            await send_raw(send, 200, data)

    async def _send_cached(self, cached, stream: bool, send, receive) -> None:
        if stream:
            await self._send_stream(cached, None, send, receive)
        else:
            await send_raw(send, 200, cached)
    def _finish(self, reply: Reply) -> str:
        return reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")

    def _full(self, req: dict, reply: Reply, pids, ids, lps) -> dict:
        want_ids = bool(req.get("return_token_ids"))
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": reply.content, "reasoning_content": reply.reasoning,
                        "tool_calls": [{"id": f"call_{k}", "index": k, "type": "function",
                                        "function": {"name": n, "arguments": a}}
                                       for k, (n, a) in enumerate(reply.tool_calls)] or None},
            "logprobs": ({"content": [{"token": f"t{i}", "logprob": lp, "bytes": None, "top_logprobs": []}
                                      for i, lp in zip(ids, lps)]} if req.get("logprobs") else None),
            "finish_reason": self._finish(reply), "matched_stop": None}
        if want_ids or req.get("return_prompt_token_ids"):
            choice["prompt_token_ids"] = pids
        if want_ids:
            choice["token_ids"] = ids
        return {"id": "chatcmpl-scripted", "object": "chat.completion", "created": int(time.time()),
                "model": req.get("model") or "scripted", "choices": [choice],
                "usage": {"prompt_tokens": len(pids), "completion_tokens": len(ids), "total_tokens": len(pids) + len(ids)},
                **self._metadata()}

    def _chunks(self, req: dict, reply: Reply, pids, ids, lps, pieces, usage: bool) -> list[bytes]:
        want_ids = bool(req.get("return_token_ids"))
        want_lp = bool(req.get("logprobs"))
        model = req.get("model") or "scripted"
        base = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model}

        def chunk(delta: dict, **extra) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": extra.pop("logprobs", None),
                      "finish_reason": extra.pop("finish_reason", None)}
            if "token_ids" in extra:
                choice["token_ids"] = extra.pop("token_ids")
            return b"data: " + orjson.dumps(dict(base, choices=[choice], **extra)) + b"\n\n"

        first: dict[str, Any] = {**self._metadata()}
        if want_ids:
            first["prompt_token_ids"] = pids
        out = [chunk({"role": "assistant", "content": ""}, **first)]
        for i, (kind, text, k) in enumerate(pieces):
            extra: dict[str, Any] = {}
            if want_ids:
                extra["token_ids"] = [ids[i]]
            if want_lp:
                extra["logprobs"] = {"content": [{"token": f"t{ids[i]}", "logprob": lps[i], "bytes": None,
                                                  "top_logprobs": []}]}
            if kind == "reasoning":
                delta = {"reasoning_content": text}
            elif kind == "content":
                delta = {"content": text} if text else {}
            elif kind == "tool_head":
                delta = {"tool_calls": [{"index": k, "id": f"call_{k}", "type": "function",
                                         "function": {"name": text, "arguments": ""}}]}
            else:
                delta = {"tool_calls": [{"index": k, "function": {"arguments": text}}]}
            out.append(chunk(delta, **extra))
        if reply.cut:
            return out
        out.append(chunk({}, finish_reason=self._finish(reply), **self._metadata()))
        if usage:
            out.append(b"data: " + orjson.dumps(dict(base, choices=[], usage={
                "prompt_tokens": len(pids), "completion_tokens": len(ids),
                "total_tokens": len(pids) + len(ids)})) + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        return out

    async def _send_stream(self, chunks: list[bytes], break_after: int | None, send, receive) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        gone = asyncio.Event()
        watcher = None
        if self.token_interval_s and receive is not None:
            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                gone.set()
            watcher = asyncio.ensure_future(watch())
        try:
            for i, c in enumerate(chunks):
                if break_after is not None and i >= break_after:
                    raise RuntimeError("scripted stream break")  # uvicorn drops the connection
                if gone.is_set():  # the client (the proxy) hung up: stop generating, like an engine aborts
                    self.disconnects += 1
                    return
                await send({"type": "http.response.body", "body": c, "more_body": True})
                if self.token_interval_s:
                    await asyncio.sleep(self.token_interval_s)
            await send({"type": "http.response.body", "body": b""})
        finally:
            if watcher is not None:
                watcher.cancel()



# ---- the stand-in judge LLM and teacher ------------------------------------------------------

_DIRECTIVE = re.compile(r"<<(score|hint|choice):(.*?)>>", re.S)


def fake_logprob(token_id: int, position: int) -> float:
    """The deterministic log-prob the stand-in judge's ``/generate`` reports (nats, in [-1, 0))."""
    return -((token_id * 7919 + position * 104729) % 1000 + 1) / 1000.0


def _chat_answer(text: str) -> dict:
    return {"id": "chatcmpl-scripted", "object": "chat.completion", "created": int(time.time()),
            "model": "scripted-judge",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text, "reasoning_content": None,
                                     "tool_calls": None}}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}


class StandInJudge(StandInServer):
    """A stand-in judge LLM and teacher driven by directives (see the module docstring).

    Args:
        hang_s: how long ``!hang`` sleeps (longer than the judge's vote time-out in tests).
        tokenizer: optional HF tokenizer, to decode ``/generate`` input ids for ``<<choice: X>>``.
        teacher_logits: ``/generate`` scores as a fixed-logits teacher instead: the logits at
            every position are these over token ids ``0 .. len-1`` (the rest -inf), whatever the
            prompt, and the reported log-probs are ``log_softmax(logits / T)`` with T the
            request's ``sampling_params.temperature`` (1.0 when absent; < 1e-6 is greedy, i.e.
            1.0), as the CPU engine and SGLang (``SGLANG_TEMP_SCALED_LOGPROBS=1``) do: a hint
            changes nothing.
        instant: answer every chat call with ``\\boxed{1}`` at once, without reading the prompt
            (benchmark baseline).
        generate_script: ``/generate`` answers with ``generate_script(body)`` as they are (a
            malformed answer, for tests of what the teacher refuses).

    Attributes:
        generate_bodies: every ``/generate`` request body.
    """

    def __init__(self, hang_s: float = 30.0, tokenizer=None, teacher_logits=None, instant: bool = False,
                 generate_script: Callable[[dict], dict] | None = None) -> None:
        super().__init__()
        self.generate_script = generate_script
        self.hang_s = hang_s
        self.tokenizer = tokenizer
        self.teacher_logits = None if teacher_logits is None else [float(x) for x in teacher_logits]
        self.instant = instant
        self._instant_answer = orjson.dumps(_chat_answer("Looks fine. \\boxed{1}"))
        self._counters: dict[tuple, int] = defaultdict(int)
        self.generate_bodies: list[dict] = []

    async def handle(self, scope, body: bytes, send, receive) -> None:
        path = scope["path"]
        if self.instant and path == "/v1/chat/completions":
            return await send_raw(send, 200, self._instant_answer)
        try:
            req = orjson.loads(body) if body else {}
        except orjson.JSONDecodeError:
            return await send_json(send, 400, {"error": {"message": "body is not JSON"}})
        if path in ("/health", "/health_generate"):
            status, payload = 200, {}
        elif path == "/v1/chat/completions":
            status, payload = await self._chat(req)
        elif path == "/generate":
            self.generate_bodies.append(req)
            if self.generate_script is not None:
                status, payload = 200, self.generate_script(req)
            elif self.teacher_logits is not None:
                status, payload = self._fixed_logits(req)
            else:
                status, payload = self._generate(req)
        else:
            status, payload = 404, {"error": {"message": f"no route {path}"}}
        await send_json(send, status, payload)

    async def _chat(self, body: dict):
        msgs = body.get("messages") or []
        text = "\n".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
        system = " ".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict) and m.get("role") == "system")
        kind = "hint" if "[HINT_START]" in system else "score"
        items = None
        for m in _DIRECTIVE.finditer(text):
            if m.group(1) == kind:
                items = [i.strip() for i in m.group(2).split("||")]
        if items is None:
            items = ["\\boxed{0}"] if kind == "score" else ["\\boxed{-1}"]
        key = (kind, text)
        n = self._counters[key]
        self._counters[key] = n + 1
        item = items[n % len(items)]
        if item.startswith("!sleep "):  # "!sleep 0.5 <answer>"
            _, secs, item = item.split(" ", 2)
            await asyncio.sleep(float(secs))
        if item == "!hang":
            await asyncio.sleep(self.hang_s)
            item = "\\boxed{0}"
        if item == "!500":
            return 500, {"object": "error", "message": "scripted failure", "code": 500}
        if item == "!400":
            return 400, {"object": "error", "message": "scripted bad request", "code": 400}
        return 200, _chat_answer(item)

    def _generate(self, body: dict):
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            return 400, {"error": {"message": "input_ids cannot be empty."}}
        start = int(body.get("logprob_start_len", -1))
        if start >= len(ids):
            return 400, {"error": {"message": "logprob_start_len is higher than the number of input tokens"}}
        k = int(body.get("top_logprobs_num") or 0)
        t = float((body.get("sampling_params") or {}).get("temperature", 1.0))
        t = 1.0 if t < 1e-6 else t  # the fake log-probs scale with 1/T, as a temperature-scaled teacher's do
        positions = range(start + 1, len(ids)) if start >= 0 else range(0)
        choice_lp = None
        if self.tokenizer is not None and start >= 0:
            full = self.tokenizer.decode(ids)
            m = re.search(r"<<choice:\s*(-?\d)\s*>>", full)
            if m:
                tail = self.tokenizer.decode(ids[start + 1:])
                choice_lp = 0.0 if f"\\boxed{{{m.group(1)}}}" in tail else -5.0
        entries, tops = [], []
        for i in positions:
            lp = choice_lp if choice_lp is not None else fake_logprob(ids[i], i) / t
            entries.append([lp, ids[i], None])
            if k:
                tops.append([[(fake_logprob(ids[i] + j, i) - j) / t, ids[i] + j, None] for j in range(k)])
        if start == 0:
            entries.insert(0, [None, ids[0], None])
            if k:
                tops.insert(0, None)
        meta = {"id": "scripted", "finish_reason": {"type": "length", "length": 0},
                "prompt_tokens": len(ids), "completion_tokens": 0, "weight_version": "scripted",
                "input_token_logprobs": entries, "output_token_logprobs": []}
        if k:
            meta["input_top_logprobs"] = tops
            meta["output_top_logprobs"] = []
        return 200, {"text": "", "output_ids": [], "meta_info": meta}

    def log_prob(self, token_id: int, temperature: float) -> float:
        """With ``teacher_logits``: log_softmax(logits / T)[token_id] in nats (-inf outside the support)."""
        logits = self.teacher_logits or []
        if not 0 <= token_id < len(logits):
            return -math.inf
        z = [x / temperature for x in logits]
        m = max(z)
        return z[token_id] - m - math.log(sum(math.exp(v - m) for v in z))

    def _fixed_logits(self, body: dict):
        ids, start = body["input_ids"], int(body.get("logprob_start_len", -1))
        t = float((body.get("sampling_params") or {}).get("temperature", 1.0))
        t = 1.0 if t < 1e-6 else t
        entries = [[self.log_prob(ids[i], t), ids[i], None] for i in range(max(start, 0) + 1, len(ids))]
        meta = {"id": "fixed", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(ids),
                "completion_tokens": 0, "weight_version": "fixed", "input_token_logprobs": entries,
                "output_token_logprobs": []}
        return 200, {"text": "", "output_ids": [], "meta_info": meta}


def main(argv=None) -> int:  # pragma: no cover - used by bench/judge.py
    """Serve a stand-in in the foreground; prints ``PORT <n>`` once listening, stops when stdin closes."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["judge", "instant-judge", "engine"])
    args = ap.parse_args(argv)
    server = {"judge": lambda: StandInJudge(), "instant-judge": lambda: StandInJudge(instant=True),
              "engine": lambda: StandInEngine(fixed=True, record=False)}[args.kind]()
    with server:
        print(f"PORT {server.port}", flush=True)
        sys.stdin.read()  # until the parent closes our stdin
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
