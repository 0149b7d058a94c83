"""A broker that does not answer a request in time. kafka-python logs it three times (a warning,
then two ERRORs naming ``RequestTimedOutError``) before it reconnects and carries on; with
:func:`explain_kafka_client_logs` (installed by every ``pipeline`` command) it is one warning that
says what happens next. A real client and a real broker, paused (SIGSTOP) longer than the
client's request time-out, then resumed."""

from __future__ import annotations

import logging
import re
import signal
import time

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from pipeline.broker import EmbeddedBroker
from pipeline.bus.settings import (_TIMEOUT_LOGGERS, RequestTimeoutExplained, SlowStepExplained,
                                   explain_kafka_client_logs)


@pytest.fixture(scope="module")
def own_broker():
    with EmbeddedBroker() as broker:  # its own: this test pauses it
        yield broker


def _timed_out(caplog) -> bool:
    return any("timed out" in r.getMessage() or "did not answer" in r.getMessage() for r in caplog.records)


def _pause_during_a_send(broker, caplog) -> list[tuple[str, str]]:
    p = KafkaProducer(bootstrap_servers=broker.bootstrap, request_timeout_ms=1000, acks="all", retries=5,
                      delivery_timeout_ms=60_000, max_block_ms=30_000)
    try:
        p.send("timeouts", b"before").get(30)
        with caplog.at_level(logging.WARNING, "kafka"):
            for _attempt in range(3):  # a loaded machine may deliver before the pause bites: pause again
                broker.proc.send_signal(signal.SIGSTOP)
                try:
                    fut = p.send("timeouts", b"during")
                    deadline = time.monotonic() + 30
                    while not _timed_out(caplog) and time.monotonic() < deadline:
                        time.sleep(0.05)
                finally:
                    broker.proc.send_signal(signal.SIGCONT)
                fut.get(30)  # recovered: the record was delivered after all (raises otherwise)
                if _timed_out(caplog):
                    break
    finally:
        p.close()
    return [(r.levelname, r.getMessage()) for r in caplog.records
            if r.name in _TIMEOUT_LOGGERS and r.levelno >= logging.WARNING]


def test_without_the_filter_kafka_python_reports_a_request_time_out_as_errors(own_broker, caplog):
    _remove_filters()  # a stage started earlier in this test process may have installed them
    lines = _pause_during_a_send(own_broker, caplog)
    assert [m for lvl, m in lines if lvl == "ERROR" and "RequestTimedOutError" in m], lines


def test_a_request_time_out_is_one_clear_warning(own_broker, caplog):
    explain_kafka_client_logs()
    try:
        lines = _pause_during_a_send(own_broker, caplog)
    finally:
        _remove_filters()
    said = [m for lvl, m in lines if re.search(r"did not answer a request within [0-9]+ ms", m)]
    assert said and "reconnecting and sending it again" in said[0], lines
    assert len(lines) == 1 and lines[0][0] == "WARNING" and "RequestTimedOutError" not in lines[0][1], lines


def _remove_filters():
    for name in (*_TIMEOUT_LOGGERS, "kafka.net.selector"):
        lg = logging.getLogger(name)
        lg.filters[:] = [f for f in lg.filters if not isinstance(f, (RequestTimeoutExplained, SlowStepExplained))]


def test_a_slow_io_step_is_explained_and_below_a_second_kept_at_debug(caplog):
    """kafka-python's own slow-step warning (its format string read from its source, so a change
    there fails this test) says a CPU/GIL wait, not a stuck loop; short ones go to DEBUG."""
    import inspect

    import kafka.net.selector as sel

    fmt = ("Task %r ran for %.3fs (>%.3fs threshold). It is blocking the event loop -- likely a tight sync loop "
           "inside a coroutine. Other pollers will time out.")
    assert "'blocking the event loop -- likely a tight sync loop '" in inspect.getsource(sel.NetworkSelector._poll_once)
    log = logging.getLogger("kafka.net.selector")
    explain_kafka_client_logs()
    try:
        with caplog.at_level(logging.WARNING, "kafka"):
            log.warning(fmt % ("<Task>", 0.216, 0.1))  # as kafka-python logs it: formatted, no args
            log.warning(fmt % ("<Task>", 2.5, 0.1))
            log.warning("something else")
    finally:
        _remove_filters()
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "kafka.net.selector"]
    assert lines == [("WARNING", "one step of the Kafka client's I/O thread took 2.50 s of wall time: it was waiting "
                                 "for a CPU or the GIL (a busy machine or a busy stage), not stuck; this stage's Kafka "
                                 "traffic was that much late"), ("WARNING", "something else")], lines


def test_a_fetch_time_out_is_one_clear_warning(own_broker, caplog):
    p = KafkaProducer(bootstrap_servers=own_broker.bootstrap)
    p.send("fetched", b"x", partition=0).get(30)  # the partition read below (auto-created topics have several)
    p.close()
    c = KafkaConsumer(bootstrap_servers=own_broker.bootstrap, request_timeout_ms=1000, fetch_max_wait_ms=100,
                      auto_offset_reset="earliest")
    c.assign([TopicPartition("fetched", 0)])
    explain_kafka_client_logs()
    try:
        deadline = time.monotonic() + 30
        while not c.poll(200):  # fetching: the record is read
            assert time.monotonic() < deadline, "the consumer never read the record of partition 0"
        with caplog.at_level(logging.WARNING, "kafka"):
            own_broker.proc.send_signal(signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 60
                while not [r for r in caplog.records if "did not answer" in r.getMessage()] \
                        and time.monotonic() < deadline:
                    c.poll(200)
            finally:
                own_broker.proc.send_signal(signal.SIGCONT)
            for _ in range(10):
                c.poll(200)
    finally:
        _remove_filters()
        c.close()
    lines = [(r.name, r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("kafka")
             and r.levelno >= logging.WARNING
             and ("RequestTimedOut" in r.getMessage() or "did not answer" in r.getMessage())]
    assert [n for n, lvl, m in lines if "did not answer a request within" in m], lines
    assert not [m for n, lvl, m in lines if "RequestTimedOutError" in m], lines
