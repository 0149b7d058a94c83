"""Crash safety: ``kill -9`` a judge process at random points of a live stream, restart it,
and check that every turn's sample is there exactly once after de-duplication by sample_id.

The judge runs as a real subprocess (``python -m pipeline judge``) against the test broker and
a :class:`ScriptedJudgeServer` (stand-in judge endpoint; each vote answers after 20 ms so judge
jobs are in flight when the kill lands). Each trial uses fresh topics and a fresh group.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from pipeline.bus import EventProducer
from pipeline.config import load_config
from pipeline.judge.testing import ScriptedJudgeServer, check_samples, read_events, scripted_stream
from pipeline.topics import apply_topics, load_topics

N_SESSIONS, TURNS = 36, 5


@pytest.fixture(scope="module")
def server():
    with ScriptedJudgeServer() as s:
        yield s


def judge_cmd(bootstrap, prefix, group, url):
    return [sys.executable, "-m", "pipeline", "judge", "--mode", "rl", "--backend", "llm", "--url", url,
            "--group-id", group, "--bootstrap", bootstrap, "--log-level", "WARNING",
            "--set", f"topics.prefix={prefix}", "--set", "judge.vote_timeout_s=5", "--set", "judge.retries=1",
            "--set", "judge.drain_timeout_s=5"]


def start(cmd, log):
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def publish_slowly(config, evs, duration_s):
    p = EventProducer(config, name="test-publisher")
    pause = duration_s / max(1, len(evs))
    for ev in evs:
        p.send(config.topics.name("turns"), ev, key=ev.session_id)
        time.sleep(pause)
    p.flush(30)
    p.close()


@pytest.mark.parametrize("trial", range(3))
def test_kill9_at_random_points_loses_nothing(broker_bootstrap, topic_prefix, server, tmp_path, trial):
    rng = random.Random(1000 + trial)
    config = load_config(None, kafka={"bootstrap_servers": broker_bootstrap}, topics={"prefix": topic_prefix})
    apply_topics(config, load_topics(config.topics.file))
    evs, expected = scripted_stream(N_SESSIONS, TURNS, seed=trial, vote_delay_s=0.02)
    cmd = judge_cmd(broker_bootstrap, topic_prefix, f"{topic_prefix}judge", server.url)
    log = open(tmp_path / "judge.log", "ab")
    publisher = threading.Thread(target=publish_slowly, args=(config, evs, 4.0))
    publisher.start()
    kills = 0
    try:
        for _ in range(2):  # two kill -9 at random points, each after a restart
            proc = start(cmd, log)
            time.sleep(rng.uniform(1.5, 4.0))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            kills += 1
        publisher.join()
        proc = start(cmd, log)  # the survivor finishes the stream
        want = set(expected)
        samples = read_events(config, "samples", lambda out: want <= {x.sample_id for x in out},
                              timeout_s=90, settle_s=0.5)
        res = check_samples(samples, expected)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        publisher.join()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        log.close()
    print(f"trial {trial}: {kills} kills, {len(samples)} samples, {res['unique']} unique, "
          f"{res['duplicates']} duplicates")
    assert kills == 2
    assert res["missing"] == [] and res["unexpected"] == [], (res, (tmp_path / "judge.log").read_text()[-3000:])
    assert res["mismatched"] == [] and res["reordered"] == [], res
    assert res["unique"] == N_SESSIONS * TURNS
