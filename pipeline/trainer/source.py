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

With ``trainer.per_tenant`` each tenant has its own buffer and a batch never mixes tenants (the
release rule, the offsets of buffers released out of order and the checkpoint's ``resume``
state: :mod:`pipeline.trainer.buffers`). Off (the default): one shared batch, as before tenants.
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
from pipeline.trainer import prom
from pipeline.trainer.buffers import Held, TenantBuffers

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

    ``offsets``: ``{partition: next offset to read}`` after this batch, for every partition (with
    ``trainer.per_tenant``: the restart point, below the samples still buffered).
    ``stats``: counts of what was consumed (records, duplicates, stale drops, masked, DLQ) and
    staleness (mean/max over the batch's samples), ``consume_s``: time spent waiting and decoding.
    ``tenant``: the tenant every sample belongs to (``trainer.per_tenant``; None: no tenant, or a
    shared batch). ``resume``: with ``trainer.per_tenant``, what a checkpoint keeps beside the
    offsets (:meth:`pipeline.trainer.buffers.TenantBuffers.resume_state`); None otherwise.
    """

    samples: list[events.Sample]
    weights: list[float]
    offsets: dict[int, int]
    stats: dict[str, float] = field(default_factory=dict)
    tenant: str | None = None
    resume: dict | None = None


def _new_stats() -> dict[str, float]:
    return dict(records=0, duplicates=0, stale_dropped=0, stale_downweighted=0, masked=0, dead_letters=0,
                unknown_adapter=0)


class SampleSource:
    """Reads ``samples`` for the trainer (rank 0 only).

    Args:
        config: the process config (``kafka``, ``topics``, ``trainer``).
        offsets: ``{partition: next offset}`` from the checkpoint; partitions not in it start at
            the group's committed offset, else at the beginning.
        seen: sample_ids of the de-duplication window from the checkpoint.
        validate: returns why a sample cannot be trained (it then goes to the DLQ), or None.
        resume: ``trainer.per_tenant``: the checkpoint's :attr:`Batch.resume` (which records
            between its offsets and its read position were consumed already).

    Raises:
        pipeline.bus.TopicMissing: ``samples`` does not exist.
    """

    def __init__(self, config: Config, offsets: dict[int, int] | None = None, seen: list[str] | None = None,
                 validate: Callable[[events.Sample], str | None] | None = None, resume: dict | None = None) -> None:
        self.config, self.cfg = config, config.trainer
        self.topic = config.topics.name("samples")
        self.reader = TopicReader(config, self.topic, Offset(per_partition=dict(offsets or {}), otherwise="committed"),
                                  name="trainer", group_id=self.cfg.group_id, dlq=True, wait_s=30.0)
        self.dedup = DedupWindow(self.cfg.dedup_window, seen)
        self.validate = validate
        self._buffer: deque = deque()
        self.positions: dict[int, int] = self.reader.positions()
        self.tenants = (TenantBuffers(self.cfg.rollout_batch_size, self.cfg.tenant_max_wait_records, self.positions,
                                      resume) if self.cfg.per_tenant else None)
        self._stats = _new_stats()  # per-tenant mode: what was consumed since the last batch
        #: ``trainer.lora``: the tenants' update counts and adapter versions (staleness per
        #: tenant's adapter, :mod:`pipeline.trainer.tenants`); None: the one trainer version
        self.adapters = None
        self._t0: float | None = None
        log.info("trainer reads %s from %s%s", self.topic, self.positions,
                 " (one batch per tenant)" if self.tenants is not None else "")

    def staleness_version(self, tenant: str | None, trainer_version: int) -> int:
        """The policy version a sample of ``tenant`` is stale against: the trainer's one version,
        or with ``trainer.lora`` (:attr:`adapters` set) the tenant's update count ``n_T``."""
        if self.adapters is not None:
            return self.adapters.updates(tenant)
        return trainer_version

    def produced_by(self, ev: events.Sample) -> int | None:
        """The policy version that generated ``ev``: its ``policy_version``, or with
        ``trainer.lora`` the update count of the adapter that served it (the base: the tenant's
        ``base``; None: a version the table does not know, :mod:`pipeline.trainer.tenants`)."""
        if self.adapters is not None:
            return self.adapters.produced_by(ev.tenant, ev.adapter)
        return ev.policy_version

    def _take(self, rec, trainer_version: int, stop, stats: dict, seen: set | Callable) -> tuple | None:
        """Decode, check and count one raw record: ``(sample, weight, staleness or None)`` when it
        counts toward a batch, None when it was dropped (DLQ, duplicate, stale, masked).
        ``seen``: sample ids already taken (a set, or a membership test).

        Raises:
            DeadLetterError: stopped while its dead letter could not be written (not consumed).
        """
        cfg = self.cfg
        got = self.reader.decode(rec, stop=stop)  # not a valid sample: to samples.dlq
        ev = got.event if got is not None else None
        problem = self.validate(ev) if self.validate is not None and ev is not None else None
        if problem:
            self.reader.dead_letter(rec, problem, stop=stop)
        stats["records"] += 1
        if ev is None or problem:
            stats["dead_letters"] += 1
            return None
        if ev.sample_id in self.dedup or (seen(ev.sample_id) if callable(seen) else ev.sample_id in seen):
            stats["duplicates"] += 1
            return None
        sampled = ev.rollout_log_probs is not None  # else never sampled by a policy: never stale
        version = self.staleness_version(ev.tenant, trainer_version)
        produced = self.produced_by(ev)
        if produced is None:  # an adapter version nobody knows: one version beyond the limit, never fresh
            stats["unknown_adapter"] += 1
            produced = version - (cfg.max_staleness or 0) - 1
        w, keep = L.staleness_weights(torch.tensor([produced]), version,
                                      cfg.max_staleness if sampled else None, cfg.stale_policy, cfg.stale_decay)
        if not bool(keep[0]):
            stats["stale_dropped"] += 1
            return None
        if float(w[0]) < 1.0:
            stats["stale_downweighted"] += 1
        if not B.trainable(ev):
            stats["masked"] += 1
            if not cfg.count_masked_samples:
                return None
        return ev, float(w[0]), (max(0, version - produced) if sampled else None)

    def next_batch(self, trainer_version: int, stop: threading.Event | None = None,
                   idle: Callable[[], bool] | None = None) -> Batch | None:
        """Block until ``rollout_batch_size`` samples count (see the module docstring); with
        ``trainer.per_tenant`` until a tenant's batch is released (:mod:`pipeline.trainer.buffers`).

        ``trainer_version`` is the policy version being trained (for staleness). Returns None if
        ``stop`` is set before the batch is full, or (``trainer.per_tenant`` only) when a poll
        brought no record and ``idle()`` returns True (the caller has work between batches:
        adapter commands); the records read so far stay buffered (not consumed), so the offsets
        of the last returned batch remain exact.
        """
        if self.tenants is not None:
            return self._next_tenant_batch(trainer_version, stop, idle)
        t0 = time.perf_counter()
        prom.BATCH_SIZE.set(self.cfg.rollout_batch_size)
        prom.BATCH_COUNTED.set(0)
        samples: list[events.Sample] = []
        weights: list[float] = []
        staleness: list[int] = []
        positions = dict(self.positions)
        stats = _new_stats()
        taken: list = []
        seen_now: set[str] = set()
        while len(samples) < self.cfg.rollout_batch_size:
            if not self._buffer:
                if stop is not None and stop.is_set():
                    self._buffer.extendleft(reversed(taken))  # nothing consumed: keep for next time
                    return None
                self._buffer.extend(self.reader.poll_raw(timeout_ms=int(self.cfg.poll_timeout_s * 1000)))
                continue
            rec = self._buffer.popleft()
            taken.append(rec)
            try:
                got = self._take(rec, trainer_version, stop, stats, seen_now)
            except DeadLetterError as e:  # stopped while the DLQ was unwritable: nothing consumed
                log.warning("%s", e)
                self._buffer.extendleft(reversed(taken))
                return None
            positions[rec.partition] = rec.offset + 1
            if got is None:
                continue
            seen_now.add(got[0].sample_id)
            samples.append(got[0])
            prom.BATCH_COUNTED.set(len(samples))
            weights.append(got[1])
            if got[2] is not None:
                staleness.append(got[2])
        for s in seen_now:
            self.dedup.add(s)
        self.positions = positions
        return Batch(samples, weights, dict(positions), _finish_stats(stats, staleness, t0))

    def _next_tenant_batch(self, trainer_version: int, stop: threading.Event | None,
                           idle: Callable[[], bool] | None = None) -> Batch | None:
        """``trainer.per_tenant``: read into the tenant buffers until one is ready, release it."""
        tb = self.tenants
        if self._t0 is None:
            self._t0 = time.perf_counter()
        while (ready := tb.ready()) is None:
            if not self._buffer:
                if stop is not None and stop.is_set():
                    return None  # what is buffered stays pending: the last batch's offsets hold
                polled = self.reader.poll_raw(timeout_ms=int(self.cfg.poll_timeout_s * 1000))
                if not polled and idle is not None and idle():
                    return None  # the same: the caller acts between batches, then asks again
                self._buffer.extend(polled)
                continue
            rec = self._buffer[0]
            if tb.consumed(rec.partition, rec.offset):  # consumed before the restart
                self._buffer.popleft()
                tb.advance(rec.partition, rec.offset)
                continue
            try:
                got = self._take(rec, trainer_version, stop, self._stats, tb.ids.__contains__)
            except DeadLetterError as e:  # stopped while the DLQ was unwritable: not consumed
                log.warning("%s", e)
                return None
            self._buffer.popleft()
            tb.advance(rec.partition, rec.offset)
            if got is not None:
                tb.add(got[0].tenant, Held(got[0], got[1], got[2], rec.partition, rec.offset, 0))
        tenant, why = ready
        held = tb.release(tenant)
        for h in held:
            self.dedup.add(h.sample.sample_id)
        stats, self._stats = self._stats, _new_stats()
        stats["released_waited"] = 1 if why == "waited" else 0
        stats["buffered"] = len(tb)
        t0, self._t0 = self._t0, None
        self.positions = tb.offsets()
        return Batch([h.sample for h in held], [h.weight for h in held], dict(self.positions),
                     _finish_stats(stats, [h.staleness for h in held if h.staleness is not None], t0),
                     tenant=tenant, resume=tb.resume_state())

    def commit(self, offsets: dict[int, int]) -> None:
        """Commit ``offsets`` to the consumer group (lag visibility; failures are only logged)."""
        try:
            self.reader.commit(offsets)
        except Exception as e:  # noqa: BLE001 - the checkpoint, not the group, is authoritative
            log.warning("group commit of %s failed: %s", offsets, e)

    def close(self) -> None:
        """Close the reader (its consumer and DLQ producer)."""
        self.reader.close()


def _finish_stats(stats: dict, staleness: list[int], t0: float) -> dict[str, float]:
    """A batch's stats as floats, with the staleness figures of its sampled samples (none such:
    no figure, not 0) and ``consume_s`` since ``t0``."""
    if staleness:
        stats["staleness_mean"] = sum(staleness) / len(staleness)
        stats["staleness_max"] = float(max(staleness))
    stats["consume_s"] = time.perf_counter() - t0
    return {k: float(v) for k, v in stats.items()}
