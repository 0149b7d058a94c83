"""The decisions the judge already published, read back from ``samples`` (Binary RL).

A judge that starts (or is assigned partitions) resumes from its group's committed offsets and
re-reads every record after them, including turns it had already settled. For those, the
decision it published is the decision: it is copied, never taken again (a second judgement
could differ, and the at-least-one rule needs the conversation's earlier decisions, see
:mod:`pipeline.judge.join`). :func:`published_rl_decisions` reads them: the ``rl`` samples
published since the oldest record the group re-delivers on the given partitions was written
(its record timestamp, less ``margin_ms`` for producer clock skew).
"""

from __future__ import annotations

import logging
import time

from pipeline import events
from pipeline.bus.reader import TopicReader, Time
from pipeline.config import Config

log = logging.getLogger(__name__)


def _oldest_redelivered_ms(config: Config, topic: str, partitions: list[int], group_id: str,
                           timeout_s: float) -> int | None:
    """Record timestamp (ms) of the oldest record at the group's committed offsets, or None
    when the group committed nothing there (a new group decides afresh) or every partition is
    read to its end."""
    first: dict[int, int] = {}
    with TopicReader(config, topic, start="committed", partitions=partitions, group_id=group_id,
                     name="judge-lookup") as r:
        committed = {p: o for p, o in r.committed().items() if o is not None}
        if not committed:
            return None
        for p in partitions:
            if p not in committed:
                r.seek_to_end(p)  # nothing committed there: nothing of this group's to re-read
        deadline = time.monotonic() + timeout_s
        while len(first) < len(partitions) and not r.caught_up() and time.monotonic() < deadline:
            for rec in r.poll(timeout_ms=200):
                first.setdefault(rec.partition, rec.timestamp_ms)
    return min(first.values()) if first else None


def published_rl_decisions(config: Config, group_id: str, tps: set, judge: str, margin_ms: int = 60_000,
                           timeout_s: float = 30.0) -> dict[str, int]:
    """``sample_id -> loss_mask`` of the samples by ``judge`` (the backend's name) that records
    the group will re-deliver on ``tps`` (``(turns topic, partition)`` pairs) may already have
    produced. Empty when the group committed nothing there or nothing will be re-delivered.
    Errors reading the topics propagate (the caller logs them and decides afresh)."""
    by_topic: dict[str, list[int]] = {}
    for topic, p in tps:
        by_topic.setdefault(topic, []).append(p)
    oldest = [t for topic, ps in by_topic.items()
              if (t := _oldest_redelivered_ms(config, topic, sorted(ps), group_id, timeout_s)) is not None]
    if not oldest:
        return {}
    out: dict[str, int] = {}
    with TopicReader(config, config.topics.name("samples"), start=Time(max(0, min(oldest) - margin_ms)),
                     name="judge-lookup") as r:
        for rec in r.read(idle_timeout_s=timeout_s):
            ev = getattr(rec, "event", None)
            if isinstance(ev, events.Sample) and ev.judge == judge:
                out[ev.sample_id] = ev.loss_mask
    log.info("judge: %d published decisions read back for %d re-read partitions", len(out), len(tps))
    return out
