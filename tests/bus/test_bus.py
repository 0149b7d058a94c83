"""Topic-level integration tests of the data plane against a real broker."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from kafka import KafkaConsumer
from prometheus_client import REGISTRY
from kafka.structs import TopicPartition

from pipeline import events
from pipeline.bus import ConsumerApp, EventProducer, consumer_kwargs
from tests.conftest import read_all

WORKER = Path(__file__).parent / "workers" / "bus_worker.py"


def _all_event_kinds():
    return [
        events.Turn(session_id="s1", turn_index=0, prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5],
                    response_logprobs=[-0.25, -1.5], messages=[{"role": "user", "content": "hi"}]),
        events.NextState(session_id="s1", messages=[{"role": "user", "content": "thanks"}], after_turn_index=0),
        events.SessionEnd(session_id="s1"),
        events.Sample(sample_id="s1:0:rl", session_id="s1", turn_index=0, tokens=[1, 2, 3, 4, 5], response_length=2,
                      rollout_log_probs=[-0.25, -1.5], reward=1.0),
        events.Control(action="weights", epoch=1, policy_version=1, location="/w/1", sha256="ab" * 32),
        events.DeadLetter(source_topic="turns", partition=0, offset=3, error="x", raw=b"\x00"),
    ]


def _run_app_until(app: ConsumerApp, handle, done: callable, timeout_s: float = 60.0, **kw):
    t = threading.Thread(target=app.run, args=(handle,), kwargs={"install_signals": False, **kw}, daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)
    app.stop()
    t.join(30)
    assert not t.is_alive(), "consumer app did not stop"
    assert done(), "timed out waiting for records"


def test_every_event_type_produced_and_consumed(kafka_config):
    topic = kafka_config.topics.name("turns")
    sent = _all_event_kinds()
    p = EventProducer(kafka_config, name="test")
    for ev in sent:
        p.send(topic, ev, key="s1")
    p.close()
    assert p.delivered == len(sent) and p.failed == 0
    got = []
    app = ConsumerApp(kafka_config, "g-all", [topic], name="test", accept=None)  # any type, for this round trip
    _run_app_until(app, lambda r: got.append(r), lambda: len(got) >= len(sent))
    assert [r.event for r in got] == sent  # one key -> one partition -> order kept
    assert {r.key for r in got} == {"s1"}
    assert [r.offset for r in got] == sorted(r.offset for r in got)


def _committed(config, group, topic, partitions=4):
    c = KafkaConsumer(**consumer_kwargs(config, group))
    try:
        return {p: c.committed(TopicPartition(topic, p)) for p in range(partitions)}
    finally:
        c.close()


def test_deferred_ack_commits_only_contiguous_prefix(kafka_config):
    topic = kafka_config.topics.name("turns")
    p = EventProducer(kafka_config, name="test")
    for i in range(5):
        p.send(topic, events.SessionEnd(session_id=f"s{i}"), key="same")
    p.close()
    seen = []
    app = ConsumerApp(kafka_config, "g-defer", [topic], name="test")

    def handle(r):
        seen.append(r)
        return r.offset != 2 and r.offset != 3  # defer offsets 2 and 3

    def done():
        if len(seen) == 5 and not getattr(done, "acked", False):
            app.ack(seen[3])  # ack 3 first: the commit may not pass 2
            done.acked = True
            return False
        return len(seen) == 5 and done.acked

    _run_app_until(app, handle, done, drain_timeout_s=0.5)
    part = seen[0].partition
    assert _committed(kafka_config, "g-defer", topic)[part] == 2, "commit must stop at the first unacked offset"
    # a second member resumes at offset 2: exactly the unacknowledged record and everything after
    again = []
    app2 = ConsumerApp(kafka_config, "g-defer", [topic], name="test")
    _run_app_until(app2, lambda r: again.append(r.offset), lambda: len(again) >= 3)
    assert again == [2, 3, 4]
    assert _committed(kafka_config, "g-defer", topic)[part] == 5


def test_corrupted_record_goes_to_dlq_and_neighbours_are_processed(kafka_config):
    from kafka import KafkaProducer

    topic = kafka_config.topics.name("turns")
    raw = KafkaProducer(bootstrap_servers=kafka_config.kafka.bootstrap_servers)
    good = lambda i: events.encode(events.SessionEnd(session_id=f"s{i}"))  # noqa: E731
    payloads = [good(0), b"\x93garbage", good(1), events.encode(events.SessionEnd(session_id="x"))[:-3], good(2)]
    metas = [raw.send(topic, value=v, key=b"k", partition=0).get(10) for v in payloads]
    raw.close()
    handled = []
    app = ConsumerApp(kafka_config, "g-dlq", [topic], name="test")

    def handle(r):
        if r.event.session_id == "s1":
            raise RuntimeError("poison for this stage")  # a handler error is dead-lettered too
        handled.append(r.event.session_id)

    _run_app_until(app, handle, lambda: len(handled) >= 2 and app.dead_lettered >= 3)
    assert handled == ["s0", "s2"]
    dlq = kafka_config.topics.dlq("turns")
    letters = [e for *_, e in read_all(kafka_config, dlq, want=3)]
    assert [(d.source_topic, d.partition, d.offset) for d in letters] == [
        (topic, 0, metas[1].offset), (topic, 0, metas[2].offset), (topic, 0, metas[3].offset)]
    assert "MalformedEvent" in letters[0].error and letters[0].raw == payloads[1]
    assert "handler error" in letters[1].error and letters[1].stage == "test"
    assert _committed(kafka_config, "g-dlq", topic)[0] == metas[-1].offset + 1


def test_wrong_type_unknown_version_and_tombstone_go_to_a_dlq_created_as_declared(kafka_config):
    """Variants of a bad record on ``turns`` (what the judge and the archive read): a valid event
    of another topic's type (the judge used to acknowledge it silently), an unknown schema
    version, a tombstone; the DLQ topic was deleted, so it is created from topics.yaml."""
    import msgpack
    from kafka import KafkaProducer

    from pipeline.bus.admin import admin_client

    topic, dlq = kafka_config.topics.name("turns"), kafka_config.topics.dlq("turns")
    admin = admin_client(kafka_config)
    admin.delete_topics([dlq], timeout_ms=10_000)
    deadline = time.monotonic() + 10
    while dlq in admin.list_topics() and time.monotonic() < deadline:
        time.sleep(0.1)
    v9 = msgpack.unpackb(events.encode(events.SessionEnd(session_id="v9")), raw=False)
    v9["v"] = 9
    sample = events.Sample(sample_id="x:0:rl", session_id="x", turn_index=0, tokens=[1, 2], response_length=1,
                           rollout_log_probs=[-1.0], reward=1.0)
    payloads = [events.encode(sample), msgpack.packb(v9, use_bin_type=True), None,
                events.encode(events.Control(action="pause", epoch=1)),
                events.encode(events.SessionEnd(session_id="ok"))]
    raw = KafkaProducer(bootstrap_servers=kafka_config.kafka.bootstrap_servers)
    metas = [raw.send(topic, value=v, key=b"k", partition=0).get(10) for v in payloads]
    raw.close()
    handled = []
    app = ConsumerApp(kafka_config, "g-kinds", [topic], name="test")
    _run_app_until(app, lambda r: handled.append(r.event), lambda: handled and app.dead_lettered >= 4)
    assert handled == [events.SessionEnd(session_id="ok")]
    letters = [e for *_, e in read_all(kafka_config, dlq, want=4)]
    assert [(d.offset, d.error.split(":")[0]) for d in letters] == [
        (metas[0].offset, "WrongTopic"), (metas[1].offset, "UnsupportedVersion"), (metas[2].offset, "MalformedEvent"),
        (metas[3].offset, "WrongTopic")]
    assert len(admin.describe_topics([dlq])[0]["partitions"]) == 1
    admin.close()
    assert _committed(kafka_config, "g-kinds", topic)[0] == metas[-1].offset + 1


def test_undeliverable_dead_letter_holds_the_commit_not_the_process_and_lands_after_restart(kafka_config):
    """The DLQ producer fails: the stage does not crash, does not pass over the bad record
    (the commit stays below it), stops cleanly; a restart with a working DLQ writes the letter
    and goes on."""
    from kafka import KafkaProducer

    topic = kafka_config.topics.name("turns")
    good = lambda i: events.encode(events.SessionEnd(session_id=f"s{i}"))  # noqa: E731
    raw = KafkaProducer(bootstrap_servers=kafka_config.kafka.bootstrap_servers)
    metas = [raw.send(topic, value=v, key=b"k", partition=0).get(10) for v in (good(0), b"\x93garbage", good(1))]
    raw.close()
    failing = EventProducer(kafka_config, name="failing-dlq", max_request_size=64)  # refuses every dead letter
    handled, crashed = [], []
    stage = f"dlqdown-{kafka_config.topics.prefix}"
    app = ConsumerApp(kafka_config, "g-dlqdown", [topic], name=stage, producer=failing)
    failures = lambda: REGISTRY.get_sample_value("pipeline_dead_letters_failed_total",  # noqa: E731
                                                 {"stage": stage, "topic": topic}) or 0

    def run():
        try:
            app.run(lambda r: handled.append(r.event.session_id), install_signals=False)
        except BaseException as e:  # noqa: BLE001 - the assertion below reports it
            crashed.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while failures() < 2 and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.05)
    assert not crashed and t.is_alive(), f"the stage crashed on an undeliverable dead letter: {crashed}"
    assert failures() >= 2 and handled == ["s0"]
    app.stop()
    t.join(30)
    failing.close()
    assert not t.is_alive() and not crashed, crashed
    assert _committed(kafka_config, "g-dlqdown", topic)[0] == metas[1].offset, "never committed past the bad record"
    again = []
    app2 = ConsumerApp(kafka_config, "g-dlqdown", [topic], name="test")
    # at least once: a rebalance on a loaded machine may deliver s1 again; never s0 (committed)
    _run_app_until(app2, lambda r: again.append(r.event.session_id),
                   lambda: again and set(again) == {"s1"} and app2.dead_lettered, timeout_s=180)
    assert set(again) == {"s1"}, again
    letters = [e for *_, e in read_all(kafka_config, kafka_config.topics.dlq("turns"), want=1)]
    assert [(d.offset, d.raw) for d in letters] == [(metas[1].offset, b"\x93garbage")]
    assert _committed(kafka_config, "g-dlqdown", topic)[0] == metas[-1].offset + 1


def _read_out(path: Path):
    rows = [tuple(line.split()) for line in path.read_text().splitlines() if line.strip()]
    return [(int(p), int(o), s) for p, o, s in rows]


@pytest.mark.parametrize("trial", range(2))
def test_killed_consumer_resumes_exactly_after_last_commit(kafka_config, tmp_path, trial):
    topic = kafka_config.topics.name("turns")
    n = 300
    p = EventProducer(kafka_config, name="test")
    for i in range(n):
        p.send(topic, events.SessionEnd(session_id=f"s{i}"), key=f"k{i % 17}")
    p.close()
    out1, out2 = tmp_path / "run1.txt", tmp_path / "run2.txt"
    group = f"g-kill-{trial}"
    cmd = [sys.executable, str(WORKER), kafka_config.kafka.bootstrap_servers, kafka_config.topics.prefix, group]
    proc = subprocess.Popen(cmd + [str(out1), "0.01"])
    deadline = time.monotonic() + 60
    target = 60 + 70 * trial
    # kill once it has processed `target` records and committed some of them (seen on the broker)
    while ((not out1.exists() or len(out1.read_text().splitlines()) < target
            or not sum(v or 0 for v in _committed(kafka_config, group, topic).values()))
           and time.monotonic() < deadline):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # no chance to commit or close
    proc.wait()
    committed = _committed(kafka_config, group, topic)
    first = _read_out(out1)
    assert len(first) >= target, "it had consumed and processed records"
    assert sum(v or 0 for v in committed.values()) > 0, "it had committed part of its work"
    assert len(first) < n, "it was killed before the end of the work"
    # nothing below a committed offset may be unprocessed (no loss at the crash)
    done1 = {(pp, o) for pp, o, _ in first}
    for part, off in committed.items():
        for o in range(off or 0):
            assert (part, o) in done1, f"offset {o} of partition {part} committed but never processed"
    proc2 = subprocess.Popen(cmd + [str(out2), "0"])
    deadline = time.monotonic() + 90
    while (not out2.exists() or len({(a, b) for a, b, _ in _read_out(out2)} | done1) < n) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc2.send_signal(signal.SIGTERM)
    assert proc2.wait(30) == 0, "graceful shutdown failed"
    second = _read_out(out2)
    # the second member starts each partition exactly at the committed offset
    for part, off in committed.items():
        offs = [o for pp, o, _ in second if pp == part]
        if offs:
            assert min(offs) == (off or 0), f"partition {part}: resumed at {min(offs)}, committed {off}"
    everything = {(pp, o) for pp, o, _ in first + second}
    assert len(everything) == n, "every record processed at least once"
    assert {s for *_, s in first + second} == {f"s{i}" for i in range(n)}
    assert len(second) == len({(pp, o) for pp, o, _ in second}), "no duplicates inside one run"
    final = _committed(kafka_config, group, topic)
    assert sum(v or 0 for v in final.values()) == n, "graceful stop commits everything"


def test_backpressure_pauses_and_resumes(kafka_config):
    topic = kafka_config.topics.name("turns")
    p = EventProducer(kafka_config, name="test")
    for i in range(50):
        p.send(topic, events.SessionEnd(session_id=f"s{i}"), key=f"k{i}")
    p.close()
    held, max_seen = [], [0]
    app = ConsumerApp(kafka_config, "g-bp", [topic], name="test", max_in_flight=10, max_poll_records=5)

    def handle(r):
        held.append(r)
        max_seen[0] = max(max_seen[0], app.in_flight())
        return False

    def tick():  # release deferred records slowly
        for r in held[:3]:
            app.ack(r)
        del held[:3]

    total = []
    orig = handle

    def counting(r):
        total.append(r)
        return orig(r)

    _run_app_until(app, counting, lambda: len(total) >= 50 and not held, tick=tick, tick_interval_s=0.05)
    assert max_seen[0] <= 10 + 5 * 4, f"backpressure did not bound in-flight records ({max_seen[0]})"


def test_a_rebalance_that_outlives_a_poll_still_completes_when_a_topic_appears(kafka_config):
    """A member subscribed to a topic the broker does not know yet joins with no partitions; when
    the topic appears, the metadata change makes the leader rejoin. kafka-python 3.0.12 runs that
    join as a task that a short poll leaves in flight, and the join itself clears the only reason
    to rejoin, so no later poll awaited the finished task: the member never took its partitions
    nor heartbeated again (seen in CI as a judge that read nothing for 60 s, and reproduced here
    about once in 100 joins with 100 ms polls; with 1 ms polls, every time)."""
    from pipeline.bus.admin import admin_client, create_topics

    topic = kafka_config.topics.name("late")
    app = ConsumerApp(kafka_config, "g-late", [topic], name="test", accept=None)
    assigned: list[set] = []
    got = []
    t = threading.Thread(target=app.run, args=(got.append,), daemon=True,
                         kwargs={"install_signals": False, "poll_timeout_ms": 1, "on_assigned": assigned.append})
    t.start()
    try:
        deadline = time.monotonic() + 60
        while not assigned and time.monotonic() < deadline:  # the first join: no partitions yet
            time.sleep(0.05)
        assert assigned == [set()]
        admin = admin_client(kafka_config)
        try:
            create_topics(admin, [(topic, 2, 1, {})])
        finally:
            admin.close()
        p = EventProducer(kafka_config, name="test")
        for k in ("a", "b", "c", "d"):
            p.send(topic, events.SessionEnd(session_id=k), key=k)
        p.close()
        deadline = time.monotonic() + 60
        while len(got) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(r.event.session_id for r in got) == ["a", "b", "c", "d"]
        assert assigned[-1] == {(topic, 0), (topic, 1)}
    finally:
        app.stop()
        t.join(30)
