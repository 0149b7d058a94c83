"""``pipeline retrain``'s range bookkeeping without a broker: which sessions the replayed range
leaves open and gets an ``end_of_range`` end (the producer is a stand-in that records what is
sent; the end-to-end run on a real broker is tests/history/test_retrain.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline import events
from pipeline.config import Config
from pipeline.history import retrain


class _Producer:
    def __init__(self, *_a, **_k) -> None:
        self.sent: list = []

    def send(self, topic, ev, key=None) -> None:
        self.sent.append((topic, ev, key))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _rec(ev):
    return SimpleNamespace(event=ev, key=ev.session_id)


def _turn(sid, k, t):
    return events.Turn(session_id=sid, turn_index=k, request_id=f"{sid}-{k}", created_at=t, finish_reason="stop")


@pytest.fixture
def producer(monkeypatch):
    import pipeline.bus

    made: list = []

    def make(*a, **k):
        made.append(_Producer())
        return made[-1]

    monkeypatch.setattr(pipeline.bus, "EventProducer", make)
    return made


def test_an_idle_end_overtaken_by_a_newer_turn_leaves_the_session_open(producer):
    """The live judge proposed an idle end for turn 0 of ``s`` (``turn_index`` 0), but turn 1
    reached the log first: the judge ignores that end, so turn 1 would wait for a reply that is
    not in the range, and the retrain judge would never settle. The range must end ``s``."""
    recs = [_rec(_turn("s", 0, 1_000)), _rec(_turn("s", 1, 2_000)),
            _rec(events.SessionEnd(session_id="s", reason="idle_timeout", created_at=2_000, turn_index=0)),
            _rec(_turn("done", 0, 1_000)), _rec(events.SessionEnd(session_id="done", created_at=1_500)),
            _rec(_turn("idle", 0, 1_000)),
            _rec(events.SessionEnd(session_id="idle", reason="idle_timeout", created_at=9_000, turn_index=0))]
    got = retrain.replay_range(Config(), recs, "t-turns")
    ends = [ev for _t, ev, _k in producer[0].sent[len(recs):]]
    assert [(e.session_id, e.reason) for e in ends] == [("s", "end_of_range")]
    assert (got["main_turns"], got["closed"]) == (4, 1)
