"""The join state machine on its own: which records are held, which jobs start (no broker)."""

from __future__ import annotations

from pipeline import events
from pipeline.bus import Record
from pipeline.judge.join import FLUSH, JUDGE, RELEASE, Joiner

TP = ("turns", 0)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Stream:
    """Builds Records with increasing offsets and timestamps."""

    def __init__(self, tp=TP):
        self.tp, self.offset, self.ts = tp, 0, 1_000_000

    def rec(self, ev, dt_ms=10):
        self.ts += dt_ms
        r = Record(self.tp[0], self.tp[1], self.offset, ev.session_id, ev, self.ts)
        self.offset += 1
        return r


def turn(sid, k, side=False):
    return events.Turn(session_id=sid, turn_index=None if side else k, turn_type="side" if side else "main",
                       messages=[{"role": "user", "content": f"q{k}"}], prompt_token_ids=[1], response_token_ids=[2],
                       response_logprobs=[-0.1])


def ns(sid, k, role="user", text="thanks"):
    msgs = [] if text is None else [{"role": role, "content": text}]
    return events.NextState(session_id=sid, messages=msgs, after_turn_index=k)


def end(sid):
    return events.SessionEnd(session_id=sid)


def test_turn_waits_then_joins_with_user_and_tool_next_states():
    j, s = Joiner(300, at_least_one=True), Stream()
    t0 = s.rec(turn("a", 0))
    assert j.on_record(t0) == (False, [])  # held, not acknowledged
    assert j.waiting == 1
    ack, jobs = j.on_record(s.rec(ns("a", 0)))
    assert ack and len(jobs) == 1 and jobs[0].kind == JUDGE and jobs[0].candidate
    assert jobs[0].acks == [t0] and jobs[0].next_state[0]["role"] == "user"
    t1 = s.rec(turn("a", 1))
    assert j.on_record(t1)[0] is False
    ack, jobs = j.on_record(s.rec(ns("a", 1, role="tool", text="42 passed")))
    assert jobs[0].kind == JUDGE and not jobs[0].candidate and jobs[0].next_state[0]["role"] == "tool"
    assert j.waiting == 0 and not j.sessions  # nothing left to remember


def test_side_turns_and_orphans_are_acknowledged_and_ignored():
    j, s = Joiner(300, at_least_one=True), Stream()
    assert j.on_record(s.rec(turn("a", 0, side=True))) == (True, [])
    assert j.on_record(s.rec(ns("a", 0))) == (True, [])  # no waiting turn
    assert j.on_record(s.rec(end("a"))) == (True, [])
    j.on_record(s.rec(turn("a", 0)))
    assert j.on_record(s.rec(ns("a", 5))) == (True, [])  # next state of another turn index
    assert j.waiting == 1


def test_session_end_flushes_waiting_turn():
    j, s = Joiner(300, at_least_one=True), Stream()
    j.on_record(s.rec(turn("a", 0)))
    j.on_record(s.rec(ns("a", 0)))
    t1 = s.rec(turn("a", 1))
    j.on_record(t1)
    ack, jobs = j.on_record(s.rec(end("a")))
    assert ack and [(x.kind, x.reason, x.acks) for x in jobs] == [(FLUSH, "session_end", [t1])]
    assert not j.sessions and j.waiting == 0


def test_at_least_one_holds_turn_zero_until_first_judged_turn():
    j, s = Joiner(300, at_least_one=True), Stream()
    t0 = s.rec(turn("a", 0))
    j.on_record(t0)
    t1 = s.rec(turn("a", 1))  # turn 1 arrives without a next state for turn 0
    ack, jobs = j.on_record(t1)
    assert not ack and [(x.kind, x.reason, x.acks) for x in jobs] == [(FLUSH, "no_next_state", [])]
    ack, jobs = j.on_record(s.rec(ns("a", 1)))
    assert jobs[0].candidate and jobs[0].acks == [t1, t0]  # turn 0 released with the first judged turn


def test_open_rule_released_at_session_end_without_waiting_turn():
    j, s = Joiner(300, at_least_one=True), Stream()
    t0 = s.rec(turn("a", 0))
    j.on_record(t0)
    j.on_record(s.rec(ns("a", 0, text=None)))  # empty next state: flushed, rule still open
    ack, jobs = j.on_record(s.rec(end("a")))
    assert [(x.kind, x.acks) for x in jobs] == [(RELEASE, [t0])]


def test_session_first_met_mid_way_counts_as_trained():
    j, s = Joiner(300, at_least_one=True), Stream()
    j.on_record(s.rec(turn("a", 3)))
    _, jobs = j.on_record(s.rec(ns("a", 3)))
    assert not jobs[0].candidate


def test_opd_has_no_at_least_one_rule():
    j, s = Joiner(300, at_least_one=False), Stream()
    t0 = s.rec(turn("a", 0))
    j.on_record(t0)
    _, jobs = j.on_record(s.rec(turn("a", 1)))
    assert jobs[0].kind == FLUSH and jobs[0].acks == [t0]
    _, jobs = j.on_record(s.rec(ns("a", 1)))
    assert not jobs[0].candidate


def test_idle_timeout_on_wall_clock_and_in_event_time():
    clock = Clock()
    j, s = Joiner(60, at_least_one=True, clock=clock), Stream()
    t0 = s.rec(turn("a", 0))
    j.on_record(t0)
    clock.t += 59
    assert j.expire() == []
    clock.t += 2
    jobs = j.expire()
    assert [(x.kind, x.reason, x.acks) for x in jobs] == [(FLUSH, "idle_timeout", [t0])]
    assert not j.sessions
    # event time: the next state is stamped 61 s after the turn -> the turn timed out first
    j2, s2 = Joiner(60, at_least_one=True, clock=Clock()), Stream()
    u0 = s2.rec(turn("b", 0))
    j2.on_record(u0)
    ack, jobs = j2.on_record(s2.rec(ns("b", 0), dt_ms=61_000))
    assert ack and [(x.kind, x.reason) for x in jobs] == [(FLUSH, "idle_timeout")]


def test_revoked_partitions_forget_their_sessions():
    j = Joiner(300, at_least_one=True)
    j.on_record(Stream(("turns", 0)).rec(turn("a", 0)))
    j.on_record(Stream(("turns", 1)).rec(turn("b", 0)))
    assert j.drop_partitions({("turns", 0)}) == 1
    assert set(j.sessions) == {"b"} and j.waiting == 1
