"""Issue 40 in the join and the reward rule, on their own (no broker): when a feedback or a session
outcome reaches its turn, and which reward a turn's sources give (docs/feedback.md).

Rules restated: the latest feedback read before a turn is decided is its feedback (last wins); a
feedback read after is counted by reason, never attached; with a grace window a judged turn is
decided once its partition's event time is ``feedback_grace_s`` past its next state; an outcome
is credited to the turns decided at the session's end, ``outcome * discount ** k`` for the turn k
turns before the last; a precedence rule takes the first present source, a weighted rule the
weighted mean of the present ones; an absent source counts for nothing.
"""

from __future__ import annotations

import pytest

from pipeline import events
from pipeline.judge.feedback import RewardPolicy
from pipeline.judge.join import FLUSH, JUDGE, RELEASE, Joiner

from tests.judge.test_judge_join import Stream, end, ns, turn


def fb(sid, k, score, comment=None, rid=None):
    return events.Feedback(session_id=sid, turn_index=k, score=score, feedback_id=f"f{sid}{k}{score}",
                           turn_request_id=rid or f"{sid}-r{k}", comment=comment)


def test_feedback_before_the_next_state_reaches_the_job_last_one_wins():
    j, s = Joiner(300, at_least_one=True), Stream()
    j.on_record(s.rec(turn("a", 0)))
    assert j.on_record(s.rec(fb("a", 0, 1.0))) == (True, [])
    j.on_record(s.rec(fb("a", 0, -1.0, "say it in French")))  # a conflicting one, still undecided: it wins
    _, (job,) = j.on_record(s.rec(ns("a", 0)))
    assert job.kind == JUDGE and (job.feedback.score, job.feedback.comment) == (-1.0, "say it in French")
    j.on_record(s.rec(fb("a", 0, 1.0)))  # after the decision: counted, never attached
    assert j.late == {"after_decision": 1}


def test_feedback_on_a_turn_flushed_without_next_state_and_unknown_turns():
    j, s = Joiner(300, at_least_one=False), Stream()
    j.on_record(s.rec(turn("a", 0)))
    j.on_record(s.rec(fb("a", 0, 0.5)))
    _, jobs = j.on_record(s.rec(turn("a", 1)))  # turn 0 superseded without a next state
    assert [(x.kind, x.reason, x.feedback.score) for x in jobs] == [(FLUSH, "no_next_state", 0.5)]
    j.on_record(s.rec(fb("zz", 0, 1.0)))
    j.on_record(s.rec(fb("a", 0, 1.0, rid="a-other")))  # the same index of another conversation's turn
    assert j.late == {"unknown_turn": 2}
    _, jobs = j.on_record(s.rec(turn("a", 2, finish="abort")))
    j.on_record(s.rec(fb("a", 2, 1.0)))  # an unfinished turn is settled at once: decided
    assert j.late["after_decision"] == 1 and jobs[-1].reason == "unfinished" and jobs[-1].feedback is None


def test_grace_window_decides_on_event_time_not_on_arrival():
    """Grace 5 s: the judged turn is held until a record of its partition is 5 s past its next
    state; feedback read meanwhile is used, feedback read after is late."""
    j, s = Joiner(300, at_least_one=False, feedback_grace_s=5), Stream()
    j.on_record(s.rec(turn("a", 0)))
    ack, jobs = j.on_record(s.rec(ns("a", 0), dt_ms=10))
    assert ack and jobs == []
    assert j.on_record(s.rec(fb("a", 0, -1.0), dt_ms=1000)) == (True, [])  # 1 s later: within the window
    _, jobs = j.on_record(s.rec(turn("b", 0), dt_ms=2000))  # 3 s: still held
    assert jobs == []
    _, jobs = j.on_record(s.rec(turn("c", 0), dt_ms=2000))  # 5 s past the next state: decided before c
    assert [(x.kind, x.session, x.feedback.score) for x in jobs] == [(JUDGE, "a", -1.0)]
    j.on_record(s.rec(fb("a", 0, 1.0)))
    assert j.late == {"after_decision": 1}


def test_grace_keeps_a_sessions_jobs_in_order_and_its_end_decides_at_once():
    j, s = Joiner(300, at_least_one=True, feedback_grace_s=60), Stream()
    t0 = s.rec(turn("a", 0))
    j.on_record(t0)
    j.on_record(s.rec(ns("a", 0)))
    _, jobs = j.on_record(s.rec(turn("a", 1, finish="abort")))  # its flush waits behind the held turn 0
    assert jobs == []
    _, jobs = j.on_record(s.rec(end("a")))
    assert [(x.kind, x.reason) for x in jobs] == [(JUDGE, ""), (FLUSH, "unfinished"), (RELEASE, "")]


@pytest.mark.parametrize("hold", [False, True])
def test_outcome_is_credited_from_the_end_with_the_discount(hold):
    j, s = Joiner(300, at_least_one=False, outcome_hold=hold, outcome_discount=0.5), Stream()
    decided = []
    for k in range(3):
        j.on_record(s.rec(turn("a", k)))
        decided += j.on_record(s.rec(ns("a", k)))[1]
    j.on_record(s.rec(turn("a", 3)))
    _, jobs = j.on_record(s.rec(events.SessionEnd(session_id="a", outcome=-0.8)))
    credit = [(x.turn.turn_index, x.outcome) for x in decided + jobs if x.kind in (JUDGE, FLUSH)]
    if hold:  # every turn waited for the end
        assert decided == [] and credit == [(0, -0.1), (1, -0.2), (2, -0.4), (3, -0.8)]
    else:  # only the turn still undecided at the end
        assert credit == [(0, None), (1, None), (2, None), (3, -0.8)]


def test_an_outcome_with_no_undecided_turn_is_counted():
    j, s = Joiner(300, at_least_one=False), Stream()
    j.on_record(s.rec(turn("a", 0)))
    j.on_record(s.rec(ns("a", 0)))
    j.on_record(s.rec(events.SessionEnd(session_id="a", outcome=1.0)))
    assert j.late == {"outcome_after_decision": 1}


def test_replay_of_the_records_decides_the_same():
    """The same records, read again at another pace (another Stream, other wall clock): the same
    jobs with the same feedback and credits."""
    def run():
        j, s = Joiner(300, at_least_one=True, feedback_grace_s=2, outcome_discount=0.9), Stream()
        recs = [turn("a", 0), fb("a", 0, 1.0), ns("a", 0), fb("a", 0, -1.0, "no"), turn("a", 1), ns("a", 1),
                turn("a", 2), fb("a", 2, 0.5), events.SessionEnd(session_id="a", outcome=1.0)]
        out = []
        for ev in recs:
            out += [(x.kind, x.reason, x.turn and x.turn.turn_index, x.feedback and x.feedback.score, x.outcome)
                    for x in j.on_record(s.rec(ev, dt_ms=1500))[1]]
        return out, dict(j.late)
    first = run()
    assert first == run()
    assert first[0][:2] == [(JUDGE, "", 0, -1.0, None), (JUDGE, "", 1, None, None)]  # 1.5 s < 2 s: "no" used


# ---- the reward rule ---------------------------------------------------------------------------------
def test_precedence_takes_the_first_present_source():
    p = RewardPolicy()
    assert p.decide(1.0, -1.0, 0.5) == (-1.0, "feedback")
    assert p.decide(1.0, None, 0.5) == (0.5, "outcome")
    assert p.decide(0.0, None, None) == (0.0, "judge")  # a real vote of 0
    assert p.decide(None, None, None) == (None, None)
    assert not p.needs_judge(-1.0, None) and p.needs_judge(None, None)
    judge_first = RewardPolicy(order=("judge", "feedback", "outcome"))
    assert judge_first.decide(1.0, -1.0, None) == (1.0, "judge") and judge_first.needs_judge(-1.0, None)


def test_weighted_mean_of_the_present_sources_only():
    p = RewardPolicy("weighted", weights={"judge": 1.0, "feedback": 3.0, "outcome": 0.0})
    assert p.decide(1.0, -1.0, 1.0) == (pytest.approx(-0.5), "judge+feedback")  # outcome weighted 0: not used
    assert p.decide(None, -1.0, None) == (-1.0, "feedback")  # absent: not a 0 pulling the mean
    assert p.decide(None, None, 1.0) == (None, None)
    with pytest.raises(ValueError):
        RewardPolicy(order=("feedback", "judge"))
    with pytest.raises(ValueError):
        RewardPolicy("weighted", weights={"votes": 1.0})


def test_a_feedback_never_overtakes_its_turn_held_by_the_reorderer():
    """Several proxies: turn 1's next state and turn 2 arrive before turn 1 (another proxy's);
    turn 2's feedback, read before turn 1 too, waits behind turn 2 and reaches it undecided."""
    from pipeline.judge.reorder import Reorderer

    ro, j, s = Reorderer(lateness_s=60), Joiner(300, at_least_one=False), Stream()
    jobs = []
    for ev in (turn("a", 0), ns("a", 0), ns("a", 1), turn("a", 2), fb("a", 2, -1.0), turn("a", 1), ns("a", 2)):
        for r in ro.on_record(s.rec(ev)):
            jobs += j.on_record(r)[1]
    assert [(x.kind, x.turn.turn_index, x.feedback and x.feedback.score) for x in jobs] == [
        (JUDGE, 0, None), (JUDGE, 1, None), (JUDGE, 2, -1.0)]
    assert not j.late
