"""Which model a request names: the served model, an alias of it, or an error.

A request's ``model`` must name what the engine serves (its ``/v1/models`` ids) or an alias from
``proxy.model_aliases`` (alias -> served id, e.g. ``{"gpt-4o-mini": "smollm2-135m"}`` for a client
whose model name cannot be changed; ``default`` always stands for the served model, as on
SGLang). Any other name is served by the served model (``proxy.unknown_model: serve``, the
default: agents whose model name cannot be set still work) or answered 404 ``model_not_found``
in the front door's own error shape (``reject``). Either way the answer's ``model`` and the
turn's ``model`` are the served id: training data never carries a name the engine did not serve
(``gpt-9`` served by SmolLM2 and echoed back as ``gpt-9`` was). A request without ``model``
gets the served one.

A client never picks a LoRA adapter: a tenant's adapter is chosen by the proxy from the
tenant's last ``resume`` on ``control`` (docs/tenants.md). A ``model`` that names one, SGLang's
``<base>:<adapter>`` (any name with a ``:`` that is not an alias), an adapter the engine lists
(a card with a ``parent``) or a name of the form the trainer gives adapters
(:func:`pipeline.events.is_adapter_name`), is refused with 400 ``model_not_allowed`` in the
front door's shape, whichever tenant's adapter it names.

The served ids are read from the engine once (and again, at most every
:data:`REFRESH_S` seconds, when a name is not among them: an engine restarted with another
model); an engine that cannot answer ``/v1/models`` is not a reason to refuse a request, so its
names are then taken on trust (the engine itself decides).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import orjson

from pipeline.proxy.errors import ProxyError
from pipeline.events import is_adapter_name

REFRESH_S = 5.0


def model_not_found(name: object, served: list[str], aliases: dict[str, str]) -> ProxyError:
    """The 404 for a model name that is neither served nor an alias."""
    offer = ", ".join(repr(s) for s in served) or "nothing yet"
    hint = f"; aliases: {', '.join(sorted(aliases))}" if aliases else "; map other names with proxy.model_aliases"
    return ProxyError(404, f"The model {str(name)[:80]!r} does not exist here: this proxy serves {offer}{hint}",
                      param="model", code="model_not_found")


def adapter_refused(name: str) -> ProxyError:
    """The 400 for a ``model`` that names a LoRA adapter (the proxy chooses a tenant's adapter)."""
    return ProxyError(400, f"The model {name[:80]!r} names a LoRA adapter: adapters are chosen by this proxy for "
                           "each tenant, never by the request; send the base model's name",
                      param="model", code="model_not_allowed")


class ServedModels:
    """Resolves request model names against the engine's served ids and the configured aliases.

    Args:
        fetch: ``async () -> (status, body)`` of the engine's ``GET /v1/models``.
        aliases: alias -> served id (``proxy.model_aliases``).
        unknown: ``serve`` (any name, answered and recorded as the served id) or ``reject`` (404
            ``model_not_found``).
    """

    def __init__(self, fetch: Callable[[], Awaitable[tuple[int, bytes]]], aliases: dict[str, str] | None = None,
                 unknown: str = "serve") -> None:
        self._fetch = fetch
        self.aliases = dict(aliases or {})
        self.default = "default"  # SGLang's name for the served model
        self.unknown = unknown
        self.served: list[str] = []
        self.adapters: set[str] = set()  # the adapter names the engine listed at the last read
        self._read_at: float | None = None
        self._reading: asyncio.Future | None = None  # the read in flight: concurrent requests share it

    async def _refresh(self) -> None:
        """Read ``/v1/models`` once for every request that asks meanwhile (a request that came
        while the first read was in flight used to go on with no served ids: vLLM refuses the
        ``default`` it was then sent with)."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read())
        reading = self._reading
        try:
            await asyncio.shield(reading)
        finally:
            if self._reading is reading and reading.done():
                self._reading = None

    async def _read(self) -> None:
        self._read_at = time.monotonic()
        try:
            status, data = await self._fetch()
            body = orjson.loads(data) if status < 400 else None
        except Exception:  # noqa: BLE001 - an unreachable engine is reported by the request itself
            return
        ids = [m.get("id") for m in base_cards(body)]
        if ids and all(isinstance(i, str) for i in ids):
            self.served = ids
            cards = body.get("data") if isinstance(body, dict) else None
            self.adapters = {m["id"] for m in cards or () if isinstance(m, dict) and m.get("parent") is not None
                             and isinstance(m.get("id"), str)}

    async def resolve(self, name: object) -> str | None:
        """The served id a request's ``model`` stands for (None: the engine gave no ids, take the
        request as it is).

        Raises:
            ProxyError: 404 ``model_not_found`` (``unknown: reject``), 400 for a non-string name and
                400 ``model_not_allowed`` for a name of a LoRA adapter (see the module docstring).
        """
        if name is not None and not isinstance(name, str):
            raise ProxyError(400, f"'model' must be a string, got {type(name).__name__}", param="model",
                             code="invalid_type")
        known = name in (None, self.default) or name in self.served or name in self.aliases
        if self._reading is not None:
            await asyncio.shield(self._reading)
        if self._read_at is None or (not (self.served and known) and time.monotonic() - self._read_at >= REFRESH_S):
            await self._refresh()
        if isinstance(name, str) and name not in self.aliases and name not in self.served and (
                ":" in name or name in self.adapters or is_adapter_name(name)):
            raise adapter_refused(name)
        if not self.served:
            return None
        if name is None or name == self.default or name in self.served:
            return self.served[0] if name in (None, self.default) else name
        if name in self.aliases:
            return self.aliases[name]
        if self.unknown == "serve":
            return self.served[0]
        raise model_not_found(name, self.served, self.aliases)


def base_cards(body: object) -> list[dict]:
    """The model cards of an engine's ``/v1/models`` answer that are base models: LoRA adapter
    cards (SGLang and our engine list them with a ``parent``) are left out, so that no tenant
    sees, or names, another tenant's adapter through the proxy."""
    data = body.get("data") if isinstance(body, dict) else None
    return [m for m in data or () if isinstance(m, dict) and m.get("parent") is None]
