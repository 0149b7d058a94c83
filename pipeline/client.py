"""One async client (httpx) for the policy engine: SGLang or this package's CPU engine.

Used by the proxy (chat, streaming with exact token ids), the judge (chat votes, teacher
``score``) and the weight syncer (``update_weights_from_disk``). The same calls work against
both servers; where SGLang behaves differently the method docstring says so.

Log-prob convention (both servers): a returned log-prob is ``log softmax(logits / T)`` of the
sampled (or scored) token, before top-p/top-k truncation, in nats. A scoring pass
(:meth:`EngineClient.score`) uses temperature 1.0 unless ``temperature`` is given.

Errors: every failure raises :class:`EngineError` (``status`` = HTTP code, None when the server
could not be reached); a timeout raises :class:`EngineTimeout`; a refused or dropped connection
raises :class:`EngineUnavailable`.

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
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator

import httpx
import orjson

from pipeline.chatbody import CHAT_FIELDS, fields_with
from pipeline.errors import PipelineError
from pipeline.sampling import CHAT_DEFAULTED, with_generation_defaults  # noqa: F401 (CHAT_DEFAULTED: re-exported)

log = logging.getLogger(__name__)


class EngineError(PipelineError):
    """The engine answered with an error (``status`` = HTTP status) or could not be used.

    Attributes:
        status: HTTP status code, or None for transport failures.
        message: the server's error message (SGLang's ``message`` / ``error.message``).
        body: the decoded error body when there was one.
    """

    def __init__(self, message: str, status: int | None = None, body: Any = None) -> None:
        super().__init__(f"{status}: {message}" if status is not None else message)
        self.status, self.message, self.body = status, message, body

    @property
    def retryable(self) -> bool:
        """True for transport failures, timeouts and 5xx/429 answers."""
        return self.status is None or self.status >= 500 or self.status == 429


class EngineTimeout(EngineError):
    """No (complete) answer within ``timeout_s``."""


class EngineUnavailable(EngineError):
    """Connection refused, reset or closed before an answer."""


@dataclass
class ScoreResult:
    """Log-probs of ``input_ids[start:]`` (nats) plus the policy version that computed them.

    ``top``: per scored position ``[(token_id, logprob), ...]`` (empty lists unless asked for).
    """

    logprobs: list[float]
    weight_version: str | None
    top: list[list[tuple[int, float]]] = field(default_factory=list)


def _error_message(body: Any, fallback: str) -> str:
    if isinstance(body, dict):
        if isinstance(body.get("message"), str):
            return body["message"]
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(body.get("detail"), str):
            return body["detail"]
    return fallback


def _finish_to_openai(finish: dict | None, has_tool_calls: bool = False) -> tuple[str | None, Any]:
    """SGLang ``/generate`` finish_reason object -> (chat finish_reason string, matched_stop)."""
    if not finish:
        return None, None
    kind = finish.get("type")
    if kind == "stop":
        return ("tool_calls" if has_tool_calls else "stop"), finish.get("matched")
    return kind, None


class EngineClient:
    """Async client of one engine base URL.

    Args:
        base_url: e.g. ``http://127.0.0.1:30000`` (no trailing ``/v1``).
        timeout_s: limit for one whole call (streams: between two chunks).
        api_key: sent as ``Authorization: Bearer`` (SGLang ``--api-key``).
        client: an existing ``httpx.AsyncClient`` to share (not closed by :meth:`aclose`).
    """

    def __init__(self, base_url: str, timeout_s: float = 300.0, api_key: str | None = None, *,
                 client: httpx.AsyncClient | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._own = client is None
        self._http = client or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self._headers = headers
        self._server_info: dict | None = None
        #: token id -> raw bytes, for log-prob ``bytes`` on the ``/generate`` chat path
        #: (:class:`pipeline.tokenbytes.TokenBytes`); None: a token's text's UTF-8, None for half a character
        self.token_bytes: Callable[[int], bytes] | None = None
        #: the served model's generation_config defaults (:data:`CHAT_DEFAULTED` keys) that SGLang's
        #: chat path applies to a request without them; the ``/generate`` chat path applies them too
        self.chat_defaults: dict[str, float] = {}

    async def aclose(self) -> None:
        if self._own:
            await self._http.aclose()

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # ---- plumbing ------------------------------------------------------------------------------
    async def _request(self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None,
                       expect_json: bool = True) -> Any:
        headers = dict(self._headers)
        content = None
        if body is not None:
            content = orjson.dumps(body)
            headers["Content-Type"] = "application/json"
        try:
            resp = await self._http.request(method, self.base_url + path, content=content, headers=headers,
                                            timeout=timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT)
        except httpx.TimeoutException as e:
            raise EngineTimeout(f"{method} {path} timed out: {e!r}") from e
        except httpx.TransportError as e:
            raise EngineUnavailable(f"{method} {path} failed: {e!r}") from e
        return self._decode(resp, method, path, expect_json)

    @staticmethod
    def _decode(resp: httpx.Response, method: str, path: str, expect_json: bool) -> Any:
        data: Any = None
        if resp.content:
            try:
                data = orjson.loads(resp.content)
            except orjson.JSONDecodeError:
                data = resp.text
        if resp.status_code >= 400:
            raise EngineError(_error_message(data, f"{method} {path} -> HTTP {resp.status_code}"),
                              resp.status_code, data)
        return data if expect_json else resp

    async def _sse(self, path: str, body: dict) -> AsyncIterator[dict]:
        """POST and yield each ``data:`` JSON object until ``[DONE]``.

        Raises EngineError for an HTTP error before the stream or an ``{"error": ...}`` event.
        """
        headers = dict(self._headers, **{"Content-Type": "application/json", "Accept": "text/event-stream"})
        try:
            async with self._http.stream("POST", self.base_url + path, content=orjson.dumps(body),
                                         headers=headers) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    self._decode(resp, "POST", path, True)
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        return
                    obj = orjson.loads(payload)
                    if isinstance(obj, dict) and "error" in obj and "choices" not in obj and "meta_info" not in obj:
                        err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
                        code = err.get("code")
                        raise EngineError(str(err.get("message")), code if isinstance(code, int) else 500, obj)
                    yield obj
        except httpx.TimeoutException as e:
            raise EngineTimeout(f"POST {path} stream timed out: {e!r}") from e
        except httpx.TransportError as e:
            raise EngineUnavailable(f"POST {path} stream failed: {e!r}") from e

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
        ``input_ids``, converting its chunks to chat chunks (:class:`GenerateChatStream`; tool
        calls parsed with :mod:`pipeline.engine.tools`). Every chat field is either carried over
        as SGLang's chat path would (:func:`chat_sampling_params`: sampling fields,
        ``response_format`` as a JSON schema, generation_config defaults from
        :attr:`chat_defaults`; ``input_ids``; a usage chunk for ``stream_options.include_usage``;
        ``parallel_tool_calls: false``) or refused
        with :class:`EngineError` 400 naming it (:func:`generate_path_refusal`) before anything
        is generated. Log-prob ``bytes`` are the tokens' raw bytes when :attr:`token_bytes` is
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
        body: dict[str, Any] = dict(extra)
        if messages is not None:
            body.update(messages=messages, add_generation_prompt=add_generation_prompt)
            if tools:
                body["tools"] = tools
        elif prompt is not None:
            body["prompt"] = prompt
        else:
            raise ValueError("give messages or prompt")
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
    # ---- end of LoRA adapters -------------------------------------------------------------------

    async def pause_generation(self, mode: str = "abort") -> dict:
        """``POST /pause_generation`` (``abort`` | ``retract`` | ``in_place``). New requests wait."""
        return await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict:
        """``POST /continue_generation``."""
        return await self._request("POST", "/continue_generation", {})

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """``POST /abort_request`` (prefix match on ``rid`` in SGLang's scheduler and here)."""
        await self._request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all}, expect_json=False)


class GenerateChatStream:
    """One streamed chat turn with token ids, served through ``POST /generate`` (SGLang).

    The adapter behind :meth:`EngineClient.chat_stream` against an engine whose chat path cannot
    stream token ids: the prompt is the body's ``input_ids`` or the rendering of
    ``POST /v1/tokenize``; the chat fields become ``sampling_params`` as SGLang's chat path maps
    them (:func:`chat_sampling_params`); each ``/generate`` chunk (cumulative, or deltas with the
    server's ``incremental_streaming_output``) becomes ``chat.completion.chunk`` dicts. In order:
    a first chunk with the role, ``prompt_token_ids`` and ``metadata`` (``weight_version`` and the
    ``sampling_params`` the engine samples with, ``temperature`` 1.0 when the body names none: the
    distribution the log-probs are of); a chunk per event with new tokens (``token_ids``,
    ``logprobs.content``, content and tool-call deltas); a finish chunk (``finish_reason``,
    ``matched_stop``, ``metadata``); a usage chunk for ``stream_options.include_usage``. A stream
    closed before the engine ended it aborts the generation (``/abort_request`` by its ``rid``).

    Args:
        client: the client whose transport, :attr:`EngineClient.token_bytes` and
            :attr:`EngineClient.chat_defaults` are used.
        body: the chat request.
        info: the engine's ``/server_info``.
    """

    def __init__(self, client: EngineClient, body: dict, info: dict) -> None:
        self.client, self.body, self.info = client, body, info
        self.tools = chat_tools(body)
        self.want_lp = bool(body.get("logprobs"))
        self.incremental = bool(info.get("incremental_streaming_output"))
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.one_call = body.get("parallel_tool_calls") is False
        self.model = body.get("model", "default")
        self.prompt: list[int] = []
        self.origin: dict[str, str] = {}  # sampling key -> the chat field it came from
        self.used: dict[str, Any] = {}  # the sampling parameters the engine samples with
        self.gen_rid = ""  # the /generate request's rid (aborts it)
        self.rid: str | None = None  # the engine's id of the generation (meta_info.id): the chunks' id
        self.created = 0
        self.parser: Any = None  # pipeline.engine.tools.ToolStreamParser when tools are offered
        self.ids: list[int] = []
        self.lps: list = []
        self.tops: list = []
        self.text = ""
        self.n_ids = self.n_text = self.n_calls = 0  # token ids, characters and tool calls sent so far
        self.first = True
        self.ended = False  # the engine ended the generation (finished or failed): nothing to abort

    async def run(self) -> AsyncIterator[dict]:
        """The chat chunks, in order (see the class). Raises :class:`EngineError`: 400 for a chat
        field this path cannot serve (nothing generated), or the engine's error (a 400 refusing
        a sampling parameter names the chat field it was sent for)."""
        gen_body = await self._payload()
        self.created = int(time.time())
        if self.tools:
            from pipeline.engine.tools import ToolStreamParser
            self.parser = ToolStreamParser(self.tools)
        try:
            async for ev in self.client._sse("/generate", gen_body):
                for out in self._on_event(ev):
                    yield out
        except EngineError as e:
            self.ended = True  # the engine ended it
            named = self._refused_fields(e)
            if named:
                raise EngineError(f"{e.message} [chat field {named}]", e.status, e.body) from None
            raise
        finally:
            if not self.ended:  # closed early (the caller's client left): stop the generation now
                await self._abort()

    async def _payload(self) -> dict:
        """The ``/generate`` body: the prompt ids, the chat body's sampling parameters
        (``max_new_tokens`` defaulting to what the context length leaves), a ``rid`` and, when
        ``logprobs`` is on, the log-prob flags. Sets :attr:`prompt`, :attr:`origin`, :attr:`used`
        and :attr:`gen_rid`. Raises EngineError 400 before any request for a field it cannot serve."""
        refused = generate_path_refusal(self.body)
        if refused is not None:
            raise EngineError(refused[1], 400, {"param": refused[0]})
        self.prompt, max_len = await self._prompt()
        sp, self.origin = chat_sampling_params(self.body, self.client.chat_defaults)
        if sp.get("max_new_tokens") is None and max_len:
            sp["max_new_tokens"] = int(max_len) - len(self.prompt)
        # an id of our own when the caller gave none: a stream closed early is aborted by it
        self.gen_rid = self.body.get("rid") or f"chat-{uuid.uuid4().hex}"
        gen_body: dict[str, Any] = {"input_ids": self.prompt, "sampling_params": sp, "stream": True,
                                    "rid": self.gen_rid}
        # what the engine samples with (its /generate default temperature is 1.0), reported as our
        # engine reports it (metadata.sampling_params) so a recorder knows the distribution
        self.used = {k: v for k, v in sp.items() if k != "max_new_tokens"}
        self.used.setdefault("temperature", 1.0)
        if self.want_lp:
            gen_body.update(return_logprob=True, top_logprobs_num=int(self.body.get("top_logprobs") or 0),
                            return_text_in_logprobs=True)
        return gen_body

    async def _prompt(self) -> tuple[list[int], Any]:
        """``(prompt ids, context length or None)``: the body's ``input_ids`` as they are (SGLang's
        chat path applies no template then), else the rendering of ``POST /v1/tokenize``
        (messages, tools, template options)."""
        body, info = self.body, self.info
        if body.get("input_ids") is not None:
            return list(body["input_ids"]), info.get("context_length")
        tok_body: dict[str, Any] = {"messages": body["messages"], "add_generation_prompt": True}
        for key in ("chat_template_kwargs", "continue_final_message", "model"):
            if body.get(key) is not None:
                tok_body[key] = body[key]
        if self.tools:
            tok_body["tools"] = self.tools
        tok = await self.client._request("POST", "/v1/tokenize", tok_body)
        return list(tok["tokens"]), tok.get("max_model_len") or info.get("context_length")

    def _on_event(self, ev: dict) -> Iterator[dict]:
        """The chat chunks of one ``/generate`` chunk, yielded one by one: the first chunk (on the
        first event, before its tokens), the new tokens' chunk, then on the last event the finish
        and usage chunks."""
        mi = ev.get("meta_info") or {}
        self.rid = self.rid or mi.get("id")
        if self.first:
            self.first = False
            yield self._chunk({"role": "assistant", "content": ""}, prompt_token_ids=self.prompt,
                              metadata=self._metadata(mi))
        self._absorb(ev, mi)
        finish = mi.get("finish_reason")
        delta_text, calls = self._text_delta(finish)
        extra = self._token_fields()
        delta: dict[str, Any] = {}
        if delta_text:
            delta["content"] = delta_text
        if calls:
            delta["tool_calls"] = [c.to_openai(self.n_calls + k) for k, c in enumerate(calls)]
            self.n_calls += len(calls)
        if delta or extra:
            yield self._chunk(delta, **extra)
        if finish:
            yield from self._final(mi, finish)

    def _absorb(self, ev: dict, mi: dict) -> None:
        """Take one event's ids, text and log-probs (appended when the server streams deltas, else
        replacing: SGLang's default is cumulative)."""
        if self.incremental:
            self.ids += ev.get("output_ids") or []
            self.text += ev.get("text") or ""
            self.lps += mi.get("output_token_logprobs") or []
            self.tops += mi.get("output_top_logprobs") or []
        else:
            self.ids = list(ev.get("output_ids") or [])
            self.text = ev.get("text") or ""
            self.lps = list(mi.get("output_token_logprobs") or [])
            self.tops = list(mi.get("output_top_logprobs") or [])

    def _text_delta(self, finish: dict | None) -> tuple[str, list]:
        """``(content delta, new tool calls)`` of the text not sent yet: with tools, what the tool
        parser lets through (flushed on ``finish``; one call at most for ``parallel_tool_calls:
        false``)."""
        delta_text = self.text[self.n_text:] if len(self.text) > self.n_text else ""
        self.n_text = max(self.n_text, len(self.text))
        calls: list = []
        if self.parser is not None:
            delta_text, calls = self.parser.feed(delta_text)
            if finish:
                rest, more = self.parser.finish()
                delta_text += rest
                calls += more
            if self.one_call:
                calls = calls[:max(0, 1 - self.n_calls)]
        return delta_text, calls

    def _token_fields(self) -> dict[str, Any]:
        """The new tokens' ``token_ids`` and (``logprobs`` on) ``logprobs.content`` entries, with
        raw ``bytes`` when the client has a byte table; ``{}`` when there are none."""
        extra: dict[str, Any] = {}
        n, new_ids = self.n_ids, self.ids[self.n_ids:]
        if new_ids:
            extra["token_ids"] = new_ids
            if self.want_lp:
                tops, token_bytes = self.tops, self.client.token_bytes
                extra["logprobs"] = {"content": [
                    _chat_lp(e, tops[n + k] if n + k < len(tops) else None, token_bytes)
                    for k, e in enumerate(self.lps[n:len(self.ids)])]}
        self.n_ids = len(self.ids)
        return extra

    def _final(self, mi: dict, finish: dict) -> Iterator[dict]:
        """The finish chunk (chat ``finish_reason``, ``matched_stop``, ``metadata``), then the usage
        chunk for ``stream_options.include_usage``; marks the generation ended."""
        reason, matched = _finish_to_openai(finish, self.n_calls > 0)
        self.ended = True
        yield self._chunk({}, finish_reason=reason, matched_stop=matched, metadata=self._metadata(mi))
        if self.include_usage:
            n_in, n_out = len(self.prompt), len(self.ids)
            yield {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                   "choices": [], "usage": {"prompt_tokens": n_in, "completion_tokens": n_out,
                                            "total_tokens": n_in + n_out, "reasoning_tokens": 0}}

    def _metadata(self, mi: dict) -> dict:
        """The ``metadata`` of the first and finish chunks: policy version and sampling parameters."""
        return {"weight_version": mi.get("weight_version"), "sampling_params": self.used}

    def _chunk(self, delta: dict, **extra: Any) -> dict:
        """A ``chat.completion.chunk`` with one choice: ``logprobs``, ``finish_reason``,
        ``matched_stop`` and ``token_ids`` of ``extra`` go into the choice, the rest on top."""
        choice = {"index": 0, "delta": delta, "logprobs": extra.pop("logprobs", None),
                  "finish_reason": extra.pop("finish_reason", None)}
        for k in ("matched_stop", "token_ids"):
            if k in extra:
                choice[k] = extra.pop(k)
        out = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "choices": [choice]}
        out.update(extra)
        return out

    def _refused_fields(self, e: EngineError) -> str:
        """For the engine's 400 before any chunk: the chat fields whose ``sampling_params`` key its
        message names (``"field (sent as sampling_params.key)"``, comma-separated), else ``""``."""
        if e.status != 400 or not self.first:
            return ""
        return ", ".join(f"{field} (sent as sampling_params.{key})" for key, field in self.origin.items()
                         if key in e.message and key != field)

    async def _abort(self) -> None:
        """``/abort_request`` for the generation (SGLang would only abort ~2 s after a disconnect);
        a failure is logged, not raised: the caller is already leaving."""
        try:
            await asyncio.wait_for(self.client.abort_request(self.gen_rid), timeout=min(5.0, self.client.timeout_s))
        except (EngineError, asyncio.TimeoutError) as e:
            log.warning("could not abort generation %s: %s", self.gen_rid, e)


def _lp_bytes(token_id: int, text: str, token_bytes: Callable[[int], bytes] | None) -> list[int] | None:
    """OpenAI ``bytes`` of one token: its raw bytes when a byte table is given; else the UTF-8 of
    its text unless that text holds a replacement character (half a character: unknown, None)."""
    if token_bytes is not None:
        try:
            return list(token_bytes(token_id))
        except KeyError:
            return None
    return None if "\ufffd" in text else list(text.encode("utf-8"))


def _chat_lp(entry: list, top: list | None, token_bytes: Callable[[int], bytes] | None = None) -> dict:
    """A ``/generate`` log-prob entry ``[lp, id, text]`` -> chat ``logprobs.content`` item."""
    s = entry[2] if len(entry) > 2 and entry[2] is not None else ""
    return {"token": s, "bytes": _lp_bytes(entry[1], s, token_bytes), "logprob": entry[0], "token_id": entry[1],
            "top_logprobs": [{"token": t[2] or "", "bytes": _lp_bytes(t[1], t[2] or "", token_bytes),
                              "logprob": t[0]} for t in (top or [])]}


# ---- chat fields on the /v1/tokenize + /generate path ------------------------------------------
#: chat field -> ``sampling_params`` key, as SGLang's chat path maps them (``to_sampling_params``);
#: derived from :data:`pipeline.chatbody.CHAT_FIELDS` (table order: the first field for a key wins)
SAMPLING_FIELDS = {k: f.sampling_key for k, f in CHAT_FIELDS.items() if f.role == "sampling"}
#: chat fields that shape the prompt (sent to ``/v1/tokenize``) or the answer (handled here)
PROMPT_FIELDS = fields_with("prompt")
ANSWER_FIELDS = fields_with("answer")


def chat_tools(body: dict) -> list | None:
    """The tools a chat request makes available (None when ``tool_choice`` is ``none``)."""
    choice = body.get("tool_choice")
    if not body.get("tools") or choice == "none":
        return None
    return body["tools"]


def generate_path_refusal(body: dict) -> tuple[str, str] | None:
    """``(field, message)`` for the first chat field that the ``/v1/tokenize`` + ``/generate``
    path cannot serve as SGLang's chat path would, or None when it can serve every field.

    Refused: fields it does not know (it cannot tell what they would do), ``tool_choice``
    ``required`` / a named function (SGLang constrains decoding to the tool-call schema there),
    ``response_format`` types other than text / json_object / json_schema, ``n`` other than 1,
    ``stream_options.continuous_usage_stats``, and ``return_prompt_token_ids`` /
    ``return_meta_info`` (SGLang refuses them with ``stream``).
    """
    known = set(SAMPLING_FIELDS) | set(PROMPT_FIELDS) | set(ANSWER_FIELDS)
    for key in body:
        if key in known or body[key] is None:
            continue
        if key in fields_with("answer_no_stream"):
            if body[key]:
                return key, f"{key} is not supported with stream=true"
            continue
        return key, f"the chat field {key!r} cannot be served on the streamed path with token ids (this engine " \
                    "has no chat streaming with token ids, so the proxy streams /generate): send it without " \
                    "stream, or without it"
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto") and body.get("tools"):
        shown = choice if isinstance(choice, str) else "a named function"
        return "tool_choice", f"tool_choice {shown} needs the engine's constrained tool-call decoding, which the " \
                              "streamed path with token ids cannot apply: send it without stream"
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text", "json_object", "json_schema"):
        return "response_format", f"response_format {rf.get('type')!r} cannot be served on the streamed path " \
                                  "with token ids: send it without stream"
    if isinstance(rf, dict) and rf.get("type") == "json_schema" and not isinstance(
            (rf.get("json_schema") or {}).get("schema", rf.get("schema")), dict):
        return "response_format", "response_format json_schema needs json_schema.schema (an object)"
    if int(body.get("n") or 1) != 1:
        return "n", "n must be 1 on the streamed path with token ids"
    if (body.get("stream_options") or {}).get("continuous_usage_stats"):
        return "stream_options", "stream_options.continuous_usage_stats is not supported on the streamed path " \
                                 "with token ids"
    return None


def response_format_schema(rf: Any) -> str | None:
    """The JSON schema (a JSON string) a chat ``response_format`` constrains to, as SGLang's chat
    path maps it: json_object -> ``{"type": "object"}``, json_schema -> ``json_schema.schema``
    (or ``schema``); None for text or another type."""
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind == "json_schema":
        return orjson.dumps((rf.get("json_schema") or {}).get("schema", rf.get("schema"))).decode()
    return None


def chat_sampling_params(body: dict, defaults: dict | None = None) -> tuple[dict, dict]:
    """``/generate`` ``sampling_params`` for a chat body, as SGLang's chat path builds them.

    ``response_format`` json_object becomes the schema ``{"type": "object"}`` and json_schema its
    schema (a JSON string); ``max_completion_tokens`` wins over ``max_tokens``; ``defaults``
    (the model's generation_config values for :data:`CHAT_DEFAULTED`) fill absent keys.
    Returns ``(sampling_params, {sampling key: chat field it came from})``.
    """
    sp: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for field_name, key in SAMPLING_FIELDS.items():
        v = body.get(field_name)
        if v is None or key in sp:
            continue
        if field_name == "response_format":
            v = response_format_schema(v)
            if v is None:
                continue
        elif field_name == "min_tokens" and not v:
            continue
        sp[key] = v
        origin[key] = field_name
    return with_generation_defaults(sp, defaults), origin
