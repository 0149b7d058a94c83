"""The join: per session, the latest main turn waits for its next state (pure logic, no I/O).

Input is the ``turns`` topic in session order (one session lives in one partition):
``Turn(0) NextState(after 0) Turn(1) NextState(after 1) ... SessionEnd``. For every record the
:class:`Joiner` says whether it can be acknowledged now and which :class:`Job` s it starts:

- ``Turn`` (main): becomes the session's waiting turn, **not** acknowledged (so a crash
  re-delivers it); a turn still waiting is flushed first (it never got a next state).
  Side turns take no part and are acknowledged at once.
- ``NextState`` for the waiting turn: a ``judge`` job (which acknowledges the turn once its
  sample is delivered). A next state with no messages flushes the turn instead. A next state
  with no waiting turn (or for another turn index) is ignored.
- ``SessionEnd``: flushes the waiting turn and forgets the session.
- Idle time-out: a session whose last record is older than ``idle_timeout_s`` is closed like a
  session end (reason ``idle_timeout``). Checked on this process's clock (time since the last
  record *arrived*, so a fast replay of old records does not time out) and, for replays, in
  event time: a record whose timestamp is more than ``idle_timeout_s`` after the session's
  previous record first closes the session.

At-least-one rule (Binary RL; OpenClaw-RL's guarantee that every session trains on at least one
sample), in the form implemented here:

    The *first judged turn* of a session -- the main turn with the lowest index that is joined
    with a next state -- is always trained: when its vote is 0 (a tie, all-neutral votes or all
    votes failed) it is emitted with reward 0 and loss_mask 1. Later judged turns follow the
    plain rule (loss_mask 0 when the vote is 0). Turns without a next state are never trained.
    A session is known from its start when the judge first meets it at turn_index 0; a session
    first met at a later turn (after an idle time-out, or a stream not starting at 0) counts as
    already having its trained sample.

The decision is made when the turn is joined (before the vote is known), in stream order, so it
does not depend on how fast votes come back or on when ``SessionEnd`` arrives (OpenClaw-RL
counts trained samples in async tasks and drops the counter at session end, so the outcome
depends on timing). It survives restarts: while a session's rule is still open (its turn 0 was
settled without a next state and no turn has been judged yet) the turn-0 record stays
unacknowledged, so the committed offset cannot pass it and a replay rebuilds the same state. In
every other case a replay that starts after turn 0 finds the rule already closed, which is what
the "first met at a later turn" clause says.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pipeline import events

JUDGE, FLUSH, RELEASE = "judge", "flush", "release"


@dataclass
class Job:
    """Work started by the join.

    ``kind``: ``judge`` (turn + next state), ``flush`` (turn without next state; ``reason`` says
    why) or ``release`` (no output; acknowledges ``acks`` once the session's earlier output is
    delivered). ``acks`` are records to acknowledge once this job's output is delivered.
    ``candidate``: the at-least-one rule applies (first judged turn of the session).
    ``joined_at``: monotonic seconds when the job was created (latency metric).
    """

    kind: str
    session_id: str
    tp: tuple
    turn: events.Turn | None = None
    record: object = None
    next_state: list | None = None
    candidate: bool = False
    reason: str = ""
    acks: list = field(default_factory=list)
    joined_at: float = 0.0


@dataclass
class _Session:
    tp: tuple
    judged_any: bool
    last_ts: int
    last_seen: float
    waiting: object = None  # (record, turn)
    hold: object = None  # turn-0 record held open by the at-least-one rule


class Joiner:
    """Join state of the sessions of the partitions this process owns.

    Args:
        idle_timeout_s: close sessions idle this long (<= 0: never).
        at_least_one: apply the at-least-one rule (Binary RL only).
        clock: monotonic clock (seconds), injectable for tests.
    """

    def __init__(self, idle_timeout_s: float, at_least_one: bool, clock=time.monotonic) -> None:
        self.idle_s = idle_timeout_s
        self.idle_ms = int(idle_timeout_s * 1000)
        self.at_least_one = at_least_one
        self.clock = clock
        self.sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently seen first
        self.waiting = 0

    # ---- records ---------------------------------------------------------------------------
    def on_record(self, rec) -> tuple[bool, list[Job]]:
        """Process one record; returns ``(ack_now, jobs)``."""
        ev = rec.event
        if not isinstance(ev, (events.Turn, events.NextState, events.SessionEnd)):
            return True, []
        if isinstance(ev, events.Turn) and ev.turn_type != "main":
            return True, []
        sid = ev.session_id
        now = self.clock()
        jobs: list[Job] = []
        st = self.sessions.get(sid)
        if st is not None and self.idle_ms > 0 and rec.timestamp_ms - st.last_ts > self.idle_ms:
            jobs += self._close(sid, "idle_timeout", now)
            st = None
        if isinstance(ev, events.Turn):
            if st is None:
                st = _Session(rec.tp, judged_any=ev.turn_index > 0, last_ts=rec.timestamp_ms, last_seen=now)
                self.sessions[sid] = st
            elif st.waiting is not None and ev.turn_index <= st.waiting[1].turn_index:
                self._touch(sid, st, rec, now)
                return True, jobs  # duplicate or stale turn
            if st.waiting is not None:
                jobs.append(self._flush(sid, st, "no_next_state", now))
            st.waiting = (rec, ev)
            self.waiting += 1
            self._touch(sid, st, rec, now)
            return False, jobs
        if st is None:
            return True, jobs  # next state / end of a session we hold nothing for
        self._touch(sid, st, rec, now)
        if isinstance(ev, events.SessionEnd):
            jobs += self._close(sid, "session_end", now)
            return True, jobs
        # NextState
        if st.waiting is None:
            return True, jobs
        wrec, turn = st.waiting
        if ev.after_turn_index is not None and ev.after_turn_index != turn.turn_index:
            return True, jobs  # belongs to another turn (stale or out of protocol)
        if not ev.messages:
            jobs.append(self._flush(sid, st, "empty_next_state", now))
        else:
            st.waiting = None
            self.waiting -= 1
            candidate = self.at_least_one and not st.judged_any
            st.judged_any = True
            acks = [wrec]
            if st.hold is not None:
                acks.append(st.hold)
                st.hold = None
            jobs.append(Job(JUDGE, sid, st.tp, turn=turn, record=wrec, next_state=list(ev.messages),
                            candidate=candidate, acks=acks, joined_at=now))
        self._maybe_forget(sid, st)
        return True, jobs

    def expire(self) -> list[Job]:
        """Close sessions idle for ``idle_timeout_s`` on this process's clock."""
        if self.idle_s <= 0:
            return []
        now = self.clock()
        jobs: list[Job] = []
        while self.sessions:
            sid, st = next(iter(self.sessions.items()))
            if now - st.last_seen < self.idle_s:
                break
            jobs += self._close(sid, "idle_timeout", now)
        return jobs

    def drop_partitions(self, tps: set) -> int:
        """Forget the sessions of revoked partitions (their records will be re-delivered)."""
        gone = [sid for sid, st in self.sessions.items() if st.tp in tps]
        for sid in gone:
            st = self.sessions.pop(sid)
            if st.waiting is not None:
                self.waiting -= 1
        return len(gone)

    # ---- internals ---------------------------------------------------------------------------
    def _touch(self, sid: str, st: _Session, rec, now: float) -> None:
        st.last_ts = max(st.last_ts, rec.timestamp_ms)
        st.last_seen = now
        self.sessions.move_to_end(sid)

    def _flush(self, sid: str, st: _Session, reason: str, now: float) -> Job:
        """Settle the waiting turn without a next state."""
        wrec, turn = st.waiting
        st.waiting = None
        self.waiting -= 1
        acks = [wrec]
        if self.at_least_one and not st.judged_any and st.hold is None:
            acks = []  # hold this (first) turn's record until the rule closes
            st.hold = wrec
        return Job(FLUSH, sid, st.tp, turn=turn, record=wrec, reason=reason, acks=acks, joined_at=now)

    def _close(self, sid: str, reason: str, now: float) -> list[Job]:
        st = self.sessions.pop(sid)
        jobs = []
        if st.waiting is not None:
            job = self._flush(sid, st, reason, now)
            jobs.append(job)
        if st.hold is not None:
            if jobs and st.hold not in jobs[-1].acks:
                jobs[-1].acks.append(st.hold)
            elif not jobs:
                jobs.append(Job(RELEASE, sid, st.tp, reason=reason, acks=[st.hold], joined_at=now))
            st.hold = None
        return jobs

    def _maybe_forget(self, sid: str, st: _Session) -> None:
        # nothing waiting and nothing held: a later turn recreates the state (turn_index > 0
        # then means "already has its trained sample", which is true here)
        if st.waiting is None and st.hold is None and st.judged_any:
            self.sessions.pop(sid, None)
        elif st.waiting is None and st.hold is None and not self.at_least_one:
            self.sessions.pop(sid, None)
