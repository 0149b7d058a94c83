"""Broker benchmark: Apache Kafka beside the embedded Tansu broker (memory and durable), same run.

    .venv/bin/python bench/broker.py                  # 5,000 records of ~1.9 KB, 200 synchronous sends
    .venv/bin/python bench/broker.py --records 20000 --sync-sends 500 --kinds kafka,"tansu durable"

One run starts each broker of :data:`KINDS` — Tansu with memory storage, Tansu durable (SeaweedFS
object store + Tansu's ``s3://`` engine), Apache Kafka (:class:`pipeline.kafka_broker.KafkaBroker`,
page cache), and Apache Kafka flushing every message (``log.flush.interval.messages=1``) — each
in its own temporary data dir, twice, in mirrored order (drift from other load on the machine
cancels out), and measures:

- start time (the first run), and restart time on the same data (the second run);
- resident memory of the broker's processes after the run;
- produce throughput: ``--records`` msgpack-sized values to a 4-partition topic with the
  pipeline's producer settings (kafka-python, idempotent, acks=all, ``kafka.linger_ms``);
- consume throughput: the same records read back from the beginning (no group);
- p50/p99 of one synchronous ``acks=all`` send (``send().get()``), the latency a caller that waits
  for each record sees.

It prints each number side by side; nothing asserts.
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


def _rss_mb(pids: list[int]) -> float:
    """Resident memory (MB) of ``pids`` and their children, read from /proc."""
    seen, todo, kb = set(), list(pids), 0
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    kb += int(line.split()[1])
            todo += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except (OSError, ValueError):
            pass
    return kb / 1024


#: label -> (kind, durable, Kafka flushing every message)
KINDS = {"tansu memory": ("tansu", False, False), "tansu durable": ("tansu", True, False),
         "kafka": ("kafka", True, False), "kafka fsync": ("kafka", True, True)}


def _broker(label: str, data: Path, log_file: str):
    from pipeline.broker import EmbeddedBroker

    kind, durable, fsync = KINDS[label]
    if kind == "kafka":
        from pipeline.kafka_broker import KafkaBroker

        return KafkaBroker(data_dir=data, log_file=log_file, flush_every_message=fsync)
    return EmbeddedBroker(data_dir=data if durable else None, log_file=log_file)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=5000)
    ap.add_argument("--sync-sends", type=int, default=200)
    ap.add_argument("--value-bytes", type=int, default=1900, help="record size (a turn event is ~2-6 KB)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of: {', '.join(KINDS)}")
    args = ap.parse_args(argv)
    from pipeline.kafka_broker import kafka_installed

    labels = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kafka_installed():
        print("Apache Kafka is not installed (bash deploy/install-kafka.sh): measuring Tansu only", file=sys.stderr)
        labels = [k for k in labels if KINDS[k][0] != "kafka"]
    tmp = Path(tempfile.mkdtemp(prefix="bench-broker-"))
    runs: dict[str, list[dict]] = {k: [] for k in labels}
    try:
        for label in labels + labels[::-1]:  # each kind twice, in mirrored order: drift cancels out
            b = _broker(label, tmp / label.replace(" ", "-"), str(tmp / "broker.log"))
            b.start()
            try:
                r = _measure(b.bootstrap, args.records, args.sync_sends, args.value_bytes, label.replace(" ", "-"))
                pids = [b.proc.pid] + ([b.store.proc.pid] if getattr(b, "store", None) is not None else [])
                runs[label].append({**r, "start": b.started_in_s, "rss": _rss_mb(pids)})
            finally:
                b.stop()
        disk = {k: sum(f.stat().st_size for f in (tmp / k.replace(" ", "-")).rglob("*") if f.is_file()) / 1e6
                for k in labels}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _report(args, labels, runs, disk)
    return 0


def _report(args, labels: list[str], runs: dict[str, list[dict]], disk: dict[str, float]) -> None:
    def mean(label: str, key: str) -> float:
        return sum(r[key] for r in runs[label]) / len(runs[label])

    print(f"{os.cpu_count()} cores; {args.records} records of {args.value_bytes} B, {args.sync_sends} synchronous "
          f"sends; each broker measured twice, in mirrored order\n")
    print(f"{'':26}" + "".join(f"{k:>15}" for k in labels))
    rows = [("produce (records/s)", "produce", "{:15.0f}"), ("consume (records/s)", "consume", "{:15.0f}"),
            ("acks=all send p50 (ms)", "p50", "{:15.2f}"), ("acks=all send p99 (ms)", "p99", "{:15.2f}"),
            ("memory after run (MB RSS)", "rss", "{:15.0f}")]
    for name, key, fmt in rows:
        print(f"{name:26}" + "".join(fmt.format(mean(k, key)) for k in labels))
    print(f"{'start (s)':26}" + "".join(f"{runs[k][0]['start']:15.2f}" for k in labels))
    print(f"{'restart, same data (s)':26}" + "".join(
        f"{runs[k][1]['start']:15.2f}" if KINDS[k][1] else f"{'(empty)':>15}" for k in labels))
    print(f"{'data after both runs (MB)':26}" + "".join(f"{disk[k]:15.0f}" for k in labels))
    lost = [k for k in labels for r in runs[k] if r["read"] < r["total"]]
    print(f"read back: {'every record' if not lost else 'MISSING records: ' + ', '.join(lost)}")


if __name__ == "__main__":
    sys.exit(main())
