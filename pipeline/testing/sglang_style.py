"""A stand-in for an SGLang server, made of our CPU engine plus SGLang's known differences.

:class:`SglangStyleEngine` is not SGLang: it is an ASGI app that forwards every request to a
running CPU engine and changes the answers where SGLang (at the commit the engine follows)
answers differently, so the proxy's SGLang paths can be tested on a CPU:

- ``/server_info`` lacks our engine's extensions ``chat_stream_token_ids`` (SGLang cannot
  stream token ids on chat) and ``logprob_token_bytes`` (SGLang's log-prob ``bytes`` are the
  UTF-8 of the per-id decoded ``token`` string);
- chat with ``stream: true`` and ``return_token_ids`` / ``return_prompt_token_ids`` /
  ``return_meta_info`` is a 400 (SGLang raises ``ValueError`` there);
- every ``bytes`` of ``logprobs.content`` and of its ``top_logprobs`` is rewritten to
  ``list(token.encode())``, so half an emoji reads ``[239, 191, 189]`` as SGLang sends it;
- chat answers carry ``metadata.weight_version`` only (our engine's ``metadata.sampling_params``,
  the parameters it really sampled with, is removed: SGLang does not report them);
- with ``temp_scaled_logprobs=False`` (SGLang started without ``SGLANG_TEMP_SCALED_LOGPROBS=1``)
  the prompt log-probs of ``/generate`` are those of temperature 1.0 whatever the request says
  (the request's ``temperature`` is dropped from a prefill-only ``max_new_tokens: 0`` call);
- ``generate_chunk_delay_s`` spaces the chunks of a streamed ``/generate`` (a slower engine).

Everything else (``/generate``, ``/v1/tokenize``, ``/model_info``, weights, ...) passes through.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson

from pipeline.testing.servers import send_json, send_raw, StandInServer

_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def sglang_bytes(obj: Any) -> None:
    """Rewrite log-prob ``bytes`` in a chat response or chunk the way SGLang fills them (in place)."""
    md = obj.get("metadata")
    if isinstance(md, dict):
        md.pop("sampling_params", None)
    for c in obj.get("choices") or ():
        lp = c.get("logprobs") if isinstance(c, dict) else None
        for item in (lp or {}).get("content") or ():
            item["bytes"] = list(item["token"].encode("utf-8"))
            for alt in item.get("top_logprobs") or ():
                alt["bytes"] = list(alt["token"].encode("utf-8"))


class SglangStyleEngine(StandInServer):
    """ASGI app in front of ``engine_url`` (see the module docstring). Create inside no loop."""

    def __init__(self, engine_url: str, *, temp_scaled_logprobs: bool = True,
                 generate_chunk_delay_s: float = 0.0) -> None:
        super().__init__()
        self.engine_url = engine_url.rstrip("/")
        self.temp_scaled_logprobs = temp_scaled_logprobs
        self.generate_chunk_delay_s = generate_chunk_delay_s
        self.requests: list[tuple[str, Any]] = []  # (path, parsed body) of every POST seen
        self._http: httpx.AsyncClient | None = None

    async def startup(self) -> None:
        self._http = httpx.AsyncClient(timeout=120)

    async def shutdown(self) -> None:
        await self._http.aclose()

    async def handle(self, scope, body: bytes, send, receive) -> None:
        path, method = scope["path"], scope["method"]
        query = scope.get("query_string", b"").decode()
        url = self.engine_url + path + (f"?{query}" if query else "")
        req = None
        if method == "POST" and body:
            try:
                req = orjson.loads(body)
            except orjson.JSONDecodeError:
                req = None
            self.requests.append((path, req))
        if path in ("/server_info", "/get_server_info"):
            r = await self._http.get(url)
            info = r.json()
            info.pop("chat_stream_token_ids", None)
            info.pop("logprob_token_bytes", None)
            info["version"] = "sglang-style-stand-in"
            return await send_json(send, r.status_code, info)
        if path == "/v1/chat/completions" and isinstance(req, dict):
            if req.get("stream") and any(req.get(k) for k in ("return_token_ids", "return_prompt_token_ids",
                                                               "return_meta_info")):
                return await send_json(send, 400, {"object": "error", "type": "BadRequestError", "param": None,
                                                    "code": 400, "message": "return_token_ids, return_prompt_"
                                                    "token_ids and return_meta_info are not supported with "
                                                    "stream=true"})
            if req.get("stream"):
                return await self._chat_stream(url, body, send)
            r = await self._http.post(url, content=body, headers={"content-type": "application/json"})
            if r.status_code != 200:
                return await send_raw(send, r.status_code, r.content)
            obj = r.json()
            sglang_bytes(obj)
            return await send_json(send, 200, obj)
        headers = {"content-type": "application/json"} if body else {}
        sp = req.get("sampling_params") if path == "/generate" and isinstance(req, dict) else None
        if isinstance(sp, dict) and sp.get("max_new_tokens") == 0 and not self.temp_scaled_logprobs:
            sp.pop("temperature", None)
            body = orjson.dumps(req)
        if isinstance(req, dict) and req.get("stream"):
            async with self._http.stream(method, url, content=body, headers=headers) as r:
                await send({"type": "http.response.start", "status": r.status_code,
                            "headers": [(b"content-type", r.headers.get("content-type", "").encode())]})
                async for part in (r.aiter_lines() if self.generate_chunk_delay_s else r.aiter_raw()):
                    if self.generate_chunk_delay_s:
                        if not part:
                            continue
                        await asyncio.sleep(self.generate_chunk_delay_s)  # pacing, not a wait for a state
                        part = (part + "\n\n").encode()
                    await send({"type": "http.response.body", "body": part, "more_body": True})
            return await send({"type": "http.response.body", "body": b""})
        r = await self._http.request(method, url, content=body or None, headers=headers)
        await send_raw(send, r.status_code, r.content, r.headers.get("content-type", "application/json").encode())

    async def _chat_stream(self, url: str, body: bytes, send) -> None:
        async with self._http.stream("POST", url, content=body, headers={"content-type": "application/json"}) as r:
            if r.status_code != 200:
                return await send_raw(send, r.status_code, await r.aread())
            await send({"type": "http.response.start", "status": 200, "headers": _SSE})
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data != "[DONE]":
                    obj = orjson.loads(data)
                    sglang_bytes(obj)
                    data = orjson.dumps(obj).decode()
                await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b""})
