"""A tenant's request served by its LoRA adapter (docs/tenants.md "Adapter sync").

The adapter is the one of the tenant's last ``resume`` on ``control``
(:meth:`pipeline.proxy.control.SyncGate.adapter_of`; with ``rollout.enabled``, the incumbent or
the live candidate by the session's canary arm, :mod:`pipeline.proxy.canary`), read once per
request, after the hold (a request held by its tenant's sync goes to the adapter that sync
resumed with). The proxy:

- forwards the chat body with ``model: "<base>:<adapter name>"`` (SGLang's chat syntax and our
  engine's, split at the first ``:``; the ``/generate`` path of
  :meth:`pipeline.engine_api.client.EngineClient.chat_stream` turns it into ``lora_path``);
- answers the client with the model it asked for: the engine's echo of ``"<base>:<name>"`` is
  put back to ``<base>`` (:func:`shown`). A client cannot choose an adapter: a ``model`` naming
  one (:mod:`pipeline.proxy.names`) and SGLang's ``lora_path`` field
  (:func:`pipeline.proxy.validate.check_request`) are refused with 400. The CPU engine's answer
  metadata (``lora_name``, ``lora_sha256``) is passed on: a tenant sees the name of its own
  adapter, never another tenant's;
- records the adapter on the turn, unless the engine reports that another one served it
  (:func:`wrong_adapter`): that turn is recorded without token ids and log-probs (it trains
  nothing), without an adapter, counted and logged as an error.
"""

from __future__ import annotations

import contextvars

#: ``(engine's model bytes, client's model bytes)`` of the request being served (None: no adapter)
_SHOWN: contextvars.ContextVar[tuple[bytes, bytes] | None] = contextvars.ContextVar("proxy_shown_model",
                                                                                    default=None)


def route_to(req: dict, adapter: dict | None, model_of=None) -> None:
    """Point the chat body ``req`` at ``adapter`` (None: the base model, ``req`` unchanged) and
    remember, for this request's task, how to show the model back to the client. ``model_of(base,
    name)``: the engine's model naming the adapter (default ``"<base>:<name>"``; vLLM: the name,
    :func:`pipeline.engine_api.backend.adapter_model`)."""
    if adapter is None:
        _SHOWN.set(None)
        return
    base = req.get("model") if isinstance(req.get("model"), str) else "default"
    req["model"] = model_of(base, adapter["name"]) if model_of else f"{base}:{adapter['name']}"
    _SHOWN.set((f'"model":"{req["model"]}"'.encode(), f'"model":"{base}"'.encode()))


def shown(data: bytes) -> bytes:
    """``data`` (an engine answer or SSE payload, compact JSON) with the adapter's model name put
    back to the base model the client asked for; unchanged without an adapter."""
    pair = _SHOWN.get()
    return data if pair is None or pair[0] not in data else data.replace(*pair)


def wrong_adapter(rec, adapter: dict | None) -> str | None:
    """Why the engine's answer ``rec`` (:class:`pipeline.proxy.record.Recorded`) was not served
    by ``adapter`` (None: the base model), or None when it was or the engine does not say.

    The name must be the adapter's and, when the engine reports the content id of what served it
    (the CPU engine's ``lora_sha256``; SGLang reports neither), that id its ``version``: a name
    loaded with other content is not the adapter the turn is recorded with."""
    want = None if adapter is None else adapter["name"]
    if not rec.lora_reported:
        return None
    if rec.lora_name != want:
        return f"the engine reports adapter {rec.lora_name!r} served it, the proxy routed it to {want!r}"
    if adapter is not None and rec.lora_sha256 is not None and rec.lora_sha256 != adapter["version"]:
        return (f"the engine's adapter {want!r} holds content {rec.lora_sha256[:16]}..., not the version "
                f"{adapter['version'][:16]}... its name stands for")
    return None
