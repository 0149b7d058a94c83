"""Window producers (the proxy's publisher transport): one window of records at a time.

The Kafka client libraries are imported only under :mod:`pipeline.bus`; the proxy's
:class:`pipeline.proxy.publisher.EventPublisher` drives one of these from its sender thread.

Two implementations of the same contract — send a window of ``(topic, key, value)`` records with
an idempotent ``acks=all`` producer and report, per record, whether the broker acknowledged it:

- :class:`RdKafkaTransport` (``confluent-kafka``, librdkafka): the default when installed. Its
  I/O threads are C threads that never hold the GIL, so the proxy's event loop does not wait
  behind them. Measured here (2 cores, ~4 KB turn events, 10 ms windows): ~80 us of CPU per
  event against ~190 us for kafka-python, whose I/O thread is Python. Keys are partitioned with
  ``murmur2_random``, the Java / kafka-python hash, so a session lands on the same partition
  whichever client wrote it.
- :class:`KafkaPythonTransport` (kafka-python, the client of :mod:`pipeline.bus`): the fallback
  and ``proxy.kafka_client: kafka-python``.

Both are driven from the publisher's sender thread only.
"""

from __future__ import annotations

import logging
from typing import Callable

from pipeline.bus.settings import producer_kwargs
from pipeline.config import Config

log = logging.getLogger(__name__)
Item = tuple  # (topic, key | None, value bytes)


def have_librdkafka() -> bool:
    """True when ``confluent_kafka`` can be imported."""
    try:
        import confluent_kafka  # noqa: F401
        return True
    except ImportError:
        return False


def make_transport(config: Config, kind: str, delivery_timeout_ms: int):
    """Build the transport for ``kind`` (``auto`` | ``librdkafka`` | ``kafka-python``).

    Raises:
        ImportError: ``librdkafka`` was asked for and confluent-kafka is not installed.
        Exception: whatever the client raises when it cannot start (the caller retries).
    """
    if kind == "librdkafka" or (kind == "auto" and have_librdkafka()):
        return RdKafkaTransport(config, delivery_timeout_ms)
    return KafkaPythonTransport(config, delivery_timeout_ms)


def librdkafka_conf(config: Config, delivery_timeout_ms: int) -> dict:
    """librdkafka settings equivalent to :func:`pipeline.bus.settings.producer_kwargs`."""
    k = config.kafka
    conf = {
        "bootstrap.servers": k.bootstrap_servers,
        "client.id": k.client_id,
        "security.protocol": k.security_protocol.lower(),
        "acks": "all",
        "enable.idempotence": True,
        "compression.type": k.compression_type,
        "linger.ms": k.linger_ms,
        "message.max.bytes": min(k.max_request_size, 1_000_000_000),
        "message.timeout.ms": delivery_timeout_ms,
        "request.timeout.ms": min(k.request_timeout_ms, max(1000, delivery_timeout_ms - k.linger_ms - 1)),
        "partitioner": "murmur2_random",
        "reconnect.backoff.max.ms": 1000,
        "socket.connection.setup.timeout.ms": 5000,
        "log.connection.close": False,
    }
    if k.sasl_mechanism:
        conf["sasl.mechanism"] = k.sasl_mechanism
        if k.sasl_plain_username is not None:
            conf["sasl.username"] = k.sasl_plain_username
        if k.sasl_plain_password is not None:
            conf["sasl.password"] = k.sasl_plain_password.get_secret_value()
    if k.security_protocol in ("SSL", "SASL_SSL"):
        for key, value in (("ssl.ca.location", k.ssl_cafile), ("ssl.certificate.location", k.ssl_certfile),
                           ("ssl.key.location", k.ssl_keyfile)):
            if value:
                conf[key] = value
        if not k.ssl_check_hostname:
            conf["ssl.endpoint.identification.algorithm"] = "none"
    return conf


class RdKafkaTransport:
    """confluent-kafka producer; librdkafka's own log lines go to the ``rdkafka`` logger."""

    name = "librdkafka"

    def __init__(self, config: Config, delivery_timeout_ms: int) -> None:
        from confluent_kafka import Producer

        self._p = Producer(librdkafka_conf(config, delivery_timeout_ms), logger=logging.getLogger("rdkafka"))

    def send_window(self, items: list, give_up: Callable[[], bool]) -> list[bool]:
        """Produce every item, wait for all delivery reports; per-item success (False if unknown)."""
        ok = [False] * len(items)
        pending = [0]

        def report(i: int):
            def cb(err, _msg) -> None:
                pending[0] -= 1
                if err is None:
                    ok[i] = True
                else:
                    log.debug("delivery failed: %s", err)
            return cb

        for i, (topic, key, value) in enumerate(items):
            try:
                self._p.produce(topic, value, key.encode() if key is not None else None, on_delivery=report(i))
            except Exception as e:  # BufferError (queue full), KafkaException ...
                log.debug("produce failed: %s", e)
                break
            pending[0] += 1
        while pending[0] > 0:
            self._p.flush(0.25)
            if give_up():
                break
        return ok

    def close(self) -> None:
        """Drop anything queued (the publisher re-sends what was not acknowledged)."""
        try:
            self._p.purge()
            self._p.flush(0)
        except Exception:
            pass


class KafkaPythonTransport:
    """kafka-python producer (settings of :func:`pipeline.bus.settings.producer_kwargs`)."""

    name = "kafka-python"

    def __init__(self, config: Config, delivery_timeout_ms: int) -> None:
        from kafka import KafkaProducer

        kw = producer_kwargs(config)
        kw["delivery_timeout_ms"] = delivery_timeout_ms
        kw["request_timeout_ms"] = min(kw["request_timeout_ms"], max(1000, delivery_timeout_ms - kw["linger_ms"] - 1))
        kw["max_block_ms"] = min(kw["max_block_ms"], 2000)
        kw["reconnect_backoff_max_ms"] = 1000
        kw["bootstrap_timeout_ms"] = 2000  # kafka-python waits 30 s by default when the broker is away
        self._p = KafkaProducer(**kw)

    def send_window(self, items: list, give_up: Callable[[], bool]) -> list[bool]:
        """Send every item, wait until each future resolves; per-item success."""
        futures = []
        for topic, key, value in items:
            try:
                futures.append(self._p.send(topic, value=value, key=key.encode() if key is not None else None))
            except Exception as e:  # metadata time-out, buffer full, closed producer
                log.debug("send failed: %s", e)
                break
        while not all(f.is_done for f in futures):
            try:
                self._p.flush(timeout=0.25)
            except Exception:
                pass
            if give_up():
                break
        return [f.succeeded() for f in futures] + [False] * (len(items) - len(futures))

    def close(self) -> None:
        """Close without waiting (the publisher re-sends what was not acknowledged)."""
        try:
            self._p.close(timeout=0)
        except Exception:
            pass


__all__ = ["make_transport", "librdkafka_conf", "RdKafkaTransport", "KafkaPythonTransport", "have_librdkafka"]
