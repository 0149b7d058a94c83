"""What a backend's adapter needs from the engine client: the HTTP calls and the client's
per-engine facts, as a :class:`typing.Protocol`.

:class:`pipeline.engine_api.client.EngineClient` satisfies it; a backend module (e.g.
:mod:`pipeline.engine_api.sglang`) types its client with :class:`EngineCalls` instead of importing
the client, so the client imports the backends and no backend imports the client (no circle).
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Protocol


class EngineCalls(Protocol):
    """The part of :class:`pipeline.engine_api.client.EngineClient` a backend adapter uses."""

    timeout_s: float
    token_bytes: Callable[[int], bytes] | None
    chat_defaults: dict[str, float]

    async def _request(self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None,
                       expect_json: bool = True) -> Any: ...

    def _sse(self, path: str, body: dict) -> AsyncIterator[dict]: ...

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None: ...
