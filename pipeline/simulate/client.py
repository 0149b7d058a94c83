"""A minimal async OpenAI-chat client for simulated users and evaluation (httpx).

Sends ``POST {base_url}/v1/chat/completions`` with the pipeline's session headers
(``X-Session-Id``, ``X-Turn-Type``, ``X-Session-Done``) and reads back the reply text, the finish
reason, the token usage and the policy version that served it, wherever the server puts it:
``metadata.weight_version`` (SGLang's chat shape), ``choices[0].meta_info.weight_version``, or a
response header ``X-Weight-Version`` / ``X-Policy-Version``.

Retries only what cannot have reached the model: connection failures and 429/503 answers
(a proxy holding requests during a weight sync may answer 503 when its hold times out).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from pipeline.errors import PipelineError
from pipeline.retry import Transient, retrying

RETRY_STATUS = (429, 503)
VERSION_HEADERS = ("x-weight-version", "x-policy-version")


class ChatError(PipelineError, RuntimeError):
    """The server answered with an error (``status`` > 0) or could not be reached (``status`` 0)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ChatReply:
    """One chat completion as the user sees it.

    ``completion_tokens`` / ``prompt_tokens`` come from ``usage`` (None if absent);
    ``policy_version`` is the server's weight version as a string (None if not reported);
    ``latency_s`` is wall time of the successful attempt in seconds.
    """

    content: str
    finish_reason: str | None
    completion_tokens: int | None
    prompt_tokens: int | None
    policy_version: str | None
    latency_s: float
    headers: dict[str, str] = field(default_factory=dict)


def policy_version_of(body: dict, headers: httpx.Headers | dict | None = None) -> str | None:
    """The policy (weight) version reported by a chat response, as a string, or None."""
    meta = body.get("metadata")
    if isinstance(meta, dict) and meta.get("weight_version") is not None:
        return str(meta["weight_version"])
    choices = body.get("choices") or []
    if choices and isinstance(choices[0], dict):
        mi = choices[0].get("meta_info")
        if isinstance(mi, dict) and mi.get("weight_version") is not None:
            return str(mi["weight_version"])
    for key in ("policy_version", "weight_version"):
        if body.get(key) is not None:
            return str(body[key])
    if headers is not None:
        lower = {k.lower(): v for k, v in headers.items()}
        for h in VERSION_HEADERS:
            if lower.get(h):
                return str(lower[h])
    return None


def parse_reply(body: dict, headers: httpx.Headers | dict | None = None, latency_s: float = 0.0) -> ChatReply:
    """Turn an OpenAI chat-completion body into a :class:`ChatReply`. Raises :class:`ChatError`."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ChatError(f"response has no choices: {str(body)[:200]}")
    msg = choices[0].get("message") or {}
    usage = body.get("usage") or {}
    return ChatReply(
        content=msg.get("content") or "",
        finish_reason=choices[0].get("finish_reason"),
        completion_tokens=usage.get("completion_tokens"),
        prompt_tokens=usage.get("prompt_tokens"),
        policy_version=policy_version_of(body, headers),
        latency_s=latency_s,
        headers={k.lower(): v for k, v in (headers or {}).items()},
    )


class ChatClient:
    """Async chat-completions client bound to one base URL (a proxy or an engine).

    Args:
        base_url: e.g. ``http://127.0.0.1:8000`` (``/v1/chat/completions`` is appended).
        model: the ``model`` field of every request.
        api_key: sent as ``Authorization: Bearer``; None sends nothing.
        timeout_s: per-request timeout in seconds.
        retries: extra attempts on connection failure or HTTP 429/503 (exponential back-off from
            0.5 s with jitter, :mod:`pipeline.retry`).
        max_connections: connection-pool bound (concurrency is bounded by the caller too).
    """

    def __init__(self, base_url: str, model: str = "default", api_key: str | None = None,
                 timeout_s: float = 300.0, retries: int = 3, max_connections: int = 64) -> None:
        self.url = base_url.rstrip("/") + "/v1/chat/completions"
        self.model = model
        self.retries = retries
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0),
                                       limits=httpx.Limits(max_connections=max_connections))

    async def chat(self, messages: list[dict], *, max_tokens: int, temperature: float = 1.0,
                   session_id: str | None = None, turn_type: str | None = None, session_done: bool = False,
                   extra: dict[str, Any] | None = None) -> ChatReply:
        """One non-streaming chat completion. Raises :class:`ChatError` after the retries."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": temperature, "stream": False}
        if extra:
            body.update(extra)
        headers = {}
        if session_id is not None:
            headers["X-Session-Id"] = session_id
        if turn_type is not None:
            headers["X-Turn-Type"] = turn_type
        if session_done:
            headers["X-Session-Done"] = "true"
        payload = orjson.dumps(body)
        last: httpx.Response | None = None
        try:
            async for attempt in retrying(self.retries + 1, 0.5):
                with attempt:
                    t0 = time.monotonic()
                    try:
                        r = await self._http.post(self.url, content=payload, headers=headers)
                    except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # never reached the server
                        last = None
                        raise Transient(f"cannot reach {self.url}: {e}") from e
                    except httpx.HTTPError as e:  # read timeout, dropped connection: it may have been served
                        raise ChatError(f"request to {self.url} failed: {type(e).__name__}: {e}") from e
                    if r.status_code == 200:
                        try:
                            data = orjson.loads(r.content)
                        except orjson.JSONDecodeError as e:
                            raise ChatError(f"{self.url} returned invalid JSON: {e}", 200) from e
                        return parse_reply(data, r.headers, time.monotonic() - t0)
                    if r.status_code in RETRY_STATUS:
                        last = r
                        raise Transient(f"{self.url} answered {r.status_code}")
                    raise ChatError(f"{self.url} answered {r.status_code}: {r.text[:300]}", r.status_code)
        except Transient as e:
            if last is not None:
                raise ChatError(f"{self.url} answered {last.status_code}: {last.text[:300]}", last.status_code) from None
            raise ChatError(str(e)) from e.__cause__
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> "ChatClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
