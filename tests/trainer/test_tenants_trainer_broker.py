"""Issue 28 (tenants): the per-tenant sample source on the real broker, restarted mid-buffer."""

from __future__ import annotations

import json
import threading

from pipeline import events
from pipeline.bus import EventProducer
from pipeline.config import load_config
from pipeline.trainer.source import SampleSource


def _s(i, tenant):
    return events.Sample(sample_id=f"{tenant}/s{i}:0:rl:r{i}", session_id=f"s{i}", turn_index=0, tokens=[1, 2, 3, 4],
                         response_length=2, rollout_log_probs=[-1.0, -1.0], reward=1.0, tenant=tenant)


def test_restart_mid_buffer_every_sample_once(kafka_config):
    base = kafka_config.model_dump(mode="python")
    cfg = load_config(None, kafka=base["kafka"], topics=base["topics"],
                      trainer={"poll_timeout_s": 0.2, "per_tenant": True, "rollout_batch_size": 3,
                               "tenant_max_wait_records": 50, "max_staleness": None})
    order = ["alice"] + ["bob"] * 6 + ["alice", "alice"] + ["bob"] * 3  # alice's first waits in her buffer
    p = EventProducer(cfg, name="test")
    for i, t in enumerate(order):
        p.send(cfg.topics.name("samples"), _s(i, t), key="one")  # one key: one partition, this order
    p.flush(10)
    p.close()
    src = SampleSource(cfg)
    b1 = src.next_batch(0)
    assert b1.tenant == "bob" and len(src.tenants) == 1  # alice's first sample still buffered
    part = next(iter(b1.resume["upto"]))
    assert b1.offsets[part] == 0  # the restart point is below alice's pending sample
    ckpt = json.loads(json.dumps({"offsets": b1.offsets, "seen": src.dedup.to_list(), "resume": b1.resume}))
    src.close()  # the crash: alice's buffered sample was never trained
    src = SampleSource(cfg, {int(k): v for k, v in ckpt["offsets"].items()}, ckpt["seen"], resume=ckpt["resume"])
    got = [(b1.tenant, [s.sample_id for s in b1.samples])]
    stop = threading.Event()
    for _ in range(3):
        b = src.next_batch(0, stop)
        got.append((b.tenant, [s.sample_id for s in b.samples]))
    src.close()
    ids = [i for _, batch in got for i in batch]
    assert sorted(ids) == sorted(s.sample_id for s in (_s(i, t) for i, t in enumerate(order)))  # each once
    assert [t for t, _ in got] == ["bob", "bob", "alice", "bob"]
    assert all(i.startswith(t + "/") for t, batch in got for i in batch)


def test_staleness_counts_per_tenant_adapter_version(kafka_config):
    from pipeline.trainer.tenants import TenantTable

    base = kafka_config.model_dump(mode="python")
    cfg = load_config(None, kafka=base["kafka"], topics=base["topics"],
                      trainer={"poll_timeout_s": 0.2, "per_tenant": True, "rollout_batch_size": 2,
                               "tenant_max_wait_records": 50, "max_staleness": 0})
    table = TenantTable()
    for c in "ab":  # alice: two updates, versions a (n=1) and b (n=2); bob: none
        table.bump("alice")
        table.record("alice", c * 64)

    def ad(c):
        return {"name": f"alice@{c * 16}", "version": c * 64, "sha256": "f" * 64}

    served = [("alice", ad("b")), ("alice", ad("a")), ("alice", None), ("alice", ad("9")), ("bob", None),
              ("alice", ad("b")), ("bob", None)]
    p = EventProducer(cfg, name="test")
    for i, (t, a) in enumerate(served):
        s = _s(i, t)
        s.adapter = a
        p.send(cfg.topics.name("samples"), s, key="one")
    p.flush(10)
    p.close()
    src = SampleSource(cfg)
    src.adapters = table
    got = [src.next_batch(0) for _ in range(2)]
    src.close()
    by = {b.tenant: b for b in got}
    # alice is at n=2: only samples of version b are fresh; a (n=1) and the base (n=0) are stale,
    # an unknown version is never taken as fresh; bob (n=0) served by the base is fresh
    assert [s.sample_id for s in by["alice"].samples] == [_s(0, "alice").sample_id, _s(5, "alice").sample_id]
    assert [s.sample_id for s in by["bob"].samples] == [_s(4, "bob").sample_id, _s(6, "bob").sample_id]
    stats = {k: sum(b.stats.get(k, 0) for b in got) for k in ("stale_dropped", "unknown_adapter")}
    assert stats == {"stale_dropped": 3, "unknown_adapter": 1}
