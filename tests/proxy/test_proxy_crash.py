"""kill -9 of the proxy right after it answered N requests: all N turns reach Kafka after a restart.

The proxy runs as its own process (``pipeline proxy --buffer-dir``) in front of a stand-in engine
(:class:`StandInEngine`, not a model). Before the kill the test proves the events were not
published: the broker is down (or frozen with SIGSTOP, so a window is in flight), the proxy's
metrics say every event is buffered and none delivered, and the buffer file holds every
answered turn. States are awaited, never slept on.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3

import httpx
import pytest

from pipeline import events
from pipeline.broker import EmbeddedBroker
from pipeline.config import load_config
from pipeline.procutil import free_port
from pipeline.proxy.buffer import DB_NAME
from pipeline.bus.admin import apply_topics
from pipeline.topics import load_topics
from pipeline.testing.servers import StandInEngine, serve_app
from pipeline.testing.topics import read_events
from pipeline.testing.waiting import wait_for
from tests.processes import PipelineProcess

CHAT = "/v1/chat/completions"


class ProxyProcess(PipelineProcess):
    def __init__(self, engine_url: str, bootstrap: str, buffer_dir, prefix: str) -> None:
        super().__init__("proxy", "--port", "0", "--engine-url", engine_url, "--bootstrap", bootstrap,
                         "--buffer-dir", str(buffer_dir), "--no-control", "--set", f"topics.prefix={prefix}",
                         "--set", "proxy.publish_delivery_timeout_ms=3000")
        self.url = self.wait_line(r"PROXY READY (\S+)", "proxy did not start", 60).group(1)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def _buffered_turns(buffer_dir) -> set[str]:
    """request ids of the turn events in the buffer file (read-only, beside the running proxy)."""
    db = sqlite3.connect(f"file:{buffer_dir / DB_NAME}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT value FROM events").fetchall()
    finally:
        db.close()
    return {e.request_id for e in (events.decode(v) for (v,) in rows) if isinstance(e, events.Turn)}


def _talk(url: str, sessions: int, turns: int) -> tuple[list[str], int]:
    """Multi-turn sessions (streamed and not, last turn with X-Session-Done); every answer must be
    200. Returns the turn request ids answered and the number of events they produce."""
    rids = []
    n_events = 0
    with httpx.Client(base_url=url, timeout=30) as c:
        for s in range(sessions):
            msgs = [{"role": "user", "content": f"session {s}"}]
            for t in range(turns):
                h = {"X-Session-Id": f"S{s}"}
                if t == turns - 1:
                    h["X-Session-Done"] = "1"
                r = c.post(CHAT, json={"model": "m", "messages": msgs, "stream": t % 2 == 1}, headers=h)
                assert r.status_code == 200, r.text
                rids.append(r.headers["x-request-id"])
                msgs = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"more {t}"}]
            n_events += turns + (turns - 1) + 1  # turns, next states, session_end
    return rids, n_events


@pytest.mark.parametrize("outage", ["broker_down", "broker_frozen"])
def test_proxy_killed_minus_9_right_after_answering_loses_no_turn(tmp_path, outage):
    port = free_port()
    broker = EmbeddedBroker(port=port).start()
    prefix = "k-"
    config = load_config(None, kafka={"bootstrap_servers": broker.bootstrap}, topics={"prefix": prefix})
    apply_topics(config, load_topics(config.topics.file))
    buffer_dir = tmp_path / "proxy-buffer"
    procs = []
    try:
        with serve_app(StandInEngine()) as engine_url:
            p = ProxyProcess(engine_url, broker.bootstrap, buffer_dir, prefix)
            procs.append(p)
            warm, _ = _talk(p.url, 1, 1)  # publishing works: the warm-up turn reaches Kafka
            wait_for(lambda: p.metric("pipeline_proxy_events_delivered_total") >= 2, "warm-up delivery")
            delivered_before = p.metric("pipeline_proxy_events_delivered_total")

            if outage == "broker_down":
                broker.proc.kill()
                broker.proc.wait(10)
            else:  # frozen: the proxy's produce request is in flight, never acknowledged
                os.kill(broker.proc.pid, signal.SIGSTOP)
            answered, n_events = _talk(p.url, 4, 3)  # N = 12 answered requests, 28 events
            # proof that the proxy is killed with its events unpublished: all buffered, none
            # delivered since the outage, and every answered turn in the buffer file on disk
            wait_for(lambda: p.metric("pipeline_proxy_events_buffered") == n_events, "every event buffered")
            assert p.metric("pipeline_proxy_events_delivered_total") == delivered_before
            assert _buffered_turns(buffer_dir) == set(answered)

            os.kill(p.proc.pid, signal.SIGKILL)  # right after the last answer
            p.proc.wait(10)
            if outage == "broker_down":
                broker.start()  # memory storage: an empty log, topics created again
                apply_topics(config, load_topics(config.topics.file))
            else:
                os.kill(broker.proc.pid, signal.SIGCONT)

            p2 = ProxyProcess(engine_url, broker.bootstrap, buffer_dir, prefix)  # same buffer folder
            procs.append(p2)
            wait_for(lambda: p2.metric("pipeline_proxy_events_buffered") == 0, "the restarted proxy drained", 60)
            evs = read_events(config, timeout_s=30, settle_s=2.0)
            p2.proc.send_signal(signal.SIGTERM)
            assert p2.proc.wait(30) in (0, -15)
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
        if broker.proc is not None and broker.proc.poll() is None:
            os.kill(broker.proc.pid, signal.SIGCONT)
        broker.stop()
    turns = [e for e in evs if isinstance(e, events.Turn)]
    got = {t.request_id for t in turns}
    assert set(answered) <= got, f"{len(set(answered) - got)} answered turns never reached Kafka"
    # at-least-once: a re-sent event is an exact copy, so the downstream de-duplicates by request_id
    by_rid: dict[str, list] = {}
    for t in turns:
        by_rid.setdefault(t.request_id, []).append(t)
    assert all(all(x == ts[0] for x in ts) for ts in by_rid.values())
    ends = {e.session_id for e in evs if isinstance(e, events.SessionEnd)}
    assert ends >= {f"S{s}" for s in range(4)}  # the session_end of each X-Session-Done answer too
    # per session, first occurrences are in order: turn 0, next_state, turn 1, ...
    for s in range(4):
        seq = [(e.TYPE, getattr(e, "turn_index", None)) for e in evs if getattr(e, "session_id", "") == f"S{s}"]
        first = list(dict.fromkeys(seq))
        assert [x for x in first if x[0] == "turn"] == [("turn", 0), ("turn", 1), ("turn", 2)]
