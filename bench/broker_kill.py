"""Kill test of a durable broker: does a ``kill -9`` lose a record it acknowledged with ``acks=all``?

    .venv/bin/python bench/broker_kill.py --kind tansu --rounds 20
    .venv/bin/python bench/broker_kill.py --kind kafka --rounds 20 --threads 4

Each round: start the durable broker on one data dir (the same dir every round: the log grows),
run ``--threads`` producers, each sending one record at a time with ``acks=all`` and waiting for
its acknowledgement (``send().get()``, no retries: a record counts as acknowledged only when the
broker said so), ``kill -9`` every broker process (Tansu and its object store, or Kafka's JVM)
at a random moment (seeded) between ``--min-s`` and ``--max-s`` after the first
acknowledgement, restart the broker on the same data dir, read the topic back, and count
acknowledged records that are missing. Records are unique (``round:thread:i``). Prints one
line per round and a total; exits 1 when any acknowledged record went missing.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOPIC = "kill-test"


def _produce(bootstrap: str, tag: str, acked: list, stop: threading.Event) -> None:
    from kafka import KafkaProducer

    try:
        p = KafkaProducer(bootstrap_servers=bootstrap, acks="all", retries=0, max_block_ms=3000,
                          request_timeout_ms=5000, linger_ms=0)
    except Exception:
        return
    i = 0
    while not stop.is_set():
        value = f"{tag}:{i}".encode()
        try:
            p.send(TOPIC, key=tag.encode(), value=value).get(timeout=10)
        except Exception:
            break  # the broker is gone: nothing after this was acknowledged
        acked.append(value)
        i += 1
    try:
        p.close(timeout=0)
    except Exception:  # records it could not deliver to a dead broker: none was acknowledged
        pass


def _read_all(bootstrap: str, idle_s: float = 3.0) -> set[bytes]:
    """Every value of the topic, read from the beginning until nothing came for ``idle_s``
    (Tansu 0.6.0's ``end_offsets`` cannot be trusted, so the end is not asked for)."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, max_partition_fetch_bytes=8 << 20)
    tps = [TopicPartition(TOPIC, p) for p in sorted(c.partitions_for_topic(TOPIC) or [])]
    c.assign(tps)
    c.seek_to_beginning(*tps)
    got: set[bytes] = set()
    last, deadline = time.monotonic(), time.monotonic() + 120
    while time.monotonic() - last < idle_s and time.monotonic() < deadline:
        for recs in c.poll(timeout_ms=500).values():
            got.update(r.value for r in recs)
            last = time.monotonic()
    c.close()
    return got


def _broker(kind: str, data: Path, port: int | None, log_file: str):
    from pipeline.broker import make_broker

    return make_broker(kind, data_dir=data, port=port, log_file=log_file, stop_grace_s=1.0)


def _kill9(b) -> None:
    procs = [b.proc] + ([b.store.proc] if getattr(b, "store", None) is not None else [])
    for p in procs:
        if p is not None and p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        if p is not None:
            p.wait(30)
    b.stop()  # releases the data dir's lock; nothing is left to stop


def _round(args, n: int, data: Path, port: int | None, rng: random.Random, log_file: str) -> tuple[int, int, int]:
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    b = _broker(args.kind, data, port, log_file).start()
    port = b.port
    admin = KafkaAdminClient(bootstrap_servers=b.bootstrap)
    try:
        admin.create_topics([NewTopic(TOPIC, 4, 1)])
    except TopicAlreadyExistsError:
        pass
    admin.close()
    acked: list[bytes] = []
    stop = threading.Event()
    threads = [threading.Thread(target=_produce, args=(b.bootstrap, f"{n}:{t}", acked, stop), daemon=True)
               for t in range(args.threads)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not acked and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(rng.uniform(args.min_s, args.max_s))
    _kill9(b)
    stop.set()
    for t in threads:
        t.join(20)
    b2 = _broker(args.kind, data, port, log_file).start()
    try:
        got = _read_all(b2.bootstrap)
    finally:
        b2.stop()
    missing = sum(1 for v in acked if v not in got)
    return port, len(acked), missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=("tansu", "kafka"), default="tansu")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--min-s", type=float, default=0.2, help="earliest kill after the first acknowledgement (s)")
    ap.add_argument("--max-s", type=float, default=3.0, help="latest kill (s)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="broker-kill-"))
    port, total_acked, total_missing = None, 0, 0
    try:
        for n in range(args.rounds):
            port, acked, missing = _round(args, n, tmp / "data", port, rng, str(tmp / "broker.log"))
            total_acked += acked
            total_missing += missing
            print(f"round {n + 1}/{args.rounds}: {acked} acknowledged, {missing} missing after kill -9 and restart",
                  flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.kind}: {args.rounds} rounds, {args.threads} threads: {total_acked} acknowledged, "
          f"{total_missing} missing")
    return 1 if total_missing else 0


if __name__ == "__main__":
    sys.exit(main())
