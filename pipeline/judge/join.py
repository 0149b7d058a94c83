"""The join: per session, the latest main turn waits for its next state (pure logic, no I/O).

Input is the ``turns`` topic in session order (one session lives in one partition; a session is
``(tenant, session_id)``: :func:`session_of`, so two tenants reusing an id are two sessions):
``Turn(0) NextState(after 0) Turn(1) NextState(after 1) ... SessionEnd``. For every record the
:class:`Joiner` says whether it can be acknowledged now and which :class:`Job` s it starts.
Every decision is a function of the ordered records alone (never of a clock or of how fast
they are read), so replaying a topic at any speed, with a restarted judge or with several
judges in a group, decides the same:

- ``Turn`` (main): becomes the session's waiting turn, **not** acknowledged (so a crash
  re-delivers it); a turn still waiting is flushed first (reason ``no_next_state``: it never got
  a next state). A turn whose generation did not finish (``finish_reason`` not
  ``stop``/``length``/``tool_calls``, e.g. ``abort``) is flushed at once (reason
  ``unfinished``): it is never trained as an answer, and a next state after it is ignored.
  Side turns take no part and are acknowledged at once.
- **A turn is its request.** A turn whose ``request_id`` this judge already holds or settled is
  the same record again (a producer retry, a replayed copy) and is ignored (counted in
  ``duplicates``). Any other turn is a new turn, whatever its ``turn_index``: the index is the
  proxy's, and a proxy that evicted the session or restarted numbers a new conversation from 0
  again. A turn whose index is not above the session's latest one is therefore told apart by
  its event time: created at or after the latest turn, it supersedes the waiting turn, and
  when its index is below the latest one, or equal to it when that turn was already settled
  (a one-turn conversation judged, then the proxy dropped the session and numbers the next
  conversation from 0 again), it starts a **new conversation** of the session (the
  at-least-one rule starts afresh; an equal index while that turn still waits is the same turn
  asked again); created
  before it, it is a turn that overtook nothing and arrived late (records of several proxies):
  it is settled at once without a judgement (reason ``out_of_order``, counted in ``stale``),
  and the waiting turn keeps waiting.
- ``NextState`` for the waiting turn: a ``judge`` job (which acknowledges the turn once its
  sample is delivered). A next state with no messages flushes the turn instead
  (``empty_next_state``). A next state with no waiting turn (or for another turn index) is
  ignored.
- ``SessionEnd``: flushes the waiting turn and forgets the session (its next conversation
  starts afresh). An end that names a ``turn_index`` applies only while that turn is the
  session's latest main turn (else it is ignored: a newer record overtook it).
- **The idle horizon** (``judge.idle_timeout_s``, hours by default: people answer late) is
  measured in event time, never on a clock: each partition's *watermark* is the newest event
  time (``created_at``) read from it, and :meth:`Joiner.idle_sessions` lists the sessions with a
  waiting turn whose latest record is ``idle_timeout_s`` older than their partition's watermark.
  The app publishes a ``SessionEnd(reason="idle_timeout", turn_index=<latest main turn>,
  created_at=<watermark>)`` to ``turns`` for those on partitions it has read to the end, and acts
  only when it reads that record back: a next state already in the log before the end is
  judged, and a replay sees the same ends in the same places. A quiet partition (no newer
  record) closes nothing, so a reply that comes after any pause is still paired. Memory is
  bounded by the horizon (the waiting turns of the last ``idle_timeout_s`` of event time) and by
  :data:`MAX_SESSIONS` remembered sessions.

Explicit signals (``docs/feedback.md``):

- ``Feedback``: attached to its turn (named by ``turn_request_id``, else ``turn_index``) while
  the turn is undecided, the last one read winning; read after the turn was decided it is
  counted in :attr:`Joiner.late` by reason, never attached. Acknowledged at once: its turn's
  record is not acknowledged before the turn is decided, so a restart re-reads both.
- With ``feedback_grace_s`` a judged turn is held until its partition's event time is that far
  past its next state (or its session ends); a session's later jobs wait behind it, in order.
- ``SessionEnd.outcome`` is credited to the turns decided at the end (:meth:`Joiner._credit`);
  with ``outcome_hold`` every turn of the conversation waits for its end.
- A feedback waits in the :class:`pipeline.judge.reorder.Reorderer` behind whatever its session
  holds there (records of several proxies out of order), so it never overtakes its turn.

At-least-one rule (Binary RL; OpenClaw-RL: a turn that would not be trained, that *has* a next
state and was scored 0 by the PRM, is trained with reward 0 when its session has no trained
sample yet):

    The first turn of a conversation that the PRM judged (a majority vote exists: not a turn
    without a next state, an unfinished turn, an empty next state, nor a turn whose votes all
    failed) is trained: a vote of +-1 trains anyway, a vote of 0 is emitted with reward 0 and
    loss_mask 1. Every later judged turn of the conversation follows the plain rule (loss_mask
    0 when the vote is 0). A retry of an aborted turn 0 (turn 1), a session whose first request
    already carries history (first index 2), and a turn after one whose votes all failed are
    therefore each promoted.

The decision depends on the votes of the conversation's earlier turns, so it is taken by the app
in the conversation's order (:class:`Conversation`, shared by its jobs: jobs of one session send
their samples in turn order, and a job decides only once the previous job of its session has
sent its sample), from the judge's own decisions on the records it read, never from timing. A
new conversation (after a ``SessionEnd``, or a turn that restarts the indices) starts untrained.
A restart (or a rebalance) decides the same, from the records and the judge's published samples:

- the conversation's first turn record (its *anchor*) is acknowledged only when the
  conversation ends (``SessionEnd``, idle end, a new conversation, or the session forgotten
  above :data:`MAX_SESSIONS`), by a ``release`` job that runs after the conversation's other
  jobs. The committed offset therefore never passes the start of an open conversation: a
  restarted judge re-reads every open conversation whole;
- records re-read after the committed offset whose turn was already settled (an ended
  conversation's tail, turns settled before the crash) keep the sample that was published:
  the app reads those decisions back from ``samples`` when it is assigned partitions
  (:mod:`pipeline.judge.published`) and copies them, trained ones marking the conversation.

The cost: in ``rl`` mode a restart re-reads the records since the oldest open conversation began
(bounded by the idle horizon), not only since the oldest waiting turn.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from pipeline import events
from pipeline.events import session_of, split_session

JUDGE, FLUSH, RELEASE = "judge", "flush", "release"
#: request ids remembered to recognise duplicate turn records
MAX_REMEMBERED_TURNS = 100_000
#: sessions whose latest turn index and conversation are remembered (least recently seen dropped)
MAX_SESSIONS = 100_000


def finished(turn: events.Turn) -> bool:
    """True when the turn's generation finished (``finish_reason`` in :data:`events.FINISHED`)."""
    return turn.finish_reason in events.FINISHED


def event_time(rec) -> int:
    """The event time (ms) of a record: its event's ``created_at``, else the record timestamp."""
    return int(getattr(rec.event, "created_at", 0) or rec.timestamp_ms or 0)


class Conversation:
    """One conversation of a session, shared by its jobs: ``trained`` is set by the app once a
    sample of it was emitted with loss_mask 1 (the at-least-one rule; see the module docstring)."""

    __slots__ = ("trained",)

    def __init__(self) -> None:
        self.trained = False


@dataclass
class Job:
    """Work started by the join.

    ``session``: the session's join key (:func:`session_of`; ``session_id`` and ``tenant`` read
    it). ``kind``: ``judge`` (turn + next state), ``flush`` (turn without next state; ``reason`` says
    why) or ``release`` (no output: a conversation ended, its anchor record can be acknowledged).
    ``acks`` are records to acknowledge once this job's output (and its session's earlier jobs'
    outputs) is delivered.
    ``candidate``: the at-least-one rule applies (Binary RL); the app promotes a vote of 0 when
    ``conversation`` has not trained yet. ``decided_at``: event time (ms) of the record that
    started the job (the sample's ``created_at``). ``joined_at``: monotonic seconds when the job
    was created (latency metric only).
    """

    kind: str
    session: str | tuple[str, str]
    tp: tuple
    turn: events.Turn | None = None
    record: object = None
    next_state: list | None = None
    candidate: bool = False
    reason: str = ""
    acks: list = field(default_factory=list)
    decided_at: int = 0
    joined_at: float = 0.0
    conversation: Conversation | None = None
    feedback: events.Feedback | None = None  # the turn's latest explicit feedback read before it was decided
    outcome: float | None = None  # the session outcome's credit to this turn (discounted; None: none)

    @property
    def tenant(self) -> str | None:
        """The session's tenant (None: none)."""
        return split_session(self.session)[0]

    @property
    def session_id(self) -> str:
        return split_session(self.session)[1]

    @property
    def key(self) -> str:
        """The Kafka key of the session's records and samples (:func:`pipeline.events.session_key`)."""
        return events.session_key(*split_session(self.session))


@dataclass
class _Session:
    tp: tuple
    last_ts: int  # newest event time of the session's records (ms)
    last_index: int = -1  # latest main turn index
    last_turn_at: int = -1  # event time (ms) of that turn
    waiting: object = None  # (record, turn)
    idle_proposed: bool = False  # an idle end was published for the current state
    conversation: Conversation = field(default_factory=Conversation)
    anchor: object = None  # the conversation's first turn record, acknowledged when it ends (rl)
    feedback: object = None  # the latest Feedback of the waiting turn (last wins until it is decided)
    held: list = field(default_factory=list)  # [due (ms; None: the end), job]: decided later, in order


class Joiner:
    """Join state of the sessions of the partitions this process owns.

    Args:
        idle_timeout_s: the idle horizon (event-time seconds; <= 0: never).
        at_least_one: apply the at-least-one rule (Binary RL only).
        clock: monotonic clock (seconds), injectable for tests; only for the latency metric.
        feedback_grace_s: a judged turn is decided only once its partition's event time is this
            far past its next state (or its session ends), so feedback read meanwhile is used
            (0: decided at its next state; :mod:`pipeline.judge.feedback`).
        outcome_hold: every turn of a conversation waits for its end, where the session's
            outcome is credited to all of them (off: only to the turns still undecided then).
        outcome_discount: the outcome's credit to the turn k main turns before the last is
            ``outcome * outcome_discount ** k``.
    """

    def __init__(self, idle_timeout_s: float, at_least_one: bool, clock=time.monotonic, *,
                 feedback_grace_s: float = 0.0, outcome_hold: bool = False, outcome_discount: float = 1.0,
                 on_late=None) -> None:
        self.idle_s = idle_timeout_s
        self.idle_ms = int(idle_timeout_s * 1000)
        self.at_least_one = at_least_one
        self.clock = clock
        self.sessions: OrderedDict[str | tuple, _Session] = OrderedDict()  # session_of key, least recently seen first
        self.watermark: dict[tuple, int] = {}  # partition -> newest event time read (ms)
        self.waiting = 0
        self.turns_seen: OrderedDict[tuple, tuple] = OrderedDict()  # (session key, request_id) -> tp
        self.duplicates = 0
        self.stale = 0
        self.conversations = 0  # new conversations of a known session (indices restarted)
        self.grace_ms = int(feedback_grace_s * 1000)
        self.outcome_hold = outcome_hold
        self.discount = outcome_discount
        self.late: Counter = Counter()  # feedback and outcomes that came after their turn was decided, by reason
        self.on_late = on_late or (lambda reason: None)  # called with each reason counted in late
        self._holding: dict[tuple, set] = {}  # partition -> sessions holding jobs with a due time

    # ---- records ---------------------------------------------------------------------------
    def on_record(self, rec) -> tuple[bool, list[Job]]:
        """Process one record; returns ``(ack_now, jobs)``."""
        ev = rec.event
        if not isinstance(ev, (events.Turn, events.NextState, events.SessionEnd, events.Feedback)):
            return True, []
        if isinstance(ev, events.Turn) and ev.turn_type != "main":
            return True, []
        at = event_time(rec)
        if at > self.watermark.get(rec.tp, -1):
            self.watermark[rec.tp] = at
        due = self._due(rec.tp) if self._holding.get(rec.tp) else []
        if isinstance(ev, events.Feedback):
            self._on_feedback(ev)
            return True, due  # a restart re-reads it: its turn's record is not acknowledged before it is decided
        ack, jobs = self._on_record(rec, ev, at)
        return ack, due + jobs

    def _on_record(self, rec, ev, at: int) -> tuple[bool, list[Job]]:
        if isinstance(ev, events.Turn):
            return self._on_turn(rec, ev, at)
        sid = session_of(ev)
        st = self.sessions.get(sid)
        if st is None:
            return True, []  # next state / end of a session we hold nothing for
        now = self.clock()
        self._touch(sid, st, at)
        if isinstance(ev, events.SessionEnd):
            if ev.turn_index is not None and ev.turn_index != st.last_index:
                return True, []  # overtaken by a newer turn of the session
            return True, self._close(sid, ev.reason if ev.reason == "idle_timeout" else "session_end", now, at,
                                     ev.outcome)
        if st.waiting is None:
            return True, []
        wrec, turn = st.waiting
        if ev.after_turn_index is not None and ev.after_turn_index != turn.turn_index:
            return True, []  # belongs to another turn (stale or out of protocol)
        if not ev.messages:
            return True, [self._flush(sid, st, "empty_next_state", now, at)]
        st.waiting = None
        self.waiting -= 1
        job = Job(JUDGE, sid, st.tp, turn=turn, record=wrec, next_state=list(ev.messages),
                  candidate=self.at_least_one, acks=self._acks(st, wrec), decided_at=at, joined_at=now,
                  conversation=st.conversation, feedback=self._take_feedback(st))
        due = None if self.outcome_hold else at + self.grace_ms if self.grace_ms > 0 else -1
        return True, self._hold(sid, st, [job], due)

    def _on_turn(self, rec, ev: events.Turn, at: int) -> tuple[bool, list[Job]]:
        sid = session_of(ev)
        if ev.request_id and (sid, ev.request_id) in self.turns_seen:
            self.duplicates += 1
            return True, []  # the same turn record again (a producer retry, a replayed copy)
        now = self.clock()
        jobs: list[Job] = []
        st = self.sessions.get(sid)
        if st is None:
            st = self.sessions[sid] = _Session(rec.tp, last_ts=at)
            jobs += self._bound(now, at)
        self._remember(sid, ev, rec.tp)
        index = ev.turn_index if ev.turn_index is not None else st.last_index + 1
        if index <= st.last_index:
            if at < st.last_turn_at:  # a late record (it overtook nothing): settle it, keep the waiting one
                self.stale += 1
                self._touch(sid, st, at)
                return False, [Job(FLUSH, sid, st.tp, turn=ev, record=rec, reason="out_of_order", acks=[rec],
                                   decided_at=at, joined_at=now)]
        # the indices restarted, or a turn at the index of one already settled: a new conversation
        restarted = index < st.last_index or (index == st.last_index and st.waiting is None)
        if st.waiting is not None:
            jobs += self._hold(sid, st, [self._flush(sid, st, "no_next_state", now, at)],
                               None if self.outcome_hold else -1)
        if restarted:  # the conversation ended: what it held is decided now, without an outcome
            jobs += self._unhold(sid, st)
            jobs += self._release(sid, st, now, at)
            st.conversation = Conversation()
            self.conversations += 1
        if self.at_least_one and st.anchor is None:
            st.anchor = rec  # held until the conversation ends: a restart re-reads it whole
        st.waiting = (rec, ev)
        st.last_index, st.last_turn_at = index, at
        self.waiting += 1
        self._touch(sid, st, at)
        if not finished(ev):
            jobs += self._hold(sid, st, [self._flush(sid, st, "unfinished", now, at)], -1)
        return False, jobs

    def idle_sessions(self, ready=lambda tp: True) -> list[tuple[str | tuple, tuple, int, int]]:
        """Sessions to propose an idle end for: ``(session key, tp, latest main turn index,
        watermark)``, the key as :func:`session_of` (:func:`split_session` gives the tenant and
        id), the watermark (ms) being the end's event time.

        A session qualifies when it holds a waiting turn or an open conversation's anchor, no end
        was proposed since its latest record, its newest record is ``idle_timeout_s`` older
        (event time) than the newest record read from its partition, and ``ready(tp)`` (the
        caller has read its partition to the end). Returned sessions are marked proposed. This only *proposes*: the session is
        closed when the published ``SessionEnd`` is read back (:meth:`on_record`).
        """
        if self.idle_s <= 0:
            return []
        out = []
        for sid, st in self.sessions.items():
            if st.idle_proposed or (st.waiting is None and st.anchor is None and not st.held):
                continue
            mark = self.watermark.get(st.tp, -1)
            if mark - st.last_ts < self.idle_ms or not ready(st.tp):
                continue
            st.idle_proposed = True
            out.append((sid, st.tp, st.last_index, mark))
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
        for tp in tps:
            self.watermark.pop(tp, None)
            self._holding.pop(tp, None)
        return len(gone)

    # ---- internals ---------------------------------------------------------------------------
    def _remember(self, sid: str | tuple, turn: events.Turn, tp: tuple) -> None:
        if not turn.request_id:
            return
        self.turns_seen[(sid, turn.request_id)] = tp
        if len(self.turns_seen) > MAX_REMEMBERED_TURNS:
            self.turns_seen.popitem(last=False)

    def _bound(self, now: float, at: int) -> list[Job]:
        """Forget the least recently seen sessions that hold no waiting turn, above
        :data:`MAX_SESSIONS` (their anchors are released: a later turn starts a new conversation)."""
        jobs: list[Job] = []
        while len(self.sessions) > MAX_SESSIONS:
            old = next((k for k, st in self.sessions.items() if st.waiting is None and not st.held), None)
            if old is None:
                break  # every remembered session waits: the idle horizon bounds them
            jobs += self._release(old, self.sessions.pop(old), now, at)
        return jobs

    def _release(self, sid: str, st: _Session, now: float, at: int) -> list[Job]:
        """The conversation ended: a job that acknowledges its anchor after the session's earlier outputs."""
        anchor, st.anchor = st.anchor, None
        if anchor is None:
            return []
        return [Job(RELEASE, sid, st.tp, record=anchor, acks=[anchor], decided_at=at, joined_at=now)]

    def _touch(self, sid: str, st: _Session, at: int) -> None:
        st.last_ts = max(st.last_ts, at)
        st.idle_proposed = False
        self.sessions.move_to_end(sid)

    def _flush(self, sid: str, st: _Session, reason: str, now: float, at: int) -> Job:
        """Settle the waiting turn without a next state."""
        wrec, turn = st.waiting
        st.waiting = None
        self.waiting -= 1
        return Job(FLUSH, sid, st.tp, turn=turn, record=wrec, reason=reason, acks=self._acks(st, wrec),
                   decided_at=at, joined_at=now, feedback=self._take_feedback(st))

    @staticmethod
    def _acks(st: _Session, rec) -> list:
        """What settling ``rec`` acknowledges: nothing while it is its conversation's anchor."""
        return [] if rec is st.anchor else [rec]

    def _close(self, sid: str, reason: str, now: float, at: int, outcome: float | None = None) -> list[Job]:
        """The session ended: its held jobs and its waiting turn are decided now, the outcome
        (when given) credited to them (:meth:`_credit`), then the conversation's anchor released."""
        st = self.sessions.pop(sid)
        jobs = self._unhold(sid, st)
        if st.waiting is not None:
            jobs.append(self._flush(sid, st, reason, now, at))
        self._credit(jobs, outcome)
        return jobs + self._release(sid, st, now, at)

    # ---- feedback, outcomes, held jobs (docs/feedback.md) ----------------------------------------
    def _credit(self, jobs: list[Job], outcome: float | None) -> None:
        """Credit a session's ``outcome`` to the main turns decided at its end (``jobs``, in turn
        order; unfinished and out-of-order turns are never trained): the last gets ``outcome``,
        the one k turns before it ``outcome * discount ** k``. None: nothing to credit."""
        if outcome is None:
            return
        turns = [j for j in jobs if j.kind in (JUDGE, FLUSH) and j.reason not in ("unfinished", "out_of_order")]
        if not turns:
            self._late("outcome_after_decision")
            return
        for k, job in enumerate(reversed(turns)):
            job.outcome = outcome * self.discount ** k

    @staticmethod
    def _names(fb: events.Feedback, turn: events.Turn) -> bool:
        """``fb`` is about ``turn``: its request id when the feedback names one, else its index."""
        if fb.turn_request_id is not None and turn.request_id:
            return fb.turn_request_id == turn.request_id
        return fb.turn_index == turn.turn_index

    def _on_feedback(self, fb: events.Feedback) -> None:
        """Attach ``fb`` to its turn if that turn is still undecided (the last one read wins), else
        count it in :attr:`late` by reason (``after_decision``: its turn was decided before;
        ``unfinished``: its turn's generation did not finish, it never trains; ``unknown_turn``:
        this judge holds no record of its turn)."""
        sid = session_of(fb)
        st = self.sessions.get(sid)
        if st is not None and st.waiting is not None and self._names(fb, st.waiting[1]):
            st.feedback = fb
            return
        for _due, job in st.held if st is not None else ():
            if job.turn is not None and job.kind in (JUDGE, FLUSH) and self._names(fb, job.turn):
                if job.reason in ("unfinished", "out_of_order"):
                    self._late("unfinished")
                    return
                job.feedback = fb
                return
        seen = fb.turn_request_id is not None and (sid, fb.turn_request_id) in self.turns_seen
        self._late("after_decision" if seen else "unknown_turn")

    def _late(self, reason: str) -> None:
        self.late[reason] += 1
        self.on_late(reason)

    @staticmethod
    def _take_feedback(st: _Session):
        fb, st.feedback = st.feedback, None
        return fb

    def _hold(self, sid, st: _Session, jobs: list[Job], due: int | None) -> list[Job]:
        """Jobs of a session leave in its order: with ``due`` -1 and nothing held they leave now;
        else they are held until the partition's event time reaches ``due`` (ms) or, for None,
        until the conversation ends, and behind every job held before them."""
        if due == -1 and not st.held:
            return jobs
        st.held.extend([due, j] for j in jobs)
        if due is not None and due >= 0:
            self._holding.setdefault(st.tp, {})[sid] = None
        return self._release_due(sid, st)

    def _release_due(self, sid, st: _Session) -> list[Job]:
        mark = self.watermark.get(st.tp, -1)
        out = []
        while st.held and st.held[0][0] is not None and st.held[0][0] <= mark:
            out.append(st.held.pop(0)[1])
        if not any(d is not None and d >= 0 for d, _j in st.held):
            self._holding.get(st.tp, {}).pop(sid, None)
        return out

    def _due(self, tp: tuple) -> list[Job]:
        """The held jobs of ``tp``'s sessions whose grace window its event time has passed."""
        out: list[Job] = []
        for sid in list(self._holding.get(tp, {})):
            st = self.sessions.get(sid)
            if st is None:
                self._holding[tp].pop(sid, None)
                continue
            out += self._release_due(sid, st)
        return out

    def _unhold(self, sid, st: _Session) -> list[Job]:
        """Every job ``st`` holds, now (its conversation ended)."""
        jobs = [j for _d, j in st.held]
        st.held = []
        self._holding.get(st.tp, {}).pop(sid, None)
        return jobs
