"""The decider's record order (pipeline/evaluator/merge.py): independent of poll boundaries."""

from __future__ import annotations

from pipeline import events
from pipeline.bus import Record
from pipeline.evaluator.merge import Merge, ordered


def _rec(topic: str, partition: int, offset: int, at: int) -> Record:
    ev = (events.Control(action="resume", epoch=1, created_at=at) if topic == "control"
          else events.Sample(sample_id=f"s{offset}", session_id="s", turn_index=0, created_at=at))
    return Record(topic, partition, offset, None, ev, at)


def test_a_record_waits_until_no_partition_can_precede_it():
    m = Merge("control")
    parts = [("control", 0), ("samples", 0), ("samples", 1)]
    m.add([_rec("samples", 0, 0, 10), _rec("samples", 0, 1, 30)])
    assert m.release(parts, {("samples", 0): 0}) == []  # samples[1] and control may still hold earlier ones
    m.add([_rec("samples", 1, 0, 20)])
    got = m.release(parts, {("samples", 0): 0, ("samples", 1): 0, ("control", 0): 0})
    assert [(r.partition, r.offset) for r in got] == [(0, 0), (1, 0), (0, 1)]
    assert len(m) == 0


def test_control_keeps_its_log_order_and_sorts_first_at_equal_time():
    recs = [_rec("control", 0, 0, 50), _rec("control", 0, 1, 40), _rec("samples", 0, 0, 45),
            _rec("samples", 1, 0, 50)]
    got = ordered(recs, "control")
    assert [(r.topic, r.offset) for r in got] == [("samples", 0), ("control", 0), ("control", 1), ("samples", 0)]
    assert [r.partition for r in got] == [0, 0, 0, 1]
