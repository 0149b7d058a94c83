"""Canary routing at the proxy (rollout on, docs/rollout.md "Serving"; pipeline/proxy/canary.py):
a tenant's new sessions split between its incumbent and its live candidate adapter by the sticky
hash, a session keeps its arm for all its turns, a session that began before the candidate went
live never moves to it, a rollback sends everyone (pinned sessions too) back to the incumbent, a
promotion sends everyone to the new incumbent, each turn records ``adapter`` and ``canary``, and
a proxy restarted mid-canary never moves a session under way to the candidate. Rollout off: the
tenant's last ``resume`` adapter, no ``canary`` (the existing tenant tests cover the rest)."""

from __future__ import annotations

import httpx
import pytest

from pipeline import events
from pipeline.proxy.canary import Arms, CanaryRoutes, arms_of
from pipeline.proxy.control import ControlFollower, ControlState, SyncGate, TenantState
from pipeline.rollout.assign import CANDIDATE, INCUMBENT, assign_arm
from pipeline.rollout.serving import ServingView
from pipeline.testing.lora import adapter_order
from pipeline.testing.proxy import running_proxy
from pipeline.testing.servers import StandInEngine, serve_app
from pipeline.testing.topics import publish, read_events
from pipeline.testing.waiting import wait_for


def _adapter(tenant: str, c: str) -> dict:
    version = c * 64
    return {"name": events.adapter_name(tenant, version), "version": version, "sha256": c * 64}


A1, A2, A3 = _adapter("alice", "1"), _adapter("alice", "2"), _adapter("alice", "3")
B1 = _adapter("bob", "b")
EVIDENCE = {"rule": "test", "reason": "test", "config": {}, "incumbent": None,
            "arms": {"candidate": {}, "incumbent": {}}, "bounds": {}}


def _order(action: str, adapter: dict | None, tenant: str = "alice", run_id: str = "default") -> events.Control:
    if action in ("promote", "rollback"):
        return events.Control(action=action, epoch=1, run_id=run_id, tenant=tenant, adapter=adapter,
                              evidence=EVIDENCE, created_at=events.now_ms())
    folder = "/unused" if action == "weights" else None
    return adapter_order(action, tenant, adapter, folder, run_id=run_id)


def _sessions(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(n)]


# ---- the routing rule, without HTTP ------------------------------------------------------------
def test_new_sessions_split_by_the_hash_and_keep_their_arm():
    routes = CanaryRoutes(0.5)
    live = Arms(A1, A2, True)
    sids = _sessions("s", 400)
    first = {s: routes.route("alice", live, s, True) for s in sids}
    for s, (adapter, canary) in first.items():
        assert canary == assign_arm("alice", s, A2["version"], 0.5)
        assert adapter == (A2 if canary == CANDIDATE else A1)
    on_candidate = sum(c == CANDIDATE for _, c in first.values())
    assert 160 < on_candidate < 240  # ~ share 0.5 (binomial sd 10)
    assert routes.pinned("alice") == on_candidate  # only candidate sessions are pinned
    for turn in range(1, 4):  # every later turn: the same arm
        assert {s: routes.route("alice", live, s, False) for s in sids} == first, turn
    assert routes.route("bob", Arms(B1), "s-0", True) == (B1, None)  # bob: no canary, nothing recorded


def test_sessions_begun_before_live_stay_on_the_incumbent_and_unrecorded_requests_too():
    routes = CanaryRoutes(1.0)  # every new session would take the candidate
    assert routes.route("alice", Arms(A1, A2, False), "early", True) == (A1, INCUMBENT)  # syncing: not live
    live = Arms(A1, A2, True)
    for turn in range(3):
        assert routes.route("alice", live, "early", False) == (A1, INCUMBENT)
    assert routes.route("alice", live, None, True) == (A1, INCUMBENT)  # no recorded session
    assert routes.route("alice", live, "new", True) == (A2, CANDIDATE)


def test_rollback_and_promote_and_pins_are_forgotten_when_the_canary_closes():
    routes = CanaryRoutes(1.0)
    live = Arms(A1, A2, True)
    assert routes.route("alice", live, "s", True) == (A2, CANDIDATE)
    routes.forget_closed({"alice": live})
    assert routes.pinned("alice") == 1
    rolled_back = Arms(A1, None, False)
    routes.forget_closed({"alice": rolled_back})
    assert routes.pinned("alice") == 0
    assert routes.route("alice", rolled_back, "s", False) == (A1, None)  # the pinned session is back
    assert routes.route("alice", rolled_back, "new", True) == (A1, None)
    assert routes.route("alice", Arms(A1, A3, True), "s", False) == (A1, INCUMBENT)  # a new canary: s began before
    assert routes.route("alice", Arms(A1, A3, True), "t", True) == (A3, CANDIDATE)
    promoted = Arms(A3, None, False)
    assert routes.route("alice", promoted, "s", False) == (A3, None)  # everyone on the new incumbent
    assert routes.route("alice", promoted, "t", False) == (A3, None) and routes.pinned("alice") == 0
    # a superseding candidate: the old one's pins go, its sessions to the incumbent
    routes.route("alice", Arms(A3, A1, True), "u", True)
    assert routes.route("alice", Arms(A3, A2, True), "u", False) == (A3, INCUMBENT)


def test_pins_are_bounded_and_bad_settings_are_refused():
    routes = CanaryRoutes(1.0, max_pins=2)
    live = Arms(None, A2, True)  # the incumbent is the base model
    for s in ("a", "b", "c"):
        routes.route("alice", live, s, True)
    assert routes.pinned("alice") == 2
    assert routes.route("alice", live, "a", False) == (None, INCUMBENT)  # evicted: the safe direction
    assert routes.route("alice", live, "c", False) == (A2, CANDIDATE)
    for bad in ((1.5, 10), (-0.1, 10), (0.5, 0)):
        with pytest.raises(ValueError):
            CanaryRoutes(*bad)


def test_the_follower_folds_the_serving_view_and_hands_out_snapshots():
    f = ControlFollower.__new__(ControlFollower)  # its apply() only: no broker
    f.state, f.run_id = ControlState(serving={}), "default"
    f.view = ServingView("default")
    assert f.apply(_order("weights", A1)) and f.state.serving["alice"] == Arms(None, A1, False)
    assert not f.apply(_order("resume", A2, run_id="other-run"))  # another run's order: nothing
    assert f.apply(_order("resume", A1))
    snap = f.state.copy()
    assert snap.serving["alice"] == Arms(None, A1, True) and snap.tenants["alice"].adapter == A1
    assert f.apply(_order("rollback", A1))
    assert f.state.serving["alice"] == Arms(None, None, False)
    assert snap.serving["alice"] == Arms(None, A1, True)  # the event loop's snapshot is untouched
    gate = SyncGate(30, 60, canary_share=1.0)
    gate.update(snap)
    assert gate.serve("alice", "s", True) == (A1, CANDIDATE)
    gate.update(f.state.copy())
    assert gate.serve("alice", "s", False) == (None, None) and gate.routes.pinned("alice") == 0
    assert gate.serve(None, "s", True) == (None, None)  # untenanted: never a canary


def test_rollout_off_serves_the_last_resume_and_records_no_canary():
    f = ControlFollower.__new__(ControlFollower)
    f.state, f.run_id = ControlState(), "default"  # no view: rollout off
    f.apply(_order("weights", A1))
    f.apply(_order("resume", A2))
    assert f.state.serving is None
    gate = SyncGate(30, 60, canary_share=1.0)
    gate.update(f.state.copy())
    assert gate.serve("alice", "s", True) == (A2, None)
    gate.update(ControlState(tenants={"alice": TenantState(adapter=A1)}))
    assert gate.serve("alice", "s", False) == (A1, None)


# ---- the proxy over HTTP, control on the broker ------------------------------------------------
class _Client:
    """Turns of alice's sessions through the proxy; remembers what each request should record."""

    def __init__(self, url: str, up: StandInEngine) -> None:
        self.url, self.up = url, up
        self.history: dict[str, list] = {}
        self.expected: dict[str, tuple] = {}  # request id -> (adapter name, canary)

    def turn(self, sid: str, want: tuple[dict | None, str | None]) -> None:
        msgs = self.history.setdefault(sid, []) + [{"role": "user", "content": f"{sid}: q{len(self.history[sid])}"}]
        r = httpx.post(self.url + "/v1/chat/completions", json={"model": "default", "messages": msgs},
                       headers={"X-Tenant-Id": "alice", "X-Session-Id": sid}, timeout=30)
        assert r.status_code == 200, r.text
        adapter, canary = want
        sent = self.up.requests[-1]["model"]
        assert sent.partition(":")[2] == ("" if adapter is None else adapter["name"]), (sid, want, sent)
        self.expected[r.headers["x-request-id"]] = (None if adapter is None else adapter["name"], canary)
        self.history[sid] = msgs + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}]


def _arm(sid: str, candidate: dict, incumbent: dict | None) -> tuple[dict | None, str]:
    arm = assign_arm("alice", sid, candidate["version"], 0.5)
    return (candidate if arm == CANDIDATE else incumbent), arm


def _serving(app, want: Arms) -> None:
    wait_for(lambda: (app.gate.state.serving or {}).get("alice") == want, what=f"the proxy to follow {want}")


def test_canary_over_http_rollback_promote_restart_and_recorded_turns(kafka_config):
    cfg = kafka_config.replace(rollout={"enabled": True, "share": 0.5}, trainer={"lora": {"rank": 4}})
    up = StandInEngine()
    with serve_app(up) as up_url:
        with running_proxy(cfg, up_url, follow_control=True) as (url, app):
            c = _Client(url, up)
            publish(cfg, [_order("weights", A1), _order("resume", A1), _order("promote", A1)], "control")
            _serving(app, Arms(A1))
            old = _sessions("old", 6)
            for s in old:
                c.turn(s, (A1, None))  # no canary: nothing recorded
            publish(cfg, [_order("weights", A2)], "control")
            _serving(app, Arms(A1, A2, False))
            c.turn("early", (A1, INCUMBENT))  # the candidate syncs: not live yet
            publish(cfg, [_order("resume", A2)], "control")
            _serving(app, Arms(A1, A2, True))
            new = _sessions("new", 16)
            arms = {s: _arm(s, A2, A1) for s in new}
            assert {a for _, a in arms.values()} == {CANDIDATE, INCUMBENT}  # both arms get sessions
            for turn in range(2):
                for s in new:
                    c.turn(s, arms[s])  # sticky: the same arm for every turn
                for s in old + ["early"]:
                    c.turn(s, (A1, INCUMBENT))  # began before the candidate went live: never moved
            publish(cfg, [_order("rollback", A2)], "control")
            _serving(app, Arms(A1))
            for s in new + ["after-rollback"]:
                c.turn(s, (A1, None))  # pinned ones too: the rolled-back version serves no one
            assert app.gate.routes.pinned("alice") == 0
            publish(cfg, [_order("weights", A3), _order("resume", A3)], "control")
            _serving(app, Arms(A1, A3, True))
            third = _sessions("third", 12)
            arms3 = {s: _arm(s, A3, A1) for s in third}
            on_a3 = [s for s in third if arms3[s][1] == CANDIDATE]
            assert on_a3 and len(on_a3) < len(third)
            for s in third:
                c.turn(s, arms3[s])
            assert app.publisher.wait_idle(10)
        # restarted mid-canary: the same view from control, no pins; sessions under way (turn
        # index > 0) go to the incumbent, never to the candidate; new ones split by the same hash
        with running_proxy(cfg, up_url, follow_control=True) as (url, app):
            c2 = _Client(url, up)
            c2.history = c.history
            _serving(app, Arms(A1, A3, True))
            for s in third:
                c2.turn(s, (A1, INCUMBENT))
            fresh = _sessions("fresh", 8)
            for s in fresh:
                c2.turn(s, _arm(s, A3, A1))
            publish(cfg, [_order("promote", A3)], "control")
            _serving(app, Arms(A3))
            for s in third + fresh + old:
                c2.turn(s, (A3, None))  # everyone on the new incumbent
            assert app.publisher.wait_idle(10)
    expected = {**c.expected, **c2.expected}
    turns = [e for e in read_events(cfg, "turns", lambda evs: sum(e.TYPE == "turn" for e in evs) >= len(expected),
                                    timeout_s=30, settle_s=0.2) if e.TYPE == "turn"]
    got = {t.request_id: ((t.adapter or {}).get("name"), t.canary) for t in turns}
    assert got == expected
