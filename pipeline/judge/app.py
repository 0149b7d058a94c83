"""The judge process: a consumer group on ``turns`` that produces scored ``samples``.

Threads: the consumer loop (:class:`pipeline.bus.ConsumerApp`, kafka-python, synchronous) runs
the join (:class:`pipeline.judge.join.Joiner`); judge jobs go to an asyncio event loop in a
worker thread, where the backend's HTTP calls (votes, teacher) run concurrently. Per session,
jobs may score concurrently but their samples are *sent* in turn order (each job waits for the
previous job of its session), and the records a job settles are acknowledged only when the
broker has confirmed its sample (the producer's delivery callback calls ``ConsumerApp.ack``).
The committed offset of a partition is the lowest unacknowledged offset, so a crash (even
``kill -9``) re-delivers exactly the unsettled tail: no sample is lost, and a re-produced
sample carries the same ``sample_id``.

Several proxies: records of one session can reach ``turns`` out of protocol order (each proxy
is its own producer); :class:`pipeline.judge.reorder.Reorderer` holds the early ones (not
acknowledged) and hands the join each session in protocol order.

Backpressure: at most ``judge.max_in_flight`` jobs are in flight (submitted, not yet
delivered); the consumer loop waits for room, and the ConsumerApp pauses its partitions when
more than ``judge.max_uncommitted_records`` records are unacknowledged.

Idle sessions: every tick, sessions whose latest record is ``judge.idle_timeout_s`` (event time)
behind their partition's newest record, on partitions this member has read to the end, get a
``SessionEnd(reason="idle_timeout", turn_index=...)`` published to ``turns`` (keyed by the
session id, so it lands in the session's partition after everything already there); the session
is closed when that record is read back (:mod:`pipeline.judge.join`). Explicit feedback and
session outcomes join their turns there too; :mod:`pipeline.judge.feedback` decides which source
gives a turn's reward (``reward_source`` on every sample). Samples are functions of
the records alone (:mod:`pipeline.judge.samples`). Every main turn that ends without a judgement
is counted in ``pipeline_judge_unjudged_turns_total{reason}``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque

from pipeline import events
from pipeline.bus import NOT_QUEUED, ConsumerApp, EventProducer
from pipeline.engine_api.errors import EngineError
from pipeline.judge import metrics
from pipeline.judge.backends import Backend, HintVerdict, Verdict, make_backend
from pipeline.judge.feedback import RewardPolicy, explicit_sample
from pipeline.judge.join import FLUSH, RELEASE, Job, Joiner, split_session
from pipeline.judge.prompts import JudgeInput
from pipeline.judge.published import published_rl_decisions
from pipeline.judge.reorder import Reorderer
from pipeline.judge.samples import MODES, combine_sample, opd_sample, rl_flush_sample, rl_sample, sample_id
from pipeline.judge.teacher import Teacher, TeacherMisconfigured, TeacherUnsupported

log = logging.getLogger(__name__)
#: hint outcomes that are no judgement (every hint vote failed, or the backend raised)
_HINT_FAILED = ("all_votes_failed", "backend_error")


class _Link:
    """A job's place in its session's chain: ``sent`` and ``delivered`` futures (worker loop)."""

    __slots__ = ("sent", "delivered")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.sent = loop.create_future()
        self.delivered = loop.create_future()


class JudgeApp:
    """One judge process (see the module docstring).

    Args:
        config: the process config (``judge``, ``kafka``, ``topics``, ``engine`` sections).
        mode: ``rl``, ``opd`` or ``combine`` (default ``judge.mode``).
        backend: a constructed :class:`Backend` (default: ``judge.backend`` by name/import path).
        teacher: a :class:`Teacher` for OPD/combine (default: built from ``engine.model``).
        group_id: consumer group (default ``judge.group_id``).
        name: stage name in metrics, logs and dead letters.
    Raises:
        ValueError: unknown mode. :class:`pipeline.judge.backends.BackendError`: bad backend.
    """

    def __init__(self, config, mode: str | None = None, backend: Backend | None = None,
                 teacher: Teacher | None = None, group_id: str | None = None, name: str = "judge") -> None:
        jc = config.judge
        self.config, self.name = config, name
        self.mode = mode or jc.mode
        if self.mode not in MODES:
            raise ValueError(f"judge mode must be one of {MODES}, got {self.mode!r}")
        self.backend = backend if backend is not None else make_backend(jc.backend, config)
        self.judge_name = getattr(self.backend, "name", type(self.backend).__name__)
        self.teacher = teacher if teacher is not None or self.mode == "rl" else Teacher(config)
        self.samples_topic = config.topics.name("samples")
        self.turns_topic = config.topics.name("turns")
        self.dlq_topic = config.topics.dlq("turns")
        self.producer = EventProducer(config, name=name)
        self.consumer = ConsumerApp(config, group_id=group_id or jc.group_id, topics=[config.topics.name("turns")],
                                    name=name, max_in_flight=jc.max_uncommitted_records, producer=self.producer,
                                    fetch_max_wait_ms=jc.fetch_max_wait_ms)
        self.policy = RewardPolicy.of(jc)  # judge votes, explicit feedback, session outcomes (docs/feedback.md)
        self.joiner = Joiner(jc.idle_timeout_s, at_least_one=(self.mode == "rl"), feedback_grace_s=jc.feedback_grace_s,
                             outcome_hold=jc.outcome_hold, outcome_discount=jc.outcome_discount,
                             on_late=lambda reason: metrics.LATE_SIGNALS.labels(reason).inc())
        # records of one session from several proxies: restore the protocol order before the join
        self.reorder = Reorderer(lateness_s=jc.reorder_lateness_s, max_wait_s=max(jc.reorder_lateness_s,
                                                                                   jc.idle_timeout_s))
        self.max_jobs = max(1, jc.max_in_flight)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"{name}-worker", daemon=True)
        self._queue: deque[Job] = deque()
        self._scheduled = False
        self._qlock = threading.Lock()
        self._cond = threading.Condition()
        self._jobs = 0
        self._chains: dict[str, _Link] = {}
        self.fatal: BaseException | None = None
        self.samples_sent = 0
        self.published: dict[str, int] = {}  # rl: sample_id -> loss_mask already published (re-read turns)

    # ---- lifecycle ---------------------------------------------------------------------------
    def run(self, install_signals: bool = True) -> int:
        """Consume until stopped (SIGTERM/SIGINT or :meth:`stop`); returns the exit status."""
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._astart(), self.loop).result()
            tick_s = min(1.0, max(0.05, self.config.judge.idle_timeout_s / 4))  # idle proposals
            self.consumer.run(self._handle, tick=self._tick, tick_interval_s=tick_s,
                              on_assigned=self._assigned, on_revoked=self._revoked, on_stop=self._drain,
                              drain_timeout_s=1.0, install_signals=install_signals)
        finally:
            try:
                asyncio.run_coroutine_threadsafe(self._aclose(), self.loop).result(timeout=10)
            except Exception:
                log.exception("%s: closing the backend failed", self.name)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.producer.close()
        if self.fatal is not None:
            log.error("%s: stopped on a fatal error: %s", self.name, self.fatal)
            return 1
        return 0

    def stop(self) -> None:
        """Ask the judge to finish (thread-safe): in-flight jobs are drained, offsets committed."""
        self.consumer.stop()

    async def _astart(self) -> None:
        await self.backend.start()
        if self.teacher is not None:
            await self.teacher.start()
            await self.teacher.check_at_start()

    async def _aclose(self) -> None:
        await self.backend.aclose()
        if self.teacher is not None:
            await self.teacher.aclose()

    # ---- consumer-thread callbacks ----------------------------------------------------------
    def _handle(self, rec) -> bool:
        ev = rec.event
        if isinstance(ev, events.Turn) and ev.turn_type == "main":
            metrics.TURNS.inc()
        ack = False  # a held record is not acknowledged now: later, when the join is done with it
        for r in self.reorder.on_record(rec):
            done = self._join(r)
            if r is rec:
                ack = done
            elif done:
                self.consumer.ack(r)
        return ack

    def _join(self, rec) -> bool:
        """Run the join on one record (in protocol order); returns whether it can be acknowledged now."""
        duplicates, conversations = self.joiner.duplicates, self.joiner.conversations
        ack, jobs = self.joiner.on_record(rec)
        if self.joiner.duplicates > duplicates:
            metrics.DUPLICATE_TURNS.inc()
        if self.joiner.conversations > conversations:
            metrics.NEW_CONVERSATIONS.inc()
        if jobs:
            self._submit(jobs)
        return ack

    def _tick(self) -> None:
        """Propose idle ends (published records, acted on when read back) for idle sessions and
        for sessions whose reordered records wait too long; update gauges."""
        stalled = self.reorder.stalled(ready=self.consumer.caught_up)  # their end releases them
        for skey, _tp, turn_index, at in stalled + self.joiner.idle_sessions(ready=self.consumer.caught_up):
            tenant, sid = split_session(skey)
            end = events.SessionEnd(session_id=sid, reason="idle_timeout", created_at=at, turn_index=turn_index,
                                    tenant=tenant)
            try:
                self.producer.send(self.turns_topic, end, key=events.session_key(tenant, sid))
            except NOT_QUEUED as e:  # proposed again after its next record
                log.warning("%s: could not publish the idle end of %s (%s)", self.name, sid, e)
                continue
            metrics.IDLE_ENDS.inc()
        metrics.SESSIONS_WAITING.set(self.joiner.waiting)
        metrics.RECORDS_HELD.set(self.reorder.held)

    def _assigned(self, tps: set) -> None:
        """Binary RL: read back the decisions already published for the records these partitions
        will re-deliver (:mod:`pipeline.judge.published`), so that they are copied, not retaken."""
        if self.mode == "rl" and tps:
            self.published.update(published_rl_decisions(self.config, self.consumer.group_id, tps,
                                                         self.judge_name))

    def _revoked(self, tps: set) -> None:
        # the group rebalances eagerly (every partition revoked, then the new assignment given
        # whole): the decisions are read again for that assignment, so none are kept unbounded
        self.published.clear()
        self.reorder.drop_partitions(tps)
        n = self.joiner.drop_partitions(tps)
        metrics.SESSIONS_WAITING.set(self.joiner.waiting)
        log.info("%s: dropped %d sessions of revoked partitions %s", self.name, n, sorted(tps))

    def _drain(self) -> None:
        deadline = time.monotonic() + self.config.judge.drain_timeout_s
        with self._cond:
            while self._jobs and time.monotonic() < deadline:
                self._cond.wait(timeout=0.05)
            left = self._jobs
        if left:
            log.warning("%s: %d judge jobs still in flight at shutdown (their records will be re-delivered)",
                        self.name, left)

    def _submit(self, jobs: list[Job]) -> None:
        with self._cond:
            while self._jobs >= self.max_jobs and not self.consumer.stopping:
                self._cond.wait(timeout=0.1)
            self._jobs += len(jobs)
            metrics.JOBS_IN_FLIGHT.set(self._jobs)
        with self._qlock:
            self._queue.extend(jobs)
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._start_jobs)

    def _job_done(self) -> None:
        with self._cond:
            self._jobs -= 1
            metrics.JOBS_IN_FLIGHT.set(self._jobs)
            self._cond.notify_all()

    # ---- worker loop ------------------------------------------------------------------------
    def _start_jobs(self) -> None:
        with self._qlock:
            jobs = list(self._queue)
            self._queue.clear()
            self._scheduled = False
        for job in jobs:
            prev = self._chains.get(job.session)
            link = _Link(self.loop)
            self._chains[job.session] = link
            link.delivered.add_done_callback(lambda _f, sid=job.session, lk=link: self._unchain(sid, lk))
            self.loop.create_task(self._run_job(job, prev, link))

    def _unchain(self, sid, link: _Link) -> None:
        if self._chains.get(sid) is link:
            del self._chains[sid]

    async def _run_job(self, job: Job, prev: _Link | None, link: _Link) -> None:
        outputs: list[tuple[str, bytes]] = []
        try:
            try:
                # encode here: a sample that fails validation becomes a dead letter, not a crash
                outputs = [(topic, events.encode(ev)) for topic, ev in await self._compute(job, prev)]
            except Exception as e:  # a bug or an unexpected answer: never lose the turn silently
                metrics.UNJUDGED.labels("judge_error").inc()
                log.exception("%s: judging %s turn %s failed", self.name, job.session_id,
                              job.turn.turn_index if job.turn else "-")
                topic, dl = self._dead_letter(job, f"judge error: {type(e).__name__}: {e}")
                outputs = [(topic, events.encode(dl))]
            if prev is not None and not prev.sent.done():
                await asyncio.shield(prev.sent)
            if outputs:
                await self._send(job, outputs, link)
            else:
                if prev is not None and not prev.delivered.done():
                    await asyncio.shield(prev.delivered)
                self._settle(job, link)
        except Exception as e:  # the producer refused the record: stop, the input will be re-delivered
            self._fail(job, e)
        finally:
            if not link.sent.done():
                link.sent.set_result(None)

    def _fail(self, job: Job, exc: BaseException) -> None:
        if self.fatal is None:
            self.fatal = exc
        log.error("%s: output of %s could not be delivered (%s): stopping", self.name, job.session_id, exc)
        self.consumer.stop()
        self._job_done()

    async def _send(self, job: Job, outputs: list[tuple[str, bytes]], link: _Link) -> None:
        remaining = [len(outputs), False]  # left to deliver, failed
        lock = threading.Lock()

        def on_delivery(exc) -> None:  # producer I/O thread
            with lock:
                if remaining[1]:
                    return
                if exc is not None:
                    remaining[1] = True
                else:
                    remaining[0] -= 1
                last = remaining[0] == 0
            if exc is not None:
                self._fail(job, exc)
            elif last:
                self.loop.call_soon_threadsafe(self._settle, job, link)

        for topic, value in outputs:
            while True:
                try:
                    self.producer.send(topic, value, key=job.key, on_delivery=on_delivery)
                    break
                except NOT_QUEUED as e:
                    log.warning("%s: producer busy (%s), retrying", self.name, e)
                    await asyncio.sleep(0.2)
            if topic == self.samples_topic:
                self.samples_sent += 1
        link.sent.set_result(None)

    def _settle(self, job: Job, link: _Link) -> None:
        """The job's outputs are delivered: acknowledge its records (worker loop)."""
        for r in job.acks:
            self.consumer.ack(r)
        metrics.LATENCY.observe(time.monotonic() - job.joined_at)
        if not link.delivered.done():
            link.delivered.set_result(None)
        self._job_done()

    # ---- scoring ---------------------------------------------------------------------------
    async def _compute(self, job: Job, prev: _Link | None = None) -> list[tuple[str, events.Event]]:
        turn, at = job.turn, job.decided_at
        if job.kind == RELEASE:  # a conversation ended: only its anchor record to acknowledge
            return []
        if self.published and (mask := self.published.pop(sample_id(turn, "rl"), None)) is not None:
            if prev is not None and not prev.sent.done():  # in the conversation's order
                await asyncio.shield(prev.sent)
            if mask and job.conversation is not None:
                job.conversation.trained = True
            metrics.REUSED.inc()
            return []  # decided before a restart: the published sample stands
        if job.feedback is not None or job.outcome is not None:
            explicit = await self._explicit(job, prev)
            if explicit is not None:
                return explicit
        if job.kind == FLUSH:
            metrics.FLUSHED.labels(job.reason).inc()
            metrics.UNJUDGED.labels(job.reason).inc()
            if job.reason == "unfinished":
                metrics.UNFINISHED.labels(str(turn.finish_reason)).inc()
            if self.mode == "rl":
                return self._samples([rl_flush_sample(turn, self.judge_name, at)])
            return []
        inp = JudgeInput.from_turn(turn, job.next_state)
        if self.mode == "rl":
            verdict = await self._score(inp)
            if verdict.all_failed:
                metrics.UNJUDGED.labels("votes_failed").inc()
            return self._samples([await self._rl_judged(job, verdict, prev)])
        if self.mode == "opd":
            hv = await self._hint(inp)
            if not hv.hint:
                metrics.DROPPED.labels("no_hint").inc()
                if hv.reason in _HINT_FAILED:
                    metrics.UNJUDGED.labels("votes_failed").inc()
                return []
            try:
                teacher = await self.teacher.log_probs(turn, hv.hint)
            except TeacherUnsupported as e:
                metrics.TEACHER_UNSUPPORTED.labels(e.reason).inc()
                metrics.DROPPED.labels("teacher_unsupported").inc()
                log.info("%s: no OPD sample for %s turn %s: %s", self.name, turn.session_id, turn.turn_index, e)
                return []
            except (TeacherMisconfigured, EngineError) as e:
                metrics.TEACHER_FAILURES.inc()
                return [self._dead_letter(job, f"teacher failed: {e}")]
            return self._samples([opd_sample(turn, hv.hint, teacher, hv.votes, self.judge_name, at)])
        # combine
        verdict, hv = await asyncio.gather(self._score(inp), self._hint(inp))
        if verdict.all_failed and hv.reason in _HINT_FAILED:  # no judgement at all (either one is one)
            metrics.UNJUDGED.labels("votes_failed").inc()
        teacher = None
        if hv.hint:
            try:
                teacher = await self.teacher.log_probs(turn, hv.hint)
            except TeacherUnsupported as e:
                metrics.TEACHER_UNSUPPORTED.labels(e.reason).inc()
                log.info("%s: no OPD term for %s turn %s: %s", self.name, turn.session_id, turn.turn_index, e)
            except (TeacherMisconfigured, EngineError) as e:
                metrics.TEACHER_FAILURES.inc()
                log.warning("%s: teacher failed for %s turn %s: %s", self.name, turn.session_id, turn.turn_index, e)
        s = combine_sample(turn, verdict.score, hv.hint if teacher is not None else None, teacher,
                           [list(verdict.votes), list(hv.votes)], self.judge_name, at)
        if s is None:
            metrics.DROPPED.labels("no_signal").inc()
            return []
        return self._samples([s])

    async def _rl_judged(self, job: Job, verdict: Verdict, prev: _Link | None) -> events.Sample:
        """The Binary RL sample of a judged turn, with the at-least-one rule decided in the
        conversation's order: once the previous job of the session has sent its sample, a vote
        of 0 is promoted when the conversation has trained nothing yet (:mod:`pipeline.judge.join`)."""
        if prev is not None and not prev.sent.done():
            await asyncio.shield(prev.sent)
        conv = job.conversation
        promote = job.candidate and conv is not None and not conv.trained
        s = rl_sample(job.turn, verdict, promote, self.judge_name, job.decided_at)
        if s.loss_mask and conv is not None:
            conv.trained = True
        if promote and s.loss_mask and verdict.score == 0:
            metrics.PROMOTED.inc()
        return s

    async def _explicit(self, job: Job, prev: _Link | None) -> list[tuple[str, events.Event]] | None:
        """The sample of a turn with explicit feedback or a session outcome (:mod:`pipeline.judge.feedback`):
        the judge votes only when they can change the reward, a feedback comment is the hint (no hint
        judge), the turn is trained (loss_mask 1). None: it carries no signal (the usual path decides)."""
        turn, fb = job.turn, job.feedback
        inp = JudgeInput.from_turn(turn, job.next_state) if job.kind != FLUSH else None
        fb_score = None if fb is None else fb.score
        ask = inp is not None and self.mode != "opd" and self.policy.needs_judge(fb_score, job.outcome)
        verdict = await self._score(inp) if ask else None
        judged = None if verdict is None or (self.mode == "combine" and verdict.score not in (1, -1)) else verdict.score
        hint, hint_source, hint_votes = (fb.comment, "feedback", []) if fb is not None and fb.comment else (None, None, [])
        if hint is None and self.mode != "rl" and inp is not None:
            hv = await self._hint(inp)
            hint, hint_source, hint_votes = hv.hint, "judge", list(hv.votes)
        reward, source = self.policy.decide(judged, fb_score, job.outcome)
        teacher = await self._hinted_teacher(turn, hint) if hint else None
        prm = list(verdict.votes) if verdict is not None else []
        votes = {"rl": prm, "opd": hint_votes}.get(self.mode, [prm, hint_votes])  # each mode's shape (samples.py)
        s = explicit_sample(turn, self.mode, reward=reward, source=source, rule=self.policy.rule, feedback=fb,
                            outcome=job.outcome, hint=hint, hint_source=hint_source, teacher=teacher, votes=votes,
                            judge=self.judge_name, decided_at=job.decided_at)
        if s is None:
            return None
        if prev is not None and not prev.sent.done():  # the conversation's order (at-least-one rule)
            await asyncio.shield(prev.sent)
        if job.conversation is not None:
            job.conversation.trained = True
        return self._samples([s])

    async def _hinted_teacher(self, turn: events.Turn, hint: str):
        """The teacher's log-probs of ``turn`` under ``hint``, or None (no teacher in ``rl`` mode,
        or it cannot or did not score this turn: the sample then carries no OPD term)."""
        if self.teacher is None:
            return None
        try:
            return await self.teacher.log_probs(turn, hint)
        except TeacherUnsupported as e:
            metrics.TEACHER_UNSUPPORTED.labels(e.reason).inc()
        except (TeacherMisconfigured, EngineError) as e:
            metrics.TEACHER_FAILURES.inc()
            log.warning("%s: teacher failed for %s turn %s: %s", self.name, turn.session_id, turn.turn_index, e)
        return None

    def _samples(self, samples) -> list[tuple[str, events.Event]]:
        for s in samples:
            if s.reward is not None and s.reward_source is None:  # the judge's votes alone
                s.reward_source, s.reward_rule = "judge", self.policy.rule
            if s.reward_source is not None:
                metrics.REWARD_SOURCE.labels(s.reward_source).inc()
            metrics.SAMPLES.labels(s.kind).inc()
        return [(self.samples_topic, s) for s in samples]

    async def _score(self, inp: JudgeInput) -> Verdict:
        try:
            v = await self.backend.score(inp)
        except Exception:
            log.exception("%s: backend %s failed to score", self.name, self.judge_name)
            v = Verdict(None, [None])
            metrics.count_vote(None)
        if v.all_failed:
            metrics.ALL_FAILED.inc()
        metrics.observe_labelled(inp.next_state, v.score)
        return v

    async def _hint(self, inp: JudgeInput) -> HintVerdict:
        try:
            hv = await self.backend.hint(inp)
        except Exception:
            log.exception("%s: backend %s failed to give a hint", self.name, self.judge_name)
            metrics.count_vote(None)
            hv = HintVerdict(None, [None], "backend_error")
        metrics.observe_hint(hv.hint, hv.reason)
        return hv

    def _dead_letter(self, job: Job, error: str) -> tuple[str, events.Event]:
        rec = job.record
        dl = events.DeadLetter(source_topic=rec.topic, partition=rec.partition, offset=rec.offset, error=error,
                               stage=self.name, key=job.key.encode(), raw=events.encode(job.turn),
                               created_at=events.now_ms())
        return (self.dlq_topic, dl)
