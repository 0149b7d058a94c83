"""Property tests (hypothesis) of the judge side of issue 11.

1. A hint that changes nothing gives teacher log-probs equal to the rollout log-probs (OPD
   advantage 0) at any temperature and truncation setting: turns sampled by the real CPU engine
   (tiny-random), recorded by the proxy's own code, scored by the real :class:`Teacher`.
2. Samples are a function of the records: replaying the same ``turns`` records fast (one pass),
   slowly (a clock that runs far ahead between records) or with a judge restart at any point
   (from the committed offsets, work in flight lost) gives identical samples: same ids, same
   content. Pure join + sample logic (every decision the judge makes), many generated logs with
   replies, empty next states, aborted generations, idle and stale ends, reused session ids and
   duplicate records (a producer retry, right after the original in its partition).
3. The same through the broker: two judge groups replay one ``turns`` topic, one fast, one
   throttled and restarted mid-way; every sample id comes out byte-identical.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import events
from pipeline.bus import Record
from pipeline.judge.backends.base import Verdict
from pipeline.judge.join import FLUSH, RELEASE, Joiner
from pipeline.judge.samples import opd_sample, rl_flush_sample, rl_sample, sample_id
from pipeline.judge.teacher import TeacherOutput


# ---- 1. null hint, real engine --------------------------------------------------------------------
#: the conftest ``engine_url`` engine's settings
ENGINE_SETTINGS = {"context_length": 512}


@pytest.fixture(scope="module")
def teacher_config(engine_url):
    from pipeline.engine_api.render import load_tokenizer
    from pipeline.config import load_config

    return load_config(None, engine={"teacher_url": engine_url, "model": "tiny-random"}), load_tokenizer("tiny-random")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(temperature=st.one_of(st.just(0.0), st.just(1.0), st.floats(0.05, 2.0)),
       top_p=st.sampled_from([None, 0.5, 0.95]), top_k=st.sampled_from([None, 1, 5]),
       seed=st.integers(0, 10_000), question=st.sampled_from(["Hi!", "What is 2+2?", "Name a colour."]))
def test_a_hint_that_changes_nothing_gives_zero_opd_advantage(engine_url, teacher_config, temperature, top_p, top_k,
                                                               seed, question):
    from pipeline.judge.teacher import Teacher
    from pipeline.proxy.app import ProxyApp
    from pipeline.proxy.record import from_response

    req = {"messages": [{"role": "user", "content": question}], "max_tokens": 6, "temperature": temperature,
           "seed": seed, "logprobs": True, "return_token_ids": True}
    for k, v in (("top_p", top_p), ("top_k", top_k)):
        if v is not None:
            req[k] = v
    r = httpx.post(engine_url + "/v1/chat/completions", json=req, timeout=60)
    assert r.status_code == 200, r.text
    rec = from_response(r.json())
    sampling = {k: req[k] for k in ("temperature", "top_p", "top_k", "seed") if k in req}
    temp, procs = ProxyApp._distribution(rec, sampling)  # what the proxy records on the turn
    assert temp == (1.0 if temperature == 0.0 else pytest.approx(temperature)) and procs == []
    turn = events.Turn(session_id="p", turn_index=0, request_id="r", messages=req["messages"], sampling=sampling,
                       prompt_token_ids=rec.prompt_ids, response_token_ids=rec.token_ids,
                       response_logprobs=rec.logprobs, finish_reason=rec.finish_reason, logprob_temperature=temp)
    config, tokenizer = teacher_config

    async def teacher_log_probs():
        teacher = Teacher(config, tokenizer=tokenizer)
        await teacher.start()
        try:
            return await teacher.log_probs(turn, None)  # the student's own prompt: a hint that changes nothing
        finally:
            await teacher.aclose()

    out = asyncio.run(teacher_log_probs())
    advantage = [t - s for t, s in zip(out.log_probs, turn.response_logprobs)]
    assert len(advantage) == len(turn.response_token_ids) > 0
    assert advantage == pytest.approx([0.0] * len(advantage), abs=2e-4)


# ---- 2. replay: fast, slow, restarted ----------------------------------------------------------------
TPS = [("turns", 0), ("turns", 1)]


def _session_script(draw, sid: str) -> list[events.Event]:
    """One session's records in order: conversations (turns, next states, duplicates, aborts,
    out-of-order turns) separated by ends; a reused session id starts a new conversation."""
    out: list[events.Event] = []
    for conv in range(draw(st.integers(1, 2))):
        n = draw(st.integers(1, 4))
        for k in range(n):
            t = events.Turn(session_id=sid, turn_index=k, request_id=f"{sid}-c{conv}-{k}",
                            created_at=1000 * (len(out) + 1), messages=[{"role": "user", "content": f"q{k}"}],
                            prompt_token_ids=[1, 2], response_token_ids=[3, 4 + k], response_logprobs=[-0.5, -0.25],
                            finish_reason=draw(st.sampled_from(["stop", "stop", "length", "abort"])),
                            logprob_temperature=0.7)
            out.append(t)
            if draw(st.integers(0, 5)) == 0:
                out.append(t)  # a duplicate record (producer retry)
            kind = draw(st.sampled_from(["reply", "reply", "empty", "none", "idle_end", "stale_end"]))
            if kind == "reply":
                vote = draw(st.sampled_from([-1, 0, 1]))
                out.append(events.NextState(session_id=sid, after_turn_index=k, created_at=1000 * (len(out) + 1),
                                            messages=[{"role": "user", "content": f"v={vote}"}]))
            elif kind == "empty":
                out.append(events.NextState(session_id=sid, after_turn_index=k, messages=[],
                                            created_at=1000 * (len(out) + 1)))
            elif kind in ("idle_end", "stale_end"):
                out.append(events.SessionEnd(session_id=sid, reason="idle_timeout", created_at=1000 * (len(out) + 1),
                                             turn_index=k if kind == "idle_end" else k - 1))
                if kind == "idle_end":
                    break  # the conversation was idle-closed
        if draw(st.booleans()) or conv == 0:
            out.append(events.SessionEnd(session_id=sid, reason="header", created_at=1000 * (len(out) + 1)))
    return out


@st.composite
def turn_logs(draw):
    per = {f"s{i}": _session_script(draw, f"s{i}") for i in range(draw(st.integers(1, 4)))}
    for sid, evs in per.items():  # every session ends eventually (the header or an idle end)
        evs.append(events.SessionEnd(session_id=sid, reason="header", created_at=10**7))
    log: dict[tuple, list] = {tp: [] for tp in TPS}
    rng = random.Random(draw(st.integers(0, 10**6)))
    pending = {sid: list(evs) for sid, evs in per.items()}
    while any(pending.values()):
        sid = rng.choice([s for s, evs in pending.items() if evs])
        tp = TPS[int(sid[1:]) % len(TPS)]
        ev = pending[sid].pop(0)
        log[tp].append(Record(tp[0], tp[1], len(log[tp]), sid, ev, 1_000_000 + 10 * len(log[tp])))
        if pending[sid] and pending[sid][0] is ev:  # a producer retry lands right after the original
            pending[sid].pop(0)
            log[tp].append(Record(tp[0], tp[1], len(log[tp]), sid, ev, 1_000_000 + 10 * len(log[tp])))
    return log


def _vote(job) -> int:
    return int(job.next_state[0]["content"].split("=")[1])


def _sample(job, mode: str, published: dict | None = None):
    """The sample a job produces (deterministic stand-in judge: the vote is in the next state).
    ``published``: the restarted judge's read-back decisions (sample_id -> loss_mask), copied as
    the app does (nothing emitted; a trained one marks the conversation)."""
    if job.kind == RELEASE:
        return None
    if published and mode == "rl" and (mask := published.get(sample_id(job.turn, "rl"))) is not None:
        if job.conversation is not None and mask:
            job.conversation.trained = True
        return None
    if job.kind == FLUSH:
        return rl_flush_sample(job.turn, "replay", job.decided_at) if mode == "rl" else None
    v = _vote(job)
    if mode == "rl":  # the app's rule: promote a 0 while the conversation has trained nothing
        conv = job.conversation
        s = rl_sample(job.turn, Verdict(v, [v]), job.candidate and not conv.trained, "replay", job.decided_at)
        conv.trained = conv.trained or bool(s.loss_mask)
        return s
    if v >= 0:  # opd: a hint; the teacher output is a function of the turn
        return opd_sample(job.turn, f"hint {v}", TeacherOutput([-0.1 * (i + 1) for i in range(2)]), [v], "replay",
                          job.decided_at)
    return None


def _run(log, mode: str, *, clock_step: float, crash_at: int | None = None, lose_in_flight: bool = False):
    """Feed the log to a judge (Joiner + sample builders), optionally crashing after ``crash_at``
    records: the restarted judge resumes each partition from its committed offset (the lowest
    unacknowledged one); jobs in flight at the crash lose their output when ``lose_in_flight``.
    Returns the samples in emission order (duplicates included)."""
    t = [0.0]

    def clock():
        t[0] += clock_step
        return t[0]

    order = sorted((r for recs in log.values() for r in recs), key=lambda r: (r.timestamp_ms, r.partition))
    out, acked, start = [], {tp: set() for tp in TPS}, {tp: 0 for tp in TPS}
    runs = [order] if crash_at is None else [order[:crash_at], order]
    for n, recs in enumerate(runs):
        j = Joiner(60, at_least_one=(mode == "rl"), clock=clock)
        in_flight = []
        for r in recs:
            if r.offset < start[r.tp]:
                continue
            ack, jobs = j.on_record(r)
            if ack:
                acked[r.tp].add(r.offset)
            for job in jobs:
                in_flight.append(job)
            j.idle_sessions(ready=lambda tp: False)  # a replaying judge is not caught up
        crashed = n == 0 and crash_at is not None
        published = {x.sample_id: x.loss_mask for x in out} if n else None  # read back at the restart
        for k, job in enumerate(in_flight):
            if crashed and lose_in_flight and k >= len(in_flight) // 2:
                break  # output never delivered: its records stay unacknowledged
            s = _sample(job, mode, published)
            if s is not None:
                out.append(s)
            for a in job.acks:
                acked[a.tp].add(a.offset)
        if crashed:
            for tp in TPS:  # committed offset = lowest unacknowledged among the records read
                read = [r.offset for r in recs if r.tp == tp]
                start[tp] = next((o for o in sorted(read) if o not in acked[tp]), max(read) + 1 if read else 0)
    return out


def _by_id(samples) -> dict:
    got: dict[str, bytes] = {}
    for s in samples:
        enc = events.encode(s)
        assert got.setdefault(s.sample_id, enc) == enc, f"{s.sample_id}: a duplicate differs"
    return got


@settings(max_examples=300, deadline=None)
@given(log=turn_logs(), mode=st.sampled_from(["rl", "opd"]), crash=st.floats(0.0, 1.0), lose=st.booleans())
def test_replaying_the_same_records_fast_slow_or_after_a_restart_gives_identical_samples(log, mode, crash, lose):
    n = sum(len(v) for v in log.values())
    fast = _by_id(_run(log, mode, clock_step=0.0))
    slow = _by_id(_run(log, mode, clock_step=1000.0))  # 1000 s between records: far past every idle time-out
    restarted = _by_id(_run(log, mode, clock_step=7.0, crash_at=int(crash * n), lose_in_flight=lose))
    assert fast == slow == restarted
    if mode == "rl":  # every distinct turn record gets exactly one sample (its request id names it)
        rids = {r.event.request_id for recs in log.values() for r in recs if isinstance(r.event, events.Turn)}
        assert sorted(sid.rsplit(":", 1)[1] for sid in fast) == sorted(rids)


def test_a_restart_inside_an_ended_conversation_copies_its_published_decisions():
    """Issue 24 case 8: conversation A trained on turn 0 (+1) and ended; session B's first turn is
    still unsettled (A's anchor released, B's held), so a restart re-reads A's turn 1 without its
    turn 0. Its published decision (a 0 vote, not promoted) is copied; without it the restarted
    judge would take A's turn 1 for the first judged turn of a new conversation and promote it."""
    def t(sid, k):
        return events.Turn(session_id=sid, turn_index=k, request_id=f"{sid}-{k}", created_at=1000 + k,
                           messages=[{"role": "user", "content": "q"}], prompt_token_ids=[1, 2],
                           response_token_ids=[3, 4], response_logprobs=[-0.5, -0.25], finish_reason="stop")

    def ns(sid, k, v):
        return events.NextState(session_id=sid, after_turn_index=k, created_at=2000 + k,
                                messages=[{"role": "user", "content": f"v={v}"}])

    evs = [t("A", 0), ns("A", 0, 1), t("B", 0), t("A", 1), ns("A", 1, 0),
           events.SessionEnd(session_id="A", created_at=3000), ns("B", 0, 0),
           events.SessionEnd(session_id="B", created_at=4000)]
    log = {TPS[0]: [Record("turns", 0, i, e.session_id, e, 1_000_000 + 10 * i) for i, e in enumerate(evs)],
           TPS[1]: []}
    fast = _by_id(_run(log, "rl", clock_step=0.0))
    a1 = next(v for k, v in fast.items() if k.startswith("A:1:"))
    assert events.decode(a1).loss_mask == 0 and events.decode(fast["B:0:rl:B-0"]).loss_mask == 1
    assert _by_id(_run(log, "rl", clock_step=0.0, crash_at=6)) == fast


# ---- 3. through the broker ----------------------------------------------------------------------------
def test_two_groups_fast_and_throttled_with_a_restart_produce_identical_samples(kafka_config):
    from pipeline.testing.servers import StandInJudge
    from pipeline.testing.judge import JudgeThread, scripted_stream
    from pipeline.testing.topics import publish, read_events

    c = kafka_config
    evs, expected = scripted_stream(12, 4, seed=3, window=6, vote_delay_s=0.01)
    publish(c, evs)
    with StandInJudge() as server:
        c = c.replace(judge={"backend": "llm", "url": server.url, "mode": "rl", "vote_timeout_s": 5.0, "retries": 0,
                             "group_id": f"{c.topics.prefix}fast"})
        with JudgeThread(c):
            read_events(c, "samples", len(expected), timeout_s=60, settle_s=0.2)
        c = c.replace(judge={"group_id": f"{c.topics.prefix}slow", "max_in_flight": 1})
        with JudgeThread(c):  # throttled, stopped part-way
            read_events(c, "samples", len(expected) + len(expected) // 3, timeout_s=60, settle_s=0.0)
        with JudgeThread(c):  # restarted: resumes from the committed offsets
            samples = read_events(c, "samples", lambda out: len({s.sample_id for s in out}) >= len(expected)
                                  and len(out) >= 2 * len(expected), timeout_s=90, settle_s=1.0)
    enc: dict[str, set] = {}
    for s in samples:
        enc.setdefault(s.sample_id, set()).add(events.encode(s))
    assert set(enc) == set(expected)
    assert all(len(v) == 1 for v in enc.values()), [k for k, v in enc.items() if len(v) > 1]
