"""The proxy stage: OpenAI-compatible front door that records every turn on ``turns``.

``python -m pipeline proxy`` serves ``POST /v1/chat/completions`` (non-stream and real
streaming), ``GET /v1/models``, ``/healthz``, ``/readyz``, ``/metrics`` and
``POST /v1/sessions/{id}/end``; see :mod:`pipeline.proxy.app` for the request path.

Session metadata (headers, or body fields ``session_id``/``turn_type``/``session_done`` that are
stripped before forwarding) and the defaults:

=============================  ===============================================================
client sends                   what happens
=============================  ===============================================================
``X-Session-Id`` only          a ``main`` turn (``proxy.default_turn_type``): turn index,
                               ``next_state`` and ``turn`` events — training data flows
``X-Turn-Type: side``          recorded as a side turn (no index, no next state)
``X-Session-Done: true``       served and recorded, then ``session_end`` (reason ``header``)
nothing                        ``proxy.anonymous``: ``record`` (default) — its own one-turn
                               session ``anon-<request id>``: ``turn`` (index 0) then
                               ``session_end`` (reason ``no_session``), so the judge can close
                               it; ``skip`` — served, not recorded; ``reject`` — 400. Always
                               counted in ``pipeline_proxy_requests_without_session_total``.
=============================  ===============================================================

Kafka never blocks serving (:mod:`pipeline.proxy.publisher`); a weight sync announced on
``control`` holds new requests up to ``proxy.sync_hold_timeout_s``
(:mod:`pipeline.proxy.control`); ``proxy.api_keys`` turns on Bearer authentication.
"""

from __future__ import annotations

__all__ = ["ProxyApp"]


def __getattr__(name: str):
    if name == "ProxyApp":
        from pipeline.proxy.app import ProxyApp

        return ProxyApp
    raise AttributeError(name)
