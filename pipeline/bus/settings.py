"""kafka-python keyword arguments derived from :class:`pipeline.config.KafkaConfig`, and how
its request time-outs are logged."""

from __future__ import annotations

import logging
import re
from typing import Any

from pipeline.config import Config


def admin_kwargs(config: Config) -> dict[str, Any]:
    """Arguments for ``KafkaAdminClient``.

    Its first connection waits at most ``kafka.request_timeout_ms`` for a broker to answer
    (``bootstrap_timeout_ms``; kafka-python's own default is a fixed 30000 ms, the same as
    ``request_timeout_ms``'s default), then the client raises ``KafkaTimeoutError``.
    """
    k = config.kafka
    return {**k.client_kwargs(), "request_timeout_ms": k.request_timeout_ms, "bootstrap_timeout_ms": k.request_timeout_ms}


def producer_kwargs(config: Config) -> dict[str, Any]:
    """Arguments for an idempotent ``KafkaProducer`` (acks=all, compression, bounded blocking).

    It never asks the broker to auto-create a topic it sends to (topics come from topics.yaml:
    :func:`pipeline.bus.admin.ensure_topics`), even on a cluster that allows auto-creation.
    """
    k = config.kafka
    return {
        **k.client_kwargs(),
        "allow_auto_create_topics": False,
        "acks": "all",
        "enable_idempotence": True,
        "compression_type": None if k.compression_type == "none" else k.compression_type,
        "linger_ms": k.linger_ms,
        "max_block_ms": k.max_block_ms,
        "max_request_size": k.max_request_size,
        "request_timeout_ms": k.request_timeout_ms,
        "retries": 2**31 - 1,
        "delivery_timeout_ms": max(120_000, k.request_timeout_ms + k.linger_ms),
    }


def consumer_kwargs(config: Config, group_id: str | None, **extra: Any) -> dict[str, Any]:
    """Arguments for a ``KafkaConsumer`` in ``group_id`` with manual commits (read from earliest);
    its metadata requests never auto-create a topic."""
    k = config.kafka
    kw = {
        **k.client_kwargs(),
        "allow_auto_create_topics": False,
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "session_timeout_ms": k.session_timeout_ms,
        "heartbeat_interval_ms": k.heartbeat_interval_ms,
        "max_poll_records": k.max_poll_records,
        "max_poll_interval_ms": k.max_poll_interval_ms,
        "request_timeout_ms": max(k.request_timeout_ms, k.session_timeout_ms + 5000),
        "fetch_max_wait_ms": 100,
        # a group leader that assigned before its broker knew a just-created topic gave it to
        # nobody; the next metadata refresh shows the topic and makes the group rejoin: within
        # seconds, not kafka-python's default 5 minutes
        "metadata_max_age_ms": 5000,
        "max_partition_fetch_bytes": k.max_request_size,
        "fetch_max_bytes": k.max_request_size,
    }
    kw.update(extra)
    return kw


class RequestTimeoutExplained(logging.Filter):
    """One clear line for a request the broker did not answer in time.

    kafka-python reports one such time-out several times: a WARNING "Request timed out after N
    ms. Closing connection.", then ERRORs naming ``RequestTimedOutError`` (the transport's
    "Abort", the connection's "Connection lost", a producer's "Error sending produce request", a
    consumer's "Fetch to node N failed", a "Metadata refresh: failed")
    and a "retrying" warning, although it then reconnects and sends the request again
    (idempotent producers, fetches and commits are safe to repeat) and the stage recovers by
    itself. This filter rewrites the first line to say so and moves the others to DEBUG. The
    usual cause is broker latency: the durable embedded broker reads and writes through an object
    store that can stall on a saturated machine (docs/environment.md §6); seen in a CPU demo on a
    machine shared with a full test run, where a trainer's fetch went unanswered for 30 s. A request that still fails
    after its retries is reported by our own code (e.g. a producer's delivery failure).
    Installed by :func:`explain_kafka_client_logs`.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        msg, args = str(record.msg), record.args if isinstance(record.args, tuple) else ()
        if msg.endswith("Request timed out after %d ms. Closing connection.") and len(args) == 2:
            record.msg = ("%s did not answer a request within %d ms (kafka.request_timeout_ms): reconnecting "
                          "and sending it again, nothing is lost (a broker slowed by its storage on a busy machine; "
                          "raise kafka.request_timeout_ms if this repeats)")
            return True
        # compare names only: kafka-python's own objects (requests, versions) may not compare with a str
        if any(type(a).__name__ == "RequestTimedOutError" or (isinstance(a, str) and a == "RequestTimedOutError")
               for a in args):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"  # said by the line above
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


class SlowStepExplained(logging.Filter):
    """Says what kafka-python's "Task ... ran for N s ... It is blocking the event loop" means here.

    kafka-python's I/O thread warns when one step of its event loop takes over 0.1 s of wall
    time, suspecting a busy loop in its own code. Measured on a consumer like ours on a loaded
    2-core machine, such steps used 1-3 ms of CPU: the rest of the time the thread waited for a
    CPU or for the GIL (a machine with more busy processes than cores; other threads of the stage). Nothing is blocked for good:
    that stage's Kafka traffic is late by that much. Below 1 s the line goes to DEBUG with that
    explanation; from 1 s on it stays a WARNING, with the same explanation. Installed by
    :func:`explain_kafka_client_logs` on ``kafka.net.selector``.
    """

    _RAN = re.compile(r"^Task .* ran for ([0-9.]+)s \(>[0-9.]+s threshold\)\. It is blocking the event loop")

    def filter(self, record: logging.LogRecord) -> bool:
        m = self._RAN.match(str(record.msg)) if not record.args else None
        if m is None:
            return True
        took = float(m.group(1))
        record.msg = ("one step of the Kafka client's I/O thread took %.2f s of wall time: it was waiting for a CPU "
                      "or the GIL (a busy machine or a busy stage), not stuck; this stage's Kafka traffic was that "
                      "much late")
        record.args = (took,)
        if took < 1.0:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


#: kafka-python's loggers that report a request time-out
_TIMEOUT_LOGGERS = ("kafka.net.connection", "kafka.net.transport", "kafka.net.manager", "kafka.cluster",
                    "kafka.producer.sender", "kafka.consumer.fetcher", "kafka.coordinator.base",
                    "kafka.coordinator.consumer")


def explain_kafka_client_logs() -> None:
    """Install :class:`RequestTimeoutExplained` on kafka-python's loggers that report request
    time-outs and :class:`SlowStepExplained` on its event loop's logger (idempotent)."""
    for name, kind in [*((n, RequestTimeoutExplained) for n in _TIMEOUT_LOGGERS),
                       ("kafka.net.selector", SlowStepExplained)]:
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
