"""One session through two proxies: turn indices, next states and the judge's join stay right.

Pure logic (no I/O): two :class:`SessionTable` s stand for two proxy replicas behind a
round-robin front; each replica's records form a FIFO stream (Kafka keeps one producer's order),
and the judge reads any interleaving of the two streams. Every interleaving must give the join
the outcome one proxy gives: each answered turn with a next state judged exactly once, with
that next state. The end-to-end version (real proxies, front, broker and judge) is in
``tests/orchestrate/test_replicas.py``.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import events
from pipeline.bus.consumer import Record
from pipeline.judge.join import FLUSH, JUDGE, Joiner
from pipeline.judge.reorder import Reorderer
from pipeline.proxy.sessions import SessionTable

TP = ("turns", 0)


def _conversation_through(replicas: list[SessionTable], turns: int, sid: str = "s", route=None):
    """Drive a sequential conversation of ``turns`` main turns; request k goes to ``route(k)``.

    Returns one list of events per replica (its publish order) and ``{turn: next-state text}``.
    """
    route = route or (lambda k: k % len(replicas))
    streams: list[list] = [[] for _ in replicas]
    msgs = [{"role": "user", "content": "q0"}]
    t = 1_000_000
    for k in range(turns):
        r = route(k)
        table = replicas[r]
        mt = table.begin(sid, msgs)
        assert mt.turn_index == k, f"request {k} through replica {r} got turn index {mt.turn_index}"
        t += 10
        if mt.next_state is not None:
            streams[r].append(events.NextState(session_id=sid, messages=mt.next_state,
                                               after_turn_index=mt.after_turn_index, request_id=f"{r}-{k}",
                                               created_at=t))
        answer = f"answer {k}"
        table.complete(sid, mt.turn_index, answer, None)
        streams[r].append(events.Turn(session_id=sid, turn_index=mt.turn_index, request_id=f"{r}-{k}",
                                      created_at=t, messages=list(msgs), response={"content": answer},
                                      finish_reason="stop", response_token_ids=[1], response_logprobs=[-0.5]))
        msgs = msgs + [{"role": "assistant", "content": answer}, {"role": "user", "content": f"q{k + 1}"}]
    return streams


def _interleave(streams: list[list], choices: list[int]) -> list:
    """Merge FIFO streams: ``choices[i] % (streams left)`` picks which stream gives the next event."""
    queues = [list(s) for s in streams if s]
    out, i = [], 0
    while queues:
        c = choices[i] % len(queues) if i < len(choices) else 0
        i += 1
        out.append(queues[c].pop(0))
        if not queues[c]:
            queues.pop(c)
    return out


def _join(evs: list, reorder: bool = True) -> dict:
    """Feed records through (optionally) the Reorderer and the Joiner; return judged/flushed turns."""
    joiner = Joiner(idle_timeout_s=0, at_least_one=False)
    ro = Reorderer(lateness_s=60.0)
    out: dict[str, list] = {"judged": [], "flushed": [], "next_state": {}}
    for off, ev in enumerate(evs + [events.SessionEnd(session_id="s", created_at=evs[-1].created_at + 1)]):
        rec = Record(TP[0], TP[1], off, "s", ev, 0)
        for r in (ro.on_record(rec) if reorder else [rec]):
            _ack, jobs = joiner.on_record(r)
            for j in jobs:
                if j.kind == JUDGE:
                    out["judged"].append(j.turn.turn_index)
                    out["next_state"][j.turn.turn_index] = j.next_state[0]["content"]
                elif j.kind == FLUSH:
                    out["flushed"].append(j.turn.turn_index)
    assert ro.held == 0
    return out


def test_alternating_replicas_assign_each_turn_its_index_and_its_own_next_state():
    a, b = SessionTable(), SessionTable()
    streams = _conversation_through([a, b], 6)
    ns = [e for s in streams for e in s if isinstance(e, events.NextState)]
    # request k+1 publishes turn k's next state, whichever replica answered turn k
    assert sorted((e.after_turn_index, e.messages[-1]["content"]) for e in ns) == [(k, f"q{k + 1}") for k in range(5)]


def test_one_replica_in_order_judges_every_turn_with_a_next_state():
    (stream,) = _conversation_through([SessionTable()], 5)
    got = _join(stream)
    assert got["judged"] == [0, 1, 2, 3] and got["flushed"] == [4]


def test_next_state_overtaking_its_turn_is_held_until_the_turn_arrives():
    a, b = SessionTable(), SessionTable()
    sa, sb = _conversation_through([a, b], 2)  # A: T0 ; B: NS(after 0), T1
    evs = [sb[0], sa[0], sb[1]]  # B's next state reaches the broker before A's turn 0
    assert _join(evs, reorder=False)["judged"] == [], "without reordering turn 0 is never judged"
    got = _join(evs)
    assert got["judged"] == [0] and got["next_state"][0] == "q1" and got["flushed"] == [1]


def test_turn_delayed_behind_later_turns_of_its_session_is_judged():
    # A answers turn 0 then is killed: its turn 0 is published only after its restart, when
    # B already served turns 1-3 (its disk buffer is drained then)
    a, b = SessionTable(), SessionTable()
    sa, sb = _conversation_through([a, b], 4, route=lambda k: 0 if k == 0 else 1)
    evs = sb + sa
    assert 0 not in _join(evs, reorder=False)["judged"]
    got = _join(evs)
    assert got["judged"] == [0, 1, 2] and got["next_state"] == {0: "q1", 1: "q2", 2: "q3"}


@settings(max_examples=100, deadline=None)
@given(turns=st.integers(2, 7), choices=st.lists(st.integers(0, 10), max_size=40), seed=st.integers(0, 1000))
def test_any_interleaving_of_two_replicas_gives_the_single_replica_outcome(turns, choices, seed):
    rng = random.Random(seed)
    routes = [rng.randrange(2) for _ in range(turns)]
    a, b = SessionTable(), SessionTable()
    streams = _conversation_through([a, b], turns, route=lambda k: routes[k])
    got = _join(_interleave(streams, choices))
    assert got["judged"] == list(range(turns - 1)), (routes, got)
    assert got["next_state"] == {k: f"q{k + 1}" for k in range(turns - 1)}
    assert got["flushed"] == [turns - 1]


def test_a_next_state_whose_turn_was_settled_before_a_restart_is_released_by_the_watermark():
    # a restarted judge replays from its committed offset and may meet NS(after 3) whose turn 3
    # it settled in its previous life: the session waits at most `lateness` in event time
    ro = Reorderer(lateness_s=5.0)
    ns = events.NextState(session_id="s", messages=[{"role": "user", "content": "x"}], after_turn_index=3,
                          created_at=10_000)
    t4 = events.Turn(session_id="s", turn_index=4, created_at=10_000, response={"content": "y"})
    other = [events.Turn(session_id=f"o{i}", turn_index=0, created_at=10_000 + 1000 * i) for i in range(1, 7)]
    assert ro.on_record(Record("turns", 0, 0, "s", ns, 0)) == []
    assert ro.on_record(Record("turns", 0, 1, "s", t4, 0)) == []  # waits behind the next state
    passed = []
    for off, ev in enumerate(other, start=2):
        passed += [r.event for r in ro.on_record(Record("turns", 0, off, ev.session_id, ev, 0))]
    assert passed.index(ns) < passed.index(t4), "released in arrival order"
    assert passed.index(t4) < passed.index(other[4]), "released once the watermark passed 10 s + 5 s"
    assert ro.held == 0 and ro.released_unordered == 2


def test_records_of_one_proxy_are_never_held():
    (stream,) = _conversation_through([SessionTable()], 6)
    ro = Reorderer()
    for off, ev in enumerate(stream):
        assert [r.event for r in ro.on_record(Record("turns", 0, off, "s", ev, 0))] == [ev]
    assert ro.reordered == 0


def test_holding_is_bounded_per_session_and_forgotten_with_a_revoked_partition():
    ro = Reorderer(lateness_s=1e6, max_held=3)
    ns = [events.NextState(session_id="s", messages=[{"role": "user", "content": str(k)}], after_turn_index=k,
                           created_at=1) for k in (5, 6, 7)]
    t9 = events.Turn(session_id="s", turn_index=9, created_at=1)
    recs = [Record("turns", 0, i, "s", e, 0) for i, e in enumerate(ns + [t9])]
    assert [ro.on_record(r) for r in recs[:3]] == [[], [], []] and ro.held == 3
    assert [r.event for r in ro.on_record(recs[3])] == ns + [t9], "over max_held: all released in arrival order"
    assert ro.held == 0 and ro.released_unordered == 4
    ro.on_record(Record("turns", 1, 0, "u", events.NextState(session_id="u", messages=[], after_turn_index=2,
                                                             created_at=1), 0))
    assert ro.held == 1
    assert ro.drop_partitions({("turns", 1)}) == 1 and ro.held == 0 and "u" not in ro.sessions


def test_a_stalled_session_is_released_only_by_a_record_in_the_log():
    """No newer record moves a quiet partition's watermark: after max_wait_s on its clock the
    judge is told (once) to publish an idle end; nothing is released on the clock itself, and the
    idle end, read back, releases the held records before it (so a replay releases them there too)."""
    t = [0.0]
    ro = Reorderer(lateness_s=60.0, max_wait_s=300.0, clock=lambda: t[0])
    ns = events.NextState(session_id="s", messages=[{"role": "user", "content": "x"}], after_turn_index=3,
                          created_at=10_000)
    t4 = events.Turn(session_id="s", turn_index=4, created_at=10_500, response={"content": "y"})
    assert ro.on_record(Record("turns", 0, 0, "s", ns, 0)) == []
    assert ro.on_record(Record("turns", 0, 1, "s", t4, 0)) == []
    t[0] = 299.0
    assert ro.stalled() == []
    t[0] = 301.0
    assert ro.stalled(ready=lambda tp: False) == []  # partition not read to its end
    # proposed once, stamped in event time: the oldest held record's + the lateness (the clock says 301 s)
    assert ro.stalled() == [("s", ("turns", 0), 4, 10_000 + 60_000)] and ro.stalled() == []
    assert ro.held == 2  # nothing released on the clock
    end = events.SessionEnd(session_id="s", reason="idle_timeout", created_at=10_000 + 60_000, turn_index=4)
    assert [r.event for r in ro.on_record(Record("turns", 0, 2, "s", end, 0))] == [ns, t4, end]
    assert ro.held == 0
