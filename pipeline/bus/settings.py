"""kafka-python keyword arguments derived from :class:`pipeline.config.KafkaConfig`."""

from __future__ import annotations

from typing import Any

from pipeline.config import Config


def admin_kwargs(config: Config) -> dict[str, Any]:
    """Arguments for ``KafkaAdminClient``."""
    k = config.kafka
    return {**k.client_kwargs(), "request_timeout_ms": k.request_timeout_ms}


def producer_kwargs(config: Config) -> dict[str, Any]:
    """Arguments for an idempotent ``KafkaProducer`` (acks=all, compression, bounded blocking)."""
    k = config.kafka
    return {
        **k.client_kwargs(),
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
    """Arguments for a ``KafkaConsumer`` in ``group_id`` with manual commits (read from earliest)."""
    k = config.kafka
    kw = {
        **k.client_kwargs(),
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "session_timeout_ms": k.session_timeout_ms,
        "heartbeat_interval_ms": k.heartbeat_interval_ms,
        "max_poll_records": k.max_poll_records,
        "max_poll_interval_ms": k.max_poll_interval_ms,
        "request_timeout_ms": max(k.request_timeout_ms, k.session_timeout_ms + 5000),
        "fetch_max_wait_ms": 100,
        "max_partition_fetch_bytes": k.max_request_size,
        "fetch_max_bytes": k.max_request_size,
    }
    kw.update(extra)
    return kw
