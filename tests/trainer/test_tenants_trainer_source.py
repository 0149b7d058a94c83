"""Issue 28 (tenants), the trainer's sample source with ``trainer.per_tenant``.

The real :class:`~pipeline.trainer.source.SampleSource` reads through ``StandInReader`` (a
stand-in for the Kafka reader: partitions held in memory, the same raw-record interface), so
hypothesis can try many interleavings; one test at the end runs it on the real broker.

Rules restated from docs/tenants.md: a batch never mixes tenants; a tenant's buffer is released
when full or when its oldest sample has waited more than ``tenant_max_wait_records`` records;
across restarts from any checkpoint every sample is trained exactly once.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import events
from pipeline.config import Config
from pipeline.trainer import source as S
from pipeline.trainer.buffers import Held, TenantBuffers

TENANTS = ["alice", "bob", None]


def _sample(i: int, tenant: str | None) -> events.Sample:
    sid = f"s{i}:0:rl:r{i}"
    return events.Sample(sample_id=sid if tenant is None else f"{tenant}/{sid}", session_id=f"s{i}", turn_index=0,
                         tokens=[1, 2, 3, 4], response_length=2, rollout_log_probs=[-1.0, -1.0], reward=1.0,
                         tenant=tenant)


class StandInReader:
    """A stand-in for :class:`pipeline.bus.TopicReader` over in-memory partitions of raw values."""

    log: dict[int, list[bytes]] = {}
    dead: list = []  # dead letters written, across restarts

    def __init__(self, config, topic, start, **kw):
        self.topic = topic
        self.pos = {p: (start.for_partition(p) or 0) for p in self.log}

    def positions(self):
        return dict(self.pos)

    def poll_raw(self, timeout_ms=0):
        out = []
        for p, values in sorted(self.log.items()):  # up to 3 records of each partition per poll
            for o in range(self.pos[p], min(self.pos[p] + 3, len(values))):
                out.append(SimpleNamespace(topic=self.topic, partition=p, offset=o, key=None, value=values[o]))
            self.pos[p] = min(self.pos[p] + 3, len(values))
        return out

    def decode(self, rec, stop=None):
        try:
            return SimpleNamespace(event=events.decode(rec.value))
        except events.EventError:
            self.dead.append((rec.partition, rec.offset))
            return None

    def dead_letter(self, rec, problem, stop=None):
        self.dead.append((rec.partition, rec.offset))

    def commit(self, offsets):
        pass

    def close(self):
        pass


def _config(batch: int, wait: int) -> Config:
    return Config().replace(trainer={"per_tenant": True, "rollout_batch_size": batch,
                                     "tenant_max_wait_records": wait, "max_staleness": None})


def _run(config, monkeypatch, restarts: list[int], n_records: int):
    """Batches of a source restarted from its last checkpoint after the batch counts in
    ``restarts``; a checkpoint goes through JSON as meta.json does."""
    monkeypatch.setattr(S, "TopicReader", StandInReader)
    ckpt = {"offsets": {}, "seen": [], "resume": None}
    trained: list[tuple[str | None, list[str]]] = []
    src = S.SampleSource(config)
    for _ in range(4 * n_records + 8):
        if restarts and len(trained) == restarts[0]:
            restarts.pop(0)
            src.close()
            ckpt = json.loads(json.dumps(ckpt))
            offsets = {int(p): o for p, o in ckpt["offsets"].items()}
            src = S.SampleSource(config, offsets, ckpt["seen"], resume=ckpt["resume"])
        stop = SimpleNamespace(is_set=lambda: src.reader.pos == {p: len(v) for p, v in StandInReader.log.items()}
                               and not src._buffer)
        b = src.next_batch(0, stop)
        if b is None:
            break
        trained.append((b.tenant, [s.sample_id for s in b.samples]))
        assert {s.tenant for s in b.samples} == {b.tenant}, "a batch mixed tenants"
        ckpt = {"offsets": b.offsets, "seen": src.dedup.to_list(), "resume": b.resume}
    return trained, src


interleavings = st.lists(st.tuples(st.integers(0, 1), st.sampled_from(TENANTS), st.booleans()), min_size=1,
                         max_size=40)


@settings(max_examples=60, deadline=None)
@given(records=interleavings, batch=st.integers(1, 4), wait=st.integers(1, 12),
       restarts=st.lists(st.integers(0, 12), max_size=3))
def test_batches_never_mix_tenants_and_every_sample_trains_once_across_restarts(records, batch, wait, restarts):
    """Any interleaving of three tenants' samples (and bad records) over two partitions, any batch
    size and wait, restarted from the last checkpoint at any points: each batch holds one
    tenant's samples only, the trained samples are every valid sample exactly once (those
    still buffered at the end are the ones not yet released), and no bad record is
    dead-lettered twice (a restart skips what was consumed above the restart point)."""
    log: dict[int, list[bytes]] = {0: [], 1: []}
    want: dict[str | None, list[str]] = {t: [] for t in TENANTS}
    for i, (p, tenant, good) in enumerate(records):
        s = _sample(i, tenant)
        log[p].append(events.encode(s) if good else b"\x93garbage")
        if good:
            want[tenant].append(s.sample_id)
    StandInReader.log, StandInReader.dead = log, []
    with pytest.MonkeyPatch.context() as mp:
        trained, src = _run(_config(batch, wait), mp, sorted(restarts), len(records))
    got = [i for _, ids in trained for i in ids]
    left = list(src.tenants.ids)
    assert len(got) == len(set(got)), "a sample trained twice"
    bad = [(p, o) for p, values in log.items() for o, v in enumerate(values) if v == b"\x93garbage"]
    assert sorted(StandInReader.dead) == [x for x in bad if x in StandInReader.dead], "dead-lettered twice"
    assert len(StandInReader.dead) == len(set(StandInReader.dead))
    assert sorted(got + left) == sorted(i for ids in want.values() for i in ids), "a sample lost"
    for tenant, ids in trained:
        assert len(ids) <= batch
        assert all(i.startswith(f"{tenant}/") if tenant else "/" not in i for i in ids)
        order = [i for i in want[tenant] if i in ids]
        assert ids == order or sorted(ids) == sorted(order)  # a tenant's batch: its own samples


def test_a_quiet_tenant_is_released_after_the_wait_not_starved_by_a_busy_one(monkeypatch):
    """Alice sends 1 sample, then Bob 20: Bob's full batches go first, and Alice's partial batch
    is released once 5 records passed after it; it never waited for a full batch."""
    StandInReader.log = {0: [events.encode(_sample(0, "alice"))] +
                         [events.encode(_sample(i, "bob")) for i in range(1, 21)], 1: []}
    trained, _ = _run(_config(4, 5), monkeypatch, [], 21)
    tenants = [t for t, _ in trained]
    assert tenants.count("alice") == 1 and len(trained[tenants.index("alice")][1]) == 1
    assert tenants.index("alice") <= 2  # released by the wait (6 records after it), among bob's first batches
    assert all(len(ids) == 4 for t, ids in trained if t == "bob")


def test_buffers_offsets_and_resume_state():
    """The restart point is the lowest pending offset; records consumed above it are skipped
    after a restart, pending ones are read again."""
    tb = TenantBuffers(2, 100, {0: 0})
    for o, t in enumerate(["a", "b", "b"]):
        tb.advance(0, o)
        tb.add(t, Held(SimpleNamespace(sample_id=f"{t}{o}"), 1.0, 0, 0, o, 0))
    assert tb.ready() == ("b", "full")
    assert [h.offset for h in tb.release("b")] == [1, 2]
    assert tb.offsets() == {0: 0} and tb.resume_state() == {"upto": {0: 3}, "pending": {0: [0]}}
    again = TenantBuffers(2, 100, {0: 0}, json.loads(json.dumps(tb.resume_state())))
    assert [again.consumed(0, o) for o in range(4)] == [False, True, True, False]
    again.advance(0, 0)  # offset 0 read again but not yet buffered: offset 1, 2 still to skip
    assert again.resume_state() == {"upto": {0: 3}, "pending": {}} and again.offsets() == {0: 1}


def test_off_by_default_one_shared_batch(monkeypatch):
    monkeypatch.setattr(S, "TopicReader", StandInReader)
    StandInReader.log = {0: [events.encode(_sample(i, t)) for i, t in enumerate(["alice", "bob", None, "alice"])]}
    src = S.SampleSource(Config().replace(trainer={"rollout_batch_size": 4, "max_staleness": None}))
    b = src.next_batch(0)
    assert src.tenants is None and b.tenant is None and b.resume is None
    assert [s.tenant for s in b.samples] == ["alice", "bob", None, "alice"]


def test_restart_mid_buffer_reads_the_pending_sample_again_and_nothing_else(monkeypatch):
    """Alice's sample (offset 0) is still buffered when Bob's batch (offsets 2, 3) is checkpointed
    and the trainer restarts: the restart point is offset 0; Alice's sample is read again, the
    bad record at offset 1 is not dead-lettered again, Bob's samples are not trained again."""
    StandInReader.log = {0: [events.encode(_sample(0, "alice")), b"\x93garbage", events.encode(_sample(2, "bob")),
                             events.encode(_sample(3, "bob")), events.encode(_sample(4, "alice"))]}
    StandInReader.dead = []
    trained, src = _run(_config(2, 100), monkeypatch, [1], 5)
    assert trained == [("bob", ["bob/s2:0:rl:r2", "bob/s3:0:rl:r3"]), ("alice", ["alice/s0:0:rl:r0", "alice/s4:0:rl:r4"])]
    assert StandInReader.dead == [(0, 1)]
