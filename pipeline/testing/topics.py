"""Reading and writing topics in tests and benchmarks, through the pipeline's own bus.

- :func:`read_records`: every record of a physical topic from the beginning, read with
  :class:`pipeline.bus.TopicReader` (assign mode: no group, nothing committed), strictly (an
  undecodable record fails the caller: tests must see what is there).
- :func:`read_events`: the same for a logical topic, events only.
- :func:`publish`: send events to a logical topic and wait for the broker.
"""

from __future__ import annotations

import time
from typing import Callable

from pipeline import events
from pipeline.bus import EventProducer, Record, TopicMissing, TopicReader, Undecodable
from pipeline.config import Config

Want = int | Callable[[list], bool] | None


def read_records(config: Config, topic: str, want: Want = None, timeout_s: float = 30.0,
                 settle_s: float = 0.5) -> list[Record]:
    """Every record of the physical ``topic`` from the beginning, in offset order per partition.

    Waits until ``want`` is met (a count of records, or a predicate on the list of events read so
    far), then ``settle_s`` more for extras (it keeps reading while records still come);
    ``want=None`` is met by the first record. Returns what arrived by ``timeout_s`` otherwise.

    Raises:
        AssertionError: an undecodable record on the topic.
    """
    try:
        reader = TopicReader(config, topic, name="test-reader", accept=None, wait_s=min(timeout_s, 10.0))
    except TopicMissing:
        return []
    out: list[Record] = []
    evs: list[events.Event] = []
    with reader:
        deadline = time.monotonic() + timeout_s
        quiet_until = None
        while time.monotonic() < deadline:
            recs = reader.poll(timeout_ms=100)
            bad = [r for r in recs if isinstance(r, Undecodable)]
            assert not bad, f"unreadable records on {topic}: {bad}"
            out.extend(recs)
            evs.extend(r.event for r in recs)
            met = bool(evs) if want is None else (want(evs) if callable(want) else len(evs) >= want)
            if met:
                if recs or quiet_until is None:
                    quiet_until = time.monotonic() + settle_s
                elif time.monotonic() >= quiet_until:
                    break
    return out


def read_events(config: Config, topic: str = "turns", want: Want = None, timeout_s: float = 30.0,
                settle_s: float = 0.5) -> list[events.Event]:
    """The events of the logical ``topic`` (``turns``, ``samples``, ``turns.dlq`` ...): see
    :func:`read_records`."""
    return [r.event for r in read_records(config, config.topics.name(topic), want, timeout_s, settle_s)]


def publish(config: Config, evs, topic: str = "turns", key: str | None = None) -> None:
    """Send events (or raw bytes) to the logical ``topic``, keyed by ``key`` or else the event's
    session id (or run id), and wait for the broker.

    Raises:
        AssertionError: a record was not delivered.
    """
    p = EventProducer(config, name="test-publisher")
    try:
        for ev in evs:
            k = key if key is not None else getattr(ev, "session_id", None) or getattr(ev, "run_id", None)
            p.send(config.topics.name(topic), ev, key=k)
        p.flush(30)
    finally:
        p.close()
    assert p.failed == 0, f"{p.failed} records not delivered to {topic}"
