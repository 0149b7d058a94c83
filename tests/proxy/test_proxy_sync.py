"""Weight sync: the proxy follows ``control``, holds new requests during a sync, tags versions."""

from __future__ import annotations

import threading

import httpx

from pipeline import events
from pipeline.bus import EventProducer
from pipeline.proxy import metrics as M
from pipeline.testing.proxy import running_proxy
from pipeline.testing.servers import StandInEngine, serve_app
from pipeline.testing.topics import read_events
from pipeline.testing.waiting import until

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "q"}]}


def _control(config, action, epoch, version=0, created_at=None):
    p = EventProducer(config, name="test")
    try:
        p.send(config.topics.name("control"), events.Control(
            action=action, epoch=epoch, policy_version=version, engine_id="engine-0" if action == "applied" else None,
            created_at=events.now_ms() if created_at is None else created_at), key="default").get(timeout=10)
    finally:
        p.close()


def test_requests_are_held_during_a_sync_and_released_by_resume(kafka_config):
    held_before = M.SYNC_HOLD._sum.get()
    with serve_app(StandInEngine(weight_version="not-a-number")) as up, \
            running_proxy(kafka_config, up, follow_control=True, sync_hold_timeout_s=60) as (url, app):
        _control(kafka_config, "pause", 1)
        assert until(lambda: app.gate.paused)
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(url + CHAT, json=BODY, timeout=60,
                                                                             headers={"X-Session-Id": "held"})))
        t.start()
        t.join(1.0)
        assert "r" not in result  # still held: the sync has not finished
        _control(kafka_config, "applied", 1, version=7)
        _control(kafka_config, "resume", 1)
        t.join(15)
        assert result["r"].status_code == 200
        assert M.SYNC_HOLD._sum.get() > held_before
        # the engine's version is not a number here, so the control topic's applied version tags the turn
        app.publisher.wait_idle(10)
        turns = [e for e in read_events(kafka_config, want=1) if e.TYPE == "turn"]
        assert turns[0].policy_version == 7
        r = httpx.get(url + "/readyz").json()
        assert r["sync_paused"] is False


def test_hold_is_bounded_then_served_or_503_when_strict(kafka_config):
    with serve_app(StandInEngine(weight_version="3")) as up, \
            running_proxy(kafka_config, up, follow_control=True, sync_hold_timeout_s=0.3) as (url, app), \
            running_proxy(kafka_config, up, follow_control=True, sync_hold_timeout_s=0.3,
                          sync_strict=True) as (url_strict, app_strict):
        _control(kafka_config, "applied", 0, version=2)
        _control(kafka_config, "pause", 5)
        assert until(lambda: app.gate.paused and app_strict.gate.paused)
        r = httpx.post(url + CHAT, json=BODY, headers={"X-Session-Id": "late"}, timeout=30)
        assert r.status_code == 200  # the trainer is slow: served anyway after the bounded hold
        r = httpx.post(url_strict + CHAT, json=BODY, headers={"X-Session-Id": "strict"}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "weight_sync"
        app.publisher.wait_idle(10)
        turns = [e for e in read_events(kafka_config, want=1) if e.TYPE == "turn"]
        assert turns[0].policy_version == 3  # the engine's own weight_version wins over the control topic


def test_a_stale_pause_does_not_hold_traffic(kafka_config):
    with serve_app(StandInEngine()) as up, \
            running_proxy(kafka_config, up, follow_control=True, sync_hold_timeout_s=60,
                          sync_max_pause_s=5) as (url, app):
        _control(kafka_config, "pause", 9, created_at=events.now_ms() - 60_000)  # a trainer died mid-sync
        assert until(lambda: app.gate.state.paused)
        assert not app.gate.paused
        r = httpx.post(url + CHAT, json=BODY, headers={"X-Session-Id": "s"}, timeout=10)
        assert r.status_code == 200
