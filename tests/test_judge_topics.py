"""Topic-level integration tests of the judge: real broker, real HTTP judge endpoint.

The judge endpoint is :class:`StandInJudge`, a stand-in (not a model) whose answers are
scripted by ``<<score: ...>>`` / ``<<hint: ...>>`` directives inside the next-state text.
"""

from __future__ import annotations

import time

import pytest
from kafka import KafkaConsumer, TopicPartition
from prometheus_client import REGISTRY

from pipeline import events
from pipeline.bus import EventProducer, consumer_kwargs
from pipeline.engine_api.render import ChatRenderer, load_tokenizer
from pipeline.testing.judge import JudgeThread, make_next_state, make_turn, short_id
from pipeline.testing.servers import StandInJudge, fake_logprob
from pipeline.testing.topics import publish, read_events

B1, BM1, B0 = "\\boxed{1}", "\\boxed{-1}", "\\boxed{0}"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-random")


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return ChatRenderer(tokenizer)


@pytest.fixture(scope="module")
def server(tokenizer):
    with StandInJudge(hang_s=5.0, tokenizer=tokenizer) as s:
        yield s


def setup(config, server, **judge):
    return config.replace(judge={"backend": "llm", "url": server.url, "group_id": f"{config.topics.prefix}judge",
                                 "vote_timeout_s": 1.0, "retries": 1, "retry_backoff_s": 0.05, **judge},
                          engine={"teacher_url": server.url, "model": "tiny-random"})


def score(*items):
    return "<<score: " + " || ".join(items) + ">>"


def hint(*items):
    return "<<hint: " + " || ".join(items) + ">>"


def by_id(samples):
    """Samples keyed by ``<session>:<turn>:<mode>`` (their ids without the request id)."""
    out = {}
    for s in samples:
        assert isinstance(s, events.Sample)
        key = short_id(s.sample_id)
        assert key not in out, f"duplicate {s.sample_id}"
        out[key] = s
    return out


def metric(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_rl_join_session_end_parsing_and_at_least_one(kafka_config, server):
    c = setup(kafka_config, server)
    evs = []
    # join with a user reply (turn 0), a tool result (turn 1); session end flushes turn 2
    evs += [make_turn("join", 0), make_next_state("join", 0, "Great, thanks! " + score(B1)),
            make_turn("join", 1), make_next_state("join", 1, "Error: not found " + score(BM1), role="tool", name="fs"),
            make_turn("join", 2), events.SessionEnd(session_id="join")]
    # parsing cases, each on turn 1 (turn 0 is +1, so the at-least-one rule is already spent)
    cases = {
        "tie": (score(B1, BM1, B0), 0, [1, -1, 0]),
        "float": (score("\\boxed{1.0}", "\\boxed{ +1 }", "\\boxed{-1}"), 1, [1, 1, -1]),
        # every vote failed: no judgement, so no reward (absent, never a 0)
        "nobox": (score("I think it is good."), None, [None, None, None]),
        "http500": (score("!500"), None, [None, None, None]),
        "http400": (score("!400"), None, [None, None, None]),
        "hang": (score("!hang"), None, [None, None, None]),
        "oneparsed": (score("\\boxed{-1.0}", "no box", "\\boxed{2}"), -1, [-1, None, None]),
    }
    for sid, (directive, _, _) in cases.items():
        evs += [make_turn(sid, 0), make_next_state(sid, 0, score(B1)),
                make_turn(sid, 1), make_next_state(sid, 1, "reply " + directive), events.SessionEnd(session_id=sid)]
    # at-least-one rule
    evs += [make_turn("alo0", 0), make_next_state("alo0", 0, score(B0)),  # turn 0 judged, vote 0: trained
            make_turn("alo0", 1), make_next_state("alo0", 1, score(B0)),  # later vote 0: masked
            events.SessionEnd(session_id="alo0")]
    evs += [make_turn("alo1", 0), make_turn("alo1", 1),  # turn 0 never got a next state
            make_next_state("alo1", 1, score(B0)), events.SessionEnd(session_id="alo1")]
    evs += [make_turn("alo2", 0), events.SessionEnd(session_id="alo2")]  # nothing judged: nothing trained
    # turn 0's votes all fail: not a judged turn, so the at-least-one rule does not promote it
    # (turn 1's votes fail too: nothing of the conversation is judged, nothing trained)
    evs += [make_turn("alo3", 0), make_next_state("alo3", 0, score("!500")),
            make_turn("alo3", 1), make_next_state("alo3", 1, score("no box here")), events.SessionEnd(session_id="alo3")]
    # the session ends while the (slow) vote of its turn 0 is still running
    evs += [make_turn("race", 0), make_next_state("race", 0, score("!sleep 0.5 " + B0)),
            events.SessionEnd(session_id="race")]
    # side turns take no part
    evs += [events.Turn(session_id="side", turn_type="side", messages=[]), events.SessionEnd(session_id="side")]
    parse_failures = metric("pipeline_judge_parse_failures_total")
    all_failed = metric("pipeline_judge_all_votes_failed_total")
    publish(c, evs)
    want = 3 + 2 * len(cases) + 2 + 2 + 1 + 2 + 1
    with JudgeThread(c):
        got = by_id(read_events(c, "samples", want, timeout_s=60))
    assert len(got) == want, sorted(got)
    j0, j1, j2 = got["join:0:rl"], got["join:1:rl"], got["join:2:rl"]
    assert (j0.reward, j0.loss_mask, j0.votes) == (1.0, 1, [1, 1, 1])
    assert (j1.reward, j1.loss_mask, j1.votes) == (-1.0, 1, [-1, -1, -1])
    assert (j2.reward, j2.loss_mask, j2.votes) == (None, 0, [])  # flushed by session end: no reward
    assert j0.tokens == [1, 2, 3, 4, 5, 6, 7] and j0.response_length == 3 and j0.kind == "rl"
    assert j0.rollout_log_probs == pytest.approx([-0.125, -0.25, -0.375]) and j0.judge == "llm"
    for sid, (_, reward, votes) in cases.items():
        s = got[f"{sid}:1:rl"]
        assert (s.reward, sorted(s.votes, key=str)) == (reward, sorted(votes, key=str)), sid
        assert (s.reward is None) == (reward is None), sid  # None is not 0
        assert s.loss_mask == (1 if reward else 0), sid
    assert metric("pipeline_judge_parse_failures_total") - parse_failures >= 3 + 2  # nobox x3, oneparsed x2
    assert metric("pipeline_judge_all_votes_failed_total") - all_failed >= 4  # nobox, 500, 400, hang
    a = got["alo0:0:rl"], got["alo0:1:rl"]
    assert [(s.reward, s.loss_mask) for s in a] == [(0.0, 1), (0.0, 0)]
    b = got["alo1:0:rl"], got["alo1:1:rl"]
    # turn 0 was never judged; turn 1 is the conversation's first judged turn: its 0 vote is
    # promoted (issue 24 case 8: OpenClaw-RL's rule, not turn 0's)
    assert [(s.reward, s.loss_mask) for s in b] == [(None, 0), (0.0, 1)]
    assert (got["alo2:0:rl"].loss_mask, got["race:0:rl"].loss_mask) == (0, 1)
    c3 = got["alo3:0:rl"], got["alo3:1:rl"]
    assert [(s.reward, s.loss_mask, s.votes) for s in c3] == [(None, 0, [None] * 3)] * 2
    # per-session order on the samples topic
    samples = read_events(c, "samples", want, timeout_s=5)
    for sid in ["join", *cases]:
        idx = [s.turn_index for s in samples if s.session_id == sid]
        assert idx == sorted(idx), sid


def _committed(config, group, topic="turns"):
    name = config.topics.name(topic)
    c = KafkaConsumer(**consumer_kwargs(config, group))
    try:
        parts = c.partitions_for_topic(name) or set()
        return {p: c.committed(TopicPartition(name, p)) for p in parts}
    finally:
        c.close()


def test_idle_timeout_flushes_waiting_turn_and_lets_offsets_commit(kafka_config, server):
    """The idle horizon is event time: a record 2 s (event time) after the turns, on their
    partition, makes them idle (1 s horizon); the ends are records, acted on when read back."""
    c = setup(kafka_config, server, idle_timeout_s=1.0)
    t = events.now_ms()
    publish(c, [make_turn("idle", 0, created_at=t), make_turn("idle-opd", 0, created_at=t),
                events.SessionEnd(session_id="tick", created_at=t + 2_000)], key="idle")  # one partition
    with JudgeThread(c) as jt:
        got = by_id(read_events(c, "samples", 2, timeout_s=30))
        assert set(got) == {"idle:0:rl", "idle-opd:0:rl"}
        assert got["idle:0:rl"].loss_mask == 0
        # the idle decision is a record in the log (published, then acted on when read back)
        ends = [e for e in read_events(c, "turns", 5, timeout_s=10) if isinstance(e, events.SessionEnd)
                and e.session_id != "tick"]
        assert sorted((e.session_id, e.reason, e.turn_index) for e in ends) == [
            ("idle", "idle_timeout", 0), ("idle-opd", "idle_timeout", 0)]
        assert got["idle:0:rl"].created_at == next(e.created_at for e in ends if e.session_id == "idle")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            committed = _committed(c, c.judge.group_id)
            if sum(v or 0 for v in committed.values()) == 5:
                break
            time.sleep(0.2)
        assert sum(v or 0 for v in committed.values()) == 5, committed  # both held turns (and the ends) committed
        assert jt.app.joiner.waiting == 0 and not jt.app.joiner.sessions


def test_opd_mode_hints_and_teacher_alignment(kafka_config, server, tokenizer, renderer):
    c = setup(kafka_config, server, mode="opd", teacher_top_k=0)
    long_hint = "Give the distance in kilometres, not miles."
    evs = [make_turn("opd", 0, request="How far is it?", response_ids=[101, 102, 103, 104], renderer=renderer,
                     temperature=0.6),
           make_next_state("opd", 0, "in km please " + hint(f"\\boxed{{1}} [HINT_START]{long_hint}[HINT_END]",
                                                              "\\boxed{1} [HINT_START]shorter hint[HINT_END]",
                                                              BM1)),
           make_turn("opd", 1), make_next_state("opd", 1, "ok " + hint("\\boxed{1} [HINT_START]0123456789[HINT_END]")),
           make_turn("opd", 2), make_next_state("opd", 2, "fine " + hint(BM1)),
           make_turn("opd", 3), events.SessionEnd(session_id="opd"),
           make_turn("opd-late", 0, renderer=renderer), make_next_state("opd-late", 0, "x " + hint(f"\\boxed{{1}} [HINT_START]{long_hint}[HINT_END]"))]
    server.generate_bodies.clear()
    publish(c, evs)
    with JudgeThread(c):
        got = by_id(read_events(c, "samples", 2, timeout_s=30, settle_s=1.0))
    assert set(got) == {"opd:0:opd", "opd-late:0:opd"}  # 10-char hint, -1 vote, flushed turn: no sample
    s = got["opd:0:opd"]
    assert (s.kind, s.reward, s.loss_mask, s.hint) == ("opd", None, 1, long_hint)
    body = next(b for b in server.generate_bodies if b["input_ids"][-4:] == [101, 102, 103, 104])
    ids, start = body["input_ids"], body["logprob_start_len"]
    assert start == len(ids) - 4 - 1  # log-probs start exactly at the response
    assert body["sampling_params"] == {"max_new_tokens": 0, "temperature": 0.6}  # scored at the rollout's T
    prompt = tokenizer.decode(ids[:-4])
    assert f"How far is it?\n\n[Hint] {long_hint}" in prompt and prompt.rstrip().endswith("assistant")
    # the teacher log-probs are those of the student's exact ids at their positions
    # (the stand-in teacher's log-probs scale with 1/T, as a temperature-scaled teacher's do)
    want = [fake_logprob(t, len(ids) - 4 + i) / 0.6 for i, t in enumerate([101, 102, 103, 104])]
    assert s.teacher_log_probs == pytest.approx(want, abs=1e-6)
    assert s.rollout_log_probs == pytest.approx([-0.125, -0.25, -0.375, -0.5])


def test_combine_mode_dispatch_with_topk(kafka_config, server, renderer):
    c = setup(kafka_config, server, mode="combine", teacher_top_k=2)
    h = "\\boxed{1} [HINT_START]Answer with one word only.[HINT_END]"
    evs = []
    for sid, text in {"both": score(BM1) + hint(h), "hintonly": score(B0) + hint(h),
                      "scoreonly": score(B1) + hint(BM1), "neither": score(B0) + hint(BM1)}.items():
        evs += [make_turn(sid, 0, renderer=renderer), make_next_state(sid, 0, text), events.SessionEnd(session_id=sid)]
    publish(c, evs)
    with JudgeThread(c):
        got = by_id(read_events(c, "samples", 3, timeout_s=30, settle_s=1.0))
    assert set(got) == {"both:0:combine", "hintonly:0:combine", "scoreonly:0:combine"}
    both, hint_only, score_only = got["both:0:combine"], got["hintonly:0:combine"], got["scoreonly:0:combine"]
    assert [s.kind for s in (both, hint_only, score_only)] == ["opd+rl", "opd", "rl"]  # what each carries
    assert all(s.loss_mask == 1 for s in got.values())
    assert (both.reward, both.hint) == (-1.0, "Answer with one word only.")
    assert both.teacher_log_probs != both.rollout_log_probs and len(both.teacher_log_probs) == 3
    assert both.teacher_top_k == 2 and len(both.teacher_topk_ids) == 6 and len(both.teacher_topk_log_probs) == 6
    assert (hint_only.reward, hint_only.hint) == (None, "Answer with one word only.")  # a vote of 0: no RL signal
    assert hint_only.teacher_log_probs != hint_only.rollout_log_probs
    assert (score_only.reward, score_only.hint, score_only.teacher_log_probs) == (1.0, None, None)  # no stand-in
    assert score_only.teacher_top_k == 0 and score_only.teacher_topk_ids == []


def test_choice_backend_scores_candidates_with_generate(kafka_config, server):
    c = setup(kafka_config, server, backend="choice", tokenizer="tiny-random")
    evs = [make_turn("ch", 0), make_next_state("ch", 0, score(B1)),  # turn 0: spend the rule
           make_turn("ch", 1), make_next_state("ch", 1, "nope <<choice: -1>>"),
           make_turn("ch", 2), make_next_state("ch", 2, "thanks <<choice: 1>>"), events.SessionEnd(session_id="ch")]
    publish(c, evs)
    before = server.calls["/generate"]
    with JudgeThread(c, backend=None):
        got = by_id(read_events(c, "samples", 3, timeout_s=30))
    assert (got["ch:1:rl"].reward, got["ch:1:rl"].votes) == (-1.0, [-1])
    assert (got["ch:2:rl"].reward, got["ch:2:rl"].judge) == (1.0, "choice")
    assert server.calls["/generate"] - before == 9  # one scoring pass per candidate and turn


def test_undecodable_records_go_to_the_dead_letter_topic(kafka_config, server):
    c = setup(kafka_config, server)
    p = EventProducer(c, name="test")
    p.send(c.topics.name("turns"), b"\x93not an event", key="bad")
    p.send(c.topics.name("turns"), make_turn("ok", 0), key="ok")
    p.send(c.topics.name("turns"), make_next_state("ok", 0, score(B1)), key="ok")
    p.close()
    with JudgeThread(c):
        got = by_id(read_events(c, "samples", 1, timeout_s=30))
        dead = read_events(c, "turns.dlq", 1, timeout_s=30)
    assert got["ok:0:rl"].reward == 1.0
    assert len(dead) == 1 and dead[0].stage == "judge" and dead[0].raw == b"\x93not an event"


def test_teacher_failure_dead_letters_the_turn_and_moves_on(kafka_config, server, renderer):
    import socket

    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    c = setup(kafka_config, server, mode="opd")
    c = c.replace(engine={"teacher_url": f"http://127.0.0.1:{dead.getsockname()[1]}"})
    h = hint("\\boxed{1} [HINT_START]Use the metric system please.[HINT_END]")
    publish(c, [make_turn("tf", 0, renderer=renderer), make_next_state("tf", 0, "in km " + h),
                events.SessionEnd(session_id="tf")])
    with JudgeThread(c) as jt:
        dl = read_events(c, "turns.dlq", 1, timeout_s=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum(v or 0 for v in _committed(c, c.judge.group_id).values()) < 3:
            time.sleep(0.2)
        committed = sum(v or 0 for v in _committed(c, c.judge.group_id).values())
        assert jt.app.samples_sent == 0
    dead.close()
    assert len(dl) == 1 and dl[0].error.startswith("teacher failed") and dl[0].stage == "judge"
    assert isinstance(events.decode(dl[0].raw), events.Turn)  # the turn, ready to be re-fed
    assert committed == 3  # the partition is not stuck behind the failed turn
