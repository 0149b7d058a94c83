"""One async client for the policy engine: SGLang or this package's CPU engine.

Used by the proxy (chat, streaming with exact token ids), the judge (chat votes, teacher
``score``) and the weight syncer (``update_weights_from_disk``). The same calls work against
both servers; where SGLang behaves differently the method docstring says so.

Log-prob convention (both servers): a returned log-prob is ``log softmax(logits / T)`` of the
sampled (or scored) token, before top-p/top-k truncation, in nats. A scoring pass
(:meth:`EngineClient.score`) uses temperature 1.0 unless ``temperature`` is given.

Transport: one aiohttp pool (:class:`pipeline.engine_api.transport.Transport`), the client's own
or one it shares (the proxy's). Errors (:mod:`pipeline.engine_api.errors`): every failure raises
:class:`EngineError` (``status`` = HTTP code, None when the server could not be reached or its
answer could not be used); a timeout raises ``EngineTimeout``; a refused or dropped connection
raises ``EngineUnavailable`` (``EngineUnreachable`` when it could not be opened).

Example::

    async with EngineClient("http://127.0.0.1:30000", timeout_s=60) as eng:
        await eng.wait_ready(30)
        out = await eng.chat({"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "return_token_ids": True})
        lps = await eng.score(out["choices"][0]["prompt_token_ids"] + out["choices"][0]["token_ids"],
                              start=len(out["choices"][0]["prompt_token_ids"]))
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import orjson

from pipeline.engine_api.errors import EngineError, EngineTimeout, error_message
from pipeline.engine_api.sglang import GenerateChatStream
from pipeline.engine_api.transport import Transport, sse_batches

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class ScoreResult:
    """Log-probs of ``input_ids[start:]`` (nats) plus the policy version that computed them.

    ``top``: per scored position ``[(token_id, logprob), ...]`` (empty lists unless asked for).
    """

    logprobs: list[float]
    weight_version: str | None
    top: list[list[tuple[int, float]]] = field(default_factory=list)


def _event(obj: Any) -> Any:
    """One decoded stream event; an ``{"error": ...}`` event (no ``choices``, no ``meta_info``)
    raises :class:`EngineError` with its ``code`` as the status (500 when it has none)."""
    if isinstance(obj, dict) and "error" in obj and "choices" not in obj and "meta_info" not in obj:
        err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
        code = err.get("code")
        raise EngineError(str(err.get("message")), code if isinstance(code, int) else 500, obj)
    return obj


class EngineClient:
    """Async client of one engine base URL.

    Args:
        base_url: e.g. ``http://127.0.0.1:30000`` (no trailing ``/v1``).
        timeout_s: limit for one whole call (streams: between two chunks).
        api_key: sent as ``Authorization: Bearer`` (SGLang ``--api-key``).
        transport: an existing :class:`Transport` to share (its base URL is used; not closed by
            :meth:`aclose`).
        max_connections: pool size of the client's own transport.
    """

    def __init__(self, base_url: str, timeout_s: float = 300.0, api_key: str | None = None, *,
                 transport: Transport | None = None, max_connections: int = 256) -> None:
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.timeout_s = timeout_s
        self._own = transport is None
        self._t = transport or Transport(self.base_url, timeout_s, max_connections)
        self.base_url = self._t.base_url
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._server_info: dict | None = None
        #: token id -> raw bytes, for log-prob ``bytes`` on the ``/generate`` chat path
        #: (:class:`pipeline.engine_api.tokenbytes.TokenBytes`); None: a token's text's UTF-8,
        #: None for half a character
        self.token_bytes: Callable[[int], bytes] | None = None
        #: the served model's generation_config defaults (:data:`pipeline.sampling.CHAT_DEFAULTED`
        #: keys) that SGLang's chat path applies to a request without them; the ``/generate``
        #: chat path applies them too
        self.chat_defaults: dict[str, float] = {}

    async def aclose(self) -> None:
        if self._own:
            await self._t.close()

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # ---- plumbing ------------------------------------------------------------------------------
    async def _request(self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None,
                       expect_json: bool = True) -> Any:
        """One call; the decoded JSON answer (its raw bytes with ``expect_json=False``).
        Raises :class:`EngineError` for an HTTP error status, the transport's errors otherwise."""
        content = body if body is None or isinstance(body, bytes) else orjson.dumps(body)
        status, data, _ = await self._t.call(method, path, content, timeout_s=timeout_s, headers=self._headers)
        decoded = self._decode(status, data, method, path)
        return decoded if expect_json else data

    @staticmethod
    def _decode(status: int, content: bytes, method: str, path: str) -> Any:
        """The JSON of an answer (its text when it is not JSON, None when empty); raises
        :class:`EngineError` (``status``, the server's message) for a status >= 400."""
        data: Any = None
        if content:
            try:
                data = orjson.loads(content)
            except orjson.JSONDecodeError:
                data = content.decode("utf-8", "replace")
        if status >= 400:
            raise EngineError(error_message(data, f"{method} {path} -> HTTP {status}"), status, data)
        return data

    async def post(self, path: str, body: dict | bytes) -> Any:
        """``POST`` a JSON body (a dict, or JSON already encoded) to any path of the server and
        return its JSON answer (the judge's votes, the ``choice`` backend's ``/generate``).

        Raises:
            EngineError: an error status, or an answer that is not JSON (``status`` None).
        """
        data = await self._request("POST", path, body)
        if not isinstance(data, (dict, list)):
            raise EngineError(f"POST {path}: the answer is not JSON: {str(data)[:200]!r}", None, data)
        return data

    async def _sse(self, path: str, body: dict) -> AsyncIterator[dict]:
        """POST and yield each ``data:`` JSON object until ``[DONE]``. A stream left before its
        end closes its connection (the server sees the disconnect).

        Raises EngineError for an HTTP error before the stream or an ``{"error": ...}`` event.
        """
        resp = await self._t.open_stream(path, orjson.dumps(body), dict(self._headers, Accept="text/event-stream"))
        done = False
        try:
            if resp.status >= 400:
                self._decode(resp.status, await resp.read(), "POST", path)
            async for batch in sse_batches(resp):
                for payload in batch:
                    if payload.strip() == b"[DONE]":
                        done = True
                        return
                    yield _event(orjson.loads(payload))
            done = True
        finally:
            if done:
                resp.release()  # read to its end: the connection goes back to the pool
            else:
                resp.close()

    # ---- health & info -----------------------------------------------------------------------
    async def health(self) -> bool:
        """True when ``GET /health`` answers 200 (SGLang: 503 while starting)."""
        try:
            await self._request("GET", "/health", timeout_s=min(5.0, self.timeout_s), expect_json=False)
            return True
        except EngineError:
            return False

    async def wait_ready(self, timeout_s: float = 60.0, interval_s: float = 0.2) -> None:
        """Poll :meth:`health` until it is true. Raises :class:`EngineTimeout`."""
        deadline = time.monotonic() + timeout_s
        while True:
            if await self.health():
                return
            if time.monotonic() >= deadline:
                raise EngineTimeout(f"engine at {self.base_url} not ready after {timeout_s:.0f}s")
            await asyncio.sleep(interval_s)

    async def model_info(self) -> dict:
        """``GET /model_info`` (falls back to the older ``/get_model_info``); has ``weight_version``."""
        try:
            return await self._request("GET", "/model_info")
        except EngineError as e:
            if e.status != 404:
                raise
            return await self._request("GET", "/get_model_info")

    async def server_info(self, refresh: bool = False) -> dict:
        """``GET /server_info`` (cached). SGLang's is large (every server arg); ours is small."""
        if self._server_info is None or refresh:
            try:
                self._server_info = await self._request("GET", "/server_info")
            except EngineError as e:
                if e.status != 404:
                    raise
                self._server_info = await self._request("GET", "/get_server_info")
        return self._server_info

    async def weight_version(self) -> str | None:
        """The engine's current policy version (``/model_info``)."""
        return (await self.model_info()).get("weight_version")

    async def models(self) -> dict:
        """``GET /v1/models``."""
        return await self._request("GET", "/v1/models")

    # ---- chat -------------------------------------------------------------------------------------
    async def chat(self, body: dict) -> dict:
        """Non-streaming ``POST /v1/chat/completions``; returns the response object.

        For exact ids send ``return_token_ids: true`` (``choices[i].token_ids`` and
        ``prompt_token_ids``) and ``logprobs: true``; the policy version is
        ``metadata.weight_version``. SGLang older than ~0.5.13 silently ignores the id flags.
        """
        return await self._request("POST", "/v1/chat/completions", dict(body, stream=False))

    async def chat_stream(self, body: dict, *, token_ids: bool = False) -> AsyncIterator[dict]:
        """Streaming chat: yields ``chat.completion.chunk`` dicts (``[DONE]`` ends the iterator).

        With ``token_ids=True`` every chunk that carries new tokens has ``choices[0].token_ids``
        (delta ids, aligned with ``logprobs.content`` when ``logprobs`` is on), the first chunk
        has ``prompt_token_ids``, and the first and last chunks have ``metadata.weight_version``.

        Our engine does this natively (``return_token_ids`` with ``stream``, vLLM-style).
        SGLang (commit 004c82e) rejects that combination with 400, so against a server whose
        ``/server_info`` lacks ``chat_stream_token_ids`` this method renders the prompt with
        ``POST /v1/tokenize`` (messages + tools) and streams ``POST /generate`` with those
        ``input_ids``, converting its chunks to chat chunks
        (:class:`pipeline.engine_api.sglang.GenerateChatStream`; tool calls parsed with
        :mod:`pipeline.engine_api.tools`). Every chat field is either carried over as SGLang's
        chat path would (:func:`pipeline.engine_api.sglang.chat_sampling_params`: sampling
        fields, ``response_format`` as a JSON schema, generation_config defaults from
        :attr:`chat_defaults`; ``input_ids``; a usage chunk for ``stream_options.include_usage``;
        ``parallel_tool_calls: false``) or refused with :class:`EngineError` 400 naming it
        (:func:`pipeline.engine_api.sglang.generate_path_refusal`) before anything is generated. Log-prob ``bytes`` are the tokens' raw bytes when :attr:`token_bytes` is
        set. Caveats of that fallback: SGLang's tokenize endpoint may render the template
        slightly differently from its chat path, no reasoning parser runs, and a stop string is
        trimmed only once it is complete.
        """
        if not token_ids:
            async for chunk in self._sse("/v1/chat/completions", dict(body, stream=True)):
                yield chunk
            return
        info = await self.server_info()
        if info.get("chat_stream_token_ids"):
            async for chunk in self._sse("/v1/chat/completions", dict(body, stream=True, return_token_ids=True)):
                yield chunk
            return
        async for chunk in GenerateChatStream(self, body, info).run():
            yield chunk

    # ---- native generate / scoring -----------------------------------------------------------
    async def generate(self, input_ids: list[int] | list[list[int]] | None = None, *, text: str | None = None,
                       sampling_params: dict | None = None, return_logprob: bool = False,
                       logprob_start_len: int | None = None, top_logprobs_num: int = 0,
                       rid: str | None = None, **extra: Any) -> Any:
        """``POST /generate`` (non-stream); returns the SGLang output object (a list for a batch).

        ``extra`` is passed through (e.g. ``return_prompt_token_ids``, ``token_ids_logprob``).
        Note SGLang's default ``max_new_tokens`` is 128 here (unlike chat).
        """
        body = self._generate_body(input_ids, text, sampling_params, return_logprob, logprob_start_len,
                                   top_logprobs_num, rid, extra)
        return await self._request("POST", "/generate", body)

    async def generate_stream(self, input_ids: list[int] | None = None, *, text: str | None = None,
                              sampling_params: dict | None = None, return_logprob: bool = False,
                              top_logprobs_num: int = 0, rid: str | None = None, **extra: Any
                              ) -> AsyncIterator[dict]:
        """Streaming ``/generate``: yields the server's chunks as sent (SGLang default and our
        engine: cumulative ``text``/``output_ids``/log-prob lists; SGLang with
        ``--incremental-streaming-output``: deltas — see ``server_info()``)."""
        body = self._generate_body(input_ids, text, sampling_params, return_logprob, None, top_logprobs_num,
                                   rid, extra)
        body["stream"] = True
        async for ev in self._sse("/generate", body):
            yield ev

    @staticmethod
    def _generate_body(input_ids, text, sampling_params, return_logprob, logprob_start_len, top_logprobs_num,
                       rid, extra) -> dict:
        if (input_ids is None) == (text is None):
            raise ValueError("give exactly one of input_ids or text")
        body: dict[str, Any] = {"sampling_params": dict(sampling_params or {})}
        if input_ids is not None:
            body["input_ids"] = input_ids
        else:
            body["text"] = text
        if return_logprob:
            body["return_logprob"] = True
            if logprob_start_len is not None:
                body["logprob_start_len"] = logprob_start_len
            if top_logprobs_num:
                body["top_logprobs_num"] = top_logprobs_num
        if rid is not None:
            body["rid"] = rid
        body.update(extra)
        return body

    async def score_result(self, input_ids: list[int], start: int, *, temperature: float | None = None,
                           top_logprobs_num: int = 0, lora_path: str | None = None) -> ScoreResult:
        """Log-probs of ``input_ids[start:]``, each conditioned on everything before it.

        One prefill-only ``/generate`` call: ``max_new_tokens=0, return_logprob=true,
        logprob_start_len=start-1``. SGLang returns entries for positions ``start .. L-1`` then
        (for ``logprob_start_len == 0``, i.e. ``start == 1``) with a ``null`` pad entry for t_0 in
        front (docs/sglang-api.md §1.4); this method keeps the last ``L - start`` entries and checks
        that their token ids equal ``input_ids[start:]``, so either alignment is handled.

        Args:
            input_ids: the full sequence (e.g. prompt ids + response ids), length L.
            start: first position to score, ``1 <= start <= L`` (``start == L`` -> ``[]``).
            temperature: scale of the scoring distribution (default 1.0).
            top_logprobs_num: also return the top-k alternatives per position.
            lora_path: score under this loaded LoRA adapter (None: the base model).
        Raises:
            ValueError: bad ``start`` or empty ids; EngineError: server error or misaligned answer.
        """
        L = len(input_ids)
        if L == 0 or not 1 <= start <= L:
            raise ValueError(f"score: need 1 <= start <= len(input_ids) = {L}, got start={start}")
        if start == L:
            return ScoreResult([], await self.weight_version(), [])
        sp: dict[str, Any] = {"max_new_tokens": 0}
        if temperature is not None:
            sp["temperature"] = temperature
        out = await self.generate(list(input_ids), sampling_params=sp, return_logprob=True,
                                  logprob_start_len=start - 1, top_logprobs_num=top_logprobs_num,
                                  **({"lora_path": lora_path} if lora_path is not None else {}))
        mi = out["meta_info"]
        entries = mi.get("input_token_logprobs") or []
        n = L - start
        if len(entries) < n:
            raise EngineError(f"score: expected {n} prompt log-probs, got {len(entries)}", None, out)
        entries = entries[len(entries) - n:]
        ids = [e[1] for e in entries]
        if ids != list(input_ids[start:]) or any(e[0] is None for e in entries):
            raise EngineError("score: the engine's prompt log-probs are not aligned with input_ids[start:]",
                              None, out)
        top: list = []
        if top_logprobs_num:
            rows = (mi.get("input_top_logprobs") or [])
            rows = rows[len(rows) - n:] if len(rows) >= n else []
            top = [[(int(t[1]), float(t[0]) if t[0] is not None else -math.inf) for t in (row or [])]
                   for row in rows]
        return ScoreResult([float(e[0]) for e in entries], mi.get("weight_version"), top)

    async def score(self, input_ids: list[int], start: int, *, temperature: float | None = None,
                    lora_path: str | None = None) -> list[float]:
        """Just the log-probs of :meth:`score_result` (one per token of ``input_ids[start:]``)."""
        return (await self.score_result(input_ids, start, temperature=temperature, lora_path=lora_path)).logprobs

    async def tokenize(self, messages: list[dict] | None = None, tools: list[dict] | None = None, *,
                       prompt: str | None = None, add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        """Prompt ids of chat ``messages`` (chat template + tools) or of a plain ``prompt``
        (``POST /v1/tokenize``). SGLang documents that this may differ from its chat path."""
        body = tokenize_body(messages, tools, prompt, add_generation_prompt, extra)
        return list((await self._request("POST", "/v1/tokenize", body))["tokens"])

    # ---- weights & control -----------------------------------------------------------------------
    async def update_weights_from_disk(self, model_path: str, weight_version: str | int | None = None, *,
                                       abort_all_requests: bool = False, timeout_s: float | None = None) -> dict:
        """``POST /update_weights_from_disk``; returns ``{success, message, num_paused_requests}``.

        Both servers let in-flight requests finish on the old weights and hold new ones until
        the swap is done (SGLang: reader/writer lock), so this call can take as long as the
        longest running generation. Our engine also returns ``weight_version``; for SGLang read
        it from :meth:`model_info`. Raises :class:`EngineError` when ``success`` is false.
        """
        body: dict[str, Any] = {"model_path": str(model_path), "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._success_call("/update_weights_from_disk", body, "message", timeout_s)

    # ---- LoRA adapters (SGLang's endpoints; docs/tenants.md) ------------------------------------
    # Per request: ``generate(..., lora_path=name)`` / ``generate_stream`` (a list for a batch),
    # ``score(..., lora_path=name)``, and chat ``model: "<base>:<name>"``; answers carry
    # ``meta_info.lora_name`` / ``lora_sha256`` (chat: ``metadata``; our engine only).
    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, pinned: bool = False) -> dict:
        """``POST /load_lora_adapter``; returns ``{success, error_message, loaded_adapters}``.

        Our engine answers 200 again for the same content under the same name; other content
        under a loaded name is refused (unload first). Raises :class:`EngineError` (status 400)
        when refused: a missing folder, an adapter that does not fit the served model, LoRA off.
        """
        return await self._success_call("/load_lora_adapter",
                                        {"lora_name": lora_name, "lora_path": str(lora_path), "pinned": pinned})

    async def unload_lora_adapter(self, lora_name: str) -> dict:
        """``POST /unload_lora_adapter``; raises :class:`EngineError` (400) for a name not loaded."""
        return await self._success_call("/unload_lora_adapter", {"lora_name": lora_name})

    async def _success_call(self, path: str, body: dict, message_key: str = "error_message",
                            timeout_s: float | None = None) -> dict:
        """POST an admin call answered ``{success, <message_key>, ...}`` (weights, LoRA); raises
        :class:`EngineError` with the server's message when ``success`` is false (HTTP 400 or 200)."""
        try:
            out = await self._request("POST", path, body, timeout_s=timeout_s)
        except EngineError as e:
            if isinstance(e.body, dict) and e.body.get("success") is False:
                raise EngineError(str(e.body.get(message_key)), e.status, e.body) from None
            raise
        if not out.get("success", False):
            raise EngineError(str(out.get(message_key)), 400, out)
        return out

    async def pause_generation(self, mode: str = "abort") -> dict:
        """``POST /pause_generation`` (``abort`` | ``retract`` | ``in_place``). New requests wait."""
        return await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict:
        """``POST /continue_generation``."""
        return await self._request("POST", "/continue_generation", {})

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """``POST /abort_request`` (prefix match on ``rid`` in SGLang's scheduler and here)."""
        await self._request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all}, expect_json=False)


def tokenize_body(messages: list[dict] | None, tools: list[dict] | None, prompt: str | None,
                  add_generation_prompt: bool, extra: dict) -> dict:
    """The body of a tokenize call (SGLang's ``/v1/tokenize``, vLLM's ``/tokenize``): chat
    ``messages`` (+ ``tools``) or a plain ``prompt``. Raises ValueError when neither is given."""
    body: dict[str, Any] = dict(extra)
    if messages is not None:
        body.update(messages=messages, add_generation_prompt=add_generation_prompt)
        if tools:
            body["tools"] = tools
    elif prompt is not None:
        body["prompt"] = prompt
    else:
        raise ValueError("give messages or prompt")
    return body


def ask_once(base_url: str, call: Callable[[EngineClient], Awaitable[T]], timeout_s: float = 5.0,
             api_key: str | None = None) -> T:
    """``await call(client)`` from synchronous code, on a client (and pool) of its own that is
    closed afterwards: the command line's one-shot probes (``pipeline up``, the demo).

    Raises:
        EngineError: the call failed (any of :mod:`pipeline.engine_api.errors`).
    """
    async def main() -> T:
        async with EngineClient(base_url, timeout_s, api_key) as client:
            return await call(client)

    return asyncio.run(main())
