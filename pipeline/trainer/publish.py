"""The trainer's step records on the ``metrics`` topic, for observers (the dashboard).

The JSONL metrics log (:mod:`pipeline.trainer.metrics`) stays the trainer's own record; this
module mirrors each step to Kafka as a :class:`pipeline.events.TrainStep` so that a process on
another machine can follow training health and see which samples each step trained. Publishing
is best effort: a broker problem is logged and never stops or slows a step beyond the send.
"""

from __future__ import annotations

import logging

from pipeline import events
from pipeline.bus import EventProducer
from pipeline.config import Config

log = logging.getLogger(__name__)

_NOT_METRICS = ("step", "policy_version", "time_ms", "skipped", "sample_ids", "tenant", "adapter", "resumed")


def step_event(record: dict, run_id: str, trained: dict[str, float]) -> events.TrainStep:
    """The :class:`~pipeline.events.TrainStep` of one metrics-log record.

    ``trained``: sample_id -> mean advantage over its response tokens, for the samples the
    step trained. ``tenant`` and ``adapter`` (with ``trainer.lora``: the adapter the step
    produced) are the event's own fields; every other field of ``record`` but ``resumed`` goes
    to ``metrics``.
    """
    return events.TrainStep(
        step=int(record["step"]), policy_version=int(record.get("policy_version", 0)), run_id=run_id,
        created_at=int(record.get("time_ms") or events.now_ms()), skipped=bool(record.get("skipped", False)),
        metrics={k: v for k, v in record.items() if k not in _NOT_METRICS},
        sample_ids=[str(i) for i in record.get("sample_ids", [])], trained=dict(trained),
        tenant=record.get("tenant"), adapter=record.get("adapter"))


class StepPublisher:
    """Sends step records to ``<prefix>metrics`` keyed by the run id (see the module docstring)."""

    def __init__(self, config: Config, producer: EventProducer) -> None:
        self.topic = config.topics.name("metrics")
        self.run_id = config.trainer.run_id
        self.producer = producer

    def publish(self, record: dict, trained: dict[str, float]) -> None:
        """Queue the step's event; failures are logged, never raised."""
        try:
            self.producer.send(self.topic, step_event(record, self.run_id, trained), key=self.run_id)
        except Exception as e:  # noqa: BLE001 - an observer's record must not stop training
            log.warning("step %s not published to %s: %s", record.get("step"), self.topic, e)
