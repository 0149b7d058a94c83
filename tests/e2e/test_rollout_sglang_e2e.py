"""Canary rollout and explicit feedback on the SGLang engine path (issues 39 and 40).

The SGLang path is the SGLang-shaped stand-in (:class:`pipeline.testing.sglang_style.SglangStyleEngine`:
no token ids on streamed chat, so the proxy streams through ``/v1/tokenize`` + ``/generate`` with
``lora_path``) in front of the CPU engine serving tiny-random with LoRA on. Real pieces: the
embedded broker, the real syncer (loading adapters through the stand-in), the real proxy following
``control`` with rollout on, the real judge (explicit feedback takes precedence over its constant
backend) and the real decider of the evaluator stage, each in a thread; the official ``openai``
SDK as the client. The trainer's side (alice's ``weights``/``resume`` orders of two exported
adapters) is published by the test, as docs/tenants.md says the trainer does (the trainer never
talks to an engine: its path is the same on every engine).

Checked from the records: every turn of the candidate's share (new sessions whose sticky hash is
below the share, streamed and not) is served by the candidate adapter, recorded with its token ids
and ``canary``, and nothing else is; alice's thumbs (down on the candidate, up on the incumbent)
reach the samples of those turns; the decider rolls the candidate back from those samples; after
the rollback no new session is served by it, and the syncer unloads it from the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import httpx
import openai
import pytest

from pipeline import events
from pipeline.engine.lora import LoraSettings
from pipeline.engine_api.client import EngineClient
from pipeline.rollout.assign import CANDIDATE, INCUMBENT, assign_arm
from pipeline.testing.engine import running_engine
from pipeline.testing.judge import JudgeThread
from pipeline.testing.lora import adapter_order, export_tenant_adapter
from pipeline.testing.proxy import running_proxy
from pipeline.testing.servers import serve_app
from pipeline.testing.sglang_style import SglangStyleEngine
from pipeline.testing.topics import publish, read_events
from pipeline.testing.waiting import wait_for
from tests.syncer.syncing import new_syncer, running, syncer_config

TENANT, SHARE, RUN = "alice", 0.5, "reconcile"


def _config(kafka_config, tmp_path):
    return syncer_config(kafka_config, tmp_path).replace(
        rollout={"enabled": True, "share": SHARE, "rollback_min_n": 4, "min_n": 8, "max_n": 400, "margin": 0.5,
                 "rollback_z": 1.645},
        trainer={"per_tenant": True, "lora": {"rank": 4, "alpha": 8}},
        judge={"mode": "rl", "backend": "constant", "idle_timeout_s": 5})


def _order(action: str, adapter: dict, folder=None) -> events.Control:
    if action == "promote":  # as an earlier canary's decision would be recorded
        evidence = {"rule": "test", "reason": "test", "config": {}, "incumbent": None,
                    "arms": {"candidate": {}, "incumbent": {}}, "bounds": {}}
        return events.Control(action=action, epoch=1, run_id=RUN, tenant=TENANT, adapter=adapter,
                              evidence=evidence, created_at=events.now_ms())
    return adapter_order(action, TENANT, adapter, folder, run_id=RUN)


def _loaded(url: str) -> set[str]:
    async def names() -> set[str]:
        async with EngineClient(url, timeout_s=30) as c:
            return {m["id"] for m in (await c.models())["data"] if m.get("parent")}
    return asyncio.run(names())


class _Alice:
    """Alice's users: single-turn sessions through the proxy, each rated by its arm."""

    def __init__(self, cfg, url: str) -> None:
        self.cfg, self.url = cfg, url
        self.sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                 default_headers={"X-Tenant-Id": TENANT})
        self.http = httpx.Client(base_url=url, headers={"X-Tenant-Id": TENANT}, timeout=60)
        self.asked: dict[str, bool] = {}  # request id -> streamed

    def session(self, stream: bool, score) -> tuple[str, events.Turn]:
        sid = f"s-{uuid.uuid4().hex[:10]}"
        kw = dict(model="default", messages=[{"role": "user", "content": f"hello {sid}"}], max_tokens=4,
                  temperature=1.0, extra_headers={"X-Session-Id": sid})
        if stream:
            chunks = list(self.sdk.chat.completions.create(stream=True, **kw))
            rid = chunks[0].id
        else:
            rid = self.sdk.chat.completions.create(**kw).id
        turn = next(e for e in read_events(self.cfg, "turns", lambda evs: any(
            getattr(e, "response_id", None) == rid for e in evs), timeout_s=60)
            if isinstance(e, events.Turn) and e.response_id == rid)
        self.asked[turn.request_id] = stream
        r = self.http.post("/v1/feedback", json={"response_id": rid, "score": score(turn)})
        assert r.status_code == 200, r.text
        assert self.http.post(f"/v1/sessions/{sid}/end", json={}).status_code == 200
        return sid, turn


@pytest.mark.slow(seconds=45)
def test_on_the_sglang_path_the_thumbed_down_candidate_is_rolled_back_on_its_share(kafka_config, tmp_path):
    from pipeline.evaluator.decider import Decider

    cfg = _config(kafka_config, tmp_path)
    (a_dir, a), (b_dir, b) = (export_tenant_adapter(tmp_path / "weights", TENANT, seed=s) for s in (1, 2))
    with running_engine("tiny-random", threads=1, lora=LoraSettings(enabled=True, max_rank=16)) as eng, \
            serve_app(SglangStyleEngine(eng)) as front:
        cfg = cfg.replace(syncer={"engine_url": front})
        with running(new_syncer(cfg)), running_proxy(cfg, front, follow_control=True) as (url, app), \
                JudgeThread(cfg), contextlib.closing(Decider(cfg).start()) as decider:
            publish(cfg, [_order("weights", a, a_dir), _order("resume", a), _order("promote", a)], "control")
            publish(cfg, [_order("weights", b, b_dir)], "control")
            wait_for(lambda: {a["name"], b["name"]} <= _loaded(eng), timeout_s=60, what="A and B loaded")
            publish(cfg, [_order("resume", b)], "control")  # B is live: the canary share goes to it
            wait_for(lambda: (s := (app.gate.state.serving or {}).get(TENANT)) is not None and s.live,
                     what="the proxy to route the canary")
            alice, served, i = _Alice(cfg, url), {}, 0
            while not decider.published:
                assert i < 60, "the decider never rolled the thumbed-down candidate back"
                sid, turn = alice.session(i % 2 == 1, lambda t: -1.0 if t.canary == CANDIDATE else 1.0)
                arm = assign_arm(TENANT, sid, b["version"], SHARE)
                want = b if arm == CANDIDATE else a
                assert (turn.canary, turn.adapter["name"]) == (arm, want["name"]), (sid, turn.canary, turn.adapter)
                assert turn.response_token_ids and len(turn.response_logprobs) == len(turn.response_token_ids)
                served[turn.request_id] = arm
                i += 1
            (decision,) = decider.published
            assert (decision.action, decision.tenant, decision.adapter["version"]) == ("rollback", TENANT, b["version"])
            wait_for(lambda: b["name"] not in _loaded(eng), timeout_s=60, what="the syncer to unload B")
            wait_for(lambda: not (app.gate.state.serving or {}).get(TENANT).live, what="the proxy to follow")
            for k in range(4):  # after the rollback: every new session on the incumbent, no canary
                _, turn = alice.session(k % 2 == 1, lambda t: 1.0)
                assert (turn.canary, turn.adapter["name"]) == (None, a["name"])
            assert {True, False} <= set(alice.asked.values())  # streamed (/generate) and not
    arms = decision.evidence["arms"]  # arm -> {"reward": [successes, n], "served": [turns, all turns]}
    samples = {s.sample_id.rsplit(":", 1)[1]: s for s in read_events(
        cfg, "samples", lambda evs: len(evs) >= len(served), timeout_s=60) if isinstance(s, events.Sample)}
    assert set(served) <= set(samples)  # every rated turn of the canary became a sample
    for rid, arm in served.items():  # each carries its thumb and the adapter that served it
        want = (-1.0, b["version"]) if arm == CANDIDATE else (1.0, a["version"])
        assert (samples[rid].feedback_score, samples[rid].adapter["version"]) == want, rid
    assert arms["candidate"]["reward"][0] == 0 and arms["incumbent"]["reward"][0] == arms["incumbent"]["reward"][1] > 0
    # the decision counts what was served up to the sample that triggered it (a session may follow it)
    assert 4 <= arms["candidate"]["served"][0] <= sum(a == CANDIDATE for a in served.values())
    assert arms["candidate"]["served"][1] <= len(served)
    assert set(served.values()) == {CANDIDATE, INCUMBENT}
