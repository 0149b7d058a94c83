"""The durable embedded broker: what it acknowledged survives a stop, a kill -9 and a restart.

Real processes throughout: ``pipeline broker --data-dir`` (SeaweedFS + Tansu's s3 engine),
``pipeline up`` stages (broker, proxy, judge) started by :func:`start_stack`, a stand-in engine
(:class:`StandInEngine`, not a model) and real Kafka clients. States are awaited, not slept on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.structs import OffsetAndMetadata

from pipeline import events
from pipeline.config import load_config
from pipeline.orchestrate.up import start_stack
from pipeline.testing.servers import StandInEngine, serve_app
from pipeline.testing.topics import read_events
from tests.processes import PipelineProcess

CHAT = "/v1/chat/completions"


class BrokerProcess(PipelineProcess):
    """``python -m pipeline broker ...`` as a child; :meth:`wait_ready` waits for its ready line."""

    def __init__(self, *args: str) -> None:
        super().__init__("broker", *args)

    def wait_ready(self, timeout_s: float = 120.0) -> str:
        """The bootstrap address from the ready line. Fails with the output if it exits first."""
        return self.wait_line(r"broker ready: bootstrap=(\S+)", "broker not ready", timeout_s).group(1)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def _config(bootstrap: str, **sections):
    return load_config(None, kafka={"bootstrap_servers": bootstrap}, topics={"prefix": "d-"}, **sections)


def _converse(url: str, session: str, turns: int) -> list[str]:
    """``turns`` requests of one session, the last one ending it (``X-Session-Done``); returns the
    request ids the proxy answered 200 with."""
    msgs = [{"role": "user", "content": f"hello from {session}"}]
    rids = []
    with httpx.Client(base_url=url, timeout=30) as c:
        for i in range(turns):
            headers = {"X-Session-Id": session, "X-Session-Done": "true" if i == turns - 1 else "false"}
            r = c.post(CHAT, json={"model": "m", "messages": msgs}, headers=headers)
            assert r.status_code == 200, r.text
            rids.append(r.headers["x-request-id"])
            msgs = msgs + [r.json()["choices"][0]["message"], {"role": "user", "content": f"more {i}"}]
    return rids


def _turns(config, want: int | None = None, topic: str = "turns") -> dict[str, events.Turn]:
    evs = read_events(config, topic, want, timeout_s=30, settle_s=2.0)
    return {e.request_id: e for e in evs if isinstance(e, events.Turn)}


def _committed(config, group: str, topic: str) -> dict[int, int]:
    c = KafkaConsumer(bootstrap_servers=config.kafka.bootstrap_servers, group_id=group, enable_auto_commit=False)
    try:
        parts = c.partitions_for_topic(topic) or set()
        out = {}
        for p in parts:
            off = c.committed(TopicPartition(topic, p))
            if off is not None:
                out[p] = off
        return out
    finally:
        c.close()


def _kind(kind: str) -> str:
    from pipeline.kafka_broker import kafka_installed

    if kind == "kafka" and not kafka_installed():
        pytest.skip("Apache Kafka is not installed (bash deploy/install-kafka.sh)")
    return kind


@pytest.mark.slow(seconds=40)
@pytest.mark.parametrize("kind", ["tansu", "kafka"])
def test_up_stopped_and_restarted_on_the_same_run_dir_keeps_every_turn_replayable(tmp_path, kind):
    run_dir = tmp_path / "run"
    judge = {"mode": "rl", "backend": "constant", "idle_timeout_s": 3600}
    with serve_app(StandInEngine()) as engine_url:
        config = load_config(None, judge=judge, engine={"url": engine_url})
        stack = start_stack(config, run_dir, engine_url=engine_url, trainer=False, ready_timeout_s=180,
                            broker_kind=_kind(kind))
        assert stack.broker_kind == kind
        config = stack.config
        try:
            bootstrap = config.kafka.bootstrap_servers
            answered = _converse(stack.proxy_url, "A", 3) + _converse(stack.proxy_url, "B", 2)
            records = len(answered) + 3 + 2  # 5 turns + 3 next states + 2 session ends
            before = _turns(config, want=records)
            assert set(before) == set(answered)
            # the judge consumed them: both conversations ended, so its group committed every record
            # (an open conversation's first turn is held until it ends, :mod:`pipeline.judge.join`);
            # awaited, not slept, and complete, or a commit landing after this snapshot would differ
            # from what the restarted stack reads
            settled = records
            deadline = time.monotonic() + 60
            while sum(_committed(config, config.judge.group_id, config.topics.name("turns")).values()) < settled:
                assert time.monotonic() < deadline, "the judge committed nothing"
                time.sleep(0.2)
            committed = _committed(config, config.judge.group_id, config.topics.name("turns"))
        finally:
            codes = stack.stop()
        assert codes["broker"].clean and codes["broker"].code == 0, codes

        config2 = load_config(None, judge=judge, engine={"url": engine_url})
        stack = start_stack(config2, run_dir, engine_url=engine_url, trainer=False, ready_timeout_s=180)
        assert stack.broker_kind == kind  # auto: the run dir keeps the kind that wrote it
        config2 = stack.config
        try:
            assert config2.kafka.bootstrap_servers == bootstrap  # same port: clients find it where it was
            after = _turns(config2, want=records)
            assert after == before  # every turn, byte for byte the same event
            # the judge group carries on from its committed offsets instead of starting over
            assert _committed(config2, config2.judge.group_id, config2.topics.name("turns")) == committed
            answered += _converse(stack.proxy_url, "A2", 1)  # and the stack keeps recording
            assert set(_turns(config2, want=records + 1 + 1)) == set(answered)  # a turn and its end
            # replayable: the history copies to a new topic with every turn
            rep = subprocess.run([sys.executable, "-m", "pipeline", "replay", "--to-topic", "replayed",
                                  "--config", str(run_dir / "config.yaml"), "--no-progress", "--idle-timeout-s", "3"],
                                 capture_output=True, text=True, timeout=120)
            assert rep.returncode == 0, rep.stdout + rep.stderr
            replayed = read_events(config2, "replayed", records + 2, timeout_s=30, settle_s=2.0)
            assert {e.request_id for e in replayed if isinstance(e, events.Turn)} == set(answered)
        finally:
            stack.stop()


@pytest.mark.slow(seconds=30)
@pytest.mark.parametrize("kind", ["tansu", "kafka"])
def test_broker_killed_minus_9_mid_produce_keeps_every_acknowledged_record(tmp_path, kind):
    data = tmp_path / "broker"
    b = BrokerProcess("--kind", _kind(kind), "--data-dir", str(data), "--port", "0", "--stop-grace", "1", "--apply-topics",
                      "--set", "topics.prefix=d-")
    bootstrap = b.wait_ready()
    config = _config(bootstrap)
    topic = config.topics.name("turns")
    acked: list[int] = []
    failed = threading.Event()
    stop = threading.Event()

    def produce() -> None:  # acks=all, one at a time: each acknowledgement is a promise the log must keep
        p = KafkaProducer(bootstrap_servers=bootstrap, acks="all", retries=0, max_block_ms=2000,
                          request_timeout_ms=3000)
        i = 0
        while not stop.is_set():
            try:
                p.send(topic, key=f"k{i % 7}".encode(), value=str(i).encode()).get(timeout=5)
                acked.append(i)
            except Exception:
                failed.set()
                break
            i += 1
        p.close(timeout=0)

    # a group commits a position: it must survive too
    group_consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id="g", enable_auto_commit=False)
    tp = TopicPartition(topic, 0)
    group_consumer.commit({tp: OffsetAndMetadata(0, "", -1)})
    t = threading.Thread(target=produce, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while len(acked) < 30:  # the broker is in the middle of the work when it is killed
        assert time.monotonic() < deadline and not failed.is_set(), "producer made no progress"
        time.sleep(0.05)
    group_consumer.commit({tp: OffsetAndMetadata(3, "", -1)})
    group_consumer.close()
    os.kill(b.proc.pid, signal.SIGKILL)  # the broker command; its children die with it (SIGKILL)
    b.proc.wait(10)
    assert failed.wait(30), "the producer never noticed the broker was gone"
    stop.set()
    t.join(10)
    n_acked = len(acked)
    assert n_acked >= 30

    b2 = BrokerProcess("--data-dir", str(data), "--stop-grace", "1")  # no --port: the last run's port
    try:
        assert b2.wait_ready() == bootstrap
        c = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", consumer_timeout_ms=4000)
        got = {int(m.value) for m in c}
        c.close()
        missing = set(acked) - got
        assert not missing, f"{len(missing)} acknowledged records lost: {sorted(missing)[:10]}"
        assert _committed(config, "g", topic) == {0: 3}
        # one broker per data dir: a second one is refused while this one runs
        other = subprocess.run([sys.executable, "-m", "pipeline", "broker", "--data-dir", str(data), "--port", "0"],
                               capture_output=True, text=True, timeout=60)
        assert other.returncode == 1 and "in use by another broker" in other.stderr
    finally:
        assert b2.stop() == 0
    # a stopped broker leaves no process behind and releases its data dir
    assert not any((data / n).exists() for n in ("tansu.pid", "weed.pid", "kafka.pid"))


def test_memory_broker_keeps_nothing_after_a_restart():
    """The contrast: memory storage (tests only) starts empty every time."""
    from pipeline.broker import EmbeddedBroker
    from pipeline.procutil import free_port
    from pipeline.bus.admin import apply_topics
    from pipeline.topics import load_topics

    port = free_port()
    with EmbeddedBroker(port=port) as b:
        config = _config(b.bootstrap)
        apply_topics(config, load_topics(config.topics.file))
        p = KafkaProducer(bootstrap_servers=b.bootstrap, acks="all")
        p.send(config.topics.name("turns"), b"x").get(10)
        p.close()
    with EmbeddedBroker(port=port) as b:
        c = KafkaConsumer(bootstrap_servers=b.bootstrap)
        assert config.topics.name("turns") not in c.topics()
        c.close()

