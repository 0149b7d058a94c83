"""Prometheus metrics shared by every stage, and the helper that serves them.

Stage-specific metrics live in their stage; the names below are the ones the data plane
(:mod:`pipeline.bus`) reports for every stage, labelled by ``stage`` and ``topic``. The
Grafana dashboard in ``deploy/`` uses these names.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, start_http_server

log = logging.getLogger(__name__)

EVENTS_PRODUCED = Counter("pipeline_events_produced_total", "Events delivered to the broker", ["stage", "topic"])
EVENTS_FAILED = Counter("pipeline_events_failed_total", "Events the broker did not accept (after retries)",
                        ["stage", "topic"])
PRODUCER_BUFFERED = Gauge("pipeline_producer_buffered_events", "Events sent but not yet acknowledged", ["stage"])
RECORDS_CONSUMED = Counter("pipeline_records_consumed_total", "Records polled from the broker", ["stage", "topic"])
DEAD_LETTERS = Counter("pipeline_dead_letters_total", "Records routed to a dead-letter topic", ["stage", "topic"])
DEAD_LETTER_FAILURES = Counter("pipeline_dead_letters_failed_total",
                               "Attempts to write a dead letter that the broker did not acknowledge",
                               ["stage", "topic"])
CONSUMER_LAG = Gauge("pipeline_consumer_lag_records",
                     "High watermark minus the committed offset (groups) or the read position (assigned readers)",
                     ["stage", "topic", "partition"])
COMMITS = Counter("pipeline_offset_commits_total", "Offset commits sent to the group coordinator", ["stage"])
IN_FLIGHT = Gauge("pipeline_consumer_in_flight_records", "Records polled but not yet acknowledged", ["stage"])


def serve_metrics(port: int | None, host: str = "127.0.0.1") -> None:
    """Expose ``/metrics`` on ``host:port`` in a daemon thread (no-op when port is None)."""
    if port is None:
        return
    start_http_server(port, addr=host)
    log.info("metrics on http://%s:%d/metrics", host, port)
