"""The one follower (:class:`pipeline.bus.Follower`): read a topic, reconnect on errors, go on.

- A follower started before its broker exists keeps trying and reads once the broker is up
  (a real embedded broker started on the port the follower was told).
- A reader that fails mid-follow (a failure injected into the real reader's poll, once) is
  closed and replaced: with ``resume=True`` every record is handed on exactly once and in
  order, with ``resume=False`` the topic is read again from the start after ``on_error``.
- A handler that raises dead-letters its record (``handler error``) and following goes on.
Without the reconnect each of the first two ends with the follower's thread dead and the later
records never handed on.
"""

from __future__ import annotations

from pipeline import events
from pipeline.broker import EmbeddedBroker
from pipeline.bus import Follower, TopicReader
from pipeline.bus.admin import apply_topics
from pipeline.config import load_config
from pipeline.procutil import free_port
from pipeline.testing.topics import publish, read_events
from pipeline.testing.waiting import until
from pipeline.topics import load_topics


def _controls(start: int, n: int) -> list:
    return [events.Control(action="applied", epoch=i, policy_version=i, run_id="r", engine_id="e")
            for i in range(start, start + n)]


def _fail_once_after_records(monkeypatch) -> dict:
    """Make the next poll after the first one that returned records raise (once)."""
    real = TopicReader.poll_raw
    seen = {"records": False, "failed": 0}

    def poll_raw(self, timeout_ms=200):
        if seen["records"] and not seen["failed"]:
            seen["failed"] += 1
            raise ConnectionError("injected: the broker went away")
        out = real(self, timeout_ms)
        seen["records"] = seen["records"] or bool(out)
        return out

    monkeypatch.setattr(TopicReader, "poll_raw", poll_raw)
    return seen


def test_a_follower_started_before_its_broker_reads_once_the_broker_is_up():
    port = free_port()
    config = load_config(None, kafka={"bootstrap_servers": f"127.0.0.1:{port}"}, topics={"prefix": "f-"})
    got = []
    follower = Follower(config, config.topics.name("control"), got.append, name="follow-test", partitions=[0],
                        dlq=True, dlq_give_up_s=5, backoff_s=0.1, max_backoff_s=0.5,
                        bootstrap_timeout_ms=500).start()
    broker = None
    try:
        assert until(lambda: follower.error is not None, 30), "no failure seen while the broker was away"
        broker = EmbeddedBroker(port=port).start()
        apply_topics(config, load_topics(config.topics.file))
        publish(config, _controls(1, 3), topic="control", key="r")
        assert until(lambda: len(got) == 3, 60), (got, follower.error)
        assert [r.event.policy_version for r in got] == [1, 2, 3]
        assert follower.error is None
    finally:
        follower.stop()
        if broker is not None:
            broker.proc.kill()
            broker.proc.wait(10)


def test_a_failed_reader_is_replaced_and_resumes_after_the_last_record_handed_on(kafka_config, monkeypatch):
    topic = kafka_config.topics.name("control")
    seen = _fail_once_after_records(monkeypatch)
    errors, got = [], []
    follower = Follower(kafka_config, topic, got.append, name="follow-test", partitions=[0], dlq=True,
                        dlq_give_up_s=5, on_error=errors.append, backoff_s=0.05)
    publish(kafka_config, _controls(1, 3), topic="control", key="r")
    follower.start()
    try:
        assert until(lambda: seen["failed"] == 1 and follower.reader is not None and follower.error is None, 30)
        publish(kafka_config, _controls(4, 3), topic="control", key="r")
        assert until(lambda: len(got) >= 6, 30), got
    finally:
        follower.stop()
    assert [type(e) for e in errors] == [ConnectionError]
    assert [r.event.policy_version for r in got] == [1, 2, 3, 4, 5, 6]
    assert [r.offset for r in got] == list(range(6))


def test_without_resume_the_topic_is_read_again_from_the_start(kafka_config, monkeypatch):
    topic = kafka_config.topics.name("control")
    seen = _fail_once_after_records(monkeypatch)
    got, forgotten = [], []
    follower = Follower(kafka_config, [topic], got.append, name="follow-test", resume=False,
                        on_error=lambda e: (forgotten.append(len(got)), got.clear()), backoff_s=0.05)
    publish(kafka_config, _controls(1, 3), topic="control", key="r")
    follower.start()
    try:
        assert until(lambda: seen["failed"] == 1 and len(got) == 3 and follower.caught_up, 30), got
    finally:
        follower.stop()
    assert forgotten == [3]
    assert [r.event.policy_version for r in got] == [1, 2, 3]


def test_a_handler_that_raises_dead_letters_its_record_and_following_goes_on(kafka_config):
    got = []

    def handle(rec):
        if rec.event.policy_version == 2:
            raise ValueError("cannot apply version 2")
        got.append(rec.event.policy_version)

    follower = Follower(kafka_config, kafka_config.topics.name("control"), handle, name="follow-test", dlq=True,
                        dlq_give_up_s=10).start()
    try:
        publish(kafka_config, _controls(1, 3), topic="control", key="r")
        assert until(lambda: got == [1, 3], 30), got
        letters = read_events(kafka_config, "control.dlq", want=1)
    finally:
        follower.stop()
    assert len(letters) == 1 and letters[0].offset == 1 and letters[0].stage == "follow-test"
    assert letters[0].error.startswith("handler error: ValueError: cannot apply version 2")
