"""``pipeline tail``: print a topic's events decoded, without joining or committing to any group.

Reads in assign mode (:class:`pipeline.bus.TopicReader`): no consumer group is created, no
offset is committed, nothing is written, so a stage's position is never moved (unlike
``pipeline archive``, which commits its group's offsets). One JSON object per line::

    {"topic": "turns", "partition": 2, "offset": 17, "timestamp": 1764500000000, "key": "s-1",
     "event": {"type": "turn", "session_id": "s-1", "turn_index": 0, ...}}

By default conversation text is shown as lengths (``chars``) and token/log-prob arrays as their
length; ``--text`` and ``--arrays`` print them. A record that does not decode is printed with
its ``error`` instead of ``event``. Examples::

    pipeline tail turns --session s-42            # that session's turns, next states, end
    pipeline tail samples --from=-10m --follow    # the last ten minutes (a value starting with - needs the =), then live
    pipeline tail control --from 120              # from offset 120 of every partition
    pipeline tail turns.dlq                       # dead letters with their errors
    pipeline tail versions                        # live metrics per version, one table per scope

``pipeline tail versions`` is not a topic: it folds ``turns``, ``samples``, ``control`` and
``metrics`` into live metrics per version (:mod:`pipeline.dashboard.versions`).
"""

from __future__ import annotations

import json
import signal
import sys
import threading

HELP = "Print a topic's events decoded (follow, from an offset or a time, by session); no consumer group."


def add_arguments(parser) -> None:
    parser.add_argument("topic", help="logical topic: turns, samples, control, metrics or <topic>.dlq "
                                      "(topics.prefix is prepended); or 'versions': live metrics per version")
    parser.add_argument("--from", dest="start", default=None, metavar="WHERE",
                        help="start: an offset for every partition (120), per partition (0:120,1:88), a time "
                             "(2026-11-01T10:00, ms:<epoch ms>, -2h, now); default: the beginning")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing new events until Ctrl-C")
    parser.add_argument("--session", help="only events of this session id (the record key or session_id) and of its "
                        "sub-sessions ID~<hex>, the new conversations of a reused id")
    parser.add_argument("--partition", type=int, action="append", help="only this partition (repeatable)")
    parser.add_argument("--type", dest="types", action="append",
                        help="only this event type: turn, next_state, session_end, sample, control, ... (repeatable)")
    parser.add_argument("-n", "--max", type=int, default=None, help="stop after printing this many events")
    parser.add_argument("--text", action="store_true", help="print conversation text (default: lengths only)")
    parser.add_argument("--arrays", action="store_true", help="print token ids and log-probs (default: lengths)")
    parser.add_argument("--pretty", action="store_true", help="indent the JSON")
    parser.add_argument("--json", action="store_true", help="versions: print the view as JSON, not as tables")


def _start(text: str | None):
    from pipeline.bus.bounds import parse_bound, reader_start

    if text is None:
        return "beginning"
    if text.strip() == "now":
        return "end"
    return reader_start(parse_bound(text))  # BoundError names the accepted forms


def line(rec, text: bool = False, arrays: bool = False) -> dict:
    """The printed object of one record (see the module docstring)."""
    from pipeline.bus import Undecodable
    from pipeline.dashboard.views import event_view

    out = {"topic": rec.topic, "partition": rec.partition, "offset": rec.offset, "timestamp": rec.timestamp_ms,
           "key": rec.key}
    if isinstance(rec, Undecodable):
        out["error"] = rec.error
        out["bytes"] = rec.size
    else:
        out["event"] = event_view(rec.event, text=text, arrays=arrays)
    return out


def matches(rec, session: str | None, types: list[str] | None) -> bool:
    """Whether ``rec`` passes the ``--session`` and ``--type`` filters."""
    from pipeline.bus import Undecodable

    if session is not None:  # the session and its sub-sessions (`S~<hex>`: a reused id's new conversation)
        sid = None if isinstance(rec, Undecodable) else getattr(rec.event, "session_id", None)
        sub = session[:239] + "~"
        if not any(v == session or (isinstance(v, str) and v.startswith(sub)) for v in (rec.key, sid)):
            return False
    if types:
        return (not isinstance(rec, Undecodable)) and rec.event.TYPE in types
    return True


def run(args, config) -> int:
    if args.topic == "versions":
        from pipeline.dashboard import versions

        return versions.run(args, config)
    from pipeline.bus import TopicReader
    from pipeline.bus.bounds import BoundError

    try:
        start = _start(args.start)
    except BoundError as e:
        print(f"pipeline tail: --from: {e}", file=sys.stderr)
        return 2
    topic = config.topics.name(args.topic)
    stop = threading.Event()
    if args.follow:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    printed = 0
    with TopicReader(config, [topic], start=start, partitions=args.partition) as reader:
        if not reader.assignment():
            print(f"pipeline tail: topic {topic!r} does not exist on {config.kafka.bootstrap_servers}", file=sys.stderr)
            return 1
        if args.follow:
            print(f"pipeline tail: following {topic} ({len(reader.assignment())} partitions); Ctrl-C stops",
                  file=sys.stderr, flush=True)
        for rec in reader.read(follow=args.follow, stop=stop):
            if not matches(rec, args.session, args.types):
                continue
            print(json.dumps(line(rec, args.text, args.arrays), ensure_ascii=False, default=str,
                             indent=2 if args.pretty else None), flush=True)
            printed += 1
            if args.max is not None and printed >= args.max:
                break
    return 0
