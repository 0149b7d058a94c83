"""Per-tenant batch buffers of the trainer's sample source, and the offsets they leave consumed
(pure: no Kafka, no torch; :class:`pipeline.trainer.source.SampleSource` drives it when
``trainer.per_tenant`` is set).

Batches. Every sample that counts goes to the buffer of its ``tenant`` (None, the samples without
a tenant, is a buffer like any other): a batch never mixes tenants. A buffer is released as a
batch when it holds ``rollout_batch_size`` samples, or when its oldest sample has waited more
than ``max_wait_records`` records read from the topic since it arrived (any tenant's records,
counted, never wall-clock: a replay at any speed releases the same batches). A busy tenant
therefore cannot starve a quiet one (its records are what moves the quiet one's clock) and a
quiet one never holds a busy one back (each buffer is released on its own). On an idle topic
nothing is released: a partial batch waits for records, not for time. Several buffers ready at
once: full ones first, then the one whose oldest sample is oldest.

Offsets. Buffers are released out of the order their records were read, so "everything before
the read position is consumed" no longer holds. The restart point of a partition is its lowest
*pending* offset (a sample in a buffer, not yet released), or the read position when nothing is
pending there (:meth:`TenantBuffers.offsets`). Every record between that point and the read
position that is not pending was consumed already (released in a batch, or dropped: duplicate,
stale, masked, dead-lettered), so a checkpoint also keeps :meth:`TenantBuffers.resume_state`
(``{"upto": {partition: read position}, "pending": {partition: [offsets]}}``). After a restart,
a record below ``upto`` that was not pending is skipped (:meth:`TenantBuffers.consumed`), and a
pending one is read again into its buffer: every sample is trained exactly once across a crash.
The pending offsets are bounded by the buffers' size (tenants x batch size).

Staleness per (tenant, adapter version) is the next step: :attr:`Held.staleness` is counted
against the one trainer version today; the source's ``staleness_version(tenant)`` hook is where a
tenant's own adapter version goes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Held:
    """One buffered sample: the event, its loss weight, its staleness (None: never sampled by a
    policy), where its record is, and ``arrival``: records read when it came."""

    sample: Any
    weight: float
    staleness: int | None
    partition: int
    offset: int
    arrival: int


@dataclass
class _Buffer:
    items: list[Held] = field(default_factory=list)


class TenantBuffers:
    """The per-tenant buffers and the consumed offsets (see the module docstring).

    Args:
        batch_size: samples per batch (``trainer.rollout_batch_size``).
        max_wait_records: a buffer whose oldest sample waited more records than this is released.
        positions: ``{partition: next offset to read}`` where reading (re)starts.
        resume: the :meth:`resume_state` of the checkpoint reading restarts from, or None.
    """

    def __init__(self, batch_size: int, max_wait_records: int, positions: dict[int, int],
                 resume: dict | None = None) -> None:
        self.batch_size = batch_size
        self.max_wait = max_wait_records
        self.pos = {int(p): int(o) for p, o in positions.items()}
        self.read = 0  # records read (the clock of max_wait_records)
        self._buffers: dict[str | None, _Buffer] = {}
        self._pending: dict[int, set[int]] = {}
        self.ids: set[str] = set()  # sample ids buffered now
        resume = resume or {}
        self._upto = {int(p): int(o) for p, o in (resume.get("upto") or {}).items()}
        self._old = {int(p): {int(o) for o in os} for p, os in (resume.get("pending") or {}).items()}

    def __len__(self) -> int:
        return sum(len(b.items) for b in self._buffers.values())

    def consumed(self, partition: int, offset: int) -> bool:
        """The record was consumed before the restart (skip it): below the checkpoint's read
        position and not pending then."""
        return offset < self._upto.get(partition, -1) and offset not in self._old.get(partition, ())

    def advance(self, partition: int, offset: int) -> None:
        """The record at ``offset`` was read (whatever became of it)."""
        self.pos[partition] = max(self.pos.get(partition, 0), offset + 1)
        self._old.get(partition, set()).discard(offset)
        self.read += 1

    def add(self, tenant: str | None, held: Held) -> None:
        """Buffer a counted sample of ``tenant`` (after :meth:`advance` of its record)."""
        held.arrival = self.read
        self._buffers.setdefault(tenant, _Buffer()).items.append(held)
        self._pending.setdefault(held.partition, set()).add(held.offset)
        self.ids.add(held.sample.sample_id)

    def ready(self) -> tuple[str | None, str] | None:
        """``(tenant, why)`` of the buffer to release now (``full`` or ``waited``), or None."""
        full = [(b.items[0].arrival, t) for t, b in self._buffers.items() if len(b.items) >= self.batch_size]
        if full:
            return min(full, key=lambda x: x[0])[1], "full"
        waited = [(b.items[0].arrival, t) for t, b in self._buffers.items()
                  if b.items and self.read - b.items[0].arrival > self.max_wait]
        return (min(waited, key=lambda x: x[0])[1], "waited") if waited else None

    def release(self, tenant: str | None) -> list[Held]:
        """Take up to ``batch_size`` samples of ``tenant`` (oldest first) out of pending."""
        buf = self._buffers[tenant]
        out, buf.items = buf.items[:self.batch_size], buf.items[self.batch_size:]
        if not buf.items:
            del self._buffers[tenant]
        for h in out:
            self._pending[h.partition].discard(h.offset)
            self.ids.discard(h.sample.sample_id)
        return out

    def offsets(self) -> dict[int, int]:
        """``{partition: restart offset}``: the lowest pending offset, else the read position
        (a previous run's pending record not read again yet is at or above it)."""
        return {p: min(self._pending[p], default=pos) if self._pending.get(p) else pos for p, pos in self.pos.items()}

    def resume_state(self) -> dict:
        """What a checkpoint keeps beside :meth:`offsets` (see the module docstring)."""
        upto = {p: max(pos, self._upto.get(p, 0)) for p, pos in self.pos.items()}
        pending = {}
        for p in upto:
            os = set(self._pending.get(p, ())) | set(self._old.get(p, ()))
            if os:
                pending[p] = sorted(os)
        return {"upto": upto, "pending": pending}
