"""The proxy's half of adapter sync (docs/tenants.md): the per-tenant hold of :class:`SyncGate`,
the per-tenant state the control follower keeps, and a turn whose engine reports another adapter
than the one the proxy routed it to (recorded without token ids, log-probs and adapter)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from pipeline import events
from pipeline.proxy import metrics as M
from pipeline.proxy.control import ControlFollower, ControlState, SyncGate, TenantState
from pipeline.testing.lora import adapter_order
from pipeline.testing.proxy import running_proxy
from pipeline.testing.servers import StandInEngine, serve_app
from pipeline.testing.topics import publish, read_events
from pipeline.testing.waiting import wait_for

A = {"name": "alice@" + "a" * 16, "version": "a" * 64, "sha256": "b" * 64}


def _paused(**tenants: bool) -> ControlState:
    now = events.now_ms()
    return ControlState(tenants={t: TenantState(p, 1, now if p else 0, A if t == "alice" else None)
                                 for t, p in tenants.items()})


def test_a_tenants_pause_holds_only_that_tenant_and_its_resume_releases_it():
    async def main():
        gate = SyncGate(hold_timeout_s=30, max_pause_s=60)
        gate.update(_paused(alice=True, bob=False))
        assert await gate.wait("bob") == 0.0 and await gate.wait(None) == 0.0  # not held at all
        alice = asyncio.ensure_future(gate.wait("alice"))
        await asyncio.sleep(0)
        assert not alice.done()
        gate.update(_paused(alice=True, bob=True))  # another tenant's pause: alice still held
        await asyncio.sleep(0)
        assert not alice.done()
        gate.update(_paused(alice=False, bob=True))
        assert await asyncio.wait_for(alice, 5) > 0.0
        assert gate.adapter_of("alice") == A and gate.adapter_of("bob") is None and gate.adapter_of(None) is None
        full = ControlState(paused=True, paused_at_ms=events.now_ms())  # a full-weight sync holds everyone
        gate.update(full)
        held = [asyncio.ensure_future(gate.wait(t)) for t in ("alice", None)]
        await asyncio.sleep(0)
        assert not any(h.done() for h in held)
        gate.update(ControlState())
        await asyncio.wait_for(asyncio.gather(*held), 5)

    asyncio.run(main())


def test_a_stale_tenant_pause_holds_nothing_and_a_long_one_times_out():
    async def main():
        gate = SyncGate(hold_timeout_s=0.2, max_pause_s=60)
        stale = events.now_ms() - 61_000
        gate.update(ControlState(tenants={"alice": TenantState(True, 1, stale, None)}))
        assert await gate.wait("alice") == 0.0
        gate.update(_paused(alice=True))
        try:
            await gate.wait("alice")
        except TimeoutError:
            return
        raise AssertionError("the hold did not time out")

    asyncio.run(main())


def test_the_follower_keeps_each_tenants_pause_epoch_and_resumed_adapter():
    f = ControlFollower.__new__(ControlFollower)  # its apply() only: no broker
    f.state, f.run_id = ControlState(), "default"
    assert f.apply(adapter_order("pause", "alice", A, epoch=3))
    assert f.state.tenants["alice"].paused and not f.state.paused
    assert not f.apply(adapter_order("resume", "alice", None, epoch=3, run_id="other-run"))  # not this run's
    # log order decides, as for the syncers: a trainer restarted from an older checkpoint resumes
    # with a lower epoch (the syncers then unload the adapter; the proxy must not keep routing to it)
    assert f.apply(adapter_order("resume", "alice", None, epoch=2))
    assert f.state.tenants["alice"] == TenantState(False, 2, 0, None)
    assert f.apply(adapter_order("resume", "alice", A, epoch=3))
    assert f.state.tenants["alice"] == TenantState(False, 3, 0, A)
    assert f.apply(adapter_order("resume", "alice", None, epoch=4))  # reset: back to the base model
    assert f.state.tenants["alice"].adapter is None
    assert not f.apply(adapter_order("applied", "alice", A, engine_id="engine-0"))


class _WrongAdapterEngine(StandInEngine):  # stand-in LLM whose answers say another adapter served them
    def __init__(self, reported: dict) -> None:
        super().__init__()
        self.reported = reported

    def _metadata(self) -> dict:
        return {"metadata": {"weight_version": "0", **self.reported}}


@pytest.mark.parametrize("reported", [
    {"lora_name": "bob@" + "c" * 16},  # another tenant's adapter
    {"lora_name": A["name"], "lora_sha256": "c" * 64},  # alice's name, loaded with other content
], ids=["other-name", "other-content"])
def test_a_turn_the_engine_says_another_adapter_served_trains_nothing(kafka_config, reported):
    before = M.ADAPTER_MISMATCH._value.get()
    up = _WrongAdapterEngine(reported)
    with serve_app(up) as up_url, running_proxy(kafka_config, up_url, follow_control=True) as (url, app):
        publish(kafka_config, [adapter_order("resume", "alice", A)], "control")
        wait_for(lambda: app.gate.adapter_of("alice") == A, what="the proxy to route alice to A")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "q"}],
                                       extra_headers={"X-Tenant-Id": "alice", "X-Session-Id": "s"})
        assert up.requests[-1]["model"].endswith(":" + A["name"])  # routed to alice's adapter
        assert app.publisher.wait_idle(10)
    (turn,) = [e for e in read_events(kafka_config, "turns", 1) if e.TYPE == "turn"]
    assert turn.tenant == "alice" and turn.adapter is None
    assert turn.response_token_ids == [] and turn.response_logprobs == []
    assert M.ADAPTER_MISMATCH._value.get() == before + 1


def test_a_request_naming_an_adapter_in_lora_path_is_refused_in_openais_shape(kafka_config):
    up = StandInEngine()
    with serve_app(up) as up_url, running_proxy(kafka_config, up_url) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="default", messages=[{"role": "user", "content": "q"}],
                                               stream=stream, extra_body={"lora_path": A["name"]},
                                               extra_headers={"X-Tenant-Id": "bob"})
            err = e.value.body
            assert (err["code"], err["param"]) == ("model_not_allowed", "lora_path") and "LoRA" in err["message"]
    assert up.requests == []  # nothing reached the engine
