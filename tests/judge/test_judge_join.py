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
    assert jobs[0].acks == [] and jobs[0].next_state[0]["role"] == "user"
    conv = jobs[0].conversation
    t1 = s.rec(turn("a", 1))
    assert j.on_record(t1)[0] is False
    ack, jobs = j.on_record(s.rec(ns("a", 1, role="tool", text="42 passed")))
    assert jobs[0].kind == JUDGE and jobs[0].next_state[0]["role"] == "tool"
    assert jobs[0].conversation is conv  # one conversation: the app decides the rule along it
    assert j.waiting == 0 and jobs[0].acks == [t1]
    _, jobs = j.on_record(s.rec(end("a")))  # the conversation ends: its anchor (turn 0) is released
    assert [(x.kind, x.acks) for x in jobs] == [(RELEASE, [t0])]


def test_side_turns_and_orphans_are_acknowledged_and_ignored():
    j, s = Joiner(300, at_least_one=True), Stream()
    assert j.on_record(s.rec(turn("a", 0, side=True))) == (True, [])
    assert j.on_record(s.rec(ns("a", 0))) == (True, [])  # no waiting turn
    assert j.on_record(s.rec(end("a"))) == (True, [])
    j.on_record(s.rec(turn("a", 0)))
    assert j.on_record(s.rec(ns("a", 5))) == (True, [])  # next state of another turn index
    assert j.waiting == 1


def test_session_end_flushes_waiting_turn():
    j, s = Joiner(300, at_least_one=False), Stream()
    j.on_record(s.rec(turn("a", 0)))
    j.on_record(s.rec(ns("a", 0)))
    t1 = s.rec(turn("a", 1))
    j.on_record(t1)
    ack, jobs = j.on_record(s.rec(end("a")))
    assert ack and [(x.kind, x.reason, x.acks) for x in jobs] == [(FLUSH, "session_end", [t1])]
    assert not j.sessions and j.waiting == 0


def test_at_least_one_follows_the_conversation_not_turn_zero():
    """Issue 24 case 8: a turn 0 without a next state is settled (and acknowledged) at once; the
    judged turn 1 is a candidate of the same, untrained conversation (the app promotes it)."""
    j, s = Joiner(300, at_least_one=True), Stream()
    t0 = s.rec(turn("a", 0))
    j.on_record(t0)
    t1 = s.rec(turn("a", 1))  # turn 1 arrives without a next state for turn 0
    ack, jobs = j.on_record(t1)
    assert not ack and [(x.kind, x.reason, x.acks) for x in jobs] == [(FLUSH, "no_next_state", [])]  # t0: the anchor
    ack, jobs = j.on_record(s.rec(ns("a", 1)))
    assert jobs[0].candidate and jobs[0].acks == [t1] and not jobs[0].conversation.trained
    _, jobs = Joiner(300, at_least_one=False).on_record(Stream().rec(turn("b", 0)))
    assert jobs == []


def test_empty_next_state_of_turn_zero_is_settled_at_once():
    j, s = Joiner(300, at_least_one=False), Stream()
    t0 = s.rec(turn("a", 0))
    j.on_record(t0)
    ack, jobs = j.on_record(s.rec(ns("a", 0, text=None)))  # empty next state: flushed
    assert [(x.kind, x.acks) for x in jobs] == [(FLUSH, [t0])]
    assert j.on_record(s.rec(end("a"))) == (True, [])


def test_session_first_met_mid_way_is_a_conversation_of_its_own():
    """A session whose first record here is turn 3 (history in the first request) is untrained."""
    j, s = Joiner(300, at_least_one=True), Stream()
    j.on_record(s.rec(turn("a", 3)))
    _, jobs = j.on_record(s.rec(ns("a", 3)))
    assert jobs[0].candidate and not jobs[0].conversation.trained


def test_opd_has_no_at_least_one_rule():
    j, s = Joiner(300, at_least_one=False), Stream()
    t0 = s.rec(turn("a", 0))
    j.on_record(t0)
    _, jobs = j.on_record(s.rec(turn("a", 1)))
    assert jobs[0].kind == FLUSH and jobs[0].acks == [t0]
    _, jobs = j.on_record(s.rec(ns("a", 1)))
    assert not jobs[0].candidate


def test_idle_end_is_proposed_in_event_time_then_acted_on_only_when_read_back():
    """Issue 23: the idle horizon is event time (the partition's newest record), never a clock."""
    clock = Clock()
    j, s = Joiner(60, at_least_one=False, clock=clock), Stream()
    t0 = s.rec(turn("a", 0))
    j.on_record(t0)
    clock.t += 10**6  # any time on this process's clock: nothing is idle without newer records
    assert j.idle_sessions() == []
    j.on_record(s.rec(turn("b", 0), dt_ms=59_000))  # another session, 59 s later (event time)
    assert j.idle_sessions() == []
    b1 = s.rec(turn("b", 1), dt_ms=2_000)  # 61 s after a's turn
    j.on_record(b1)
    assert j.idle_sessions(ready=lambda tp: False) == []  # partition not read to the end
    assert j.idle_sessions() == [("a", TP, 0, b1.timestamp_ms)]  # the end's event time: the watermark
    assert j.idle_sessions() == []  # proposed once
    assert j.waiting == 2 and "a" in j.sessions  # nothing decided before the end is read back
    ack, jobs = j.on_record(s.rec(end("a", 0, "idle_timeout")))
    assert ack and [(x.kind, x.reason, x.acks) for x in jobs] == [(FLUSH, "idle_timeout", [t0])]
    assert "a" not in j.sessions


def test_reply_ten_minutes_later_is_judged():
    """Issue 23: a reply 10 minutes (event time) after its turn, with the default horizon and other
    traffic on the partition meanwhile, is joined and judged."""
    from pipeline.config import load_config

    j, s = Joiner(load_config(None).judge.idle_timeout_s, at_least_one=False), Stream()
    t0 = s.rec(turn("a", 0))
    j.on_record(t0)
    for minute in range(1, 10):  # other sessions keep the partition busy
        j.on_record(s.rec(turn(f"o{minute}", 0), dt_ms=60_000))
        assert ("a", TP, 0) not in [x[:3] for x in j.idle_sessions()]
    _, jobs = j.on_record(s.rec(ns("a", 0), dt_ms=60_000))
    assert [(x.kind, x.acks) for x in jobs] == [(JUDGE, [t0])]


def test_lagging_judge_still_joins_the_next_state_already_in_the_log():
    """Case 7: the turn is read, a record 301 s later (another session) makes it idle, the next
    state (20 s after the turn) is in the log after it: it is judged. The proposed idle end lands
    after it and is then ignored."""
    j, s = Joiner(300, at_least_one=True), Stream()
    t0 = s.rec(turn("a", 0))
    j.on_record(t0)
    j.on_record(s.rec(turn("b", 0), dt_ms=301_000))
    assert [x[:3] for x in j.idle_sessions()] == [("a", TP, 0)]
    n = ns("a", 0)
    n.created_at = t0.timestamp_ms + 20_000  # written late by a slow producer
    ack, jobs = j.on_record(s.rec(n))
    assert [(x.kind, x.candidate, x.acks) for x in jobs] == [(JUDGE, True, [])]  # t0 is its conversation's anchor
    ack, jobs = j.on_record(s.rec(end("a", 0, "idle_timeout")))  # the proposal, read back
    assert ack and [(x.kind, x.acks) for x in jobs] == [(RELEASE, [t0])]  # nothing flushed: the anchor released


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


def test_new_conversation_with_a_reused_session_id_is_not_a_duplicate():
    """Issue 24 case 4: the proxy evicted (or lost) the session; a new conversation arrives with
    the same session id and indices from 0. Its turns are new requests: the old waiting turn is
    superseded, the new turns are joined and judged, the rule starts afresh. Was: both new turns
    dropped as "older than" the waiting turn 1."""
    j, s = Joiner(300, at_least_one=True), Stream()
    old0 = s.rec(turn("a", 0, rid="old-0"))
    j.on_record(old0)
    _, jobs = j.on_record(s.rec(ns("a", 0)))
    old_conv = jobs[0].conversation
    old_conv.trained = True  # as the app would mark it
    old1 = s.rec(turn("a", 1, rid="old-1"))
    j.on_record(old1)
    new0 = s.rec(turn("a", 0, rid="new-0"))  # later in event time, index 0 again
    ack, jobs = j.on_record(new0)
    assert not ack and [(x.kind, x.reason, x.acks) for x in jobs] == [(FLUSH, "no_next_state", [old1]),
                                                                  (RELEASE, "", [old0])]  # the old anchor
    _, jobs = j.on_record(s.rec(ns("a", 0)))
    assert [(x.kind, x.acks) for x in jobs] == [(JUDGE, [])]  # new0: the new conversation's anchor
    assert jobs[0].conversation is not old_conv and not jobs[0].conversation.trained
    new1 = s.rec(turn("a", 1, rid="new-1"))
    assert j.on_record(new1) == (False, [])
    _, jobs = j.on_record(s.rec(ns("a", 1)))
    assert [(x.kind, x.acks) for x in jobs] == [(JUDGE, [new1])]
    assert j.duplicates == 0 and j.stale == 0 and j.conversations == 1


def test_late_turn_is_settled_without_a_judgement_not_dropped():
    """A turn record older (event time) than the session's latest turn, with a lower index (it
    arrived late from another proxy), is settled at once (out_of_order) and the waiting turn keeps
    waiting; the same request again is a duplicate."""
    j, s = Joiner(300, at_least_one=False), Stream()
    t1 = turn("a", 1, rid="r1")
    t1.created_at = 5_000
    w = s.rec(t1)
    j.on_record(w)
    late = turn("a", 0, rid="r0")
    late.created_at = 4_000
    rl = s.rec(late)
    ack, jobs = j.on_record(rl)
    assert not ack and [(x.kind, x.reason, x.acks) for x in jobs] == [(FLUSH, "out_of_order", [rl])]
    assert j.waiting == 1 and j.stale == 1
    _, jobs = j.on_record(s.rec(ns("a", 1)))
    assert [(x.kind, x.acks) for x in jobs] == [(JUDGE, [w])]
    assert j.on_record(s.rec(late)) == (True, []) and j.duplicates == 1


def test_new_conversation_at_the_index_of_a_settled_one_turn_conversation_is_new():
    """The proxy dropped session ``a`` after its one-turn conversation was judged (turn 0 +
    next state); a new conversation under ``a`` starts at index 0 again. Its turn 0 is a new
    conversation (the rule starts afresh, the old anchor is released), not the old one's: was
    the same conversation, already trained, so its first judged turn was no longer promoted."""
    j, s = Joiner(300, at_least_one=True), Stream()
    j.on_record(s.rec(turn("a", 0, rid="old-0")))
    _, jobs = j.on_record(s.rec(ns("a", 0)))
    old = jobs[0].conversation
    old.trained = True  # the app trained the old conversation's turn
    _, jobs = j.on_record(s.rec(turn("a", 0, rid="new-0"), dt_ms=60_000))
    assert [x.kind for x in jobs] == [RELEASE] and j.conversations == 1
    _, jobs = j.on_record(s.rec(ns("a", 0)))
    assert jobs[0].turn.request_id == "new-0" and jobs[0].conversation is not old
    assert jobs[0].candidate and not jobs[0].conversation.trained


def test_a_turn_asked_again_while_it_waits_stays_in_its_conversation():
    """The same index while that turn still waits is the turn asked again (a retry through a
    replica that lost the session): it supersedes the waiting turn in the same conversation."""
    j, s = Joiner(300, at_least_one=True), Stream()
    _, jobs = j.on_record(s.rec(turn("a", 0, rid="try-1")))
    _, jobs = j.on_record(s.rec(turn("a", 0, rid="try-2")))
    assert [(x.kind, x.reason) for x in jobs] == [(FLUSH, "no_next_state")] and j.conversations == 0
