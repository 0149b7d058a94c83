"""Crash safety: ``kill -9`` a judge process in the middle of its work on a live stream, restart
it, and check that every turn's sample is there exactly once after de-duplication by sample_id.

The judge runs as a real subprocess (``python -m pipeline judge``) against the test broker and
a :class:`StandInJudge` (stand-in judge endpoint; each vote answers after 20 ms). The
stream is published in three parts, one per judge incarnation. Each kill waits for observable
proof that the judge is in the middle of its work (a random number of records consumed, part of
them committed to the group on the broker, records polled but not yet acknowledged on its
/metrics), and the test asserts that proof. Each trial uses fresh topics and a fresh group.
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

from pipeline.procutil import free_port
from pipeline.bus import EventProducer, TopicReader
from pipeline.config import load_config
from pipeline.bus.admin import apply_topics
from pipeline.topics import load_topics
from tests.conftest import scrape
from pipeline.testing.judge import check_samples, scripted_stream
from pipeline.testing.topics import read_events

N_SESSIONS, TURNS = 36, 5


def judge_cmd(bootstrap, prefix, group, url, metrics_port):
    return [sys.executable, "-m", "pipeline", "judge", "--mode", "rl", "--backend", "llm", "--url", url,
            "--group-id", group, "--bootstrap", bootstrap, "--log-level", "WARNING",
            "--set", f"topics.prefix={prefix}", "--set", "judge.vote_timeout_s=5", "--set", "judge.retries=1",
            "--set", "judge.drain_timeout_s=5", "--set", f"metrics_port={metrics_port}",
            # the restarted judge resumes mid-session: a next state whose turn the killed one settled
            # waits for it this long in event time (the stream here spans seconds, not minutes)
            "--set", "judge.reorder_lateness_s=1"]


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


def _committed(reader: TopicReader) -> int:
    return sum(o or 0 for o in reader.committed().values())


@pytest.mark.parametrize("trial", range(3))
def test_kill9_in_the_middle_of_judging_loses_nothing(broker_bootstrap, topic_prefix, judge_server, tmp_path, trial):
    rng = random.Random(1000 + trial)
    config = load_config(None, kafka={"bootstrap_servers": broker_bootstrap}, topics={"prefix": topic_prefix})
    apply_topics(config, load_topics(config.topics.file))
    evs, expected = scripted_stream(N_SESSIONS, TURNS, seed=trial, vote_delay_s=0.02)
    third = len(evs) // 3
    parts = [evs[:third], evs[third:2 * third], evs[2 * third:]]
    group = f"{topic_prefix}judge"
    log = open(tmp_path / "judge.log", "ab")
    groups = TopicReader(config, config.topics.name("turns"), name="test", group_id=group)
    proofs = []
    proc = publisher = None
    try:
        for part in parts[:2]:  # two kill -9 in the middle of the work, each after a restart
            port = free_port()
            before = _committed(groups)
            proc = start(judge_cmd(broker_bootstrap, topic_prefix, group, judge_server.url, port), log)
            started = time.monotonic()
            while "pipeline_consumer_in_flight_records" not in scrape(port) and time.monotonic() < started + 180:
                time.sleep(0.05)  # until its consumer loop runs (a loaded machine: slow imports)
            startup_s = time.monotonic() - started
            publisher = threading.Thread(target=publish_slowly, args=(config, part, 2.0))
            publisher.start()  # then the part arrives live; the work's own deadline starts now
            deadline = time.monotonic() + 120
            want = rng.randint(1, len(part))
            proof, m, committed = None, {}, before
            while proof is None and time.monotonic() < deadline and proc.poll() is None:
                m, committed = scrape(port, stage="judge"), _committed(groups)
                if (m.get("pipeline_records_consumed_total", 0) >= want and m.get("pipeline_consumer_in_flight_records", 0) > 0
                        and m.get("pipeline_events_produced_total", 0) >= 1 and committed > before):
                    proof = m
                else:
                    time.sleep(0.02)
            exited = proc.poll()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            publisher.join()
            assert proof is not None, (
                f"the judge never got into the middle of its work (start-up {startup_s:.1f} s, exit code {exited}, "
                f"want {want} consumed, committed {before} -> {committed}): last metrics {m}; log: "
                f"{(tmp_path / 'judge.log').read_text(errors='replace')[-2000:]}")
            proofs.append((before, _committed(groups), proof))
        proc = start(judge_cmd(broker_bootstrap, topic_prefix, group, judge_server.url, free_port()), log)
        publish_slowly(config, parts[2], 1.0)  # the survivor finishes the stream
        want = set(expected)
        samples = read_events(config, "samples", lambda out: want <= {x.sample_id for x in out},
                              timeout_s=90, settle_s=0.5)
        res = check_samples(samples, expected)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if publisher is not None:
            publisher.join()
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        groups.close()
        log.close()
    print(f"trial {trial}: kills after {[int(p['pipeline_records_consumed_total']) for *_, p in proofs]} records "
          f"consumed, {len(samples)} samples, {res['unique']} unique, {res['duplicates']} duplicates")
    assert len(proofs) == 2
    for before, after, proof in proofs:  # what each killed judge had done
        assert proof["pipeline_records_consumed_total"] >= 1, "consumed"
        assert after > before, "committed part of its work"
        assert proof["pipeline_consumer_in_flight_records"] > 0, "held records not yet acknowledged"
        assert proof.get("pipeline_events_produced_total", 0) >= 1, "delivered samples"
    assert res["missing"] == [] and res["unexpected"] == [], (res, (tmp_path / "judge.log").read_text()[-3000:])
    assert res["mismatched"] == [] and res["reordered"] == [], res
    assert res["unique"] == N_SESSIONS * TURNS
