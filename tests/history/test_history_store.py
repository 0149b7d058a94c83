"""Pure tests of the history formats: archive lines, event round trips, replay ranges."""

from __future__ import annotations

import pytest

from pipeline import events
from pipeline.bus.bounds import Bound, BoundError, in_range, parse_bound
from pipeline.history.replay import mark_replayed
from pipeline.history.store import (ArchivedRecord, day_of, event_from_dict, parse_line, partition_file,
                                    read_archive, to_line)


def _turn(**kw):
    base = dict(session_id="s1", turn_index=0, prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5, 6],
                response_logprobs=[-0.1, -2.3456789, -1e-7], messages=[{"role": "user", "content": "héllo"}],
                sampling={"temperature": 1.0}, response={"content": "hi", "tool_calls": None}, created_at=5)
    base.update(kw)
    return events.Turn(**base)


@pytest.mark.parametrize("ev", [
    _turn(),
    _turn(source="import", response_logprobs=[], tools=[{"type": "function", "function": {"name": "f"}}]),
    events.NextState(session_id="s1", messages=[{"role": "tool", "content": "{}"}], after_turn_index=0),
    events.SessionEnd(session_id="s1", reason="idle_timeout", created_at=9),
])
def test_archive_line_round_trips_to_identical_wire_bytes(ev):
    wire = events.decode(events.encode(ev))  # float32 precision, as a consumer sees it
    line = to_line("t-turns", 2, 41, 1_714_557_600_123, "s1", wire)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    rec = parse_line(line)
    assert (rec.topic, rec.partition, rec.offset, rec.timestamp_ms, rec.key) == ("t-turns", 2, 41, 1_714_557_600_123, "s1")
    assert rec.event == wire
    assert events.encode(rec.event) == events.encode(wire)


def test_event_from_dict_validates_like_decode():
    d = _turn().to_dict()
    with pytest.raises(events.UnknownEventType):
        event_from_dict({**d, "type": "nope"})
    with pytest.raises(events.UnsupportedVersion):
        event_from_dict({**d, "v": 2})
    with pytest.raises(events.MalformedEvent, match="unknown fields"):
        event_from_dict({**d, "extra": 1})
    with pytest.raises(events.MalformedEvent):
        event_from_dict({**d, "response_logprobs": [0.0]})  # 1 log-prob for 3 tokens
    with pytest.raises(events.MalformedEvent):
        event_from_dict({**d, "turn_index": "zero"})
    with pytest.raises(events.MalformedEvent):
        event_from_dict({k: v for k, v in d.items() if k != "session_id"})


def test_partition_file_layout_is_utc_day():
    assert day_of(0) == "1970-01-01"
    assert str(partition_file("/a", 1_714_521_599_999, 3)) == "/a/2024-04-30/partition-3.jsonl"
    assert str(partition_file("/a", 1_714_521_600_000, 3)) == "/a/2024-05-01/partition-3.jsonl"


def test_read_archive_keeps_partition_order_and_skips_bad_lines(tmp_path):
    ev = events.SessionEnd(session_id="x")
    day1, day2 = 1_714_500_000_000, 1_714_600_000_000
    for p, offs in ((0, [0, 1, 2]), (1, [0, 1])):
        for o in offs:
            ts = day1 if o < 2 else day2
            f = partition_file(tmp_path, ts + o * 10 + p, p)
            f.parent.mkdir(parents=True, exist_ok=True)
            with f.open("ab") as fh:
                fh.write(to_line("t", p, o, ts + o * 10 + p, f"k{p}", ev))
    f = partition_file(tmp_path, day1, 0)
    with f.open("ab") as fh:
        fh.write(to_line("t", 0, 1, day1, "k0", ev))  # a duplicate offset
        fh.write(b'{"not": "a record"}\n{"topic": "t", "partiti')  # junk + a half-written line
    stats = {}
    got = [(r.partition, r.offset) for r in read_archive(tmp_path, stats=stats)]
    assert sorted(got) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert [o for p, o in got if p == 0] == [0, 1, 2]
    assert stats == {"bad": 2, "duplicates": 1}
    assert [r.offset for r in read_archive(tmp_path, partitions=[1])] == [0, 1]


def test_parse_bound_forms():
    now = 1_714_557_600_000
    assert parse_bound("1200") == Bound(offset=1200)
    assert parse_bound("0:120,3:88") == Bound(offsets={0: 120, 3: 88})
    assert parse_bound("ms:1714557600123") == Bound(time_ms=1_714_557_600_123)
    assert parse_bound("2024-05-01") == Bound(time_ms=1_714_521_600_000)
    assert parse_bound("2024-05-01T10:00:00") == Bound(time_ms=1_714_557_600_000)
    assert parse_bound("2024-05-01T12:00:00+02:00") == Bound(time_ms=1_714_557_600_000)
    assert parse_bound("2024-05-01T10:00:00Z") == Bound(time_ms=1_714_557_600_000)
    assert parse_bound("-2h", now_ms=now) == Bound(time_ms=now - 7_200_000)
    assert parse_bound("now", now_ms=now) == Bound(time_ms=now)
    for bad in ("yesterday", "1:2:3", "-2w", ""):
        with pytest.raises(BoundError):
            parse_bound(bad)


def test_in_range_and_marking():
    def rec(p, o, ts):
        return ArchivedRecord("t", p, o, ts, "k", events.SessionEnd(session_id="k"))

    assert in_range(rec(0, 5, 100), None, None)
    assert in_range(rec(0, 5, 100), Bound(time_ms=100), Bound(time_ms=101))
    assert not in_range(rec(0, 5, 100), Bound(time_ms=101), None)
    assert not in_range(rec(0, 5, 100), None, Bound(time_ms=100))  # the end is exclusive
    assert in_range(rec(0, 5, 100), Bound(offset=5), Bound(offset=6))
    assert not in_range(rec(0, 5, 100), Bound(offsets={0: 6}), None)
    assert in_range(rec(1, 5, 100), Bound(offsets={0: 6}), None)  # unlisted partition: unbounded
    assert not in_range(rec(1, 5, 100), None, Bound(offsets={1: 5}))
    t = events.decode(events.encode(_turn()))
    assert mark_replayed(t).source == "replay" and t.source == "proxy"
    imported = _turn(source="import", response_logprobs=[])
    assert mark_replayed(imported).source == "import"
    ns = events.NextState(session_id="s", messages=[])
    assert mark_replayed(ns) is ns


def test_archive_records_filters_by_time_and_offsets(tmp_path):
    from pipeline.history.replay import archive_records

    for p in (0, 1):
        for o in range(5):
            ts = 1_000_000 + o * 1000 + p
            f = partition_file(tmp_path, ts, p)
            f.parent.mkdir(parents=True, exist_ok=True)
            with f.open("ab") as fh:
                fh.write(to_line("t", p, o, ts, f"k{p}", events.SessionEnd(session_id=f"k{p}")))
    stats = {}
    got = [(r.partition, r.offset) for r in archive_records(tmp_path, Bound(time_ms=1_002_000),
                                                             Bound(time_ms=1_004_000), stats)]
    assert got == [(0, 2), (1, 2), (0, 3), (1, 3)]  # merged by timestamp, per partition in order
    assert stats["out_of_range"] == 6
    got = [(r.partition, r.offset) for r in archive_records(tmp_path, Bound(offsets={1: 3}), Bound(offset=4), {})]
    assert sorted(got) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 3)]
