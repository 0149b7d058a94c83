"""Test helpers: a scripted stand-in OpenAI chat server (NOT a model) on a real HTTP port.

``ScriptedChatServer(reply)`` serves ``POST /v1/chat/completions`` with uvicorn on a free
127.0.0.1 port in a background thread. ``reply(messages, headers) -> str | dict`` scripts the
answer (a dict may set ``content``, ``finish_reason``, ``completion_tokens``); usage counts
whitespace words as tokens unless given. Every request is recorded in ``requests`` (body and
lower-cased headers) so tests can check the conversation the simulator held.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Callable

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ScriptedChatServer:
    """Stand-in OpenAI chat endpoint answering from a script (context manager; see module doc).

    Args:
        reply: the script; gets the request's ``messages`` and lower-cased headers.
        weight_version: reported as ``metadata.weight_version`` (SGLang's shape); None omits it.
        fail_first: answer the first N requests with HTTP 503 (to exercise client retries).
        delay_s: wait this long (asynchronously) before answering, so concurrent requests overlap;
            ``peak_in_flight`` then records the most requests held at once.
    """

    def __init__(self, reply: Callable[[list[dict], dict], str | dict], weight_version: str | None = "0",
                 fail_first: int = 0, delay_s: float = 0.0) -> None:
        self.reply = reply
        self.delay_s = delay_s
        self.in_flight = 0
        self.peak_in_flight = 0
        self.weight_version = weight_version
        self.fail_first = fail_first
        self.requests: list[dict] = []
        self.port = _free_port()
        self._lock = threading.Lock()
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def _app(self):
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = orjson.loads(await request.body())
            headers = {k.lower(): v for k, v in request.headers.items()}
            with self._lock:
                self.requests.append({"body": body, "headers": headers})
                n = len(self.requests)
            if n <= self.fail_first:
                return Response(b'{"error":"scripted 503"}', status_code=503, media_type="application/json")
            if self.delay_s:
                self.in_flight += 1  # the event loop is single-threaded: no lock needed here
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
                try:
                    await asyncio.sleep(self.delay_s)
                finally:
                    self.in_flight -= 1
            out = self.reply(body.get("messages", []), headers)
            out = {"content": out} if isinstance(out, str) else dict(out)
            content = out.get("content", "")
            toks = out.get("completion_tokens", len(content.split()))
            resp = {
                "id": f"chatcmpl-{n}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", "scripted"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                             "finish_reason": out.get("finish_reason", "stop")}],
                "usage": {"prompt_tokens": 1, "completion_tokens": toks, "total_tokens": toks + 1},
            }
            if self.weight_version is not None:
                resp["metadata"] = {"weight_version": self.weight_version}
            return Response(orjson.dumps(resp), media_type="application/json")

        return app

    def start(self) -> "ScriptedChatServer":
        """Serve in a background thread; returns when the port accepts connections."""
        import uvicorn

        config = uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("ScriptedChatServer did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Stop the server and join its thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> "ScriptedChatServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
