"""The assign-mode reader (:class:`pipeline.bus.TopicReader`) and the rules it shares with
:class:`pipeline.bus.ConsumerApp`: every kind of bad record to the DLQ with its source offset,
a missing DLQ topic created as declared, an undeliverable dead letter never silently dropped."""

from __future__ import annotations

import logging
import threading
import time

import msgpack
import pytest
from kafka import KafkaProducer
from prometheus_client import REGISTRY

from pipeline import events
from pipeline.bus import DeadLetterError, EventProducer, Offset, Time, TopicReader, Undecodable
from pipeline.bus.admin import admin_client
from tests.conftest import read_all


def _sample(i: int) -> events.Sample:
    return events.Sample(sample_id=f"id{i}", session_id="one", turn_index=i, tokens=[1, 2, 3, 4], response_length=2,
                         rollout_log_probs=[-1.0, -1.0], reward=1.0)


def _bad_values() -> list[tuple[bytes | None, str]]:
    """(value, name of the error it must be dead-lettered with) for every kind of bad record."""
    v9 = msgpack.unpackb(events.encode(_sample(9)), raw=False)
    v9["v"] = 9
    return [(b"\x93garbage", "MalformedEvent"),                                         # not msgpack
            (events.encode(events.SessionEnd(session_id="one")), "WrongTopic"),          # valid, wrong topic
            (msgpack.packb(v9, use_bin_type=True), "UnsupportedVersion"),                # unknown schema version
            (events.encode(_sample(8))[:-5], "MalformedEvent"),                          # truncated
            (None, "MalformedEvent")]                                                    # tombstone


def _produce_raw(config, topic: str, values: list) -> list[int]:
    raw = KafkaProducer(bootstrap_servers=config.kafka.bootstrap_servers)
    offsets = [raw.send(topic, value=v, key=b"one", partition=0).get(10).offset for v in values]
    raw.close()
    return offsets


def _delete_topic(config, name: str) -> None:
    admin = admin_client(config)
    try:
        admin.delete_topics([name], timeout_ms=10_000)
        deadline = time.monotonic() + 10
        while name in admin.list_topics() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert name not in admin.list_topics()
    finally:
        admin.close()


def _partitions(config, name: str) -> int:
    admin = admin_client(config)
    try:
        return len(admin.describe_topics([name])[0]["partitions"])
    finally:
        admin.close()


def _metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_reader_starts_where_told_and_dead_letters_every_kind_of_bad_record(kafka_config):
    topic, dlq = kafka_config.topics.name("samples"), kafka_config.topics.dlq("samples")
    _delete_topic(kafka_config, dlq)  # the DLQ topic is missing: it must be created as topics.yaml declares it
    bad = _bad_values()
    offs = _produce_raw(kafka_config, topic, [events.encode(_sample(0))] + [v for v, _ in bad]
                        + [events.encode(_sample(1))])
    stage = f"reader-{kafka_config.topics.prefix}"
    with TopicReader(kafka_config, topic, Offset(offs[1]), partitions=[0], name=stage, dlq=True) as reader:
        got = []
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got += reader.poll(timeout_ms=200)
        assert [r.event.sample_id for r in got] == ["id1"]  # id0 is before the start offset
        assert (got[0].offset, got[0].key, got[0].value) == (offs[-1], "one", events.encode(_sample(1)))
        assert reader.position(0) == offs[-1] + 1
        assert reader.dead_lettered == len(bad) and reader.consumed == len(bad) + 1
    letters = [e for *_, e in read_all(kafka_config, dlq, want=len(bad))]
    assert [(d.source_topic, d.partition, d.offset, d.stage) for d in letters] == [
        (topic, 0, o, stage) for o in offs[1:-1]]
    for d, (value, error) in zip(letters, bad):
        assert d.error.startswith(error), d.error
        assert d.raw == (value or b"") and d.key == b"one"
    assert _partitions(kafka_config, dlq) == 1  # declared shape, not the broker's auto-creation
    assert _metric("pipeline_dead_letters_total", stage=stage, topic=topic) == len(bad)
    assert _metric("pipeline_records_consumed_total", stage=stage, topic=topic) == len(bad) + 1


def _failing_producer(config) -> EventProducer:
    """A real producer whose every send is refused (records larger than it may send)."""
    return EventProducer(config, name="failing-dlq", max_request_size=64)


def test_follower_passes_over_a_bad_record_whose_dead_letter_cannot_be_written(kafka_config, caplog):
    topic = kafka_config.topics.name("control")
    ok = events.Control(action="resume", epoch=1)
    offs = _produce_raw(kafka_config, topic, [b"\x93garbage", events.encode(ok)])
    failing = _failing_producer(kafka_config)
    stage = f"follower-{kafka_config.topics.prefix}"
    try:
        with caplog.at_level(logging.ERROR, logger="pipeline.bus.records"), \
                TopicReader(kafka_config, topic, Offset(0), partitions=[0], name=stage, dlq=True, producer=failing,
                            dlq_give_up_s=1.0) as reader:
            got = []
            deadline = time.monotonic() + 30
            while not got and time.monotonic() < deadline:
                got += reader.poll(timeout_ms=200)
            assert [r.event for r in got] == [ok]  # it went on
            assert reader.dead_lettered == 0 and reader.intake.dead_letter_failures >= 1
    finally:
        failing.close()
    # never silent: an error names the record that was passed over, and the failure is counted
    assert any(f"{topic}[0]@{offs[0]}" in r.getMessage() and "passing over" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert _metric("pipeline_dead_letters_failed_total", stage=stage, topic=topic) >= 1


def test_an_undeliverable_dead_letter_holds_the_reader_until_stopped(kafka_config):
    topic = kafka_config.topics.name("samples")
    _produce_raw(kafka_config, topic, [b"\x93garbage", events.encode(_sample(1))])
    failing = _failing_producer(kafka_config)
    reader = TopicReader(kafka_config, topic, Offset(0), partitions=[0], name="holding", dlq=True, producer=failing)
    got, raised = [], []

    def loop():
        try:
            while not reader.stopping:
                got.extend(reader.poll(timeout_ms=200))
        except DeadLetterError as e:
            raised.append(e)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while reader.intake.dead_letter_failures < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reader.intake.dead_letter_failures >= 2, "the dead letter is retried"
        assert got == [] and t.is_alive(), "nothing after the bad record is handed on while its letter is missing"
        reader.stop()
        t.join(15)
        assert not t.is_alive()
    finally:
        reader.close()
        failing.close()
    assert len(raised) == 1 and f"{topic}[0]@0" in str(raised[0])
    assert got == []


@pytest.mark.parametrize("start,want", [
    ("beginning", ["id0", "id1", "id2", "id3"]), ("committed", ["id2", "id3"]), ("end", ["id3"]),
    (Offset(1), ["id1", "id2", "id3"]), (Offset(per_partition={}, otherwise="committed"), ["id2", "id3"]),
    ("time", ["id2", "id3"])])
def test_start_positions(kafka_config, start, want):
    topic = kafka_config.topics.name("samples")
    p = EventProducer(kafka_config, name="test")
    part = [p.send(topic, _sample(i), key="one").get(10).partition for i in range(2)][0]
    time.sleep(0.01)  # distinct broker timestamps on each side of `cut` (ms resolution)
    cut = events.now_ms()
    time.sleep(0.01)
    p.send(topic, _sample(2), key="one").get(10)
    group = f"{kafka_config.topics.prefix}g"
    with TopicReader(kafka_config, topic, partitions=[part], group_id=group) as r:
        r.commit({part: 2})
    start = Time(cut) if start == "time" else start
    with TopicReader(kafka_config, topic, start, partitions=[part], group_id=group, name="t", dlq=True) as r:
        r.positions()  # resolve the start now ("end": before id3)
        p.send(topic, _sample(3), key="one").get(10)
        got = []
        deadline = time.monotonic() + 30
        while "id3" not in got and time.monotonic() < deadline:
            got += [x.event.sample_id for x in r.poll(timeout_ms=200)]
    p.close()
    assert got == want


def test_an_observer_writes_nothing_joins_nothing_and_sees_bad_records(kafka_config):
    """Default mode (observers: tail, dashboard): bad records come back as Undecodable with the
    error, no dead letter is written, no consumer group is created; read() ends when caught up."""
    topic = kafka_config.topics.name("samples")
    offs = _produce_raw(kafka_config, topic, [events.encode(_sample(0))] + [v for v, _ in _bad_values()])
    admin = admin_client(kafka_config)
    groups_before = set(map(str, admin.list_groups()))
    with TopicReader(kafka_config, [topic]) as r:
        got = list(r.read())
        assert r.caught_up()
    assert [type(x).__name__ for x in got] == ["Record"] + ["Undecodable"] * len(_bad_values())
    want = [(o, e) for o, (_v, e) in zip(offs[1:], _bad_values())]
    assert [(x.offset, x.error.split(":")[0]) for x in got[1:]] == want
    assert all(isinstance(x, Undecodable) and x.key == "one" for x in got[1:])
    assert read_all(kafka_config, kafka_config.topics.dlq("samples"), timeout_s=2) == []
    assert set(map(str, admin.list_groups())) == groups_before, "an observer created a consumer group"
    admin.close()
