"""Two judge processes in one consumer group split the partitions; one leaves mid-stream.

Checks that no turn's sample is lost and no session's samples are re-ordered (first
occurrences in turn order after de-duplication by sample_id), against a live stream.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

from pipeline.bus import EventProducer
from pipeline.procutil import free_port
from tests.conftest import scrape
from pipeline.testing.judge import check_samples, scripted_stream
from pipeline.testing.servers import StandInJudge
from pipeline.testing.topics import read_events

N_SESSIONS, TURNS = 40, 5


def test_two_judges_one_leaves_no_loss_no_reorder(kafka_config, tmp_path):
    c = kafka_config
    evs, expected = scripted_stream(N_SESSIONS, TURNS, seed=7, window=12, vote_delay_s=0.02)
    with StandInJudge() as server:
        cmd = [sys.executable, "-m", "pipeline", "judge", "--mode", "rl", "--backend", "llm", "--url", server.url,
               "--group-id", f"{c.topics.prefix}judge", "--bootstrap", c.kafka.bootstrap_servers,
               "--log-level", "INFO", "--set", f"topics.prefix={c.topics.prefix}",
               # B takes over mid-session: a next state whose turn A settled waits for it this long
               # in event time (the stream here spans seconds, not minutes)
               "--set", "judge.reorder_lateness_s=1"]
        logs = [tmp_path / "a.log", tmp_path / "b.log"]
        ports = [free_port(), free_port()]
        procs = [subprocess.Popen(cmd + ["--set", f"metrics_port={port}"], stdout=open(p, "wb"), stderr=subprocess.STDOUT)
                 for p, port in zip(logs, ports)]
        try:
            p = EventProducer(c, name="test-publisher")
            half = len(evs) // 2

            def publish(part, pause):
                for ev in part:
                    p.send(c.topics.name("turns"), ev, key=ev.session_id)
                    time.sleep(pause)
                p.flush(30)

            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # both members own partitions
                owned = [re.findall(r"assigned \[\(", lg.read_text()) for lg in logs]
                if all(owned):
                    break
                time.sleep(0.2)
            publish(evs[:half], 3.0 / half)
            # A is in the middle of its work: it consumed records, delivered samples and holds
            # records not yet acknowledged (sessions waiting for their next state)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                a = scrape(ports[0], stage="judge")
                if (a.get("pipeline_records_consumed_total", 0) > 0 and a.get("pipeline_events_produced_total", 0) > 0
                        and a.get("pipeline_consumer_in_flight_records", 0) > 0):
                    break
                time.sleep(0.05)
            procs[0].send_signal(signal.SIGTERM)  # A leaves the group mid-stream
            t = threading.Thread(target=publish, args=(evs[half:], 3.0 / half))
            t.start()
            assert procs[0].wait(timeout=60) == 0
            t.join()
            p.close()
            want = set(expected)
            samples = read_events(c, "samples", lambda out: want <= {x.sample_id for x in out},
                                  timeout_s=60, settle_s=0.5)
            procs[1].send_signal(signal.SIGTERM)
            assert procs[1].wait(timeout=60) == 0
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert a.get("pipeline_records_consumed_total", 0) > 0, "A had consumed records"
    assert a.get("pipeline_events_produced_total", 0) > 0, "A had delivered samples"
    assert a.get("pipeline_consumer_in_flight_records", 0) > 0, "A held unacknowledged records when it left"
    a_log, b_log = (lg.read_text() for lg in logs)
    assert re.search(r"assigned \[\(", a_log) and re.search(r"assigned \[\(", b_log), "both members owned partitions"
    res = check_samples(samples, expected)
    print(f"{len(samples)} samples, {res['unique']} unique, {res['duplicates']} duplicates")
    assert res["missing"] == [] and res["unexpected"] == [], res
    assert res["reordered"] == [] and res["mismatched"] == [], res
