"""The join: per session, the latest main turn waits for its next state (pure logic, no I/O).

Input is the ``turns`` topic in session order (one session lives in one partition):
``Turn(0) NextState(after 0) Turn(1) NextState(after 1) ... SessionEnd``. For every record the
:class:`Joiner` says whether it can be acknowledged now and which :class:`Job` s it starts.
Every decision is a function of the ordered records alone (never of a clock or of how fast
they are read), so replaying a topic at any speed, with a restarted judge or with several
judges in a group, decides the same:

- ``Turn`` (main): becomes the session's waiting turn, **not** acknowledged (so a crash
  re-delivers it); a turn still waiting is flushed first (it never got a next state). A turn
  whose generation did not finish (``finish_reason`` not ``stop``/``length``/``tool_calls``,
  e.g. ``abort``) is flushed at once (reason ``unfinished``): it is never trained as an answer,
  and a next state after it is ignored. A turn whose ``request_id`` this judge already holds or
  settled (a duplicate record) is ignored, so is a turn older than the waiting one. Side turns
  take no part and are acknowledged at once.
- ``NextState`` for the waiting turn: a ``judge`` job (which acknowledges the turn once its
  sample is delivered). A next state with no messages flushes the turn instead. A next state
  with no waiting turn (or for another turn index) is ignored.
- ``SessionEnd``: flushes the waiting turn and forgets the session. An end that names a
  ``turn_index`` applies only while that turn is the session's latest main turn (else it is
  ignored: a newer record overtook it).
- Idle time-out: the judge does not decide it on its clock. :meth:`Joiner.idle_sessions` lists
  sessions whose latest record is older than ``idle_timeout_s`` (event time and this process's
  read time both); the app publishes a ``SessionEnd(reason="idle_timeout", turn_index=<latest
  main turn>)`` to ``turns`` for those on partitions it has read to the end, and acts only when
  it reads that record back. A next state already in the log before the end (a lagging judge)
  is therefore judged, and a replay sees the same ends in the same places.

At-least-one rule (Binary RL; OpenClaw-RL's guarantee that a session trains on at least one
sample), in the form implemented here:

    A session's turn 0, when it is joined with a next state and judged, is always trained:
    when its vote is 0 (a tie or all-neutral votes) it is emitted with reward 0 and loss_mask
    1. Every other judged turn follows the plain rule (loss_mask 0 when the vote is 0). Turns
    without a next state are never trained, nor are turns whose votes all failed (no
    judgement: no reward, loss_mask 0, even for turn 0).

OpenClaw-RL promotes the first judged turn of a session that has no trained sample yet; the two
differ only when turn 0 gets no next state (an aborted generation, an empty next state) or its
votes all fail, and a later turn is judged 0. The promoted sample has reward 0, so it adds nothing to a GRPO
advantage (only KL and entropy terms). Tying the rule to turn 0 makes the decision a function of
the turn record alone: it does not depend on how fast votes come back, on when ``SessionEnd``
arrives (OpenClaw-RL counts trained samples in async tasks and resets the counter at session
end, so its outcome depends on timing), nor on where a restarted judge resumes reading (a judge
that resumes in the middle of a session, after records of it were committed, decides exactly as
the first one did: replays give identical samples).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pipeline import events

JUDGE, FLUSH = "judge", "flush"
#: request ids remembered to recognise duplicate turn records
MAX_REMEMBERED_TURNS = 100_000


def finished(turn: events.Turn) -> bool:
    """True when the turn's generation finished (``finish_reason`` in :data:`events.FINISHED`)."""
    return turn.finish_reason in events.FINISHED


def event_time(rec) -> int:
    """The event time (ms) of a record: its event's ``created_at``, else the record timestamp."""
    return int(getattr(rec.event, "created_at", 0) or rec.timestamp_ms or 0)


@dataclass
class Job:
    """Work started by the join.

    ``kind``: ``judge`` (turn + next state) or ``flush`` (turn without next state; ``reason`` says
    why). ``acks`` are records to acknowledge once this job's output is delivered.
    ``candidate``: the at-least-one rule applies (the session's turn 0).
    ``decided_at``: event time (ms) of the record that started the job (the sample's
    ``created_at``). ``joined_at``: monotonic seconds when the job was created (latency metric only).
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
    decided_at: int = 0
    joined_at: float = 0.0


@dataclass
class _Session:
    tp: tuple
    last_ts: int  # newest record timestamp of the session (ms)
    last_seen: float  # this process's monotonic clock when its latest record was read
    last_index: int = -1  # latest main turn index
    waiting: object = None  # (record, turn)
    idle_proposed: bool = False  # an idle end was published for the current state


class Joiner:
    """Join state of the sessions of the partitions this process owns.

    Args:
        idle_timeout_s: sessions idle this long are proposed for an idle end (<= 0: never).
        at_least_one: apply the at-least-one rule (Binary RL only).
        clock: monotonic clock (seconds), injectable for tests; only used to propose idle ends
            and for the latency metric, never for a decision.
    """

    def __init__(self, idle_timeout_s: float, at_least_one: bool, clock=time.monotonic) -> None:
        self.idle_s = idle_timeout_s
        self.idle_ms = int(idle_timeout_s * 1000)
        self.at_least_one = at_least_one
        self.clock = clock
        self.sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently seen first
        self.waiting = 0
        self.turns_seen: OrderedDict[tuple[str, str], tuple] = OrderedDict()  # (session, request_id) -> tp
        self.duplicates = 0
        self.stale = 0

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
        at = event_time(rec)
        jobs: list[Job] = []
        st = self.sessions.get(sid)
        if isinstance(ev, events.Turn):
            if ev.request_id and (sid, ev.request_id) in self.turns_seen:
                self.duplicates += 1
                return True, jobs  # the same turn record again (a producer retry, a replayed copy)
            if st is None:
                st = _Session(rec.tp, last_ts=rec.timestamp_ms, last_seen=now)
                self.sessions[sid] = st
            elif st.waiting is not None and ev.turn_index <= st.waiting[1].turn_index:
                self.stale += 1
                self._touch(sid, st, rec, now)
                return True, jobs  # older than the waiting turn (out of order)
            self._remember(sid, ev)
            if st.waiting is not None:
                jobs.append(self._flush(sid, st, "no_next_state", now, at))
            st.waiting = (rec, ev)
            st.last_index = ev.turn_index
            self.waiting += 1
            self._touch(sid, st, rec, now)
            if not finished(ev):
                jobs.append(self._flush(sid, st, "unfinished", now, event_time(rec)))
                self._maybe_forget(sid, st)
                return False, jobs
            return False, jobs
        if st is None:
            return True, jobs  # next state / end of a session we hold nothing for
        if isinstance(ev, events.SessionEnd):
            if ev.turn_index is not None and ev.turn_index != st.last_index:
                self._touch(sid, st, rec, now)
                return True, jobs  # overtaken by a newer turn of the session
            jobs += self._close(sid, ev.reason if ev.reason == "idle_timeout" else "session_end", now, at)
            return True, jobs
        self._touch(sid, st, rec, now)
        # NextState
        if st.waiting is None:
            return True, jobs
        wrec, turn = st.waiting
        if ev.after_turn_index is not None and ev.after_turn_index != turn.turn_index:
            return True, jobs  # belongs to another turn (stale or out of protocol)
        if not ev.messages:
            jobs.append(self._flush(sid, st, "empty_next_state", now, at))
        else:
            st.waiting = None
            self.waiting -= 1
            candidate = self.at_least_one and turn.turn_index == 0
            jobs.append(Job(JUDGE, sid, st.tp, turn=turn, record=wrec, next_state=list(ev.messages),
                            candidate=candidate, acks=[wrec], decided_at=at, joined_at=now))
        self._maybe_forget(sid, st)
        return True, jobs

    def idle_sessions(self, now_ms: int, ready=lambda tp: True) -> list[tuple[str, tuple, int]]:
        """Sessions to propose an idle end for: ``(session_id, tp, latest main turn index)``.

        A session qualifies when it holds a waiting turn, no end was proposed since its
        latest record, its newest record timestamp is ``idle_timeout_s`` older than ``now_ms``
        and this process read that record ``idle_timeout_s`` ago or more (a skewed producer
        clock cannot close a live session early), and ``ready(tp)`` (the caller has read its
        partition to the end). Returned sessions are marked proposed. This only *proposes*: the
        session is closed when the published ``SessionEnd`` is read back (:meth:`on_record`).
        """
        if self.idle_s <= 0:
            return []
        now = self.clock()
        out = []
        for sid, st in self.sessions.items():  # least recently seen first
            if now - st.last_seen < self.idle_s:
                break
            if st.idle_proposed or st.waiting is None:
                continue
            if now_ms - st.last_ts < self.idle_ms or not ready(st.tp):
                continue
            st.idle_proposed = True
            out.append((sid, st.tp, st.last_index))
        return out

    def drop_partitions(self, tps: set) -> int:
        """Forget the sessions of revoked partitions (their records will be re-delivered)."""
        gone = [sid for sid, st in self.sessions.items() if st.tp in tps]
        for sid in gone:
            st = self.sessions.pop(sid)
            if st.waiting is not None:
                self.waiting -= 1
        for key in [k for k, tp in self.turns_seen.items() if tp in tps]:
            del self.turns_seen[key]  # their records will be re-delivered: not duplicates
        return len(gone)

    # ---- internals ---------------------------------------------------------------------------
    def _remember(self, sid: str, turn: events.Turn) -> None:
        if not turn.request_id:
            return
        self.turns_seen[(sid, turn.request_id)] = self.sessions[sid].tp
        if len(self.turns_seen) > MAX_REMEMBERED_TURNS:
            self.turns_seen.popitem(last=False)

    def _touch(self, sid: str, st: _Session, rec, now: float) -> None:
        st.last_ts = max(st.last_ts, rec.timestamp_ms)
        st.last_seen = now
        st.idle_proposed = False
        self.sessions.move_to_end(sid)

    def _flush(self, sid: str, st: _Session, reason: str, now: float, at: int) -> Job:
        """Settle the waiting turn without a next state."""
        wrec, turn = st.waiting
        st.waiting = None
        self.waiting -= 1
        return Job(FLUSH, sid, st.tp, turn=turn, record=wrec, reason=reason, acks=[wrec], decided_at=at,
                   joined_at=now)

    def _close(self, sid: str, reason: str, now: float, at: int) -> list[Job]:
        st = self.sessions.pop(sid)
        jobs = []
        if st.waiting is not None:
            jobs.append(self._flush(sid, st, reason, now, at))
        return jobs

    def _maybe_forget(self, sid: str, st: _Session) -> None:
        # nothing waiting: a later record of the session recreates the state
        if st.waiting is None:
            self.sessions.pop(sid, None)
