"""Issue 40 in the dashboard: a reviewer's thumb on the session page, and the feedback it shows.

The dashboard's real app (``create_app``) in front of the real proxy (``StandInEngine`` behind it,
a stand-in, NOT a model) with a tenant key map: ``POST /api/feedback`` is refused while the
dashboard is read-only (the default); enabled, it reaches the proxy with the reviewer's key, which
decides the tenant (another tenant's turn: 404 from the proxy); the event is a ``feedback`` with
``source: reviewer``. The state shows each turn's feedback and each sample's reward source.
(Not tested in a browser: the buttons only post this endpoint.)
"""

from __future__ import annotations

import hashlib

import httpx
import openai

from pipeline import events
from pipeline.bus import Record
from pipeline.config import load_config
from pipeline.dashboard.app import create_app
from pipeline.dashboard.state import DashboardState
from pipeline.testing.proxy import stack
from pipeline.testing.servers import Reply, serve_app
from pipeline.testing.topics import read_records

KEY_A, KEY_B = "key-of-alice", "key-of-bob"
TENANTS = {hashlib.sha256(KEY_A.encode()).hexdigest(): "alice", hashlib.sha256(KEY_B.encode()).hexdigest(): "bob"}


def test_review_is_refused_read_only_and_forwarded_with_the_reviewers_key(kafka_config):
    with stack(kafka_config, lambda req: Reply(content="an answer"), tenants=TENANTS) as (url, app, up):
        alice = openai.OpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0,
                              default_headers={"X-Session-Id": "rv"})
        alice.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        body = {"session_id": "rv", "turn_index": 0, "score": -1, "comment": "Greet the user by name."}
        auth = {"Authorization": f"Bearer {KEY_A}"}
        read_only = create_app(kafka_config.replace(dashboard={"proxy_url": url}), DashboardState(kafka_config))
        with serve_app(read_only) as dash:
            r = httpx.post(dash + "/api/feedback", json=body, headers=auth)
            assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
            assert httpx.get(dash + "/api/config").json()["review"] is False
        cfg = kafka_config.replace(dashboard={"review": True, "proxy_url": url})
        with serve_app(create_app(cfg, DashboardState(cfg))) as dash:
            assert httpx.get(dash + "/api/config").json()["review"] is True
            ok = httpx.post(dash + "/api/feedback", json={**body, "source": "user"}, headers=auth)
            bob = httpx.post(dash + "/api/feedback", json=body, headers={"Authorization": f"Bearer {KEY_B}"})
            nokey = httpx.post(dash + "/api/feedback", json=body)
        assert ok.status_code == 200 and ok.json()["source"] == "reviewer", ok.text
        assert bob.status_code == 404 and bob.json()["error"]["code"] == "turn_not_found"
        assert nokey.status_code == 401
        assert app.publisher.wait_idle(10)
        recs = read_records(kafka_config, kafka_config.topics.name("turns"),
                            lambda evs: any(e.TYPE == "feedback" for e in evs))
    (fb,) = [r.event for r in recs if r.event.TYPE == "feedback"]
    assert (fb.tenant, fb.session_id, fb.turn_index, fb.score, fb.source, fb.comment) == (
        "alice", "rv", 0, -1.0, "reviewer", "Greet the user by name.")


def test_the_session_page_shows_feedback_and_reward_sources():
    state = DashboardState(load_config(None))
    turn = events.Turn(session_id="s", turn_index=0, request_id="r0", response_token_ids=[1], response_logprobs=[-1.0],
                       prompt_token_ids=[2], response_id="chatcmpl-r0")
    fb = events.Feedback(session_id="s", turn_index=0, score=-1.0, feedback_id="f", turn_request_id="r0",
                         comment="SECRET correction", source="reviewer")
    sample = events.Sample(sample_id="s:0:rl:r0", session_id="s", turn_index=0, tokens=[2, 1], response_length=1,
                           reward=-1.0, reward_source="feedback", reward_rule="precedence", feedback_score=-1.0,
                           hint="SECRET correction", hint_source="feedback")
    for i, (topic, ev) in enumerate((("turns", turn), ("turns", fb), ("samples", sample))):
        state.apply(Record(topic, 0, i, "s", ev, events.now_ms()))
    (t,) = state.session("s")["turns"]
    assert t["response_id"] == "chatcmpl-r0"
    (f,) = t["feedback"]
    assert (f["score"], f["source"], f["comment_chars"]) == (-1.0, "reviewer", len("SECRET correction"))
    assert "comment" not in f  # conversation text only with --show-text
    (s,) = t["samples"]
    assert (s["reward_source"], s["reward_rule"], s["feedback_score"], s["hint_source"]) == (
        "feedback", "precedence", -1.0, "feedback")


def test_review_buttons_in_headless_chromium(kafka_config):
    """The session page of a tenant's turn in a real browser: with Bob's key the thumb is refused
    (403 from the proxy: the page names the session's tenant, Bob's key is another's; shown on the page), with Alice's key a thumbs-down with a correction
    reaches ``turns`` as a reviewer's feedback and the page then lists it under the turn."""
    import pytest

    from tests.dashboard.dashboard_helpers import Browser, DashboardServer, chromium_path

    if chromium_path() is None:
        pytest.skip("no chromium binary: deploy/install.sh installs Debian's chromium where apt-get is available")
    with stack(kafka_config, lambda req: Reply(content="an answer"), tenants=TENANTS) as (url, app, up):
        alice = openai.OpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0,
                              default_headers={"X-Session-Id": "rv-b"})
        alice.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        cfg = kafka_config.replace(dashboard={"review": True, "proxy_url": url, "push_interval_s": 0.2})
        with DashboardServer(cfg) as d, Browser() as b:
            d.wait(lambda o: o["traffic"]["turns_main"] >= 1 if "turns_main" in o["traffic"] else
                   httpx.get(f"{d.url}/api/sessions/rv-b", params={"tenant": "alice"}).is_success)
            b.goto(f"{d.url}#/session/rv-b?tenant=alice")
            b.wait("document.querySelector('.review .thumb-down') !== null")

            def thumb(key: str) -> None:
                b.eval(f"""(() => {{ const f = document.querySelector('.review');
                    f.querySelector('.review-comment').value = 'Greet the user by name.';
                    f.querySelector('.review-key').value = {key!r};
                    f.querySelector('.thumb-down').click(); return true; }})()""")

            thumb(KEY_B)
            assert "refused (403)" in b.wait("(document.querySelector('.review-result') || {}).textContent")
            thumb(KEY_A)
            assert app.publisher.wait_idle(10)
            recs = read_records(kafka_config, kafka_config.topics.name("turns"),
                                lambda evs: any(e.TYPE == "feedback" for e in evs))
            shown = b.wait("[...document.querySelectorAll('.feedback')].map(e => e.textContent).join('|')")
    (fb,) = [r.event for r in recs if r.event.TYPE == "feedback"]
    assert (fb.tenant, fb.score, fb.source, fb.comment) == ("alice", -1.0, "reviewer", "Greet the user by name.")
    assert shown.startswith("-1 from reviewer")


def test_pipeline_tail_prints_where_a_reward_came_from():
    from pipeline.dashboard.tail import line

    sample = events.Sample(sample_id="s:0:combine:r0", session_id="s", turn_index=0, tokens=[2, 1], response_length=1,
                           kind="opd+rl", reward=-1.0, reward_source="feedback", reward_rule="precedence",
                           feedback_score=-1.0, teacher_log_probs=[-0.5], rollout_log_probs=[-1.0],
                           hint="Use metres.", hint_source="feedback")
    fb = events.Feedback(session_id="s", turn_index=0, score=-1.0, feedback_id="f", comment="Use metres.")
    out = line(Record("samples", 0, 7, "s", sample, 0))["event"]
    assert (out["reward"], out["reward_source"], out["reward_rule"], out["hint_source"], out["has_teacher"]) == (
        -1.0, "feedback", "precedence", "feedback", True)
    shown = line(Record("turns", 0, 8, "s", fb, 0), text=True)["event"]
    hidden = line(Record("turns", 0, 8, "s", fb, 0))["event"]
    assert shown["type"] == "feedback" and shown["comment"] == "Use metres." and "comment" not in hidden
