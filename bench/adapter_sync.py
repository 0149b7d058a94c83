"""Adapter sync vs full-weight sync: event -> every engine serving it, bytes on control and on disk.

    .venv/bin/python bench/adapter_sync.py                       # SmolLM2-135M, 2 engines
    .venv/bin/python bench/adapter_sync.py --model tiny-random --repeats 2

One run: the session broker (``--broker``: Apache Kafka when installed, as ``pipeline up``
chooses; Tansu answers some fetches only after ~50 ms, which is most of an adapter sync),
``--engines`` real CPU engines (each its own process, LoRA on,
one torch thread each: two engines in one process would load new weights with transformers in
two threads at once, which it does not support) and one real syncer per engine (``pipeline
syncer``, its own process), all as the stack runs them. This script plays the trainer's side of the protocol of
docs/tenants.md: for an **adapter update** it exports a fresh random LoRA adapter (rank
``--rank``, all seven projections, :func:`pipeline.testing.lora.export_tenant_adapter`) and
publishes ``pause`` (tenant, A), ``weights`` (tenant, A, folder), then ``resume`` once every
syncer answered; for a **full-weight update** it exports the whole model as the trainer does
(:func:`pipeline.testing.trainer.shifted_export`: ``model.safetensors`` + its checksum, fp32)
and publishes ``pause``, ``weights`` (version), ``resume``. The folder is written before the
clock starts (the trainer writes it before the record is sent).

Measured per update: the time from sending ``weights`` (after the broker acknowledged it) to
reading the last engine's ``applied`` for it on ``control`` (each syncer verifies the folder's
checksum and content id, then ``/load_lora_adapter`` or ``/update_weights_from_disk``); bytes on
control: the encoded records of one sync (pause, weights, one ``applied`` per engine, resume);
bytes on disk: the exported folder. Updates alternate (adapter, full, adapter, ...) ``--repeats``
times after one warm-up round of each (an engine's first load of either kind pays one-time costs:
imports, first allocations; printed, not counted); medians are printed with the ratio full / adapter. Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline import events  # noqa: E402
from pipeline.procutil import die_with_parent, stop_group  # noqa: E402

TENANT = "bench-tenant"


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


class ControlWatch:
    """The ``control`` topic read as it grows (one reader for the run): waits for answers."""

    def __init__(self, cfg) -> None:
        from pipeline.bus import TopicReader

        self.reader = TopicReader(cfg, cfg.topics.name("control"), "beginning", partitions=[0], name="bench-watch")
        self.seen: list = []

    def until(self, done, timeout_s: float = 600.0) -> float:
        """Poll until ``done(new events)`` is true; returns the monotonic time it became true."""
        got: list = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for rec in self.reader.poll(timeout_ms=20):
                if getattr(rec, "event", None) is not None:
                    got.append(rec.event)
            if done(got):
                t = time.monotonic()
                self.seen.extend(got)
                return t
        raise TimeoutError(f"no answer within {timeout_s:.0f} s: {[(e.action, e.engine_id) for e in got]}")

    def close(self) -> None:
        self.reader.close()


def _answers_of(n: int, match):
    """A ``done`` for :meth:`ControlWatch.until`: ``n`` engines answered the update ``match`` names."""
    def done(evs) -> bool:
        failed = [e for e in evs if e.action == "failed" and match(e)]
        if failed:
            raise RuntimeError(f"{failed[0].engine_id} failed: {failed[0].message}")
        return len({e.engine_id for e in evs if e.action == "applied" and match(e)}) >= n
    return done


def _sync(producer, watch: ControlWatch, cfg, n: int, pause, weights, resume_of, match) -> tuple[float, int]:
    """One sync as the trainer runs it; returns (seconds weights -> every applied, bytes on control)."""
    topic = cfg.topics.name("control")
    producer.send(topic, pause, key=pause.run_id).get(timeout=30)
    t0 = time.monotonic()
    producer.send(topic, weights, key=weights.run_id).get(timeout=30)
    t1 = watch.until(_answers_of(n, match))
    resume = resume_of()
    producer.send(topic, resume, key=resume.run_id).get(timeout=30)
    applied = [e for e in watch.seen if e.action == "applied" and match(e)][-n:]
    size = sum(len(events.encode(e)) for e in (pause, weights, resume, *applied))
    return t1 - t0, size


def _adapter_update(k: int, args, export: Path, producer, watch, cfg) -> tuple[float, int, int]:
    from pipeline.testing.lora import adapter_order, export_tenant_adapter

    folder, a = export_tenant_adapter(export, TENANT, args.model, r=args.rank, alpha=2.0 * args.rank, seed=k)
    run = cfg.trainer.run_id
    secs, size = _sync(producer, watch, cfg, args.engines,
                       adapter_order("pause", TENANT, a, epoch=k, run_id=run),
                       adapter_order("weights", TENANT, a, folder, epoch=k, run_id=run),
                       lambda: adapter_order("resume", TENANT, a, epoch=k, run_id=run),
                       lambda e: e.adapter == a)
    return secs, size, _folder_bytes(folder)


def _full_update(k: int, args, export: Path, producer, watch, cfg) -> tuple[float, int, int]:
    from pipeline.testing.trainer import shifted_export

    folder, sha = shifted_export(export, k, shift=0.001 * k, model=args.model)
    run = cfg.trainer.run_id

    def order(action: str, **kw) -> events.Control:
        return events.Control(action=action, epoch=k, policy_version=k, run_id=run, created_at=events.now_ms(), **kw)

    secs, size = _sync(producer, watch, cfg, args.engines, order("pause"),
                       order("weights", location=str(folder), sha256=sha), lambda: order("resume"),
                       lambda e: e.full_weights and e.policy_version == k)
    return secs, size, _folder_bytes(folder)


@contextlib.contextmanager
def _syncer_process(cfg, i: int, url: str):
    """``pipeline syncer`` for engine ``i`` as its own process (as ``pipeline up`` runs it), returned
    once it reconciled the engine and joined its consumer group (its "syncer engine-i ->" log line)."""
    cmd = [sys.executable, "-m", "pipeline", "syncer", "--bootstrap", cfg.kafka.bootstrap_servers,
           "--engine", url, "--engine-id", f"engine-{i}", "--group-id", f"bench-{i}",
           "--set", f"topics.prefix={cfg.topics.prefix}", "--set", f"trainer.run_id={cfg.trainer.run_id}",
           "--set", "syncer.check_interval_s=60"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            cwd=Path(__file__).resolve().parents[1], start_new_session=True,
                            preexec_fn=die_with_parent)
    joined = threading.Event()
    tail: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            tail[:] = (tail + [line])[-20:]
            if f"syncer engine-{i} ->" in line:
                joined.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while not joined.wait(0.1):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"syncer engine-{i} never joined its group:\n{''.join(tail)}")
        yield proc
    finally:
        stop_group(proc, 15)


@contextlib.contextmanager
def _stack(args, tmp: Path):
    """``(cfg, producer, watch)`` with the broker, ``--engines`` engines and their syncers running."""
    from pipeline.broker import make_broker
    from pipeline.bus import EventProducer
    from pipeline.bus.admin import apply_topics
    from pipeline.config import load_config
    from pipeline.engine.lora import LoraSettings
    from pipeline.testing.engine import running_engine
    from pipeline.topics import load_topics

    with make_broker(args.broker) as broker, contextlib.ExitStack() as stack:
        cfg = load_config(None, kafka={"bootstrap_servers": broker.bootstrap}, topics={"prefix": "bench-sync-"},
                          trainer=dict(model=args.model, export_dir=str(tmp / "weights"), run_id="bench-sync"))
        apply_topics(cfg, load_topics(cfg.topics.file))
        print(f"broker: {'Apache Kafka' if broker.kind == 'kafka' else 'Tansu'} at {broker.bootstrap}", flush=True)
        lora = LoraSettings(enabled=True, max_rank=max(16, args.rank))
        urls = [stack.enter_context(running_engine(args.model, subprocess=True, threads=1, lora=lora))
                for _ in range(args.engines)]
        for i, url in enumerate(urls):
            stack.enter_context(_syncer_process(cfg, i, url))
        producer = EventProducer(cfg, name="bench-trainer")
        watch = ControlWatch(cfg)
        try:
            yield cfg, producer, watch
        finally:
            watch.close()
            producer.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default) or tiny-random")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--broker", default="auto", choices=("auto", "kafka", "tansu"),
                   help="auto (default): Apache Kafka when installed (deploy/install.sh does), else Tansu")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    rows: dict[str, list[tuple[float, int, int]]] = {"adapter": [], "full": []}
    with tempfile.TemporaryDirectory(prefix="bench-adapter-sync-") as tmp:
        export = Path(tmp) / "weights"
        with _stack(args, Path(tmp)) as (cfg, producer, watch):
            for k in range(1, args.repeats + 2):  # round 1 warms up (first load per engine), not counted
                a = _adapter_update(k, args, export, producer, watch, cfg)
                f = _full_update(k, args, export, producer, watch, cfg)
                if k > 1:
                    rows["adapter"].append(a)
                    rows["full"].append(f)
                print(f"round {k}{' (warm-up, not counted)' if k == 1 else ''}: adapter {a[0]:.3f} s, "
                      f"full {f[0]:.3f} s, {f[0] / a[0]:.1f}x", flush=True)
    med = {kind: [statistics.median(r[i] for r in rs) for i in range(3)] for kind, rs in rows.items()}
    print(f"\nsync of one update to {args.engines} engines ({args.model}; adapter rank {args.rank} on all seven "
          f"projections; median of {args.repeats}; 'weights' sent -> every engine's 'applied' read on control)")
    print(f"{'update':<10}{'seconds':>10}{'control bytes':>16}{'disk bytes':>16}")
    for kind in ("adapter", "full"):
        s, c, d = med[kind]
        print(f"{kind:<10}{s:>10.3f}{int(c):>16,}{int(d):>16,}")
    a, f = med["adapter"], med["full"]
    print(f"{'full/adapter':<10}{f[0] / a[0]:>9.1f}x{f[1] / a[1]:>15.2f}x{f[2] / a[2]:>15.1f}x")
    per_round = sorted(fr[0] / ar[0] for ar, fr in zip(rows["adapter"], rows["full"]))
    print(f"per-round ratio (full / adapter of the same round): min {per_round[0]:.1f}x, "
          f"median {statistics.median(per_round):.1f}x, max {per_round[-1]:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
