"""Issue 23 (a reply is paired whenever it arrives) and issue 24 cases 4 and 8 (judge side),
through the real topics (broker) and the real judge app. ``StandInJudge`` (stand-in judge LLM,
votes scripted in the next-state text) is not a model.
"""

from __future__ import annotations

from prometheus_client import REGISTRY

from pipeline import events
from pipeline.testing.judge import JudgeThread, make_next_state, make_turn, short_id
from pipeline.testing.topics import publish, read_events

ZERO = "<<score: \\boxed{0}>>"
UP = "<<score: \\boxed{1}>>"
FAIL = "<<score: !500>>"


def configure(c, url, **judge):
    return c.replace(judge={"backend": "llm", "url": url, "mode": "rl", "group_id": f"{c.topics.prefix}judge",
                            "vote_timeout_s": 5.0, "retries": 0, "retry_backoff_s": 0.05, **judge},
                     engine={"model": "tiny-random", "teacher_url": url})


def run_judge(config, want: set[str], timeout_s: float = 60.0) -> dict:
    """Run the judge until the samples ``want`` (``<session>:<turn>:rl``) exist; samples by short id."""
    with JudgeThread(config):
        out = read_events(config, "samples", lambda evs: want <= {short_id(s.sample_id) for s in evs},
                          timeout_s=timeout_s, settle_s=1.0)
    got: dict = {}
    for s in out:
        got.setdefault(short_id(s.sample_id), []).append(s)
    return got


def counter(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# ---- issue 24 case 8: the at-least-one rule is the method's -------------------------------------------
def test_at_least_one_promotes_the_first_prm_judged_turn_of_the_conversation(kafka_config, judge_server):
    """Each session's first turn the PRM judged is trained (a vote of 0: reward 0, loss_mask 1);
    later 0 votes are not. Was: only turn 0 was ever promoted, so none of these sessions (turn 0
    aborted and retried as turn 1, an empty next state, all votes failed, first index 2) trained
    anything."""
    c = configure(kafka_config, judge_server.url)
    evs = [  # aborted turn 0, its retry is turn 1
        make_turn("abort", 0, finish_reason="abort"), make_turn("abort", 1),
        make_next_state("abort", 1, "hm " + ZERO), make_turn("abort", 2), make_next_state("abort", 2, "ok " + ZERO),
        # turn 0's next state is empty
        make_turn("empty", 0), make_next_state("empty", 0, None), make_turn("empty", 1),
        make_next_state("empty", 1, "hm " + ZERO),
        # turn 0's votes all fail: no judgement, not a 0
        make_turn("failed", 0), make_next_state("failed", 0, "x " + FAIL), make_turn("failed", 1),
        make_next_state("failed", 1, "hm " + ZERO),
        # the first request already carries history: first index 2
        make_turn("history", 2), make_next_state("history", 2, "hm " + ZERO), make_turn("history", 3),
        make_next_state("history", 3, "ok " + ZERO),
        # control: turn 0 trained on its +1 vote, so turn 1's 0 is not promoted
        make_turn("control", 0), make_next_state("control", 0, "great " + UP), make_turn("control", 1),
        make_next_state("control", 1, "ok " + ZERO)]
    promoted = counter("pipeline_judge_at_least_one_promoted_total")
    publish(c, evs)
    got = run_judge(c, {"abort:2:rl", "empty:1:rl", "failed:1:rl", "history:3:rl", "control:1:rl"})

    def signal(key):
        (s,) = got[key]
        return s.reward, s.loss_mask

    assert signal("abort:0:rl") == (None, 0)
    assert signal("abort:1:rl") == (0.0, 1)  # the retry: the first judged turn
    assert signal("abort:2:rl") == (0.0, 0)
    assert signal("empty:0:rl") == (None, 0) and signal("empty:1:rl") == (0.0, 1)
    assert signal("failed:0:rl") == (None, 0) and signal("failed:1:rl") == (0.0, 1)
    assert signal("history:2:rl") == (0.0, 1) and signal("history:3:rl") == (0.0, 0)
    assert signal("control:0:rl") == (1.0, 1) and signal("control:1:rl") == (0.0, 0)
    assert counter("pipeline_judge_at_least_one_promoted_total") - promoted == 4


# ---- issue 24 case 4: a new conversation with a reused session id ----------------------------------
def test_new_conversation_after_the_proxy_forgot_the_session_is_judged(kafka_config, judge_server):
    """The proxy evicted the session (or restarted), then a new conversation came with the same
    session id and turn indices from 0: both its turns are judged as new requests. Was: dropped
    as "older than" the old conversation's waiting turn (0 samples, counted as duplicates)."""
    c = configure(kafka_config, judge_server.url)
    dup = counter("pipeline_judge_duplicate_turns_total")
    new_conv = counter("pipeline_judge_new_conversations_total")
    t = events.now_ms()
    old = [make_turn("evict", 0, request_id="old-0", created_at=t),
           make_next_state("evict", 0, "thanks " + UP), make_turn("evict", 1, request_id="old-1", created_at=t + 10)]
    new = [make_turn("evict", 0, request_id="new-0", created_at=t + 1_000),
           make_next_state("evict", 0, "nice " + UP), make_turn("evict", 1, request_id="new-1", created_at=t + 2_000),
           make_next_state("evict", 1, "no, wrong " + "<<score: \\boxed{-1}>>"),
           events.SessionEnd(session_id="evict")]
    publish(c, old + new)
    with JudgeThread(c):
        out = read_events(c, "samples", 4, timeout_s=60, settle_s=1.0)
    by_request = {s.sample_id.rsplit(":", 1)[1]: s for s in out}
    assert set(by_request) == {"old-0", "old-1", "new-0", "new-1"}
    assert (by_request["old-0"].reward, by_request["old-0"].loss_mask) == (1.0, 1)
    assert (by_request["old-1"].reward, by_request["old-1"].loss_mask) == (None, 0)  # superseded: no next state
    assert (by_request["new-0"].reward, by_request["new-0"].loss_mask) == (1.0, 1)
    assert (by_request["new-1"].reward, by_request["new-1"].loss_mask) == (-1.0, 1)
    assert counter("pipeline_judge_duplicate_turns_total") == dup  # nothing taken for a duplicate
    assert counter("pipeline_judge_new_conversations_total") - new_conv == 1


# ---- issue 23: a reply is paired whenever it arrives -------------------------------------------------
def test_a_reply_ten_minutes_after_its_turn_is_judged(kafka_config, judge_server):
    """Default idle horizon; the turn, then other traffic on its partition for 10 minutes (event
    time), then the reply: the turn is judged on it. Was: closed by the 5-minute idle end, the
    reply dropped."""
    c = configure(kafka_config, judge_server.url, idle_timeout_s=kafka_config.judge.idle_timeout_s)
    assert c.judge.idle_timeout_s >= 3600
    t = events.now_ms() - 20 * 60_000
    evs = [make_turn("late", 0, created_at=t)]
    for minute in range(1, 10):  # other sessions' records on the same partition (keyed alike below)
        evs += [make_turn(f"busy{minute}", 0, created_at=t + minute * 60_000),
                events.SessionEnd(session_id=f"busy{minute}", created_at=t + minute * 60_000 + 1)]
    reply = make_next_state("late", 0, "thanks " + UP)
    reply.created_at = t + 10 * 60_000
    unjudged = counter("pipeline_judge_unjudged_turns_total", reason="idle_timeout")
    publish(c, evs + [reply], key="late")
    got = run_judge(c, {"late:0:rl"})
    (s,) = got["late:0:rl"]
    assert (s.reward, s.loss_mask, s.created_at) == (1.0, 1, reply.created_at)
    assert counter("pipeline_judge_unjudged_turns_total", reason="idle_timeout") == unjudged


def test_turns_ending_without_a_judgement_are_counted_by_reason(kafka_config, judge_server):
    """Every main turn that ends without a judgement is counted with its reason (the dashboard and
    the demo summary read this counter)."""
    c = configure(kafka_config, judge_server.url, idle_timeout_s=60.0)
    name = "pipeline_judge_unjudged_turns_total"
    reasons = ("unfinished", "empty_next_state", "no_next_state", "session_end", "votes_failed", "idle_timeout")
    before = {r: counter(name, reason=r) for r in reasons}
    t = events.now_ms()
    evs = [make_turn("u-cut", 0, finish_reason="abort", created_at=t),
           make_turn("u-empty", 0, created_at=t), make_next_state("u-empty", 0, None),
           make_turn("u-next", 0, created_at=t), make_turn("u-next", 1, created_at=t + 1),
           events.SessionEnd(session_id="u-next", created_at=t + 2),
           make_turn("u-fail", 0, created_at=t), make_next_state("u-fail", 0, "x " + FAIL),
           make_turn("u-idle", 0, created_at=t),
           events.SessionEnd(session_id="u-tick", created_at=t + 61_000)]  # 61 s later: u-idle is idle
    publish(c, evs, key="u")
    run_judge(c, {"u-cut:0:rl", "u-empty:0:rl", "u-next:0:rl", "u-next:1:rl", "u-fail:0:rl", "u-idle:0:rl"})
    assert {r: counter(name, reason=r) - before[r] for r in reasons} == {
        "unfinished": 1, "empty_next_state": 1, "no_next_state": 1, "session_end": 1, "votes_failed": 1,
        "idle_timeout": 1}


def test_combine_counts_a_turn_unjudged_only_when_both_judgements_failed(kafka_config, judge_server):
    """``combine``: every PRM vote fails but the hint votes give a hint, so the turn is judged
    (here the teacher cannot score these synthetic turns, which is counted as that, not as
    unjudged); a turn whose PRM and hint votes all fail is counted once as ``votes_failed``.
    Was: every failed PRM vote counted, whatever the hint."""
    c = configure(kafka_config, judge_server.url, mode="combine")
    name, hint = ("pipeline_judge_unjudged_turns_total",
                  "<<hint: \\boxed{1} [HINT_START]Run the unit tests before you answer again.[HINT_END]>>")
    before = counter(name, reason="votes_failed")
    unsupported = counter("pipeline_judge_teacher_unsupported_total", reason="prompt_mismatch")
    evs = [make_turn("c-hinted", 0), make_next_state("c-hinted", 0, "no " + FAIL + " " + hint),
           events.SessionEnd(session_id="c-hinted"),
           make_turn("c-none", 0), make_next_state("c-none", 0, "no " + FAIL + " <<hint: !500>>"),
           make_turn("c-none", 1), make_next_state("c-none", 1, "fine " + UP), events.SessionEnd(session_id="c-none")]
    publish(c, evs, key="c")
    got = run_judge(c, {"c-none:1:combine"})
    assert set(got) == {"c-none:1:combine"}  # neither the failed PRM nor the unscorable hint is a sample
    assert counter(name, reason="votes_failed") - before == 1  # c-none turn 0 only
    # c-hinted's hint was given (its teacher pass was tried): judged, not counted as unjudged
    assert counter("pipeline_judge_teacher_unsupported_total", reason="prompt_mismatch") - unsupported == 1
