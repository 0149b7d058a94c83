"""Restore each session's protocol order when its records come from several proxies (pure logic, no I/O).

Kafka keeps the order of one producer within a partition, not across producers. With one proxy a
session's records arrive as the proxy made them: ``Turn(k)``, then (from the request of turn k+1)
``NextState(after k)``, ``Turn(k+1)`` ... With several proxies behind a round-robin front, turn k
may be served (and published) by proxy A and turn k+1 by proxy B; B can then publish
``NextState(after k)`` and ``Turn(k+1)`` before A's ``Turn(k)`` reaches the broker (A lingers on
its publish window, or A was killed and its disk buffer is sent only when it restarts). The
join (:class:`pipeline.judge.join.Joiner`) expects the protocol order and would ignore the early
next state and drop the late turn as stale: turn k would never be judged.

:class:`Reorderer` sits in front of the join and holds records that arrived too early, per
session, using only what the records say (so a replay decides the same):

- ``NextState(after k)`` is held while ``Turn(k)`` has not been seen: a next state names a turn
  that was answered (the proxy publishes one only after an answered turn), so that turn's record
  exists and is on its way.
- ``Turn(j)`` (main) is held while a held next state names a turn ``i < j``: the record of turn
  i must reach the join first.
- ``SessionEnd`` and ``Feedback`` are held while anything of their session is held (a feedback is
  published after its turn, so the turn it names reaches the join first).
- Whatever a record releases is passed on in arrival order, repeatedly, until nothing more moves.

Held records are not acknowledged (the app acknowledges them only when the join has settled
them), so a crash re-delivers them.

Waiting is bounded in event time, like a stream processor's allowed lateness: each partition's
*watermark* is the newest event time (``created_at``) of any record read from it, and a session's
held records are released in arrival order once the watermark is ``lateness_s`` past the oldest
of them (the awaited turn is then taken as lost upstream, or as settled before this process
started: a judge that restarts replays from its committed offset and may meet a next state whose
turn it settled in its previous life). Release is a function of the records, so a replay decides
the same. Two fallbacks keep a quiet partition live: more than ``max_held`` records held by one
session are released in arrival order; and a session held for ``max_wait_s`` on this process's
clock (no newer record arrives to move the watermark) is reported by :meth:`Reorderer.stalled`,
for which the judge publishes an idle ``SessionEnd``: that record's event time moves the
watermark when it is read back, so even this release is decided by a record in the log. With one proxy nothing is ever held, and the join sees exactly the records it saw
before.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pipeline import events
from pipeline.judge.join import session_of

#: turn indices remembered per session (most recent), enough to recognise an overtaking record
MAX_SEEN = 1024


def event_time(rec) -> int:
    """Event time (ms) of a record: its event's ``created_at``, else the record's timestamp."""
    return int(getattr(rec.event, "created_at", 0) or getattr(rec, "timestamp_ms", 0) or 0)


@dataclass
class _State:
    tp: tuple
    seen: OrderedDict = field(default_factory=OrderedDict)  # turn indices passed on (insertion order)
    held: list = field(default_factory=list)  # records held, arrival order
    since: float = 0.0  # monotonic time the oldest held record arrived
    held_at: int = 0  # event time (ms) of the oldest held record
    proposed: bool = False  # an idle end was asked for (see Reorderer.stalled)


class Reorderer:
    """Per-session reordering buffer in front of the join (see the module docstring).

    Args:
        lateness_s: event-time seconds a held record waits for the record it needs.
        max_held: records held per session before giving up and releasing them in arrival order.
        max_wait_s: seconds (this process's clock) a session holds records before
            :meth:`stalled` reports it (<= 0: never).
        clock: monotonic clock (seconds), injectable for tests.
    """

    def __init__(self, lateness_s: float = 60.0, max_held: int = 256, max_wait_s: float = 600.0,
                 clock=time.monotonic) -> None:
        self.lateness_ms = int(lateness_s * 1000)
        self.max_held = max_held
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.watermark: dict[tuple, int] = {}  # partition -> newest event time read (ms)
        self.holding: dict[str, _State] = {}  # sessions holding records now
        self.sessions: OrderedDict[str, _State] = OrderedDict()
        self.held = 0  # records held now, all sessions
        self.reordered = 0  # records that were held and later passed on in protocol order
        self.released_unordered = 0  # records released by a bound (their turn never came)

    def on_record(self, rec) -> list:
        """Take one record; returns the records to pass to the join now, in order (maybe none)."""
        ev = rec.event
        out = self._advance(rec)
        if not isinstance(ev, (events.Turn, events.NextState, events.SessionEnd, events.Feedback)) or \
                (isinstance(ev, events.Turn) and ev.turn_type != "main"):
            return out + [rec]
        sid = session_of(ev)  # (tenant, session id): tenants never share a buffer
        st = self.sessions.get(sid)
        if st is None:
            st = self.sessions[sid] = _State(rec.tp)
            while len(self.sessions) > 100_000:  # bounded memory; a forgotten session only holds less
                old_sid, old = next(iter(self.sessions.items()))
                if old.held:
                    break
                del self.sessions[old_sid]
        self.sessions.move_to_end(sid)
        if self._blocked(st, ev):
            if not st.held:
                st.since, st.held_at, st.proposed = self.clock(), event_time(rec), False
                self.holding[sid] = st
            st.held.append(rec)
            self.held += 1
            if len(st.held) > self.max_held:
                return out + self._release_all(sid, st)
            return out
        out.append(self._pass(st, rec))
        if st.held and isinstance(ev, events.Turn):
            out += self._release(sid, st)
        if isinstance(ev, events.SessionEnd) and not st.held:
            self.sessions.pop(sid, None)
        return out

    def _advance(self, rec) -> list:
        """Move the partition's watermark with ``rec``; release sessions held beyond the lateness."""
        t = event_time(rec)
        tp = rec.tp
        if t <= self.watermark.get(tp, -1):
            return []
        self.watermark[tp] = t
        out = []
        for sid, st in list(self.holding.items()):
            if st.tp == tp and st.held and t - st.held_at >= self.lateness_ms:
                out += self._release_all(sid, st)
        return out

    def stalled(self, ready=lambda tp: True) -> list[tuple[str, tuple, int | None, int]]:
        """Sessions that have held records for ``max_wait_s`` on this process's clock (no newer
        record moved their partition's watermark), each returned once, when ``ready(tp)`` (the
        caller has read the partition to its end): ``(session key (join.session_of), tp, newest held turn index or
        None, event time for the end)``. The end's event time is the oldest held record's plus the
        lateness (what releases it), never this process's clock: read back, it moves the partition's
        watermark only as far as the records themselves would, so a replay of old records or a
        long pause does not make every waiting session look idle.

        Nothing is released here: the caller publishes an idle ``SessionEnd`` for each, and its
        event time moves the watermark when it is read back, so the release is in the log and a
        replay releases at the same place.
        """
        if self.max_wait_s <= 0:
            return []
        now = self.clock()
        out = []
        for sid, st in list(self.holding.items()):
            if st.held and not st.proposed and now - st.since >= self.max_wait_s and ready(st.tp):
                st.proposed = True
                turns = [r.event.turn_index for r in st.held if isinstance(r.event, events.Turn)]
                out.append((sid, st.tp, max(turns) if turns else None, st.held_at + self.lateness_ms))
        return out

    def drop_partitions(self, tps: set) -> int:
        """Forget the sessions of revoked partitions (their unacknowledged records are re-delivered)."""
        gone = [sid for sid, st in self.sessions.items() if st.tp in tps]
        for sid in gone:
            self.held -= len(self.sessions.pop(sid).held)
            self.holding.pop(sid, None)
        for tp in tps:
            self.watermark.pop(tp, None)
        return len(gone)

    # ---- internals ---------------------------------------------------------------------------
    @staticmethod
    def _awaited(st: _State) -> list[int]:
        """Turn indices named by held next states whose turn has not been seen."""
        return [r.event.after_turn_index for r in st.held
                if isinstance(r.event, events.NextState) and r.event.after_turn_index is not None
                and r.event.after_turn_index not in st.seen]

    def _blocked(self, st: _State, ev) -> bool:
        if isinstance(ev, events.NextState):
            k = ev.after_turn_index  # a turn older than every remembered one is not waited for
            return k is not None and k not in st.seen and (not st.seen or k > min(st.seen))
        if isinstance(ev, events.Turn):
            return any(i < ev.turn_index for i in self._awaited(st))
        return bool(st.held)  # SessionEnd, Feedback: behind whatever the session holds (its turn among them)

    def _pass(self, st: _State, rec):
        ev = rec.event
        if isinstance(ev, events.Turn):
            st.seen[ev.turn_index] = True
            st.seen.move_to_end(ev.turn_index)
            while len(st.seen) > MAX_SEEN:
                st.seen.popitem(last=False)
        return rec

    def _release(self, sid: str, st: _State) -> list:
        out = []
        moved = True
        while moved and st.held:
            moved = False
            pending, st.held = st.held, []
            self.held -= len(pending)
            for rec in pending:
                if self._blocked(st, rec.event):
                    st.held.append(rec)
                    self.held += 1
                else:
                    out.append(self._pass(st, rec))
                    self.reordered += 1
                    moved = True
        if not st.held:
            self.holding.pop(sid, None)
        elif moved:
            st.held_at = event_time(st.held[0])
        if any(isinstance(r.event, events.SessionEnd) for r in out) and not st.held:
            self.sessions.pop(sid, None)
        return out

    def _release_all(self, sid: str, st: _State) -> list:
        out = [self._pass(st, r) for r in st.held]
        self.held -= len(st.held)
        self.released_unordered += len(st.held)
        st.held = []
        self.holding.pop(sid, None)
        if any(isinstance(r.event, events.SessionEnd) for r in out):
            self.sessions.pop(sid, None)
        return out
