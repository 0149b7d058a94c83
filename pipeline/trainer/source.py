"""Fixed-size batches of ``samples`` records, with exact per-partition offsets.

The trainer assigns itself every partition of ``samples`` (a :class:`pipeline.bus.TopicReader`:
no group rebalancing, one trainer job reads everything) and seeks each to the offset stored in
its checkpoint; without a checkpoint it starts at the consumer group's committed offset, else at
the beginning. It still
commits to its consumer group (``trainer.group_id``) after each checkpoint, so lag shows in the
usual tools, but the checkpoint is the source of truth.

What counts toward ``rollout_batch_size``: a record that decodes to a :class:`events.Sample`,
whose ``sample_id`` was not seen within the de-duplication window, that is not dropped as
stale, and that is trainable (``loss_mask = 1`` with a prompt and a response) — or, with
``trainer.count_masked_samples``, also a fully masked sample. Staleness applies to samples with
rollout log-probs only: one without (an imported conversation) was never sampled by any policy
version, is trained against the trainer's own log-probs, and is never stale. Fully masked samples never reach
the forward pass; they are consumed (their offsets move) and counted in the metrics. Records
that fail to decode or are not samples go to ``samples.dlq`` (delivered before the offset moves
past them; while the DLQ cannot be written the source retries, and a stop then returns no
batch); duplicates and stale drops are skipped and counted. Offsets cover every record consumed
into a batch, counted or not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from pipeline import events
from pipeline.bus import DeadLetterError, Offset, TopicReader
from pipeline.config import Config
from pipeline.trainer import batch as B
from pipeline.trainer import loss as L

log = logging.getLogger(__name__)


class DedupWindow:
    """The last ``size`` sample_ids seen, in arrival order (checkpointed as a list)."""

    def __init__(self, size: int, ids: list[str] | None = None) -> None:
        self.size = size
        self._ids: OrderedDict[str, None] = OrderedDict()
        for i in ids or []:
            self.add(i)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._ids

    def add(self, sample_id: str) -> None:
        """Remember ``sample_id`` (forgetting the oldest beyond ``size``)."""
        self._ids[sample_id] = None
        self._ids.move_to_end(sample_id)
        while len(self._ids) > self.size:
            self._ids.popitem(last=False)

    def to_list(self) -> list[str]:
        """Oldest first."""
        return list(self._ids)


@dataclass
class Batch:
    """One trainer step's input: the samples, their loss weights, and where consumption ended.

    ``offsets``: ``{partition: next offset to read}`` after this batch, for every partition.
    ``stats``: counts of what was consumed (records, duplicates, stale drops, masked, DLQ) and
    staleness (mean/max over the batch's samples), ``consume_s``: time spent waiting and decoding.
    """

    samples: list[events.Sample]
    weights: list[float]
    offsets: dict[int, int]
    stats: dict[str, float] = field(default_factory=dict)


class SampleSource:
    """Reads ``samples`` for the trainer (rank 0 only).

    Args:
        config: the process config (``kafka``, ``topics``, ``trainer``).
        offsets: ``{partition: next offset}`` from the checkpoint; partitions not in it start at
            the group's committed offset, else at the beginning.
        seen: sample_ids of the de-duplication window from the checkpoint.
        validate: returns why a sample cannot be trained (it then goes to the DLQ), or None.

    Raises:
        pipeline.bus.TopicMissing: ``samples`` does not exist.
    """

    def __init__(self, config: Config, offsets: dict[int, int] | None = None, seen: list[str] | None = None,
                 validate: Callable[[events.Sample], str | None] | None = None) -> None:
        self.config, self.cfg = config, config.trainer
        self.topic = config.topics.name("samples")
        self.reader = TopicReader(config, self.topic, Offset(per_partition=dict(offsets or {}), otherwise="committed"),
                                  name="trainer", group_id=self.cfg.group_id, dlq=True, wait_s=30.0)
        self.dedup = DedupWindow(self.cfg.dedup_window, seen)
        self.validate = validate
        self._buffer: deque = deque()
        self.positions: dict[int, int] = self.reader.positions()
        log.info("trainer reads %s from %s", self.topic, self.positions)

    def next_batch(self, trainer_version: int, stop: threading.Event | None = None) -> Batch | None:
        """Block until ``rollout_batch_size`` samples count (see the module docstring).

        ``trainer_version`` is the policy version being trained (for staleness). Returns None if
        ``stop`` is set before the batch is full; the records read so far stay buffered (not
        consumed), so the offsets of the last returned batch remain exact.
        """
        cfg = self.cfg
        t0 = time.perf_counter()
        samples: list[events.Sample] = []
        weights: list[float] = []
        staleness: list[int] = []
        positions = dict(self.positions)
        stats = dict(records=0, duplicates=0, stale_dropped=0, stale_downweighted=0, masked=0, dead_letters=0)
        taken: list = []
        seen_now: set[str] = set()
        while len(samples) < cfg.rollout_batch_size:
            if not self._buffer:
                if stop is not None and stop.is_set():
                    self._buffer.extendleft(reversed(taken))  # nothing consumed: keep for next time
                    return None
                self._buffer.extend(self.reader.poll_raw(timeout_ms=int(cfg.poll_timeout_s * 1000)))
                continue
            rec = self._buffer.popleft()
            taken.append(rec)
            try:
                got = self.reader.decode(rec, stop=stop)  # not a valid sample: to samples.dlq
                ev = got.event if got is not None else None
                problem = self.validate(ev) if self.validate is not None and ev is not None else None
                if problem:
                    self.reader.dead_letter(rec, problem, stop=stop)
            except DeadLetterError as e:  # stopped while the DLQ was unwritable: nothing consumed
                log.warning("%s", e)
                self._buffer.extendleft(reversed(taken))
                return None
            positions[rec.partition] = rec.offset + 1
            stats["records"] += 1
            if ev is None or problem:
                stats["dead_letters"] += 1
                continue
            if ev.sample_id in self.dedup or ev.sample_id in seen_now:
                stats["duplicates"] += 1
                continue
            seen_now.add(ev.sample_id)
            sampled = ev.rollout_log_probs is not None  # else never sampled by a policy: never stale
            w, keep = L.staleness_weights(torch.tensor([ev.policy_version]), trainer_version,
                                          cfg.max_staleness if sampled else None, cfg.stale_policy, cfg.stale_decay)
            if not bool(keep[0]):
                stats["stale_dropped"] += 1
                continue
            if float(w[0]) < 1.0:
                stats["stale_downweighted"] += 1
            if not B.trainable(ev):
                stats["masked"] += 1
                if not cfg.count_masked_samples:
                    continue
            samples.append(ev)
            weights.append(float(w[0]))
            if sampled:
                staleness.append(max(0, trainer_version - ev.policy_version))
        for s in seen_now:
            self.dedup.add(s)
        self.positions = positions
        if staleness:  # no sample sampled by a policy (e.g. only imported ones): no figure, not 0
            stats["staleness_mean"] = sum(staleness) / len(staleness)
            stats["staleness_max"] = float(max(staleness))
        stats["consume_s"] = time.perf_counter() - t0
        return Batch(samples, weights, dict(positions), {k: float(v) for k, v in stats.items()})

    def commit(self, offsets: dict[int, int]) -> None:
        """Commit ``offsets`` to the consumer group (lag visibility; failures are only logged)."""
        try:
            self.reader.commit(offsets)
        except Exception as e:  # noqa: BLE001 - the checkpoint, not the group, is authoritative
            log.warning("group commit of %s failed: %s", offsets, e)

    def close(self) -> None:
        """Close the reader (its consumer and DLQ producer)."""
        self.reader.close()
