"""Sessions through two real proxies behind the round-robin front, judged from a real broker.

Each request of a session goes to the other proxy (round robin). Proxy A publishes with a long
linger, so its ``turn`` events reach the broker after B's ``next_state`` for them (and B's next
turn): the order of one session's records on the topic differs from the order they happened.
Every answered turn must still be recorded once with its own index, and every turn followed by a
next state judged exactly once with that next state (what one proxy guarantees).
"""

from __future__ import annotations

import httpx

from pipeline import events
from pipeline.judge.backends.constant import ConstantBackend
from pipeline.orchestrate.front import Backend, Front
from tests.orchestrate.test_front import running_front
from pipeline.testing.judge import JudgeThread, short_id
from pipeline.testing.proxy import running_proxy
from pipeline.testing.servers import Reply, StandInEngine, serve_app
from pipeline.testing.topics import read_events

SESSIONS, TURNS = 3, 4


def _converse(url: str, sid: str, turns: int) -> list[tuple[int, str, str]]:
    """A sequential conversation; returns ``(turn index, request id, upstream)`` per request."""
    msgs = [{"role": "user", "content": f"hello from {sid}"}]
    out = []
    for k in range(turns):
        headers = {"X-Session-Id": sid}
        if k == turns - 1:
            headers["X-Session-Done"] = "true"
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 8},
                       headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        out.append((int(r.headers["x-turn-index"]), r.headers["x-request-id"], r.headers["x-upstream"]))
        msgs = msgs + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                       {"role": "user", "content": f"{sid} reply {k}"}]
    return out


def test_turns_of_one_session_through_two_proxies_are_all_recorded_and_judged(kafka_config):
    n = [0]

    def script(req):
        n[0] += 1
        return Reply(content=f"answer {n[0]}")

    with serve_app(StandInEngine(script)) as engine_url, \
            running_proxy(kafka_config, engine_url, publish_linger_ms=400) as (slow, _), \
            running_proxy(kafka_config, engine_url, publish_linger_ms=0) as (fast, _):
        with running_front(Front([Backend(slow), Backend(fast)], health_interval_s=0)) as url:
            served = {f"x{i}": _converse(url, f"x{i}", TURNS) for i in range(SESSIONS)}
        want = SESSIONS * (2 * TURNS)  # a turn per request, a next state per later request, an end per session
        recs = read_events(kafka_config, "turns", want, timeout_s=30)

    for sid, rows in served.items():
        assert [k for k, _, _ in rows] == list(range(TURNS)), "indices 0..n-1 whichever proxy answered"
        assert len({u for _, _, u in rows}) == 2, "the session used both proxies"
    turns = [e for e in recs if isinstance(e, events.Turn)]
    assert sorted(t.request_id for t in turns) == sorted(rid for rows in served.values() for _, rid, _ in rows)
    nexts = [e for e in recs if isinstance(e, events.NextState)]
    assert sorted((e.session_id, e.after_turn_index, e.messages[-1]["content"]) for e in nexts) == sorted(
        (sid, k, f"{sid} reply {k}") for sid in served for k in range(TURNS - 1))
    # the records of the sessions are on the topic out of protocol order (one proxy lingers)
    protocol = [("Turn", 0)] + [x for k in range(1, TURNS) for x in (("NextState", k - 1), ("Turn", k))] + \
        [("SessionEnd", None)]
    orders = {sid: [(type(e).__name__, getattr(e, "turn_index", getattr(e, "after_turn_index", None)))
                    for e in recs if getattr(e, "session_id", None) == sid] for sid in served}
    assert all(sorted(o, key=str) == sorted(protocol, key=str) for o in orders.values())
    assert any(o != protocol for o in orders.values()), orders

    with JudgeThread(kafka_config, mode="rl", backend=ConstantBackend(kafka_config), group_id="judge-replicas"):
        samples = read_events(kafka_config, "samples", SESSIONS * TURNS, timeout_s=60)
    got = {short_id(s.sample_id): s for s in samples}
    assert len(got) == SESSIONS * TURNS
    for sid in served:
        for k in range(TURNS - 1):
            s = got[f"{sid}:{k}:rl"]
            assert s.votes == [1] and s.loss_mask == 1, f"{sid} turn {k} was judged with its next state"
        last = got[f"{sid}:{TURNS - 1}:rl"]
        assert last.votes == [] and last.loss_mask == 0, "the last turn has no next state"
