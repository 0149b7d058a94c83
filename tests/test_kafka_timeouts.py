"""A broker that does not answer a request in time. kafka-python logs it three times (a warning,
then two ERRORs naming ``RequestTimedOutError``) before it reconnects and carries on; with
:func:`explain_request_timeouts` (installed by every ``pipeline`` command) it is one warning that
says what happens next. A real client and a real broker, paused (SIGSTOP) longer than the
client's request time-out, then resumed."""

from __future__ import annotations

import logging
import re
import signal
import time

import pytest
from kafka import KafkaProducer

from pipeline.broker import EmbeddedBroker
from pipeline.bus.settings import _TIMEOUT_LOGGERS, RequestTimeoutExplained, explain_request_timeouts


@pytest.fixture(scope="module")
def own_broker():
    with EmbeddedBroker() as broker:  # its own: this test pauses it
        yield broker


def _pause_during_a_send(broker, caplog) -> list[tuple[str, str]]:
    p = KafkaProducer(bootstrap_servers=broker.bootstrap, request_timeout_ms=1000, acks="all", retries=5,
                      delivery_timeout_ms=60_000, max_block_ms=30_000)
    try:
        p.send("timeouts", b"before").get(30)
        with caplog.at_level(logging.WARNING, "kafka"):
            broker.proc.send_signal(signal.SIGSTOP)
            try:
                fut = p.send("timeouts", b"during")
                deadline = time.monotonic() + 20
                while not any("timed out" in r.getMessage() or "did not answer" in r.getMessage()
                              for r in caplog.records) and time.monotonic() < deadline:
                    time.sleep(0.05)
            finally:
                broker.proc.send_signal(signal.SIGCONT)
            fut.get(30)  # recovered: the record was delivered after all (raises otherwise)
    finally:
        p.close()
    return [(r.levelname, r.getMessage()) for r in caplog.records
            if r.name in _TIMEOUT_LOGGERS and r.levelno >= logging.WARNING]


def test_without_the_filter_kafka_python_reports_a_request_time_out_as_errors(own_broker, caplog):
    lines = _pause_during_a_send(own_broker, caplog)
    assert [m for lvl, m in lines if lvl == "ERROR" and "RequestTimedOutError" in m], lines


def test_a_request_time_out_is_one_clear_warning(own_broker, caplog):
    explain_request_timeouts()
    try:
        lines = _pause_during_a_send(own_broker, caplog)
    finally:
        for name in _TIMEOUT_LOGGERS:
            lg = logging.getLogger(name)
            lg.filters[:] = [f for f in lg.filters if not isinstance(f, RequestTimeoutExplained)]
    said = [m for lvl, m in lines if re.search(r"did not answer a request within (999|1000) ms", m)]
    assert said and "reconnecting and sending it again" in said[0], lines
    assert len(lines) == 1 and lines[0][0] == "WARNING" and "RequestTimedOutError" not in lines[0][1], lines
