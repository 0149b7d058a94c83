"""Issue 28 end to end at serving: two tenants, one engine, adapter sync through ``control``.

Real pieces: the embedded broker, the CPU engine serving tiny-random with LoRA on, the real
syncer, the real proxy following ``control``, the official ``openai`` SDK. The trainer's side
of a sync (pause, weights, resume for tenant ``alice``) is published by the test, as the
contract of docs/tenants.md says the trainer does. Checked:

- an adapter update of one tenant holds none of the other tenant's requests: while ``alice``
  is paused, ``bob`` is answered (by his adapter); ``alice``'s request waits for her ``resume``;
- after ``resume`` (alice, A) alice's turns carry ``adapter == A`` and the engine says A served
  them (its ``metadata.lora_name``); bob, served by his own adapter B throughout, has turns that
  carry B; no answer shows the adapter's name as its model;
- alice naming bob's adapter (or any adapter) as her ``model`` is refused 400;
- the ``/generate`` path of the engine client (SGLang's streamed chat) serves ``"<base>:<A>"``
  with ``lora_path = A``.
"""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest

from pipeline.engine.lora import LoraSettings
from pipeline.engine_api.client import EngineClient
from pipeline.engine_api.sglang import GenerateChatStream
from pipeline.testing.engine import running_engine
from pipeline.testing.lora import adapter_order, export_tenant_adapter
from pipeline.testing.proxy import running_proxy
from pipeline.testing.topics import publish, read_events
from pipeline.testing.waiting import wait_for
from tests.syncer.syncing import new_syncer, running, syncer_config

MSG = [{"role": "user", "content": "Say something."}]


def _client(url: str, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                         default_headers={"X-Tenant-Id": tenant})


def _ask(url: str, tenant: str, session: str, stream: bool = False, model: str = "default"):
    c = _client(url, tenant)
    if not stream:
        return c.chat.completions.create(model=model, messages=MSG, max_tokens=4, temperature=1.0,
                                         extra_headers={"X-Session-Id": session})
    chunks = list(c.chat.completions.create(model=model, messages=MSG, max_tokens=4, temperature=1.0, stream=True,
                                            extra_headers={"X-Session-Id": session}))
    return chunks


def _order(action, tenant, adapter, folder=None, epoch=1):
    return adapter_order(action, tenant, adapter, folder, epoch=epoch, run_id="reconcile")


@pytest.fixture
def serving(kafka_config, tmp_path):
    """``(cfg, engine url, proxy url, proxy app, {tenant: (folder, adapter)})``: engine + syncer + proxy."""
    cfg = syncer_config(kafka_config, tmp_path)
    adapters = {t: export_tenant_adapter(tmp_path / "weights", t, seed=s) for t, s in (("alice", 1), ("bob", 2))}
    with running_engine("tiny-random", threads=1, lora=LoraSettings(enabled=True, max_rank=16)) as eng:
        cfg = cfg.replace(syncer={"engine_url": eng})
        with running(new_syncer(cfg)), \
                running_proxy(cfg, eng, follow_control=True, sync_hold_timeout_s=120) as (url, app):
            yield cfg, eng, url, app, adapters


def test_one_tenants_adapter_sync_holds_none_of_the_others_requests_and_routes_each_to_its_own(serving):
    cfg, eng, url, app, adapters = serving
    a_dir, a = adapters["alice"]
    b_dir, b = adapters["bob"]  # bob is served by his own adapter while alice's syncs
    publish(cfg, [_order("pause", "bob", b), _order("weights", "bob", b, b_dir)], "control")
    wait_for(lambda: any(e.action == "applied" and e.adapter == b for e in read_events(cfg, "control", None, 2, 0)),
             what="the syncer's applied (bob, B)")
    publish(cfg, [_order("resume", "bob", b)], "control")
    wait_for(lambda: app.gate.adapter_of("bob") == b, what="the proxy to route bob to B")
    publish(cfg, [_order("pause", "alice", a)], "control")
    wait_for(lambda: app.gate.tenant_paused("alice"), what="the proxy to see alice's pause")
    held: dict = {}
    t = threading.Thread(target=lambda: held.update(r=_ask(url, "alice", "a-held")), daemon=True)
    t.start()
    for i in range(2):  # bob is served, by his adapter, while alice's adapter syncs
        out = _ask(url, "bob", f"b-{i}", stream=bool(i))
        assert out
        if not i:
            assert out.metadata["lora_name"] == b["name"]
    assert t.is_alive() and "r" not in held  # alice's request is still held, bob's were answered
    publish(cfg, [_order("weights", "alice", a, a_dir)], "control")
    wait_for(lambda: any(e.action == "applied" and e.adapter == a for e in read_events(cfg, "control", None, 2, 0)),
             what="the syncer's applied (alice, A)")
    publish(cfg, [_order("resume", "alice", a)], "control")
    t.join(120)
    assert ":" not in held["r"].model and a["name"] not in held["r"].model  # never "<base>:<adapter>"
    assert held["r"].metadata["lora_name"] == a["name"]  # the engine says A served it
    after = _ask(url, "alice", "a-after")
    assert after.metadata["lora_name"] == a["name"]
    streamed = _ask(url, "alice", "a-stream", stream=True)
    assert {c.model for c in streamed} == {app.names.served[0]}
    assert app.publisher.wait_idle(10)
    turns = read_events(cfg, "turns", lambda evs: sum(e.TYPE == "turn" for e in evs) >= 5, timeout_s=30)
    by_session = {e.session_id: e for e in turns if e.TYPE == "turn"}
    assert {s: by_session[s].adapter for s in ("a-held", "a-after", "a-stream")} == dict.fromkeys(
        ("a-held", "a-after", "a-stream"), a)
    assert all(by_session[s].tenant == "alice" and by_session[s].response_token_ids for s in ("a-held", "a-stream"))
    assert [by_session[s].adapter for s in ("b-0", "b-1")] == [b, b]
    assert {by_session[s].tenant for s in ("b-0", "b-1")} == {"bob"}
    # a client never picks an adapter: alice naming bob's (or her own) adapter is refused in OpenAI's shape
    for model in (f"default:{adapters['bob'][1]['name']}", adapters["bob"][1]["name"], f"x:{a['name']}"):
        with pytest.raises(openai.BadRequestError) as e:
            _ask(url, "alice", "a-refused", model=model)
        assert e.value.code == "model_not_allowed"


def test_the_generate_path_serves_chat_model_base_colon_adapter_as_lora_path(serving):
    cfg, eng, url, app, adapters = serving
    a_dir, a = adapters["alice"]

    async def stream(model: str) -> list[dict]:
        async with EngineClient(eng, timeout_s=60) as c:
            await c.load_lora_adapter(a["name"], str(a_dir))
            body = {"model": model, "messages": MSG, "max_tokens": 4, "temperature": 0.0, "logprobs": True}
            return [ch async for ch in GenerateChatStream(c, body, await c.server_info()).run()]

    with_adapter = asyncio.run(stream(f"default:{a['name']}"))
    base = asyncio.run(stream("default"))
    assert {c["model"] for c in with_adapter} == {"default"}
    assert with_adapter[-1]["metadata"]["lora_name"] == a["name"]
    assert with_adapter[-1]["metadata"]["lora_sha256"] == a["version"]  # the proxy compares it with the version
    assert base[-1]["metadata"]["lora_name"] is None and base[-1]["metadata"]["lora_sha256"] is None
