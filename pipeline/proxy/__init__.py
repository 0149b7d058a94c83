"""The proxy stage: OpenAI-compatible front door that records every turn on ``turns``.

``python -m pipeline proxy`` serves ``POST /v1/chat/completions`` (non-stream and real
streaming), ``GET /v1/models``, ``/healthz``, ``/readyz``, ``/metrics`` and
``POST /v1/sessions/{id}/end``; see :mod:`pipeline.proxy.app` for the request path. ``POST
/v1/responses`` (:mod:`pipeline.proxy.responses`) and ``POST /v1/messages``
(:mod:`pipeline.proxy.messages`) are translated into the same chat path (:mod:`pipeline.proxy.doors`).

Session metadata (headers, or body fields ``session_id``/``turn_type``/``session_done`` that are
stripped before forwarding) and the defaults:

=============================  ===============================================================
client sends                   what happens
=============================  ===============================================================
``X-Session-Id`` only          a ``main`` turn (``proxy.default_turn_type``): turn index,
                               ``next_state`` and ``turn`` events — training data flows
``X-Turn-Type: side``          recorded as a side turn (no index, no next state)
``X-Session-Done: true``       served and recorded, then ``session_end`` (reason ``header``)
no session id                  derived (``docs/sessions.md``, :mod:`pipeline.proxy.identity`):
                               an agent marker (OpenClaw's ``sessionId=`` footer ->
                               ``openclaw:<id>``), the ``user`` field (``user:<value>``), the
                               session of the recorded turn the messages continue, else a new
                               ``conv-<hash>``; the turn's ``session_source`` says which. With
                               none of header/body/marker/user, ``proxy.anonymous``: ``record``
                               (default, as above), ``skip`` (served, not recorded) or
                               ``reject`` (400); counted in
                               ``pipeline_proxy_requests_without_session_total``
an agent's own housekeeping    OpenClaw's compaction, title, memory-flush or heartbeat prompt
                               (:mod:`pipeline.proxy.housekeeping`): a side turn marked
                               ``housekeeping``, whatever ``X-Turn-Type`` says; without a
                               claimed id its session is ``housekeeping:<agent>``
an unfilled id (``${VAR}``)    ignored with an ``x-session-warning`` header; the next rule decides
``X-Tenant-Id: <tenant>``      the request's tenant when ``proxy.tenants`` (API key -> tenant)
                               is empty; with a key map the key decides and a header that
                               disagrees is 403; sessions are ``(tenant, session id)``
                               (``docs/tenants.md``)
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
