"""The dashboard over a real broker and a real HTTP server: no conversation text without the flag
(every route, the live stream included), API keys, counters against an independent count of the
topics, the session view, and the assign-mode reader's start positions."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import httpx
import pytest
from fastapi.routing import APIRoute

from pipeline import events
from pipeline.bus import Offset, Time, TopicReader
from pipeline.dashboard import views
from tests.dashboard.dashboard_helpers import MARK, DashboardServer, marked_conversation, topic_records
from pipeline.testing.topics import publish

SESSIONS = ("s-alpha", "s-beta")


def _fill(config) -> dict:
    """Publish two marked sessions, control, a train step, an evaluation and bad records; expected counts."""
    turns, samples = [], []
    for sid in SESSIONS:
        t, s = marked_conversation(sid)
        turns += t
        samples += s
    publish(config, turns, "turns")
    publish(config, samples + [samples[0]], "samples")  # one duplicate delivery
    publish(config, [events.Control(action=a, epoch=1, policy_version=1, created_at=events.now_ms() + i,
                                               **({"location": "/w/v1", "sha256": "ab" * 32} if a == "weights" else {}),
                                               **({"engine_id": "engine-0"} if a == "applied" else {}))
                                for i, a in enumerate(["pause", "weights", "applied", "resume"])], "control")
    publish(config, [
        events.TrainStep(step=1, policy_version=1, created_at=events.now_ms(), metrics={"loss": 0.5, "kl": 0.01},
                         sample_ids=[s.sample_id for s in samples], trained={samples[0].sample_id: 0.75}),
        events.Evaluation(policy_version=1, n=8, metrics={"success_rate": 0.5})], "metrics")
    publish(config, [events.DeadLetter(source_topic=config.topics.name("turns"), partition=0, offset=3,
                                                    error="MalformedEvent: turn.session_id is missing", stage="judge",
                                                    raw=f"{MARK} raw".encode())], "turns.dlq")
    publish(config, [b"\x01not msgpack"], "turns", key="s-alpha")
    return {"turns": 4, "next_states": 4, "session_ends": 2, "samples": 4, "duplicates": 1}


def _caught_up(expect):
    def ok(o):
        t, s = o["traffic"], o["samples"]
        return (t["main_turns"] == expect["turns"] and t["next_states"] == expect["next_states"]
                and t["session_ends"] == expect["session_ends"] and s["total"] == expect["samples"]
                and o["trainer"]["steps"] and o["evaluations"] and o["syncs"] and o["dlq"]["latest"])
    return ok


def _get_routes(app) -> list[str]:
    paths = []
    for r in app.routes:
        if isinstance(r, APIRoute) and "GET" in r.methods:
            paths.append(r.path.replace("{session_id:path}", SESSIONS[0]).replace("{session_id}", SESSIONS[0]))
    return paths


def _stream(url: str, n_events: int, headers=None) -> str:
    out = []
    with httpx.stream("GET", f"{url}/api/stream", headers=headers or {}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            out.append(line)
            if sum(1 for x in out if x.startswith("event: overview")) >= n_events:
                break
    return "\n".join(out)


def test_no_conversation_text_without_the_flag(kafka_config):
    expect = _fill(kafka_config)
    with DashboardServer(kafka_config) as d:
        d.wait(_caught_up(expect))
        routes = _get_routes(d.app)
        # every JSON route the app has (a new one is checked automatically), plus the page itself
        assert {"/api/overview", "/api/sessions", f"/api/sessions/{SESSIONS[0]}", "/api/stream", "/api/config"} <= set(routes)
        served = {}
        for path in routes + ["/", "/api/sessions?q=alpha", f"/api/sessions/{SESSIONS[1]}"]:
            if path == "/api/stream":
                served[path] = _stream(d.url, 2)
            else:
                r = httpx.get(d.url + path, timeout=10)
                assert r.status_code == 200, (path, r.text)
                served[path] = r.text
        for path, body in served.items():
            assert MARK not in body, f"{path} serves conversation text without --show-text"
        # lengths instead of text: the session page still says how long each piece was
        s = json.loads(served[f"/api/sessions/{SESSIONS[0]}"])
        t0 = s["turns"][0]
        assert t0["response"]["chars"] == len(f"{MARK} reply 0") and t0["messages"][1]["chars"] == len(f"{MARK} user part 0")
        assert t0["samples"][0]["hint_chars"] == len(f"{MARK} hint 0")
        # nothing of it is even held in memory
        assert MARK not in repr(d.state.sessions)

    # the same dashboard with the flag serves the text (so the check above can fail)
    with DashboardServer(kafka_config.replace(dashboard={"show_text": True})) as d:
        d.wait(_caught_up(expect))
        body = httpx.get(f"{d.url}/api/sessions/{SESSIONS[0]}", timeout=10).text
        for piece in ("reply 0", "thinking 0", "user part 0", "next 0", "result 0", "hint 0", "args", "tool doc"):
            assert f"{MARK} {piece}" in body, piece
        assert f"{MARK} raw" not in body and f"{MARK} raw" not in _stream(d.url, 1)  # dead letters' bytes: never


def test_counts_and_session_view_match_the_topics(kafka_config):
    expect = _fill(kafka_config)
    with DashboardServer(kafka_config) as d:
        o = d.wait(_caught_up(expect))
    t = o["traffic"]
    assert (t["sessions"], t["sessions_open"], t["turns"], t["waiting"]) == (2, 0, 4, 0)
    s = o["samples"]
    assert s["by_kind"] == {"opd+rl": 4} and s["duplicates"] == 1 and s["masked"] == 0 and s["trained"] == 1
    assert s["reward_mean"] == 0.0
    # votes: [1, 1, None] and [-1, 0, -1] per session; hint votes [1, -1, 1] per sample
    assert o["judge"]["prm_votes"] == {"1": 4, "0": 2, "-1": 4, "failed": 2}
    assert o["judge"]["hint_votes"] == {"accepted": 8, "rejected": 4, "failed": 0}
    assert o["judge"]["hint_samples_with_hint"] == 4
    sync = o["syncs"][0]
    assert sync["policy_version"] == 1 and list(sync["applied"]) == ["engine-0"] and sync["pause_s"] >= 0
    assert o["trainer"]["steps"][0]["loss"] == 0.5 and o["evaluations"][0]["success_rate"] == 0.5
    assert o["dlq"]["counts"][kafka_config.topics.dlq("turns")] == 1
    assert o["topics"]["undecodable"] == {kafka_config.topics.name("turns"): 1}

    # the session view: each turn's votes and majority, reward, mask, advantage and training step;
    # the lag of a stage's group: its committed offsets against the topic's end, counted independently
    from kafka import KafkaConsumer
    from kafka.structs import OffsetAndMetadata, TopicPartition

    from pipeline.bus import consumer_kwargs

    topic = kafka_config.topics.name("turns")
    per_partition = Counter(r.partition for r in topic_records(kafka_config, "turns"))
    group = f"{kafka_config.topics.prefix}judge"
    c = KafkaConsumer(**consumer_kwargs(kafka_config, group))
    c.assign([TopicPartition(topic, p) for p in per_partition])
    c.commit({TopicPartition(topic, p): OffsetAndMetadata(1, "", -1) for p in per_partition})
    c.close()
    want_lag = {"group": group, "topic": topic, "lag": sum(n - 1 for n in per_partition.values())}
    d2 = DashboardServer(kafka_config)
    with d2:
        d2.wait(_caught_up(expect))
        d2.wait(lambda o: want_lag in o["lag"])
        page = httpx.get(f"{d2.url}/api/sessions/{SESSIONS[0]}", timeout=5).json()
        listed = httpx.get(f"{d2.url}/api/sessions", params={"q": "bet"}, timeout=5).json()
        missing = httpx.get(f"{d2.url}/api/sessions/nope", timeout=5)
    s0, s1 = page["turns"][0]["samples"][0], page["turns"][1]["samples"][0]
    assert (s0["prm_votes"], s0["majority"], s0["reward"], s0["trained_step"], s0["mean_advantage"]) == \
        ([1, 1, None], 1, 1.0, 1, 0.75)
    assert (s1["prm_votes"], s1["majority"], s1["trained"], s1["mean_advantage"]) == ([-1, 0, -1], -1, False, None)
    assert s0["teacher_minus_rollout_mean"] == pytest.approx(0.125)
    assert page["turns"][0]["finish_reason"] == "stop" and page["end"]["reason"] == "header"
    assert [x["session_id"] for x in listed["sessions"]] == ["s-beta"]
    assert missing.status_code == 404 and "no session" in missing.json()["error"]["message"]


def test_api_keys_are_the_proxys(kafka_config, monkeypatch):
    from pipeline.config import load_config

    monkeypatch.setenv("PIPELINE_PROXY__API_KEYS", '["k-one", "k-two"]')
    config = load_config(None, kafka={"bootstrap_servers": kafka_config.kafka.bootstrap_servers},
                         topics={"prefix": kafka_config.topics.prefix})
    _fill(config)
    with DashboardServer(config) as d:
        assert httpx.get(f"{d.url}/api/config").json() == {"auth": True, "show_text": False, "review": False}
        for path in _get_routes(d.app):
            if path == "/api/config" or not path.startswith("/api/"):  # the page and /healthz hold no data
                continue
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k-one"}):
                r = httpx.get(d.url + path, headers=headers, timeout=10)
                assert r.status_code == 401 and "API key" in r.json()["error"]["message"], (path, headers)
        ok = {"Authorization": "Bearer k-two"}
        assert httpx.get(f"{d.url}/api/overview", headers=ok, timeout=10).status_code == 200
        assert "event: overview" in _stream(d.url, 1, headers=ok)
        assert httpx.get(f"{d.url}/").status_code == 200  # the page itself holds no data; it asks for the key


def test_views_redact_every_text_field():
    turns, samples = marked_conversation("s", turns=1)
    for ev in turns + samples:
        hidden = json.dumps(views.event_view(ev))
        shown = json.dumps(views.event_view(ev, text=True))
        assert MARK not in hidden, ev.TYPE
        if not isinstance(ev, events.SessionEnd):
            assert MARK in shown, ev.TYPE
    dl = events.DeadLetter(source_topic="turns", partition=0, offset=1, error="e", raw=f"{MARK}".encode(), key=b"s")
    assert MARK not in json.dumps(views.event_view(dl, text=True)) and views.event_view(dl)["raw_bytes"] == len(MARK)
    # votes: rl -> PRM, opd -> hint votes, opd+rl -> [PRM, hint]
    rl = events.Sample(sample_id="a", session_id="s", turn_index=0, votes=[1, None, -1])
    opd = events.Sample(sample_id="b", session_id="s", turn_index=0, kind="opd", votes=[1, -1])
    assert views.split_votes(rl) == ([1, None, -1], []) and views.split_votes(opd) == ([], [1, -1])
    assert views.majority([1, None, -1]) == 0 and views.majority([1, 1, -1]) == 1 and views.majority([]) is None


def _adapter(tenant: str, digit: str) -> dict:
    version = digit * 64
    return {"name": events.adapter_name(tenant, version), "version": version, "sha256": "ab" * 32}


def test_views_show_tenant_and_adapter_on_every_record_that_carries_them():
    """``pipeline tail`` and the dashboard show a turn's, next state's and sample's ``tenant`` (and
    a turn's and sample's LoRA ``adapter``) as the other records' views do: None when absent."""
    ad = _adapter("alice", "1")
    tenanted = [events.Turn(session_id="s", turn_index=0, tenant="alice", adapter=ad),
                events.NextState(session_id="s", after_turn_index=0, messages=[], tenant="alice"),
                events.Sample(sample_id="alice/s:0:rl", session_id="s", turn_index=0, loss_mask=0, tenant="alice",
                              adapter=ad),
                events.SessionEnd(session_id="s", tenant="alice"),
                events.Control(action="pause", epoch=1, tenant="alice", adapter=ad)]
    for ev in tenanted:
        shown = views.event_view(events.decode(events.encode(ev)))
        assert shown["tenant"] == "alice", ev.TYPE
        if hasattr(ev, "adapter"):
            assert shown["adapter"] == ad, ev.TYPE
    for ev in (events.Turn(session_id="s", turn_index=0), events.NextState(session_id="s", after_turn_index=0, messages=[]),
               events.Sample(sample_id="s:0:rl", session_id="s", turn_index=0, loss_mask=0), events.SessionEnd(session_id="s")):
        shown = views.event_view(events.decode(events.encode(ev)))
        assert "tenant" in shown and shown["tenant"] is None, ev.TYPE
        assert shown.get("adapter", "absent") in (None, "absent") and ("adapter" in shown) == hasattr(ev, "adapter")


def test_two_tenants_adapter_syncs_of_one_epoch_are_two_syncs():
    """``/api/overview`` keys syncs by (tenant, epoch): alice's and bob's epoch-1 adapter syncs are
    two entries naming tenant and adapter; a full-weight epoch-1 sync is a third, in its old shape."""
    from pipeline.bus import Record
    from pipeline.config import load_config
    from pipeline.dashboard.state import DashboardState
    from pipeline.testing.lora import adapter_order

    state = DashboardState(load_config(None))
    recs = []
    for tenant, digit in (("alice", "1"), ("bob", "2")):
        ad = _adapter(tenant, digit)
        recs += [adapter_order("pause", tenant, ad), adapter_order("weights", tenant, ad, "/x/" + tenant),
                 adapter_order("applied" if tenant == "alice" else "failed", tenant, ad, engine_id="engine-0"),
                 adapter_order("resume", tenant, ad if tenant == "alice" else None)]
    recs += [events.Control(action="pause", epoch=1, policy_version=1, created_at=events.now_ms()),
             events.Control(action="applied", epoch=1, policy_version=1, engine_id="engine-0")]
    for i, c in enumerate(recs):
        state.apply(Record("control", 0, i, c.run_id, c, events.now_ms()))
    syncs = state.overview()["syncs"]
    by_tenant = {s.get("tenant", "-"): s for s in syncs}
    assert len(syncs) == 3 and set(by_tenant) == {"alice", "bob", "-"}
    assert by_tenant["alice"]["adapter"] == _adapter("alice", "1")["name"] and list(by_tenant["alice"]["applied"]) == [
        "engine-0"] and not by_tenant["alice"]["failed"]
    # bob's resume names no adapter (back to the base): the entry still names the adapter that failed
    assert by_tenant["bob"]["adapter"] == _adapter("bob", "2")["name"] and list(by_tenant["bob"]["failed"]) == [
        "engine-0"] and not by_tenant["bob"]["applied"]
    assert "adapter" not in by_tenant["-"] and list(by_tenant["-"]["applied"]) == ["engine-0"]


def test_reader_start_positions_and_no_group(kafka_config):
    from pipeline.bus.admin import admin_client

    admin = admin_client(kafka_config)
    groups_before = set(map(str, admin.list_groups()))
    topic = kafka_config.topics.name("turns")
    publish(kafka_config, [events.SessionEnd(session_id="a", reason=str(i)) for i in range(6)], "turns")
    time.sleep(0.05)
    cut = events.now_ms()
    time.sleep(0.05)
    publish(kafka_config, [events.SessionEnd(session_id="a", reason=str(i)) for i in range(6, 9)], "turns")

    with TopicReader(kafka_config, [topic]) as r:
        everything = [rec.event.reason for rec in r.read()]
    assert sorted(everything, key=int) == [str(i) for i in range(9)]  # one key: one partition, in order
    assert everything == [str(i) for i in range(9)]
    with TopicReader(kafka_config, [topic], start=Time(cut)) as r:
        assert [rec.event.reason for rec in r.read()] == ["6", "7", "8"]
    with TopicReader(kafka_config, [topic], start=Time(events.now_ms() + 60_000)) as r:
        assert list(r.read(idle_timeout_s=1.0)) == []  # a time past the end: nothing (not everything)
    with TopicReader(kafka_config, [topic], start=Offset(7)) as r:
        assert [rec.event.reason for rec in r.read()] == ["7", "8"]

    # from "end": only what arrives afterwards, even where the broker's end offset is off by one
    got: list = []
    stop = threading.Event()
    with TopicReader(kafka_config, [topic], start="end") as r:
        t = threading.Thread(target=lambda: got.extend(rec.event.reason for rec in r.read(follow=True, stop=stop)))
        t.start()
        time.sleep(0.5)
        publish(kafka_config, [events.SessionEnd(session_id="a", reason="new")], "turns")
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        t.join(5)
    assert got == ["new"]
    assert set(map(str, admin.list_groups())) == groups_before, "an observer created a consumer group"
    admin.close()


def test_state_fold_rules_without_a_broker():
    """Eviction keeps the counts; a redone step re-attributes its samples; waiting turns follow the topic."""
    from pipeline.bus import Record
    from pipeline.config import load_config
    from pipeline.dashboard.state import DashboardState

    state = DashboardState(load_config(None, dashboard={"max_sessions": 2}))
    offset = iter(range(10_000))

    def feed(topic, ev):
        state.apply(Record(topic, 0, next(offset), getattr(ev, "session_id", None), ev, events.now_ms()))

    for sid in ("a", "b", "c"):
        turns, samples = marked_conversation(sid, turns=1)
        for ev in turns:
            feed("turns", ev)
        for s in samples:
            feed("samples", s)
    o = state.overview()
    assert o["traffic"]["sessions"] == 3 and o["traffic"]["main_turns"] == 3 and o["samples"]["total"] == 3
    assert [s["session_id"] for s in state.sessions_list()] == ["c", "b"]  # the oldest one left the browser
    assert state.session("a") is None

    # a main turn without next state, sample or session end is waiting; its sample settles it
    feed("turns", events.Turn(session_id="d", turn_index=0, response_token_ids=[1], response_logprobs=[-1.0]))
    assert state.overview()["traffic"]["waiting"] == 1
    feed("samples", events.Sample(sample_id="d:0:rl", session_id="d", turn_index=0, tokens=[1], response_length=1,
                                  rollout_log_probs=[-1.0], loss_mask=0))
    assert state.overview()["traffic"]["waiting"] == 0

    # step 1 trains c:0 ... the trainer restarts and redoes step 1 with d:0 instead: c:0 is no longer trained
    feed("metrics", events.TrainStep(step=1, trained={"c:0:combine": 0.5}, sample_ids=["c:0:combine"]))
    assert state.session("c")["turns"][0]["samples"][0]["trained_step"] == 1
    feed("metrics", events.TrainStep(step=1, trained={"d:0:rl": -0.25}, sample_ids=["d:0:rl"]))
    assert state.session("c")["turns"][0]["samples"][0]["trained"] is False
    assert state.session("d")["turns"][0]["samples"][0]["mean_advantage"] == -0.25
    assert len(state.overview()["trainer"]["steps"]) == 1


def test_two_tenants_with_one_session_id_are_two_sessions():
    """Sessions are keyed by (tenant, id) as everywhere else: two tenants' ``s1`` are two sessions,
    each found with its tenant; an untenanted ``s1`` is a third; the list names the tenant."""
    from fastapi.testclient import TestClient

    from pipeline.bus import Record
    from pipeline.config import load_config
    from pipeline.dashboard.state import DashboardState

    state = DashboardState(load_config(None))
    for i, tenant in enumerate(("alice", "bob", None, "bob")):
        ev = events.Turn(session_id="s1", turn_index=i, tenant=tenant, response_token_ids=[1], response_logprobs=[-1.0])
        state.apply(Record("turns", 0, i, "s1", ev, events.now_ms()))
    state.apply(Record("turns", 0, 9, "s1", events.SessionEnd(session_id="s1", tenant="alice"), events.now_ms()))
    listed = state.sessions_list()
    assert sorted((x["tenant"] or "", x["turns"]) for x in listed) == [("", 1), ("alice", 1), ("bob", 2)]
    assert [x["tenant"] for x in state.sessions_list("ali")] == ["alice"]
    assert state.session("s1", "alice")["end"] is not None and state.session("s1", "bob")["end"] is None
    assert [t["turn_index"] for t in state.session("s1", "bob")["turns"]] == [1, 3]
    assert [t["turn_index"] for t in state.session("s1")["turns"]] == [2]
    assert state.session("s1", "carol") is None and state.overview()["traffic"]["sessions_open"] == 2


def test_bad_requests_and_odd_records_get_clear_answers(kafka_config):
    from pipeline.bus import Record
    from pipeline.dashboard.state import DashboardState

    # a sample whose votes are not votes (valid msgpack, odd content) is still shown, as failed votes
    odd = events.Sample(sample_id="o", session_id="o", turn_index=0, votes=["yes", 2, True, 1])
    assert views.split_votes(odd) == ([None, None, None, 1], [])
    state = DashboardState(kafka_config)
    state.apply(Record("x", 0, 0, "o", odd, 0))
    state.apply(Record("x", 0, 1, "k", events.TrainStep(step=1, metrics={"loss": "n/a"}, trained={"o": "?"}), 0))
    assert state.overview()["judge"]["prm_votes"] == {"1": 1, "0": 0, "-1": 0, "failed": 3}
    with DashboardServer(kafka_config) as d:
        for path in ("/api/sessions?limit=0", "/api/sessions?limit=abc", "/api/sessions?q=" + "x" * 300):
            r = httpx.get(d.url + path, timeout=5)
            assert r.status_code == 422 and r.json()["error"]["message"].startswith("bad request"), path
        r = httpx.get(d.url + "/api/nothing-here", timeout=5)
        assert r.status_code == 404 and "no route" in r.json()["error"]["message"]


def test_dashboard_process_serves_and_stops_with_a_live_stream_open(kafka_config, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    import yaml

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"kafka": {"bootstrap_servers": kafka_config.kafka.bootstrap_servers},
                                   "topics": {"prefix": kafka_config.topics.prefix}}))
    _fill(kafka_config)
    bad = subprocess.run([sys.executable, "-m", "pipeline", "dashboard", "--metrics", "judge", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "STAGE=http" in bad.stdout + bad.stderr
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "dashboard", "--port", "0", "--from", "now",
                             "--metrics", "ghost=http://127.0.0.1:9/metrics", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("dashboard: http://") and "topics from now" in line, line
        url = line.split()[1].rstrip("/")
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).json()["caught_up"]:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "dashboard not ready"
            time.sleep(0.1)
        deadline = time.monotonic() + 60
        while True:  # the first scrape of the stages' endpoints (it follows a listing of the broker's groups)
            o = httpx.get(f"{url}/api/overview", timeout=5).json()
            if "ghost" in o["stages"]:
                break
            assert time.monotonic() < deadline, "no scrape of the stages' endpoints"
            time.sleep(0.2)
        assert o["traffic"]["turns"] == 0 and o["samples"]["total"] == 0  # --from now: the history is skipped
        assert o["stages"]["ghost"]["up"] is False and o["reader"]["start"] == "now"
        publish(kafka_config, marked_conversation("s-late", turns=1)[0], "turns")
        got = []
        opened = threading.Event()

        def listen():
            try:
                with httpx.stream("GET", f"{url}/api/stream", timeout=60) as r:
                    opened.set()
                    for ln in r.iter_lines():
                        got.append(ln)
            except httpx.HTTPError:  # the server closes the stream when it stops
                pass

        t = threading.Thread(target=listen, daemon=True)
        t.start()
        assert opened.wait(10)
        deadline = time.monotonic() + 20
        while not any('"main_turns":1' in x for x in got):
            assert time.monotonic() < deadline, "the new turn never reached the stream"
            time.sleep(0.1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        assert time.monotonic() - t0 < 15  # an open stream does not hold the shutdown
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stage_that_takes_the_connection_but_does_not_answer_is_busy_not_down():
    # a trainer in a step holds the GIL: its metrics server accepts and answers late; a stage
    # whose port refuses the connection is down
    import socket

    import httpx

    from pipeline.dashboard.sources import Scraper
    from pipeline.procutil import free_port

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(8)  # accepts (the kernel's backlog), never answers
    urls = {"trainer": f"http://127.0.0.1:{busy.getsockname()[1]}/metrics",
            "judge": f"http://127.0.0.1:{free_port()}/metrics"}
    from tests.conftest import make_config

    config = make_config("127.0.0.1:9", "t-").replace(dashboard={"metrics_urls": urls})
    scraper = Scraper(config)
    scraper.stages = {"trainer": {"values": {"pipeline_trainer_steps_total": 3.0}}}
    try:
        with httpx.Client(timeout=0.5) as client:
            scraper.scrape_once(client)
    finally:
        busy.close()
    stages = scraper.snapshot()["stages"]
    assert stages["trainer"]["up"] and stages["trainer"]["busy"], stages
    assert scraper.stages["trainer"]["values"] == {"pipeline_trainer_steps_total": 3.0}  # last values kept
    assert not stages["judge"]["up"] and not stages["judge"].get("busy")


@pytest.mark.slow
def test_a_finished_run_is_served_from_its_durable_broker_log(tmp_path):
    # `pipeline dashboard --run-dir DIR` after the stack stopped: the run's broker restarts from
    # DIR/broker and the dashboard shows what the run recorded (the demo's last evaluation too)
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import make_config
    from pipeline.broker import kafka_answers
    from pipeline.orchestrate.supervisor import Supervisor
    from pipeline.orchestrate.up import broker_stage_args, write_config_file
    from pipeline.bus.admin import apply_topics
    from pipeline.topics import load_topics

    run_dir = tmp_path / "run"
    sup = Supervisor(run_dir / "logs")
    bargs, port = broker_stage_args(run_dir)
    bootstrap = f"127.0.0.1:{port}"
    sup.start("broker", bargs, ready=lambda: kafka_answers(bootstrap), timeout_s=180)
    try:
        config = make_config(bootstrap, "fin-")
        apply_topics(config, load_topics(config.topics.file))
        turn_events, samples = marked_conversation("fin-s1", turns=2)
        publish(config, turn_events, "turns")
        publish(config, samples, "samples")
        write_config_file(config, run_dir / "config.yaml")
    finally:
        sup.stop_all()
    assert not kafka_answers(bootstrap)
    bad = subprocess.run([sys.executable, "-m", "pipeline", "dashboard", "--run-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "holds no run" in bad.stdout
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "dashboard", "--run-dir", str(run_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = []
        while not (lines and lines[-1].startswith("dashboard: http://")):
            lines.append(proc.stdout.readline())
            assert lines[-1], f"dashboard exited: {lines}"
        assert any("restarted from" in line for line in lines)
        url = lines[-1].split()[1].rstrip("/")
        want = sum(1 for e in turn_events if isinstance(e, events.Turn))
        deadline = time.monotonic() + 60
        while True:
            try:
                o = httpx.get(f"{url}/api/overview", timeout=5).json()
                if o["traffic"]["main_turns"] == want and o["samples"]["total"] == len(samples):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the finished run's records never showed"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    assert not kafka_answers(bootstrap), "the broker it started stops with it"


def test_the_overview_says_how_many_samples_the_next_step_still_needs():
    """Trainable samples no step took yet count toward ``trainer.rollout_batch_size``; a masked one
    does not (unless ``trainer.count_masked_samples``); a trained one no longer waits."""
    from pipeline.bus import Record
    from pipeline.config import load_config
    from pipeline.dashboard.state import DashboardState

    def fill(state):
        for i, mask in enumerate((1, 1, 1, 0)):
            s = events.Sample(sample_id=f"s:{i}:rl", session_id="s", turn_index=i, tokens=[1], response_length=1,
                              rollout_log_probs=[-1.0], loss_mask=mask, reward=1.0 if mask else None)
            state.apply(Record("samples", 0, i, "s", s, events.now_ms()))
        return state.overview()["trainer"]

    state = DashboardState(load_config(None, trainer={"rollout_batch_size": 4}))
    assert {k: fill(state)[k] for k in ("batch_size", "waiting", "needs")} == {"batch_size": 4, "waiting": 3, "needs": 1}
    state.apply(Record("metrics", 0, 9, None, events.TrainStep(step=1, trained={"s:0:rl": 0.5, "s:1:rl": -0.5},
                                                                sample_ids=["s:0:rl", "s:1:rl"]), events.now_ms()))
    assert (state.overview()["trainer"]["waiting"], state.overview()["trainer"]["needs"]) == (1, 3)
    masked_count = DashboardState(load_config(None, trainer={"rollout_batch_size": 4, "count_masked_samples": True}))
    assert fill(masked_count)["needs"] == 0


def test_the_overview_carries_live_metrics_per_version():
    """The state folds turns, samples, control and evaluations into the versions view (counts only:
    no reply text kept) and sends it with every overview; ``/api/versions`` serves the same."""
    from fastapi.testclient import TestClient

    from pipeline.bus import Record
    from pipeline.config import load_config
    from pipeline.dashboard.app import create_app
    from pipeline.dashboard.state import DashboardState
    from tests.rollout.live_records import A2, canary_log

    config = load_config(None).replace(rollout={"enabled": True}, trainer={"lora": {"rank": 4}})
    state = DashboardState(config)
    offset = 0
    for topic, records in canary_log().items():
        for ev in records:
            state.apply(Record(config.topics.name(topic), 0, offset, None, ev, 0))
            offset += 1
    scopes = {s["scope"]: s for s in state.overview()["versions"]}
    a2 = next(v for v in scopes["alice"]["versions"] if v["label"] == A2["name"])
    assert (a2["role"], a2["turns"], a2["reward"]["k"], a2["reward"]["n"], a2["refusals"]["k"]) == (
        "rolled back", 10, 2, 10, 3)
    assert "sorry" not in json.dumps(state.overview()["versions"])  # counts, never the reply text
    with TestClient(create_app(config, state)) as client:
        assert client.get("/api/versions").json()["versions"] == json.loads(json.dumps(state.overview()["versions"]))
