"""Simulated users against a real HTTP server: a scripted stand-in (StandInEngine) for the
conversation logic, and the real CPU engine (tiny-random)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import defaultdict
from decimal import Decimal


from pipeline.simulate.datasets import load_gsm8k, load_mt_bench
from pipeline.simulate.evaluate import evaluate
from pipeline.simulate.feedback import NOT_STEPWISE, THANKS_BRIEF, THANKS_CORRECT, THANKS_STEPS
from pipeline.simulate.runner import SimulationPlan, simulate, summarize
from pipeline.simulate.users import UserSettings
from pipeline.testing.engine import running_engine
from pipeline.testing.proxy import running_proxy
from pipeline.testing.servers import Reply, StandInEngine
from pipeline.testing.topics import read_records

LONG = " ".join(["blah"] * 50)
GOLD = {p.question: p for p in load_gsm8k("train") + load_gsm8k("heldout")}


def _chat(reply, fail_first: int = 0, delay_s: float = 0.0, **kw) -> StandInEngine:
    """A stand-in engine answering ``reply(messages)``; the first ``fail_first`` requests get a 503."""
    def script(req: dict) -> Reply:
        if len(srv.requests) <= fail_first:
            return Reply(status=503)
        return Reply(content=reply(req["messages"]), delay_s=delay_s)

    srv = StandInEngine(script, **kw)
    return srv


def _requests(server: StandInEngine) -> list[dict]:
    """``{"body", "headers"}`` of every request the stand-in received."""
    return [{"body": b, "headers": h} for b, h in zip(server.requests, server.headers)]


def _by_session(server: StandInEngine) -> dict[str, list[dict]]:
    out = defaultdict(list)
    for r in _requests(server):
        out[r["headers"].get("x-session-id")].append(r)
    return out


def _run(url, plan, settings, **kw):
    return asyncio.run(simulate(url, plan, settings, progress=False, **kw))


def test_gsm8k_brevity_session_too_long_then_thanks_then_closing(tmp_path):
    def script(messages):  # first reply long, then short; closing replies anything
        return LONG if len(messages) == 1 else "It is 7."

    log = tmp_path / "sim.jsonl"
    with _chat(script, weight_version="3") as srv:
        out = _run(srv.url, SimulationPlan(sessions=3, seed=1, concurrency=2, session_prefix="s"),
                   UserSettings(max_words=40), log_path=log)
    sessions = _by_session(srv)
    assert sorted(sessions) == ["s-00000", "s-00001", "s-00002"]
    for sid, reqs in sessions.items():
        assert len(reqs) == 3  # ask, answer "too long", closing request with the thanks
        assert [r["headers"].get("x-turn-type") for r in reqs] == ["main"] * 3
        assert [r["headers"].get("x-session-done") for r in reqs] == [None, None, "true"]
        m1, m2, m3 = (r["body"]["messages"] for r in reqs)
        assert [m["role"] for m in m1] == ["user"] and m1[0]["content"] in GOLD
        assert m2 == m1 + [{"role": "assistant", "content": LONG},
                           {"role": "user", "content": "Too long — answer in at most 40 words."}]
        assert m3[:3] == m2 and m3[3] == {"role": "assistant", "content": "It is 7."}
        assert m3[4]["role"] == "user" and m3[4]["content"] in THANKS_BRIEF
        assert [r["body"]["max_tokens"] for r in reqs] == [96, 96, 16]
        assert all(r["body"]["temperature"] == 1.0 and r["body"]["stream"] is False for r in reqs)
    assert out["sessions"] == 3 and out["sessions_failed"] == 0 and out["requests"] == 9
    assert out["replies"] == 6 and out["graded_replies"] == 6
    assert out["success_rate"] == 0.5 and out["first_reply_success_rate"] == 0.0
    assert out["words_per_reply"] == (50 + 3) / 2 and out["accuracy"] == 0.0
    assert list(out["by_policy_version"]) == ["3"]
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == 9 and sum(x["closing"] for x in lines) == 3
    assert {x["feedback_kind"] for x in lines if not x["closing"]} == {"too_long", "thanks"}
    assert summarize(lines) == {k: v for k, v in out.items() if k in summarize(lines)}


def test_gsm8k_correctness_policy_hints_steps_and_stops_at_max_turns():
    def script(messages):  # always short and wrong
        return "It is 123456789."

    with _chat(script) as srv:
        out = _run(srv.url, SimulationPlan(sessions=2, seed=0, session_prefix="c"),
                   UserSettings(feedback="correctness", max_turns=2))
    for reqs in _by_session(srv).values():
        assert len(reqs) == 3 and reqs[-1]["headers"].get("x-session-done") == "true"
        problem = GOLD[reqs[0]["body"]["messages"][0]["content"]]
        fb1 = reqs[1]["body"]["messages"][-1]["content"]
        fb2 = reqs[2]["body"]["messages"][-1]["content"]
        assert problem.answer.steps[0] in fb1  # the first correction reveals step 1
        assert problem.answer.steps[min(1, len(problem.answer.steps) - 1)] in fb2
    assert out["success_rate"] == 0.0 and out["graded_replies"] == 4


def test_steps_user_of_a_tenant_asks_for_one_step_per_line_then_thanks():
    """The second tenant of the two-tenant demo: every request names the tenant; a reply on one
    line gets "one step per line", four lines get thanks."""
    stepwise = "2 + 2 = 4\n4 * 3 = 12\nso 12\nThe answer is 12."

    def script(messages):
        return "It is 12 because 2 + 2 = 4 and 4 * 3 = 12." if len(messages) == 1 else stepwise

    with _chat(script) as srv:
        out = _run(srv.url, SimulationPlan(sessions=2, seed=0, session_prefix="t"),
                   UserSettings(feedback="steps", max_turns=3), tenant="bob")
    assert {h.get("x-tenant-id") for h in srv.headers} == {"bob"}
    for reqs in _by_session(srv).values():
        assert len(reqs) == 3  # ask, "one step per line", closing with the thanks
        assert reqs[1]["body"]["messages"][-1]["content"] in NOT_STEPWISE
        assert reqs[2]["body"]["messages"][-1]["content"] in THANKS_STEPS
    assert out["success_rate"] == 0.5 and out["graded_replies"] == 4


def test_gsm8k_right_answer_is_thanked_at_once():
    def script(messages):
        p = GOLD.get(messages[0]["content"])
        return f"So the answer is {p.answer.final}." if p else "ok"

    with _chat(script) as srv:
        out = _run(srv.url, SimulationPlan(sessions=4, seed=2), UserSettings(feedback="correctness"))
    for reqs in _by_session(srv).values():
        assert len(reqs) == 2 and reqs[1]["body"]["messages"][-1]["content"] in THANKS_CORRECT
    assert out["accuracy"] == 1.0 and out["success_rate"] == 1.0


def test_mt_bench_second_turn_is_the_real_follow_up_and_ends_the_session():
    questions = {q.turns[0]: q for q in load_mt_bench()}
    with _chat(lambda m: f"reply {len(m)}") as srv:
        out = _run(srv.url, SimulationPlan(dataset="mt_bench", sessions=5, seed=0), UserSettings(max_tokens=32))
    sessions = _by_session(srv)
    assert len(sessions) == 5
    for reqs in sessions.values():
        assert [r["headers"].get("x-session-done") for r in reqs] == [None, "true"]
        q = questions[reqs[0]["body"]["messages"][0]["content"]]
        assert reqs[1]["body"]["messages"] == [{"role": "user", "content": q.turns[0]},
                                               {"role": "assistant", "content": "reply 1"},
                                               {"role": "user", "content": q.turns[1]}]
    assert out["replies"] == 10 and out["graded_replies"] == 0 and out["success_rate"] is None
    assert out["words_per_reply"] == 2.0


def test_concurrency_bound_and_retry_on_503():
    with _chat(lambda m: "Fine.", fail_first=1, delay_s=0.05) as srv:
        out = _run(srv.url, SimulationPlan(sessions=6, concurrency=3), UserSettings())
    assert out["sessions_failed"] == 0 and out["sessions"] == 6
    assert len(srv.requests) == 6 * 2 + 1  # one 503 answered, then retried
    assert 2 <= srv.peak_in_flight <= 3  # sessions overlap, but never more than --concurrency


def test_unreachable_proxy_fails_sessions_without_raising():
    from pipeline.procutil import free_port

    out = _run(f"http://127.0.0.1:{free_port()}", SimulationPlan(sessions=2), UserSettings(),)
    assert out["sessions_failed"] == 2 and "cannot reach" in out["errors"][0]
    with _chat(lambda m: "late", delay_s=2.0) as srv:  # slower than the client's timeout
        out = _run(srv.url, SimulationPlan(sessions=2), UserSettings(), timeout_s=0.3)
    assert out["sessions_failed"] == 2 and "did not answer within 0.3 s" in out["errors"][0]


def test_cli_writes_log_and_json_summary(tmp_path):
    log = tmp_path / "log.jsonl"
    with _chat(lambda m: "Short answer: 5") as srv:
        p = subprocess.run([sys.executable, "-m", "pipeline", "simulate", "--proxy-url", srv.url, "--sessions", "2",
                            "--log", str(log), "--no-progress", "--max-words", "10", "--seed", "4"],
                           capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["sessions"] == 2 and summary["success_rate"] == 1.0 and summary["requests"] == 4
    assert len(log.read_text().splitlines()) == 4
    bad = subprocess.run([sys.executable, "-m", "pipeline", "simulate", "--dataset", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_cli_sigterm_stops_a_long_run_and_still_reports(tmp_path):
    import signal
    import time

    log = tmp_path / "log.jsonl"
    with _chat(lambda m: "Fine.", delay_s=0.05) as srv:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline", "simulate", "--proxy-url", srv.url, "--sessions",
                                 "100000", "--concurrency", "2", "--log", str(log), "--no-progress"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            # 2 workers with 2 replies per session: at most 4 logged lines belong to unfinished
            # sessions, so 10 lines mean at least 3 finished ones
            while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 10):
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert 3 <= summary["sessions"] < 100000 and summary["sessions_cancelled"] <= 2
    assert summary["requests"] == 2 * summary["sessions"]


def test_evaluate_sends_heldout_prompts_without_session_headers():
    held = load_gsm8k("heldout")
    right = {p.question for p in held[::2]}

    def script(messages):
        p = GOLD[messages[-1]["content"]]
        return f"The answer is {p.answer.final}." if p.question in right else LONG

    with _chat(script, weight_version="7") as srv:
        out = evaluate(srv.url, max_tokens=48, concurrency=8)
    assert len(srv.requests) == 32
    assert all("x-session-id" not in h and "x-turn-type" not in h for h in srv.headers)
    assert {r["messages"][-1]["content"] for r in srv.requests} == {p.question for p in held}
    assert out["n"] == 32 and out["accuracy"] == 0.5 and out["success_rate"] == 0.5 and out["brief_rate"] == 0.5
    assert out["words_per_reply"] == (4 + 50) / 2 and out["policy_versions"] == ["7"]
    assert Decimal(out["accuracy"]) == Decimal("0.5")


def test_against_real_engine_tiny_random(tmp_path):
    with running_engine("tiny-random", threads=1) as url:
        out = _run(url, SimulationPlan(sessions=2, concurrency=2), UserSettings(max_tokens=24, max_turns=2))
        ev = evaluate(url, load_gsm8k("heldout")[:4], max_tokens=16, concurrency=4)
    assert out["sessions_failed"] == 0, out["errors"]
    assert out["graded_replies"] >= 2 and out["completion_tokens"] is not None
    assert 0 < out["completion_tokens"] <= 24
    assert list(out["by_policy_version"]) == ["0"]  # the engine's weight_version reaches the log
    assert ev["n"] == 4 and ev["completion_tokens"] <= 16 and ev["policy_versions"] == ["0"]


def test_sessions_through_the_real_proxy_and_engine_become_turn_events(kafka_config, tmp_path):
    """Simulator -> proxy -> engine (tiny-random): the feedback is each turn's next state, the
    closing request is the last turn, then session_end (the header rule of the simulator)."""
    from pipeline import events

    log = tmp_path / "sim.jsonl"
    with running_engine("tiny-random", threads=1) as engine_url, \
            running_proxy(kafka_config, engine_url) as (proxy_url, _app):
        out = _run(proxy_url, SimulationPlan(sessions=3, concurrency=3, session_prefix="e2e"),
                   UserSettings(max_tokens=16, max_turns=2, max_words=8), log_path=log)
        assert out["sessions_failed"] == 0, out["errors"]
        got = read_records(kafka_config, kafka_config.topics.name("turns"), out["requests"] + 2 * 3, timeout_s=30)
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    per = defaultdict(list)
    for rec in got:
        assert rec.key == rec.event.session_id
        per[rec.event.session_id].append(rec.event)
    assert sorted(per) == ["e2e-00000", "e2e-00001", "e2e-00002"]
    for sid, evs in per.items():
        mine = [r for r in rows if r["session_id"] == sid]
        turns = [e for e in evs if isinstance(e, events.Turn)]
        states = [e for e in evs if isinstance(e, events.NextState)]
        assert isinstance(evs[-1], events.SessionEnd) and sum(isinstance(e, events.SessionEnd) for e in evs) == 1
        assert [t.turn_index for t in turns] == list(range(len(mine)))  # graded replies + the closing one
        assert all(t.turn_type == "main" and t.source == "proxy" and t.response_logprobs for t in turns)
        assert [t.response["content"] for t in turns] == [r["reply"] for r in mine]
        feedback = [r["feedback"] for r in mine if not r["closing"]]
        assert [s.messages for s in states] == [[{"role": "user", "content": f}] for f in feedback]
        assert [s.after_turn_index for s in states] == list(range(len(feedback)))
        # order in the partition: turn k, its next state, turn k+1 ..., then session_end
        kinds = [(e.TYPE, getattr(e, "turn_index", None) if isinstance(e, events.Turn) else
                  getattr(e, "after_turn_index", None)) for e in evs]
        want = []
        for k in range(len(mine)):
            want.append(("turn", k))
            if k < len(feedback):
                want.append(("next_state", k))
        assert kinds == want + [("session_end", None)]


def test_tenant_is_sent_as_x_tenant_id_on_every_request():
    """``pipeline simulate --tenant T``: every request of every session carries ``X-Tenant-Id: T``;
    without it, no such header."""
    with _chat(lambda m: "The answer is 3.") as srv:
        asyncio.run(simulate(srv.url, SimulationPlan(sessions=2, concurrency=2), UserSettings(max_turns=2),
                             progress=False, tenant="alice"))
        n = len(srv.requests)
        asyncio.run(simulate(srv.url, SimulationPlan(sessions=1, concurrency=1), UserSettings(max_turns=1),
                             progress=False))
    assert n >= 4 and all(h.get("x-tenant-id") == "alice" for h in srv.headers[:n])
    assert len(srv.headers) > n and all("x-tenant-id" not in h for h in srv.headers[n:])


# ---- issue 40: simulated thumbs through POST /v1/feedback -------------------------------------------
def test_thumbs_reach_the_log_as_feedback_on_each_graded_turn(kafka_config):
    """``--thumbs`` with the correctness policy: a wrong short reply gets a thumbs-down whose
    comment is the correction's worked step, the right reply a thumbs-up; each feedback names its
    turn's request id and is published before the next state it precedes."""
    from pipeline.simulate.client import ChatClient
    from pipeline.simulate.datasets import GSM8KProblem
    from pipeline.simulate.grading import GSM8KAnswer
    from pipeline.simulate.users import gsm8k_session
    from pipeline.testing.proxy import stack

    answers = iter(["It is 3.", "The answer is 42.", "ok"])
    problem = GSM8KProblem("p1", "What is 6 times 7?", GSM8KAnswer(("Multiply 6 by 7.",), Decimal(42)))
    settings = UserSettings(feedback="correctness", max_turns=3, thumbs=True)
    with stack(kafka_config, lambda req: Reply(content=next(answers))) as (url, app, up):
        async def main():
            async with ChatClient(url) as client:
                return await gsm8k_session(client, "thumbs-1", problem, settings)

        result = asyncio.run(main())
        assert result.error is None and [r.feedback_kind for r in result.records[:2]] == ["correction", "thanks"]
        assert app.publisher.wait_idle(10)
        recs = read_records(kafka_config, kafka_config.topics.name("turns"),
                            lambda evs: sum(e.TYPE == "feedback" for e in evs) >= 2)
    evs = [r.event for r in recs if r.key == "thumbs-1"]
    turns = {e.turn_index: e for e in evs if e.TYPE == "turn"}
    fbs = [e for e in evs if e.TYPE == "feedback"]
    assert [(f.turn_index, f.score, f.comment, f.source) for f in fbs] == [
        (0, -1.0, "Multiply 6 by 7.", "user"), (1, 1.0, None, "user")]
    assert all(f.turn_request_id == turns[f.turn_index].request_id for f in fbs)
    order = [(e.TYPE, getattr(e, "turn_index", getattr(e, "after_turn_index", None))) for e in evs]
    assert order.index(("feedback", 0)) < order.index(("next_state", 0))  # read before its turn is decided
