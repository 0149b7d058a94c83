"""The join state machine on its own: which records are held, which jobs start (no broker)."""

from __future__ import annotations

from pipeline import events
from pipeline.bus import Record
from pipeline.judge.join import FLUSH, JUDGE, Joiner

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


def turn(sid, k, side=False, rid=None, finish="stop"):
    return events.Turn(session_id=sid, turn_index=None if side else k, turn_type="side" if side else "main",
                       request_id=rid or f"{sid}-r{k}", messages=[{"role": "user", "content": f"q{k}"}],
                       prompt_token_ids=[1], response_token_ids=[2], response_logprobs=[-0.1], finish_reason=finish)


def ns(sid, k, role="user", text="thanks"):
    msgs = [] if text is None else [{"role": role, "content": text}]
    return events.NextState(session_id=sid, messages=msgs, after_turn_index=k)


def end(sid, turn_index=None, reason="header"):
    return events.SessionEnd(session_id=sid, reason=reason, turn_index=turn_index)


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


def test_at_least_one_is_turn_zero_and_nothing_is_held():
    """The rule is decided from the turn record alone (turn 0): a turn 0 without a next state is
    settled (and acknowledged) at once, and a later judged turn is not promoted."""
    j, s = Joiner(300, at_least_one=True), Stream()
    t0 = s.rec(turn("a", 0))
    j.on_record(t0)
    t1 = s.rec(turn("a", 1))  # turn 1 arrives without a next state for turn 0
    ack, jobs = j.on_record(t1)
    assert not ack and [(x.kind, x.reason, x.acks) for x in jobs] == [(FLUSH, "no_next_state", [t0])]
    ack, jobs = j.on_record(s.rec(ns("a", 1)))
    assert not jobs[0].candidate and jobs[0].acks == [t1]
    j2, s2 = Joiner(300, at_least_one=True), Stream()
    j2.on_record(s2.rec(turn("b", 0)))
    _, jobs = j2.on_record(s2.rec(ns("b", 0)))
    assert jobs[0].candidate


def test_empty_next_state_of_turn_zero_is_settled_at_once():
    j, s = Joiner(300, at_least_one=True), Stream()
    t0 = s.rec(turn("a", 0))
    j.on_record(t0)
    ack, jobs = j.on_record(s.rec(ns("a", 0, text=None)))  # empty next state: flushed
    assert [(x.kind, x.acks) for x in jobs] == [(FLUSH, [t0])]
    assert j.on_record(s.rec(end("a"))) == (True, [])


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


def test_idle_end_is_proposed_then_acted_on_only_when_read_back():
    clock = Clock()
    j, s = Joiner(60, at_least_one=True, clock=clock), Stream()
    t0 = s.rec(turn("a", 0))
    j.on_record(t0)
    now_ms = s.ts + 59_000
    clock.t += 59
    assert j.idle_sessions(now_ms) == []
    clock.t += 2
    assert j.idle_sessions(now_ms + 2_000, ready=lambda tp: False) == []  # partition not read to the end
    assert j.idle_sessions(now_ms + 2_000) == [("a", TP, 0)]
    assert j.idle_sessions(now_ms + 9_000) == []  # proposed once
    assert j.waiting == 1 and "a" in j.sessions  # nothing decided on the clock
    ack, jobs = j.on_record(s.rec(end("a", 0, "idle_timeout"), dt_ms=61_000))
    assert ack and [(x.kind, x.reason, x.acks) for x in jobs] == [(FLUSH, "idle_timeout", [t0])]
    assert not j.sessions
    # a producer whose clock is behind (old record timestamps) cannot close a session just read
    j2, s2 = Joiner(60, at_least_one=True, clock=Clock()), Stream()
    j2.on_record(s2.rec(turn("b", 0)))
    assert j2.idle_sessions(s2.ts + 10**9) == []


def test_lagging_judge_still_joins_the_next_state_already_in_the_log():
    """Case 7: the turn is read, the judge stalls 301 s, the next state (20 s after the turn) is
    in the log: it is judged. A proposed idle end lands after it and is then ignored."""
    clock = Clock()
    j, s = Joiner(300, at_least_one=True, clock=clock), Stream()
    t0 = s.rec(turn("a", 0))
    j.on_record(t0)
    clock.t += 301  # stalled: slow judge model, backlog
    proposals = j.idle_sessions(events.now_ms())  # the judge's clock says idle (its highwater is stale)
    assert proposals == [("a", TP, 0)]
    ack, jobs = j.on_record(s.rec(ns("a", 0), dt_ms=20_000))
    assert [(x.kind, x.candidate, x.acks) for x in jobs] == [(JUDGE, True, [t0])]
    ack, jobs = j.on_record(s.rec(end("a", 0, "idle_timeout"), dt_ms=281_000))  # the proposal, read back
    assert ack and jobs == []


def test_idle_end_overtaken_by_a_newer_turn_is_ignored():
    j, s = Joiner(60, at_least_one=False), Stream()
    j.on_record(s.rec(turn("a", 0)))
    t1 = s.rec(turn("a", 1))
    _, jobs = j.on_record(t1)
    assert [x.reason for x in jobs] == ["no_next_state"]
    ack, jobs = j.on_record(s.rec(end("a", 0, "idle_timeout")))  # names turn 0; turn 1 came after
    assert ack and jobs == [] and j.waiting == 1
    ack, jobs = j.on_record(s.rec(ns("a", 1)))
    assert [x.kind for x in jobs] == [JUDGE]


def test_unfinished_turn_is_flushed_at_once_and_its_next_state_ignored():
    j, s = Joiner(300, at_least_one=False), Stream()
    cut = s.rec(turn("a", 0, finish="abort"))
    ack, jobs = j.on_record(cut)
    assert not ack and [(x.kind, x.reason, x.acks) for x in jobs] == [(FLUSH, "unfinished", [cut])]
    assert j.waiting == 0
    assert j.on_record(s.rec(ns("a", 0))) == (True, [])  # the user continued: nothing is judged
    for reason in (None, "cancelled"):
        _, jobs = Joiner(300, at_least_one=False).on_record(Stream().rec(turn("b", 0, finish=reason)))
        assert [x.reason for x in jobs] == ["unfinished"]
    for reason in ("stop", "length", "tool_calls"):
        assert Joiner(300, at_least_one=False).on_record(Stream().rec(turn("c", 0, finish=reason)))[1] == []


def test_duplicate_turn_records_are_ignored():
    j, s = Joiner(300, at_least_one=True), Stream()
    t0 = turn("a", 0)
    j.on_record(s.rec(t0))
    assert j.on_record(s.rec(t0)) == (True, [])  # while waiting
    _, jobs = j.on_record(s.rec(ns("a", 0)))
    assert [x.kind for x in jobs] == [JUDGE]
    assert j.on_record(s.rec(t0)) == (True, [])  # after it was judged: no second, different sample
    assert j.on_record(s.rec(ns("a", 0))) == (True, [])
    assert j.duplicates == 2


def test_reused_session_id_is_a_new_conversation():
    j, s = Joiner(300, at_least_one=True), Stream()
    j.on_record(s.rec(turn("a", 0, rid="conv1-0")))
    _, jobs = j.on_record(s.rec(ns("a", 0)))
    first = jobs[0]
    j.on_record(s.rec(end("a")))
    j.on_record(s.rec(turn("a", 0, rid="conv2-0")))  # same session id, new conversation
    _, jobs = j.on_record(s.rec(ns("a", 0)))
    second = jobs[0]
    assert first.candidate and second.candidate  # each conversation gets its at-least-one turn
    assert (first.turn.request_id, second.turn.request_id) == ("conv1-0", "conv2-0")


def test_job_event_times_come_from_the_records():
    j, s = Joiner(300, at_least_one=False), Stream()
    t = turn("a", 0)
    t.created_at = 1_000
    j.on_record(s.rec(t))
    n = ns("a", 0)
    n.created_at = 5_000
    _, jobs = j.on_record(s.rec(n))
    assert jobs[0].decided_at == 5_000


def test_revoked_partitions_forget_their_sessions():
    j = Joiner(300, at_least_one=True)
    a0 = Stream(("turns", 0)).rec(turn("a", 0))
    j.on_record(a0)
    j.on_record(Stream(("turns", 1)).rec(turn("b", 0)))
    assert j.drop_partitions({("turns", 0)}) == 1
    assert set(j.sessions) == {"b"} and j.waiting == 1
    assert j.on_record(a0) == (False, [])  # re-delivered after the revocation: not a duplicate
