"""The proxy's full-weight canary over several engines (``rollout.canary_engines``, docs/rollout.md
"Full-weight canaries over several engines"): a live candidate's share of new sessions (the same
sticky hash as adapters, under the full weights' scope) goes to ``proxy.canary_engine_url``,
every other session and request to ``engine.url``; rollback and promote send everyone to
``engine.url``; a restarted proxy moves sessions under way to the incumbent, never to the
candidate; each turn records its arm and the version the engine that served it reported.

Two stand-in engines (the incumbent's and the canary's), the real proxy, ``control`` on the broker."""

from __future__ import annotations

import httpx

from pipeline import events
from pipeline.proxy.canary import FULL_WEIGHTS, Arms, CanaryRoutes, full_session
from pipeline.rollout.assign import CANDIDATE, INCUMBENT, assign_arm
from pipeline.testing.proxy import running_proxy
from pipeline.testing.servers import StandInEngine, serve_app
from pipeline.testing.topics import publish, read_events
from pipeline.testing.waiting import wait_for

EVIDENCE = {"rule": "newcombe-noninferiority-v1", "reason": "test", "config": {}, "incumbent": 0,
            "arms": {"candidate": {}, "incumbent": {}}, "bounds": {}}
SHARE = 0.5


def _order(action: str, version: int) -> events.Control:
    return events.Control(action=action, epoch=version, policy_version=version, run_id="default",
                          evidence=EVIDENCE if action in events.ROLLOUT_DECISIONS else None,
                          location="/w" if action == "weights" else None, sha256="0" * 64 if action == "weights" else None)


def test_the_full_weights_scope_reuses_the_routing_rule_and_never_mixes_tenants():
    routes = CanaryRoutes(SHARE)
    live = Arms(0, 1, True)
    sids = [f"s{i}" for i in range(40)]
    first = {s: routes.route(FULL_WEIGHTS, live, s, True) for s in sids}
    assert {a for _, a in first.values()} == {CANDIDATE, INCUMBENT}
    assert all(v == (1 if a == CANDIDATE else 0) and a == assign_arm(None, s, 1, SHARE) for s, (v, a) in first.items())
    assert {s: routes.route(FULL_WEIGHTS, live, s, False) for s in sids} == first  # sticky
    on = next(s for s in sids if first[s][1] == CANDIDATE)
    assert full_session("alice", on) != on and routes.route(FULL_WEIGHTS, live, full_session("alice", on), False) \
        == (0, INCUMBENT)  # alice's session of that id never began on the candidate


class _Client:
    """Turns through the proxy; checks which engine got each and remembers what it should record."""

    def __init__(self, url: str, engines: dict[str, StandInEngine]) -> None:
        self.url, self.engines = url, engines
        self.history: dict[str, list] = {}
        self.expected: dict[str, tuple] = {}  # request id -> (canary, policy_version)

    def turn(self, sid: str, engine: str, canary: str | None) -> None:
        msgs = self.history.setdefault(sid, []) + [{"role": "user", "content": f"{sid}: q{len(self.history[sid])}"}]
        counts = {k: len(e.requests) for k, e in self.engines.items()}
        r = httpx.post(self.url + "/v1/chat/completions", json={"model": "default", "messages": msgs},
                       headers={"X-Session-Id": sid}, timeout=30)
        assert r.status_code == 200, r.text
        grew = [k for k, e in self.engines.items() if len(e.requests) > counts[k]]
        assert grew == [engine], (sid, engine, canary, grew)
        self.expected[r.headers["x-request-id"]] = (canary, int(self.engines[engine].weight_version))
        self.history[sid] = msgs + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}]


def _arm(sid: str, version: int) -> tuple[str, str]:
    arm = assign_arm(None, sid, version, SHARE)
    return ("canary" if arm == CANDIDATE else "main"), arm


def _serving(app, want: Arms) -> None:
    wait_for(lambda: (app.gate.state.serving or {}).get(FULL_WEIGHTS) == want, what=f"the proxy to follow {want}")


def test_full_weight_canary_over_http_rollback_promote_restart_and_recorded_turns(kafka_config):
    main, canary = StandInEngine(weight_version="0"), StandInEngine(weight_version="0")
    with serve_app(main) as main_url, serve_app(canary) as canary_url:
        cfg = kafka_config.replace(rollout={"enabled": True, "share": SHARE, "canary_engines": ["engine-1"]},
                                   trainer={"engines": ["engine-0", "engine-1"]},
                                   proxy={"canary_engine_url": canary_url})
        engines = {"main": main, "canary": canary}
        with running_proxy(cfg, main_url, follow_control=True) as (url, app):
            c = _Client(url, engines)
            old = [f"old-{i}" for i in range(4)]
            for s in old:
                c.turn(s, "main", None)  # no canary
            publish(cfg, [_order("pause", 1), _order("weights", 1)], "control")
            canary.weight_version = "1"  # the canary engine applied v1
            publish(cfg, [_order("resume", 1)], "control")
            _serving(app, Arms(0, 1, True))
            new = [f"new-{i}" for i in range(12)]
            arms = {s: _arm(s, 1) for s in new}
            assert {a for _, a in arms.values()} == {CANDIDATE, INCUMBENT}
            for _ in range(2):
                for s in new:
                    c.turn(s, *arms[s])  # sticky, each to its engine
                for s in old:
                    c.turn(s, "main", INCUMBENT)  # began before: never moved
            publish(cfg, [_order("rollback", 1)], "control")
            _serving(app, Arms(0))
            canary.weight_version = "0"  # its syncer re-applied the incumbent
            for s in new + ["after-rollback"]:
                c.turn(s, "main", None)  # the rolled-back version serves no one
            assert app.gate.routes.pinned(FULL_WEIGHTS) == 0
            publish(cfg, [_order("pause", 2), _order("weights", 2)], "control")
            canary.weight_version = "2"
            publish(cfg, [_order("resume", 2)], "control")
            _serving(app, Arms(0, 2, True))
            third = [f"third-{i}" for i in range(10)]
            arms3 = {s: _arm(s, 2) for s in third}
            assert {a for _, a in arms3.values()} == {CANDIDATE, INCUMBENT}
            for s in third:
                c.turn(s, *arms3[s])
            assert app.publisher.wait_idle(10)
        with running_proxy(cfg, main_url, follow_control=True) as (url, app):  # restarted mid-canary
            c2 = _Client(url, engines)
            c2.history = c.history
            _serving(app, Arms(0, 2, True))
            for s in third:
                c2.turn(s, "main", INCUMBENT)  # under way: to the incumbent, never the other way
            fresh = [f"fresh-{i}" for i in range(8)]
            for s in fresh:
                c2.turn(s, *_arm(s, 2))  # new sessions: the same hash
            publish(cfg, [_order("promote", 2)], "control")
            _serving(app, Arms(2))
            c2.turn("before-applied", "main", None)  # engine-0 not yet on v2: recorded as what served it (v0)
            main.weight_version = "2"  # engine-0's syncer applied the promoted v2
            for s in third + fresh:
                c2.turn(s, "main", None)
            assert app.publisher.wait_idle(10)
    expected = {**c.expected, **c2.expected}
    turns = [e for e in read_events(cfg, "turns", lambda evs: sum(e.TYPE == "turn" for e in evs) >= len(expected),
                                    timeout_s=30, settle_s=0.2) if e.TYPE == "turn"]
    assert {t.request_id: (t.canary, t.policy_version) for t in turns} == expected


def test_an_engine_that_reports_no_version_is_recorded_version_unknown_never_with_the_candidates(kafka_config):
    """Beside the canary engines, the highest applied version (the candidate's, once engine-1
    applied it) is not the version of an incumbent engine's answer: a turn whose engine reported
    none is recorded without token ids (its samples count for no arm) and with its routed arm's
    version, never another engine's."""
    main, canary = StandInEngine(weight_version=None), StandInEngine(weight_version="1")
    with serve_app(main) as main_url, serve_app(canary) as canary_url:
        cfg = kafka_config.replace(rollout={"enabled": True, "share": SHARE, "canary_engines": ["engine-1"]},
                                   trainer={"engines": ["engine-0", "engine-1"]},
                                   proxy={"canary_engine_url": canary_url})
        with running_proxy(cfg, main_url, follow_control=True) as (url, app):
            applied = events.Control(action="applied", epoch=1, policy_version=1, run_id="default",
                                     engine_id="engine-1")
            publish(cfg, [_order("pause", 1), _order("weights", 1), applied, _order("resume", 1)], "control")
            _serving(app, Arms(0, 1, True))
            wait_for(lambda: app.gate.state.applied_version == 1, what="the proxy to see v1 applied")
            sids = [f"s-{i}" for i in range(12)]
            engine_of = {s: "main" if _arm(s, 1)[1] == INCUMBENT else "canary" for s in sids}
            assert set(engine_of.values()) == {"main", "canary"}
            for s in sids:
                r = httpx.post(url + "/v1/chat/completions", json={"model": "default", "messages": [
                    {"role": "user", "content": s}]}, headers={"X-Session-Id": s}, timeout=30)
                assert r.status_code == 200, r.text
            assert app.publisher.wait_idle(10)
    turns = [e for e in read_events(cfg, "turns", lambda evs: sum(e.TYPE == "turn" for e in evs) >= len(sids),
                                    timeout_s=30, settle_s=0.2) if e.TYPE == "turn"]
    got = {t.session_id: (t.canary, t.policy_version, bool(t.response_token_ids)) for t in turns}
    assert got == {s: (INCUMBENT, 0, False) if engine_of[s] == "main" else (CANDIDATE, 1, True) for s in sids}
