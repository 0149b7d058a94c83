"""Broker benchmark: the cost of the durable embedded broker beside memory storage.

    .venv/bin/python bench/broker.py                  # 5,000 records of ~1.9 KB, 200 synchronous sends
    .venv/bin/python bench/broker.py --records 20000 --sync-sends 500

One run starts both kinds of :class:`pipeline.broker.EmbeddedBroker` — memory storage and durable
storage (SeaweedFS object store + Tansu's ``s3://`` engine, in a temporary data dir) — and
measures on each, in the order memory, durable, durable, memory (drift from other load on the
machine cancels out):

- start time (durable: the object store, then Tansu; and a restart on the same data dir);
- produce throughput: ``--records`` msgpack-sized values to a 4-partition topic with the
  pipeline's producer settings (kafka-python, idempotent, acks=all, ``kafka.linger_ms``);
- consume throughput: the same records read back from the beginning (no group);
- p50/p99 of one synchronous ``acks=all`` send (``send().get()``), the latency a caller that waits
  for each record sees.

It prints each number and the durable/memory ratio measured in the same run; nothing asserts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _measure(bootstrap: str, records: int, sync_sends: int, value_size: int, tag: str) -> dict:
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.admin import NewTopic

    from pipeline.bus.settings import producer_kwargs
    from pipeline.config import load_config

    config = load_config(None, kafka={"bootstrap_servers": bootstrap})
    topic = f"bench-{tag}-{os.getpid()}-{time.monotonic_ns()}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, 4, 1)])
    admin.close()
    p = KafkaProducer(**producer_kwargs(config))
    value = os.urandom(value_size)
    p.send(topic, key=b"warm", value=value).get(30)
    t0 = time.perf_counter()
    for i in range(records):
        p.send(topic, key=f"s{i % 97}".encode(), value=value)
    p.flush()
    produce_s = time.perf_counter() - t0
    lat = []
    for i in range(sync_sends):
        t = time.perf_counter()
        p.send(topic, key=f"s{i % 97}".encode(), value=value).get(30)
        lat.append(time.perf_counter() - t)
    p.close()
    lat.sort()
    total = records + sync_sends + 1
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, max_partition_fetch_bytes=8 << 20)
    tps = [TopicPartition(topic, i) for i in range(4)]
    c.assign(tps)
    c.seek_to_beginning(*tps)
    got = 0
    t0 = time.perf_counter()
    deadline = t0 + 120
    while got < total and time.perf_counter() < deadline:
        for recs in c.poll(timeout_ms=500).values():
            got += len(recs)
    consume_s = time.perf_counter() - t0
    c.close()
    return {"produce": records / produce_s, "consume": got / consume_s, "read": got, "total": total,
            "p50": 1000 * lat[len(lat) // 2], "p99": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=5000)
    ap.add_argument("--sync-sends", type=int, default=200)
    ap.add_argument("--value-bytes", type=int, default=1900, help="record size (a turn event is ~2-6 KB)")
    args = ap.parse_args(argv)

    from pipeline.broker import EmbeddedBroker

    tmp = Path(tempfile.mkdtemp(prefix="bench-broker-"))
    runs: dict[str, list[dict]] = {"memory": [], "durable": []}
    starts: dict[str, list[float]] = {"memory": [], "durable": [], "durable restart": []}
    store_s: list[float] = []
    try:
        for kind in ("memory", "durable", "durable", "memory"):
            data = tmp / "data" if kind == "durable" else None
            b = EmbeddedBroker(data_dir=data, log_file=str(tmp / "broker.log"))
            b.start()
            restart = kind == "durable" and bool(runs["durable"])
            starts["durable restart" if restart else kind].append(b.started_in_s)
            if b.store is not None:
                store_s.append(b.store.started_in_s)
            try:
                runs[kind].append(_measure(b.bootstrap, args.records, args.sync_sends, args.value_bytes, kind))
            finally:
                b.stop()
        durable_dir_mb = sum(f.stat().st_size for f in (tmp / "data").rglob("*") if f.is_file()) / 1e6
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def mean(kind: str, key: str) -> float:
        xs = [r[key] for r in runs[kind]]
        return sum(xs) / len(xs)

    print(f"{os.cpu_count()} cores; {args.records} records of {args.value_bytes} B, {args.sync_sends} synchronous "
          f"sends; each kind measured twice (memory, durable, durable, memory)\n")
    print(f"{'':24} {'memory':>10} {'durable':>10} {'durable/memory':>15}")
    rows = [("produce (records/s)", "produce", "{:10.0f}"), ("consume (records/s)", "consume", "{:10.0f}"),
            ("acks=all send p50 (ms)", "p50", "{:10.2f}"), ("acks=all send p99 (ms)", "p99", "{:10.2f}")]
    for label, key, fmt in rows:
        m, d = mean("memory", key), mean("durable", key)
        print(f"{label:24} {fmt.format(m)} {fmt.format(d)} {d / m:15.2f}")
    ms, ds = sum(starts["memory"]) / 2, starts["durable"][0]
    print(f"{'start (s)':24} {ms:10.2f} {ds:10.2f} {ds / ms:15.1f}")
    print(f"{'restart, same data (s)':24} {'':>10} {starts['durable restart'][0]:10.2f}")
    print(f"\ndurable start: object store {store_s[0]:.1f} s + Tansu {ds - store_s[0]:.1f} s; "
          f"restart: object store {store_s[1]:.1f} s; data dir after both runs: {durable_dir_mb:.0f} MB")
    lost = [r for r in runs["durable"] + runs["memory"] if r["read"] < r["total"]]
    print(f"read back: {'every record' if not lost else f'MISSING records in {len(lost)} run(s)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
