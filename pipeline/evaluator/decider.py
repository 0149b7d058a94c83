"""The decider: fold ``control`` + ``metrics`` + ``samples`` + ``turns`` into canaries and publish
each ``promote``/``rollback`` on ``control`` (issue 39; docs/rollout.md "The evaluator stage").

One thread, no consumer group, nothing committed: every start (and every reconnect) rebuilds the
state by reading every partition of the four topics from offset 0 (assign mode,
:class:`pipeline.bus.TopicReader`), as the proxy's control follower does. Per life:

1. **Recorded decisions.** ``control`` is read to its end first (an observer read: bad records
   are left to step 2's dead-lettering) and the ``promote``/``rollback`` of this run already
   there are noted as ``(scope, candidate)``.
2. **Fold.** The four topics are read together; records are held and released in one order
   (:class:`pipeline.evaluator.merge.Merge`: by ``created_at``, then topic, partition, offset;
   ``control`` in its log order) and fed to :class:`pipeline.rollout.fold.RolloutFold`
   (``config.rollout.rule(guards)``, the run's ``run_id``: ``syncer.run_id`` or
   ``trainer.run_id``; a tenant's adapter decided by the live arms, the full weights by
   ``rollout.full_weights_gate``: the eval set's guards alone on one engine, the live arms with
   ``rollout.canary_engines``). A decision the fold returns is published on ``control`` (key: the run
   id, as the trainer's records) and acknowledged by the broker before the next record is
   folded, unless a decision about that candidate is already on ``control`` (step 1, or
   published by this life): it is then never published again. Its own record, read back
   later, changes nothing (the fold already applied it).
3. **Bad records.** A record that does not decode or is not of its topic goes to the topic's
   DLQ (``<topic>.dlq``; :class:`pipeline.bus.TopicReader` rules: after ``DLQ_GIVE_UP_S``
   without delivery it is logged and passed over), and one the fold raises on is dead-lettered
   with the error; folding goes on.
4. **Errors.** A broker error, or a decision the broker did not acknowledge, ends the life:
   after a back-off a new life starts from step 1 (a restart in all but the process).

What "a restart decides the same" means here: a restart folds the same records in the same
order as the live decider did (the merge order does not depend on poll boundaries), so it makes
the same decisions with the same evidence; a decision already on ``control`` is applied, never
published twice. Limits: a record that reached the broker after the live decider had folded a
later record of another partition was folded late live and in its place at a restart; when that
happens inside a canary the restart may decide at another record (other counts, even the other
action). The decision is then still published once at most, and when the fold decided
otherwise than the recorded decision, the record wins (:class:`~pipeline.rollout.fold.RolloutFold`).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from pipeline import events
from pipeline.bus import EventProducer, Offset, Record, TopicReader
from pipeline.config import Config
from pipeline.evaluator import prom
from pipeline.evaluator.lifecycle import DaemonThread
from pipeline.evaluator.merge import Merge
from pipeline.rollout.fold import RolloutFold

log = logging.getLogger(__name__)

#: the topics the decider folds (logical names)
TOPICS = ("control", "metrics", "samples", "turns")
#: the decider passes over a bad record whose dead letter cannot be written for this long (s)
DLQ_GIVE_UP_S = 10.0


def run_id_of(config: Config) -> str:
    """The run whose records count: ``syncer.run_id`` or else ``trainer.run_id`` (as the proxy)."""
    return config.syncer.run_id or config.trainer.run_id


def decision_key(ev: events.Control) -> tuple:
    """``(scope, candidate version)`` of a ``promote``/``rollback``: scope None (full weights,
    version ``policy_version``) or the tenant (version: its adapter's content id)."""
    if ev.full_weights:
        return (None, ev.policy_version)
    return (ev.tenant, (ev.adapter or {}).get("version"))


class Decider(DaemonThread):
    """Fold the records and publish the decisions (module docstring). Runs in its own thread.

    Args:
        config: the process config (``rollout`` enabled, ``kafka``, ``topics``).
        guards: the eval set's declared guards (used when ``rollout.guards`` is empty).
        stop: the owner's stop flag (default: its own).
        on_decision: called with each decision after it was published (tests, logs).

    Attributes:
        published: the decisions this process published, in order (all lives).
        folded: records folded in the current life.
        caught_up: set once a life has folded every record that was on the broker when it read.
    """

    def __init__(self, config: Config, guards: tuple = (), stop: threading.Event | None = None,
                 on_decision: Callable[[events.Control], None] | None = None,
                 backoff_s: float = 0.5, max_backoff_s: float = 5.0) -> None:
        self.config, self.rule, self.run_id = config, config.rollout.rule(tuple(guards)), run_id_of(config)
        self.topic = {t: config.topics.name(t) for t in TOPICS}
        self.stop = stop if stop is not None else threading.Event()
        self.on_decision = on_decision
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.published: list[events.Control] = []
        self.folded = 0
        self.fold: RolloutFold | None = None
        self.caught_up = threading.Event()
        self._producer: EventProducer | None = None
        self._init_thread("evaluator-decider")

    def _closed(self) -> None:
        """After the join: close the producer."""
        if self._producer is not None:
            self._producer.close()
            self._producer = None

    def run(self) -> None:
        """Lives until :attr:`stop` (blocking): each reads everything again (module docstring)."""
        backoff = self.backoff_s
        while not self.stop.is_set():
            try:
                self._life()
                return
            except Exception as e:  # broker trouble, an unacknowledged decision: start again
                log.warning("evaluator: decider failed (%s: %s); reading the records again in %.1f s",
                            type(e).__name__, e, backoff)
                prom.RESTARTS.inc()
                self.caught_up.clear()
                self.stop.wait(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)

    # ---- one life -------------------------------------------------------------------------------
    def recorded(self) -> set:
        """``(scope, candidate)`` of every decision of this run now on ``control`` (read to its end)."""
        out = set()
        with TopicReader(self.config, self.topic["control"], Offset(0), [0], name="evaluator", stop=self.stop,
                         wait_s=10.0) as reader:
            for rec in reader.read():
                ev = getattr(rec, "event", None)
                if isinstance(ev, events.Control) and ev.action in events.ROLLOUT_DECISIONS and ev.run_id == self.run_id:
                    out.add(decision_key(ev))
        return out

    def _life(self) -> None:
        recorded = self.recorded()
        self.fold, self.folded = RolloutFold(self.rule, self.run_id, full_weights=self.config.rollout.full_weights_gate), 0
        merge = Merge(self.topic["control"])
        log.info("evaluator: decider folds %s from offset 0 (%d decisions already on control)",
                 ", ".join(self.topic.values()), len(recorded))
        with TopicReader(self.config, list(self.topic.values()), Offset(0), name="evaluator", dlq=True,
                         dlq_give_up_s=DLQ_GIVE_UP_S, stop=self.stop, wait_s=10.0) as reader:
            polls = 0
            while not self.stop.is_set():
                merge.add(reader.poll(300))
                for rec in merge.release(reader.assignment(), reader.lag()):
                    self._fold(reader, rec, recorded)
                if not self.caught_up.is_set() and not len(merge) and reader.caught_up():
                    self.caught_up.set()
                    log.info("evaluator: decider caught up (%d records folded)", self.folded)
                polls += 1
                if polls % 20 == 0:
                    reader.refresh()  # partitions added meanwhile

    def _fold(self, reader: TopicReader, rec: Record, recorded: set) -> None:
        try:
            decision = self.fold.apply(rec.event)
        except Exception as e:  # one record never stops the decider
            log.exception("evaluator: folding %s[%d]@%d failed", rec.topic, rec.partition, rec.offset)
            reader.dead_letter(rec, f"evaluator: fold failed: {type(e).__name__}: {e}")
            return
        self.folded += 1
        if decision is None:
            return
        key = decision_key(decision)
        if key in recorded:
            log.info("evaluator: %s of %s already on control: applied, not published again", decision.action, key)
            return
        self._publish(decision)
        recorded.add(key)

    def _publish(self, decision: events.Control) -> None:
        """Publish and wait for the broker (raises on failure: the life ends, nothing is lost)."""
        if self._producer is None:
            self._producer = EventProducer(self.config, name="evaluator")
        self._producer.send(self.topic["control"], decision, key=decision.run_id).get(timeout=30)
        self.published.append(decision)
        prom.DECISIONS.labels(decision.action).inc()
        ev = decision.evidence
        what = (f"full weights v{decision.policy_version}" if decision.tenant is None else
                f"{decision.tenant}'s adapter {(decision.adapter or {}).get('name')}")
        log.info("evaluator: published %s of %s (%s; reward %s candidate vs %s incumbent)", decision.action,
                 what, ev["reason"], ev["arms"]["candidate"].get("reward"), ev["arms"]["incumbent"].get("reward"))
        if self.on_decision is not None:
            self.on_decision(decision)
