"""One order for records of several topics and partitions: the order the decider folds them in.

Kafka orders records within a partition only. The decider reads ``control`` (one partition),
``metrics``, ``samples`` and ``turns`` (several partitions each) and must fold them in one order
that does not depend on how the broker happened to batch them, so that a restart (which reads
everything again in large batches) folds the records it re-reads in the order the live decider
folded them. The order is :func:`order_key`:

``(created_at, topic, partition, offset)`` -- ``created_at`` being, for ``control``, the running
maximum of ``created_at`` along the log (so ``control`` keeps its own log order, which is the one
the proxy and the syncers follow, and a decision whose ``created_at`` is its triggering record's
is placed no earlier than the record before it on ``control``). At equal time the topic name
decides: ``control`` < ``metrics`` < ``samples`` < ``turns`` (a decision is placed before the
record that triggered it, which then finds its canary closed).

:class:`Merge` releases a held record once no partition can still deliver one that sorts
before it: every other partition either has nothing more on the broker (its read position is
its high watermark) or already delivered a record that sorts after it. Records that reach the
broker *after* a later record of another partition was released (a producer that held a record,
a clock that lags) are released at once, out of this order: that is the one way the live order
can differ from a restart's (see docs/rollout.md "The evaluator stage").

Pure: no broker, no clock. Not thread-safe (one decider thread).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterable


def order_key(record, created_at: int) -> tuple:
    """The sort key of a :class:`pipeline.bus.Record` whose (effective) time is ``created_at`` (ms)."""
    return (created_at, record.topic, record.partition, record.offset)


class Merge:
    """Hold polled records and release them in :func:`order_key` order (module docstring).

    Args:
        control_topic: the physical name of ``control`` (its times are made monotonic).
    """

    def __init__(self, control_topic: str) -> None:
        self.control_topic = control_topic
        self._heap: list = []
        self._seq = itertools.count()
        self._last: dict[tuple[str, int], tuple] = {}  # (topic, partition) -> key of its last record added
        self._control_time = 0

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, records: Iterable) -> None:
        """Hold decoded records (:class:`pipeline.bus.Record`, in offset order per partition)."""
        for rec in records:
            at = int(getattr(rec.event, "created_at", 0) or 0)
            if rec.topic == self.control_topic:
                self._control_time = at = max(self._control_time, at)
            key = order_key(rec, at)
            self._last[(rec.topic, rec.partition)] = key
            heapq.heappush(self._heap, (key, next(self._seq), rec))

    def release(self, assigned: Iterable[tuple[str, int]], lag: dict[tuple[str, int], int]) -> list:
        """The held records that no partition can precede any more, in order.

        Args:
            assigned: every ``(topic, partition)`` being read.
            lag: records on the broker not yet polled, per ``(topic, partition)`` (a partition
                absent here has an unknown high watermark: it may still hold anything).
        """
        assigned = list(assigned)
        out = []
        while self._heap:
            key, _, rec = self._heap[0]
            own = (rec.topic, rec.partition)
            if any(tp != own and lag.get(tp) != 0 and self._last.get(tp, ()) <= key for tp in assigned):
                break
            heapq.heappop(self._heap)
            out.append(rec)
        return out

    def drain(self) -> list:
        """Every held record, in order (a bounded read that ends here)."""
        out = [heapq.heappop(self._heap)[2] for _ in range(len(self._heap))]
        return out


def ordered(records: Iterable, control_topic: str) -> list:
    """Every record of a bounded read (:class:`pipeline.bus.Record`, in offset order per
    partition) in the decider's order: what a restart folds, and what
    :func:`pipeline.rollout.fold.replay` must be given to decide as the decider did."""
    merge = Merge(control_topic)
    merge.add(records)
    return merge.drain()
