"""``python -m pipeline replay``: re-feed historical turns to a topic (or a consumer group).

Sources:
- ``--archive DIR``: files written by ``pipeline archive`` (works after the broker is gone);
- otherwise the ``turns`` topic itself (``--source-topic``/``--source-bootstrap``), read by a
  :class:`pipeline.bus.TopicReader` (manual assignment, no group, nothing committed). Records of
  it that are not valid events of the topic go to its dead-letter topic (``<source>.dlq``) and
  are counted in ``bad``; they are not copied.

Range: ``--from`` (inclusive) and ``--to`` (exclusive), each a time or offsets:
``2024-05-01``, ``2024-05-01T10:00:00`` (UTC unless an offset such as ``+02:00`` is given),
``ms:1714557600000``, ``-2h`` / ``-30m`` / ``-1d`` (relative to now), or offsets: ``1200`` (the
same offset on every partition) or ``0:120,1:88`` (per partition). Times are compared with each
record's timestamp; on the topic the start is found with ``offsets_for_times`` (on Tansu that
call is per batch and answers 0 past the end, so records are filtered by timestamp as well).

Target: ``--to-topic`` (physical name; default ``turns`` under the configured prefix) on the
configured broker. Keys (session ids) are kept, so each session lands in one partition in its
original order (one source partition is read in offset order; the idempotent producer keeps
per-partition order). Turns sampled live are marked ``source="replay"`` (imported ones stay
``import``); other events are re-sent unchanged. Then start the judge on that topic (or with a
new group id) to retrain with other settings. SIGTERM/SIGINT stop the copy cleanly: what was
sent is flushed, the summary says ``"stopped": true`` and the exit status is 1.

``--reset-group G`` (topic source only) copies nothing: it commits the ``--from`` positions of
the source topic for consumer group ``G``, so a stage started with that group re-reads history
from there.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from typing import Iterable, Iterator

import orjson

from pipeline import events
from pipeline.bus.bounds import Bound, BoundError, in_range, parse_bound
from pipeline.history.store import ArchivedRecord, count_lines, read_archive, read_manifest

log = logging.getLogger(__name__)
HELP = "Re-feed archived or historical turns (time or offset range) into a topic or consumer group."

def mark_replayed(ev: events.Event) -> events.Event:
    """A live turn re-fed from history becomes ``source="replay"``; everything else is unchanged."""
    if isinstance(ev, events.Turn) and ev.source == "proxy":
        return dataclasses.replace(ev, source="replay")
    return ev


# ---- sources ----------------------------------------------------------------------------------
def archive_records(directory: str, start: Bound | None, end: Bound | None, stats: dict) -> Iterator[ArchivedRecord]:
    """Records of an archive directory in range (per partition in offset order)."""
    for rec in read_archive(directory, stats=stats):
        if in_range(rec, start, end):
            yield rec
        else:
            stats["out_of_range"] = stats.get("out_of_range", 0) + 1


DLQ_GIVE_UP_S = 30.0  # replay passes over a bad record whose dead letter cannot be written


def _start_positions(reader, start: Bound | None) -> dict[int, int | None]:
    """Where to begin reading each partition (see the Tansu note in the module docstring)."""
    begin = reader.beginning_offsets()
    pos: dict[int, int | None] = dict(begin)
    if start is None:
        return pos
    if start.time_ms is not None:
        found = reader.offsets_for_times(start.time_ms)
        for p in reader.partitions:
            oat = found.get(p)
            if oat is None:  # Apache Kafka: no record at or after the time
                pos[p] = None
            elif oat.timestamp >= 0:
                pos[p] = max(begin[p], oat.offset)
            # timestamp -1 (Tansu past the end / unknown): scan from the beginning, filter by time
    for p in reader.partitions:
        o = start.offset_for(p)
        if o is not None and pos[p] is not None:
            pos[p] = max(pos[p], o)
    return pos


def _assigned_reader(config, topic: str, group: str | None, start: Bound | None,
                     stop: threading.Event | None = None):
    """A :class:`pipeline.bus.TopicReader` on every partition of ``topic``, with the start position
    of each (None: nothing at or after ``start``). Raises :class:`pipeline.bus.TopicMissing`."""
    from pipeline.bus import TopicReader

    reader = TopicReader(config, topic, name="replay", group_id=group, dlq=True, dlq_give_up_s=DLQ_GIVE_UP_S,
                         stop=stop, wait_s=5.0)
    try:
        return reader, _start_positions(reader, start)
    except BaseException:
        reader.close()
        raise


def topic_records(config, topic: str, start: Bound | None, end: Bound | None, stats: dict,
                  idle_timeout_s: float = 10.0, on_total=None,
                  stop: threading.Event | None = None) -> Iterator[ArchivedRecord]:
    """Records of ``topic`` in range, read with manual assignment up to the high-water marks seen
    at the start (records produced meanwhile are not chased). Records that are not valid events
    of the topic go to its DLQ and are counted in ``stats["bad"]``. ``on_total(n)`` gets the
    number of offsets to scan. Setting ``stop`` ends the reading (``stats["stopped"]``)."""
    reader, pos = _assigned_reader(config, topic, None, start, stop)
    try:
        active = set()
        for p in reader.partitions:
            if pos[p] is None or (end is not None and end.offset_for(p) is not None and pos[p] >= end.offset_for(p)):
                continue
            reader.seek(p, pos[p])
            active.add(p)
        if set(reader.partitions) - active:
            reader.pause(*(set(reader.partitions) - active))
        stop_at: dict[int, int] = {}
        total_reported = False
        last_data = time.monotonic()
        while active and not stats.get("stopped"):
            if reader.stopping:
                stats["stopped"] = True
                break
            for r in reader.poll_raw(timeout_ms=200):
                p = r.partition
                if reader.stopping:
                    stats["stopped"] = True
                    break
                if p not in active:
                    continue
                last_data = time.monotonic()
                if p in stop_at and r.offset >= stop_at[p]:
                    continue
                got = reader.decode(r)
                if got is None:  # dead-lettered
                    stats["bad"] = stats.get("bad", 0) + 1
                    continue
                rec = ArchivedRecord(r.topic, p, r.offset, r.timestamp, got.key, got.event)
                if in_range(rec, start, end):
                    yield rec
                else:
                    stats["out_of_range"] = stats.get("out_of_range", 0) + 1
            for p in list(active):
                if p not in stop_at:
                    hw = reader.highwater(p)
                    if hw is None:
                        continue
                    o = end.offset_for(p) if end is not None else None
                    stop_at[p] = hw if o is None else min(hw, o)
                if reader.position(p) >= stop_at[p]:
                    active.discard(p)
                    reader.pause(p)
            if not total_reported and on_total and all(p in stop_at for p in active):
                total_reported = True
                on_total(sum(max(0, stop_at[p] - (pos[p] or 0)) for p in stop_at))
            if active and time.monotonic() - last_data > idle_timeout_s:
                log.warning("replay: no data for %.0f s from %s; stopping early", idle_timeout_s, sorted(active))
                stats["stopped_idle"] = True
                break
    finally:
        reader.close()


# ---- sink -------------------------------------------------------------------------------------
def ensure_topic(config, name: str, like: str = "turns") -> bool:
    """Create topic ``name`` with the partitions/config of ``like`` in topics.yaml if missing.
    Returns True when created (False when it exists, or another client created it meanwhile).

    Raises:
        pipeline.topics.TopicsError: topics.yaml is unreadable, or the broker refused the creation.
        kafka.errors.KafkaError: the broker could not be reached.
    """
    from pipeline.bus.admin import create_topic_if_missing
    from pipeline.topics import load_topics

    spec = next(s for s in load_topics(config.topics.file) if s.name == like)
    return create_topic_if_missing(config, name, spec.partitions, spec.replication_factor, spec.config)


def replay(records: Iterable[ArchivedRecord], producer, topic: str, *, mark: bool = True, bar=None) -> dict:
    """Send ``records`` to ``topic`` keyed by their key (else the session id), in order.

    Returns ``{"sent", "turns", "sessions"}``. Raises what :meth:`EventProducer.send` raises.
    """
    sent = turns = 0
    sessions = set()
    for rec in records:
        ev = mark_replayed(rec.event) if mark else rec.event
        sid = getattr(ev, "session_id", None)
        fallback = sid if sid is None or getattr(ev, "tenant", None) is None else events.session_key(ev.tenant, sid)
        producer.send(topic, ev, key=rec.key if rec.key is not None else fallback)
        sent += 1
        turns += isinstance(ev, events.Turn)
        if sid is not None:
            sessions.add(sid)
        if bar is not None:
            bar.update(1)
    return {"sent": sent, "turns": turns, "sessions": len(sessions)}


def reset_group(config, group: str, topic: str, start: Bound | None) -> dict[int, int]:
    """Commit the start positions of ``topic`` for ``group`` (no copy). Returns partition -> offset.
    The group should have no running members (their commits would overwrite these)."""
    reader, pos = _assigned_reader(config, topic, group, start)
    try:
        offsets = {}
        for p in reader.partitions:
            if pos[p] is None:  # nothing at or after the time: start at the end
                reader.seek_to_end(p)
                pos[p] = reader.position(p)
            offsets[p] = pos[p]
        reader.commit(offsets)
        return offsets
    finally:
        reader.close()


# ---- command ----------------------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--archive", metavar="DIR", help="read this archive directory (default: the source topic)")
    parser.add_argument("--from", dest="from_", metavar="TIME|OFFSETS", help="start, inclusive (default: the beginning)")
    parser.add_argument("--to", metavar="TIME|OFFSETS", help="end, exclusive (default: everything present now)")
    parser.add_argument("--to-topic", help="target topic, physical name (default: turns with the configured prefix)")
    parser.add_argument("--source-topic", help="source topic, physical name (default: turns with the configured prefix)")
    parser.add_argument("--source-bootstrap", metavar="HOST:PORT", help="broker of the source topic (default: --bootstrap)")
    parser.add_argument("--reset-group", metavar="GROUP",
                        help="instead of copying, commit the --from positions of the source topic for GROUP")
    parser.add_argument("--keep-source", action="store_true", help="do not mark live turns as source=replay")
    parser.add_argument("--no-create", action="store_true", help="do not create a missing target topic")
    parser.add_argument("--idle-timeout-s", type=float, default=10.0, help="topic source: give up after S idle seconds")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args, config) -> int:
    try:
        start = parse_bound(args.from_) if args.from_ else None
        end = parse_bound(args.to) if args.to else None
    except BoundError as e:
        print(f"pipeline replay: {e}", file=sys.stderr)
        return 2
    source_topic = args.source_topic or config.topics.name("turns")
    source_config = config.replace(kafka={"bootstrap_servers": args.source_bootstrap}) if args.source_bootstrap \
        else config
    if args.reset_group:
        if args.archive:
            print("pipeline replay: --reset-group works on the source topic, not on --archive", file=sys.stderr)
            return 2
        from pipeline.bus import TopicMissing

        try:
            got = reset_group(source_config, args.reset_group, source_topic, start)
        except TopicMissing as e:
            print(f"pipeline replay: {e}", file=sys.stderr)
            return 2
        print(orjson.dumps({"group": args.reset_group, "topic": source_topic,
                            "committed": {str(k): v for k, v in got.items()}}).decode(), flush=True)
        return 0
    target = args.to_topic or config.topics.name("turns")
    if not args.archive and target == source_topic and source_config.kafka.bootstrap_servers == \
            config.kafka.bootstrap_servers:
        print(f"pipeline replay: source and target are both {target!r} on the same broker; give --to-topic "
              "(or --archive DIR, or --reset-group GROUP)", file=sys.stderr)
        return 2
    if args.archive:
        try:
            manifest = read_manifest(args.archive)
        except Exception as e:
            print(f"pipeline replay: {e}", file=sys.stderr)
            return 2
        if manifest is None:
            print(f"pipeline replay: {args.archive} is not an archive (no ARCHIVE.json)", file=sys.stderr)
            return 2

    from pipeline.bus import EventProducer, TopicMissing, stop_on_signals

    stop = threading.Event()
    stop_on_signals(stop.set)
    if not args.no_create and ensure_topic(config, target):
        log.info("replay: created topic %s", target)
    stats: dict = {"bad": 0}
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(desc=f"replay -> {target}", unit="event")
    if args.archive:
        if bar is not None:
            bar.total = count_lines(args.archive)
        records = _until(archive_records(args.archive, start, end, stats), stop, stats)
    else:
        def on_total(n: int) -> None:
            if bar is not None:
                bar.total = n
                bar.refresh()

        records = topic_records(source_config, source_topic, start, end, stats, args.idle_timeout_s, on_total, stop)
    producer = EventProducer(config, name="replay")
    try:
        out = replay(records, producer, target, mark=not args.keep_source, bar=bar)
    except TopicMissing as e:
        print(f"pipeline replay: {e}", file=sys.stderr)
        return 2
    finally:
        producer.close()
        if bar is not None:
            bar.close()
    out.update(target=target, source=args.archive or source_topic, failed=producer.failed, **stats)
    print(orjson.dumps(out).decode(), flush=True)
    return 1 if producer.failed or stats.get("stopped") else 0


def _until(records: Iterable[ArchivedRecord], stop: threading.Event, stats: dict) -> Iterator[ArchivedRecord]:
    """``records`` until ``stop`` is set (then ``stats["stopped"]``)."""
    for rec in records:
        if stop.is_set():
            stats["stopped"] = True
            return
        yield rec
