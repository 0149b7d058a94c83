"""Per-tenant LoRA adapters on a real vLLM (issue 38), synced through ``control`` by the real
syncer, served by the real proxy to the official ``openai`` SDK.

vLLM's answers do not say which adapter served them, so the proof is the log-probs: each recorded
turn's log-probs are those of its tenant's adapter (the engine's own scoring of the same tokens
under that adapter) and not those of the other tenant's adapter or of the base model. A second
version of alice's adapter replaces the first on the engine (versioned names: vLLM can reuse
stale prefix-cache blocks of a same-name reload) and leaves bob's untouched; a third unloads the
first.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from pipeline.engine_api.backend import engine_client
from pipeline.testing.lora import adapter_order, export_tenant_adapter
from pipeline.testing.proxy import running_proxy
from pipeline.testing.topics import publish, read_events
from pipeline.testing.vllm import require_vllm, running_vllm
from pipeline.testing.waiting import wait_for
from tests.syncer.syncing import new_syncer, running, syncer_config

MODEL = "tiny-random-64"
MSG = [{"role": "user", "content": "Say something about the sea."}]
pytestmark = pytest.mark.slow


def _ask(url: str, tenant: str, session: str, stream: bool = False):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, default_headers={"X-Tenant-Id": tenant})
    out = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, temperature=1.0, stream=stream,
                                    extra_headers={"X-Session-Id": session})
    return list(out) if stream else out


def _sync(cfg, tenant: str, adapter: dict, folder, epoch: int) -> None:
    """The trainer's side of one adapter sync (pause, weights, applied, resume)."""
    def order(action, f=None):
        return adapter_order(action, tenant, adapter, f, epoch=epoch, run_id="reconcile")

    publish(cfg, [order("pause"), order("weights", folder)], "control")
    wait_for(lambda: any(e.action == "applied" and e.adapter == adapter for e in read_events(cfg, "control", None, 2, 0)),
             what=f"the syncer's applied ({tenant})")
    publish(cfg, [order("resume")], "control")


def _score(url: str, turn, lora: str | None) -> list[float]:
    async def go():
        async with engine_client("vllm", url, 60) as c:
            ids = list(turn.prompt_token_ids) + list(turn.response_token_ids)
            return (await c.score_result(ids, len(turn.prompt_token_ids), lora_path=lora)).logprobs
    return asyncio.run(go())


def test_two_tenants_adapters_on_vllm(kafka_config, tmp_path):
    require_vllm()
    cfg = syncer_config(kafka_config, tmp_path).replace(engine={"kind": "vllm", "model": MODEL})
    ad = {t: export_tenant_adapter(tmp_path / "weights", t, model=MODEL, seed=s, std=0.3)
          for t, s in (("alice", 1), ("bob", 2))}
    a2_dir, a2 = export_tenant_adapter(tmp_path / "weights", "alice", model=MODEL, seed=3, std=0.3)
    a3_dir, a3 = export_tenant_adapter(tmp_path / "weights", "alice", model=MODEL, seed=4, std=0.3)
    with running_vllm(MODEL, max_lora_rank=16) as eng:
        cfg = cfg.replace(syncer={"engine_url": eng})
        with running(new_syncer(cfg)), \
                running_proxy(cfg, eng, follow_control=True, sync_hold_timeout_s=120) as (url, app):
            for epoch, tenant in enumerate(("bob", "alice"), 1):
                _sync(cfg, tenant, ad[tenant][1], ad[tenant][0], epoch)
            wait_for(lambda: app.gate.adapter_of("alice") == ad["alice"][1], what="the proxy to route alice")
            answers = {"a-0": _ask(url, "alice", "a-0"), "b-0": _ask(url, "bob", "b-0"),
                       "a-1": _ask(url, "alice", "a-1", stream=True)}
            _sync(cfg, "alice", a2, a2_dir, 3)
            wait_for(lambda: app.gate.adapter_of("alice") == a2, what="the proxy to route alice to her v2")
            answers["a-2"] = _ask(url, "alice", "a-2")
            answers["b-1"] = _ask(url, "bob", "b-1")
            assert app.publisher.wait_idle(10)
            turns = {e.session_id: e for e in read_events(
                cfg, "turns", lambda evs: sum(e.TYPE == "turn" for e in evs) >= 5, timeout_s=30) if e.TYPE == "turn"}
            def cards() -> set:
                return {m.id for m in openai.OpenAI(base_url=eng + "/v1", api_key="x").models.list().data}

            # a resume keeps the tenant's current adapter and the one before it (requests in flight):
            # alice's v3 unloads her v1
            _sync(cfg, "alice", a3, a3_dir, 4)
            wait_for(lambda: ad["alice"][1]["name"] not in cards(), what="alice's v1 to be unloaded")
            loaded = cards()
            served_by = {s: {name: _score(eng, turns[s], name) for name in (a2["name"], ad["bob"][1]["name"], None)}
                         for s in ("a-2", "b-1")}
            first = {s: _score(eng, turns[s], None) for s in ("a-0", "b-0", "a-1")}
    assert answers["a-0"].model == MODEL and {c.model for c in answers["a-1"]} == {MODEL}  # never the adapter's name
    want = {"a-0": ad["alice"][1], "a-1": ad["alice"][1], "b-0": ad["bob"][1], "a-2": a2, "b-1": ad["bob"][1]}
    assert {s: turns[s].adapter for s in want} == want
    assert all(turns[s].response_token_ids for s in want)
    # the log-probs recorded are those of the tenant's own adapter, not the other's nor the base's
    for s, name in (("a-2", a2["name"]), ("b-1", ad["bob"][1]["name"])):
        assert list(turns[s].response_logprobs) == pytest.approx(served_by[s][name], abs=1e-4)
        for other in served_by[s]:
            if other != name:
                assert list(turns[s].response_logprobs) != pytest.approx(served_by[s][other], abs=1e-3)
    for s in first:  # served by an adapter, not by the base model
        assert list(turns[s].response_logprobs) != pytest.approx(first[s], abs=1e-3)
    # alice's v1 was unloaded when v3 took over; her v2 and bob's adapter were left as they were
    assert {a3["name"], a2["name"], ad["bob"][1]["name"]} <= loaded
