"""Issue 28 (tenants) at the proxy's front door: tests that try to cross tenants.

The real proxy app over HTTP with the official ``openai`` and ``anthropic`` clients, in front of
``StandInEngine`` (a stand-in LLM: tenancy does not depend on the model), turns read back from
the broker. Rules restated from docs/tenants.md: a key mapped in ``proxy.tenants`` (by its
sha256) decides the tenant; an unknown key is 401 and a header tenant that disagrees with the
key is 403, each in its API's own error shape; without a key map ``X-Tenant-Id`` decides; a
session is ``(tenant, session id)``.
"""

from __future__ import annotations

import hashlib
import itertools

import anthropic
import httpx
import openai
import pytest

from pipeline.proxy.errors import ProxyError
from pipeline.proxy.identity import Tenants
from pipeline.testing.proxy import stack
from pipeline.testing.servers import Reply
from pipeline.testing.topics import read_records

KEY_A, KEY_B = "key-of-alice", "key-of-bob"
TENANTS = {hashlib.sha256(KEY_A.encode()).hexdigest(): "alice", hashlib.sha256(KEY_B.encode()).hexdigest(): "bob"}


def _numbered():
    n = itertools.count(1)
    return lambda req: Reply(content=f"answer {next(n)}")


def _turn_records(config, app, n):
    assert app.publisher.wait_idle(10)
    recs = read_records(config, config.topics.name("turns"), n, timeout_s=15)
    assert len(recs) == n, [(r.event.TYPE, r.event.session_id) for r in recs]
    return recs


# ---- the rules, without HTTP -------------------------------------------------------------------
def _h(key=None, tenant=None):
    h = {}
    if key is not None:
        h[b"authorization"] = b"Bearer " + key.encode()
    if tenant is not None:
        h[b"x-tenant-id"] = tenant.encode()
    return h


def _status(t: Tenants, headers) -> int | str | None:
    try:
        return t.resolve(headers)
    except ProxyError as e:
        return e.status


def test_resolve_rules():
    mapped = Tenants(TENANTS, {b"operator"})
    assert _status(mapped, _h(KEY_A)) == "alice" and _status(mapped, _h(KEY_B, "bob")) == "bob"
    assert _status(mapped, _h(KEY_A, "bob")) == 403  # the header never overrides the key
    assert _status(mapped, _h("unknown")) == 401 and _status(mapped, _h()) == 401
    assert _status(mapped, _h(None, "alice")) == 401  # a header alone is no credential with a key map
    assert _status(mapped, _h("operator")) is None  # an api_keys key: accepted, no tenant
    assert _status(mapped, _h("operator", "alice")) == 403
    header = Tenants({}, set())
    assert _status(header, _h(None, "alice")) == "alice" and _status(header, _h()) is None
    for bad in ("", " ", "a b", "${TENANT}", "undefined", "x" * 257, "é"):
        assert _status(header, {b"x-tenant-id": bad.encode()}) == 400, bad
    keyed = Tenants({}, {b"k"})
    assert _status(keyed, _h("k", "alice")) == "alice" and _status(keyed, _h("other", "alice")) == 401


def test_config_refuses_keys_in_clear_and_bad_tenants():
    from pipeline.config import Config, ConfigError

    with pytest.raises((ConfigError, ValueError)):
        Config().replace(proxy={"tenants": {KEY_A: "alice"}})
    with pytest.raises((ConfigError, ValueError)):
        Config().replace(proxy={"tenants": {next(iter(TENANTS)): "has space"}})
    assert Config().replace(proxy={"tenants": TENANTS}).proxy.tenants == TENANTS


# ---- over HTTP with the real clients -------------------------------------------------------------
def test_same_session_id_from_two_tenants_is_two_sessions(kafka_config):
    """Alice and Bob both send ``X-Session-Id: shared``, interleaved, two turns each: two
    sessions (indices 0, 1 each, each next state in its own tenant), keyed ``tenant/session``."""
    with stack(kafka_config, _numbered(), tenants=TENANTS) as (url, app, up):
        clients = {t: openai.OpenAI(base_url=url + "/v1", api_key=k, max_retries=0,
                                    default_headers={"X-Session-Id": "shared"})
                   for t, k in (("alice", KEY_A), ("bob", KEY_B))}
        convs = {t: [] for t in clients}
        for k in range(2):
            for t, client in clients.items():
                convs[t].append({"role": "user", "content": f"question {k}"})  # same text: only the tenant differs
                out = client.chat.completions.create(model="m", messages=convs[t])
                convs[t].append({"role": "assistant", "content": out.choices[0].message.content})
        recs = _turn_records(kafka_config, app, 6)
    turns = [r for r in recs if r.event.TYPE == "turn"]
    states = [r for r in recs if r.event.TYPE == "next_state"]
    for t in ("alice", "bob"):
        mine = [r for r in turns if r.event.tenant == t]
        assert [r.event.turn_index for r in mine] == [0, 1] and {r.event.session_id for r in mine} == {"shared"}
        assert {r.key for r in mine} == {f"{t}/shared"}
        (ns,) = [r for r in states if r.event.tenant == t]
        assert ns.key == f"{t}/shared" and ns.event.after_request_id == mine[0].event.request_id
    assert not any(r.event.tenant is None for r in recs)


def test_continuation_never_crosses_tenants(kafka_config):
    """No session header: Bob sends exactly the conversation Alice's turn ended with (her
    messages + her answer): he gets a new session of his own, not a continuation of hers."""
    with stack(kafka_config, _numbered()) as (url, app, up):
        alice = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                              default_headers={"X-Tenant-Id": "alice"})
        bob = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                            default_headers={"X-Tenant-Id": "bob"})
        msgs = [{"role": "user", "content": "hi"}]
        msgs.append({"role": "assistant", "content": alice.chat.completions.create(
            model="m", messages=msgs).choices[0].message.content})
        msgs.append({"role": "user", "content": "and then?"})
        bob.chat.completions.create(model="m", messages=msgs)
        alice.chat.completions.create(model="m", messages=msgs)  # her own continuation still works
        recs = _turn_records(kafka_config, app, 4)
    turns = [r.event for r in recs if r.event.TYPE == "turn"]  # partitions differ: order by tenant and index
    (b,) = [t for t in turns if t.tenant == "bob"]
    a0, a1 = sorted((t for t in turns if t.tenant == "alice"), key=lambda t: t.turn_index)
    assert b.session_source == "new" and b.session_id != a0.session_id
    assert a1.session_source == "continuation" and a1.session_id == a0.session_id
    (ns,) = [r.event for r in recs if r.event.TYPE == "next_state"]
    assert ns.tenant == "alice" and ns.session_id == a0.session_id


def test_responses_previous_id_of_another_tenant_is_not_found(kafka_config):
    with stack(kafka_config, _numbered(), tenants=TENANTS) as (url, app, up):
        alice = openai.OpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0)
        bob = openai.OpenAI(base_url=url + "/v1", api_key=KEY_B, max_retries=0)
        first = alice.responses.create(model="m", input="a secret of alice")
        with pytest.raises(openai.BadRequestError) as err:
            bob.responses.create(model="m", input="what did she say?", previous_response_id=first.id)
        assert err.value.body["code"] == "previous_response_not_found"
        alice.responses.create(model="m", input="go on", previous_response_id=first.id)  # hers: found


def test_unknown_key_401_and_foreign_tenant_header_403_in_each_doors_shape(kafka_config):
    with stack(kafka_config, _numbered(), tenants=TENANTS) as (url, app, up):
        msgs = [{"role": "user", "content": "hi"}]
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="not-a-key", max_retries=0)
        spoof = openai.OpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0,
                              default_headers={"X-Tenant-Id": "bob"})
        for call in (lambda c: c.chat.completions.create(model="m", messages=msgs),
                     lambda c: c.responses.create(model="m", input="hi")):
            with pytest.raises(openai.AuthenticationError) as e401:
                call(wrong)
            assert e401.value.body["type"] == "authentication_error" and e401.value.body["code"] == "invalid_api_key"
            with pytest.raises(openai.PermissionDeniedError) as e403:
                call(spoof)
            assert e403.value.body["code"] == "tenant_mismatch"
        a_wrong = anthropic.Anthropic(base_url=url, api_key="not-a-key", max_retries=0)
        a_spoof = anthropic.Anthropic(base_url=url, api_key=KEY_A, max_retries=0,
                                      default_headers={"X-Tenant-Id": "bob"})
        for client, exc, kind in ((a_wrong, anthropic.AuthenticationError, "authentication_error"),
                                  (a_spoof, anthropic.PermissionDeniedError, "permission_error")):
            with pytest.raises(exc) as e:
                client.messages.create(model="m", max_tokens=8, messages=msgs)
            assert e.value.body == {"type": "error", "error": {"type": kind, "message": e.value.body["error"]["message"]}}
        r = httpx.post(url + "/v1/sessions/s/end", headers={"Authorization": f"Bearer {KEY_A}", "X-Tenant-Id": "bob"})
        assert r.status_code == 403
        ok = anthropic.Anthropic(base_url=url, api_key=KEY_B, max_retries=0)
        ok.messages.create(model="m", max_tokens=8, messages=msgs)
        recs = _turn_records(kafka_config, app, 1)
    assert [(r.event.TYPE, r.event.tenant, r.key.split("/")[0]) for r in recs] == [("turn", "bob", "bob")]
