"""What the dashboard knows: a fold of the topics' records plus the stages' Prometheus samples.

:class:`DashboardState` is fed every record the dashboard's topic reader sees (``turns``,
``samples``, ``control``, ``metrics`` and every dead-letter topic) and keeps compact views:
per-session turn summaries, the samples of each turn, the trainer's steps, the weight syncs,
evaluations, dead letters and the live metrics per version (:mod:`pipeline.rollout.live`: the
versions view). Without ``show_text`` no conversation text is ever stored: the
views of :mod:`pipeline.dashboard.views` replace it with lengths at ingestion.

Counts follow the topics: every record of a topic counts once (a ``turns`` record is a turn,
next state or session end); samples are counted by distinct ``sample_id`` (a re-delivered
sample after a crash is counted as a duplicate, not twice); a trainer step redone after a
restart replaces the earlier record of that step. Thread-safe: one lock around every call.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from pipeline import events
from pipeline.bus import Record, Undecodable
from pipeline.config import Config
from pipeline.dashboard import views
from pipeline.rollout.live import LiveVersions

log = logging.getLogger(__name__)
BUCKET_S = 10  # width of the traffic timeline's buckets (seconds)
MAX_BUCKETS = 8640  # one day of 10-second buckets
TRAINER_KEYS = ("loss", "pg_loss", "kl", "ppo_kl", "entropy", "pg_clipfrac", "logprob_abs_diff",
                "logprob_abs_diff_current", "logprob_abs_diff_stale", "reward_mean", "rl_samples", "opd_samples",
                "grad_norm", "step_s", "sync_s", "consume_s", "export_s", "train_samples", "train_tokens", "staleness_mean",
                "masked", "duplicates", "stale_dropped", "dead_letters")


@dataclass
class SessionView:
    """One session as the browser shows it (text only when the dashboard stores text)."""

    session_id: str
    tenant: str | None = None  # sessions of two tenants with one id are two sessions
    first_ms: int = 0
    last_ms: int = 0
    turns: list[dict] = field(default_factory=list)  # turn views in topic order (main and side)
    next_states: dict[int, list[dict]] = field(default_factory=dict)  # after_turn_index -> views
    samples: dict[int, dict[str, dict]] = field(default_factory=dict)  # turn_index -> sample_id -> view
    feedback: dict[int, list[dict]] = field(default_factory=dict)  # turn_index -> feedback views, in topic order
    end: dict | None = None

    def touch(self, ms: int) -> None:
        self.first_ms = min(self.first_ms, ms) if self.first_ms else ms
        self.last_ms = max(self.last_ms, ms)


class DashboardState:
    """The fold described in the module docstring.

    Args:
        config: the process config (topic names, ``dashboard.show_text``, limits).
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.text = config.dashboard.show_text
        self.max_sessions = config.dashboard.max_sessions
        self.max_errors = config.dashboard.max_errors
        t = config.topics
        self.logical = {t.name(n): n for n in ("turns", "samples", "control", "metrics")}
        self.lock = threading.Lock()
        self.version = 0  # bumped on every change (the live stream sends only after a change)
        self._clear()

    def _clear(self) -> None:
        # topics
        self.records: Counter = Counter()  # physical topic -> records read
        self.undecodable: Counter = Counter()
        self.unprocessable: Counter = Counter()  # decoded records the fold could not use (logged)
        self.positions: dict[tuple[str, int], int] = {}  # next offset per partition read
        # turns
        self.counts: Counter = Counter()
        #: keyed by :func:`pipeline.events.session_of` (the id, or ``(tenant, id)``); least recently active first
        self.sessions: OrderedDict[str | tuple[str, str], SessionView] = OrderedDict()
        self.session_ids: set[str | tuple[str, str]] = set()  # every session seen (also evicted ones)
        self.ended: set[str | tuple[str, str]] = set()
        self.turn_buckets: Counter = Counter()  # bucket start (s) -> main+side turns
        self.housekeeping: Counter = Counter()  # "<agent>:<kind>" -> an agent's own upkeep calls (side turns)
        self.sample_buckets: Counter = Counter()
        # samples
        self.samples: dict[str, dict] = {}  # sample_id -> compact view (for the overview counters)
        self.duplicate_samples = 0
        # trainer, control, evaluations
        self.steps: dict[int, dict] = {}  # step -> record
        self.trained: dict[str, dict] = {}  # sample_id -> {"step", "advantage", "policy_version"}
        #: (run_id, tenant, epoch) -> pause/weights/applied/resume times; tenant None: the full weights,
        #: else that tenant's adapter sync (its epoch counts its own updates: two tenants' epoch 1 are two syncs)
        self.syncs: dict[tuple[str, str | None, int], dict] = {}
        self.evaluations: dict[tuple[str, int], dict] = {}
        #: live metrics per version (the versions view), of this run's control (``trainer.run_id``)
        self.live_versions = LiveVersions(run_id=self.config.trainer.run_id, rollout=self.config.rollout.enabled)
        # dead letters
        self.dlq_counts: Counter = Counter()
        self.dlq_latest: dict[str, deque] = {}

    def reset(self) -> None:
        """Forget everything (the topic reader starts over, e.g. after losing the broker)."""
        with self.lock:
            self.version += 1
            self._clear()

    # ---- ingestion ----------------------------------------------------------------------------
    def apply(self, rec: Record | Undecodable) -> None:
        """Fold one record (in offset order per partition). Never raises: a record the fold
        cannot use is logged and counted in ``unprocessable``."""
        with self.lock:
            self.version += 1
            self.records[rec.topic] += 1
            self.positions[(rec.topic, rec.partition)] = rec.offset + 1
            if isinstance(rec, Undecodable):
                self.undecodable[rec.topic] += 1
                return
            try:
                self._fold(rec)
            except Exception:  # noqa: BLE001 - one odd record must not stop the view
                log.exception("dashboard: cannot fold %s[%d]@%d", rec.topic, rec.partition, rec.offset)
                self.unprocessable[rec.topic] += 1

    def _fold(self, rec: Record) -> None:
        ev = rec.event
        if isinstance(ev, events.DeadLetter) or rec.topic.endswith(self.config.topics.dlq_suffix):
            self._dead_letter(rec.topic, ev)
            return
        fold = {events.Turn: self._turn, events.NextState: self._next_state, events.SessionEnd: self._session_end,
                events.Feedback: self._feedback, events.Sample: self._sample, events.Control: self._control, events.TrainStep: self._train_step,
                events.Evaluation: self._evaluation}.get(type(ev))
        if fold is not None:
            fold(ev, rec.timestamp_ms)
            self.live_versions.apply(ev)

    def _evaluation(self, ev: events.Evaluation, ts: int) -> None:
        self.evaluations[(ev.run_id, ev.policy_version)] = {
            "policy_version": ev.policy_version, "n": ev.n, "name": ev.name, "created_at": ev.created_at or ts,
            **{k: v for k, v in ev.metrics.items() if isinstance(v, (int, float))}}

    def _session(self, ev, ms: int) -> SessionView:
        """The view of ``ev``'s session (keyed by tenant and id), created on first sight."""
        sid = events.session_of(ev)
        s = self.sessions.get(sid)
        if s is None:
            s = self.sessions[sid] = SessionView(ev.session_id, ev.tenant)
            self.session_ids.add(sid)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        else:
            self.sessions.move_to_end(sid)
        s.touch(ms)
        return s

    def _turn(self, t: events.Turn, ts: int) -> None:
        ms = t.created_at or ts
        self.counts["turns"] += 1
        self.counts[f"turns_{t.turn_type}"] += 1
        self.turn_buckets[ms // 1000 // BUCKET_S * BUCKET_S] += 1
        self._trim(self.turn_buckets)
        if t.housekeeping:  # an agent's own upkeep: counted; a side turn of a session listed for its
            self.housekeeping[t.housekeeping] += 1  # conversation, never a session of its own (OpenClaw
            if events.session_of(t) not in self.sessions:  # runs memory flushes in internal sessions)
                return
        self._session(t, ms).turns.append(views.turn_view(t, text=self.text))

    def _next_state(self, n: events.NextState, ts: int) -> None:
        ms = n.created_at or ts
        self.counts["next_states"] += 1
        key = n.after_turn_index if n.after_turn_index is not None else -1
        view = views.event_view(n, text=self.text)
        self._session(n, ms).next_states.setdefault(key, []).append(view)

    def _session_end(self, e: events.SessionEnd, ts: int) -> None:
        self.counts["session_ends"] += 1
        self.ended.add(events.session_of(e))
        self._session(e, e.created_at or ts).end = {"reason": e.reason, "created_at": e.created_at or ts,
                                                    "outcome": e.outcome}

    def _feedback(self, f: events.Feedback, ts: int) -> None:
        self.counts["feedback"] += 1
        self._session(f, f.created_at or ts).feedback.setdefault(f.turn_index, []).append(
            views.event_view(f, text=self.text))

    def _sample(self, s: events.Sample, ts: int) -> None:
        view = views.sample_view(s, text=self.text)
        if s.sample_id in self.samples:
            self.duplicate_samples += 1
        else:
            self.sample_buckets[(view["created_at"] or ts) // 1000 // BUCKET_S * BUCKET_S] += 1
            self._trim(self.sample_buckets)
        self.samples[s.sample_id] = {k: view[k] for k in (
            "kind", "reward", "loss_mask", "prm_votes", "hint_votes", "has_hint", "policy_version", "session_id",
            "turn_index", "reward_source")}
        sess = self._session(s, s.created_at or ts)
        sess.samples.setdefault(s.turn_index, {})[s.sample_id] = view

    def _control(self, c: events.Control, ts: int) -> None:
        ms = c.created_at or ts
        sync = self.syncs.get((c.run_id, c.tenant, c.epoch))
        if sync is None:
            sync = self.syncs[(c.run_id, c.tenant, c.epoch)] = {
                "run_id": c.run_id, "epoch": c.epoch, "policy_version": c.policy_version, "applied": {}, "failed": {}}
            if c.tenant is not None:  # a tenant's adapter sync (full-weight syncs keep their old shape)
                sync.update(tenant=c.tenant, adapter=None)
        if c.tenant is not None and c.adapter is not None and (sync["adapter"] is None or c.action != "resume"):
            # the adapter synced (pause/weights/applied/failed name it); a resume after a failure
            # names the one the tenant stays on, shown only when nothing else named one
            sync["adapter"] = c.adapter["name"]
        if c.action in ("applied", "failed"):
            sync[c.action][c.engine_id] = ms if c.action == "applied" else (c.message or "failed")
        else:
            sync[f"{c.action}_ms"] = ms
        sync["policy_version"] = c.policy_version

    def _train_step(self, e: events.TrainStep, ts: int) -> None:
        old = self.steps.get(e.step)
        if old is not None:  # a step redone after a restart: its samples are re-attributed below
            for sid in old.get("_trained", ()):
                if self.trained.get(sid, {}).get("step") == e.step:
                    del self.trained[sid]
        rec = {"step": e.step, "policy_version": e.policy_version, "time_ms": e.created_at or ts,
               "skipped": e.skipped, "batch_samples": len(e.sample_ids), "trained_samples": len(e.trained),
               "_trained": list(e.trained)}
        for k in TRAINER_KEYS:
            v = e.metrics.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                rec[k] = v
        self.steps[e.step] = rec
        for sid, adv in e.trained.items():
            self.trained[sid] = {"step": e.step, "advantage": adv, "policy_version": e.policy_version}

    def _dead_letter(self, topic: str, ev: events.Event) -> None:
        self.dlq_counts[topic] += 1
        latest = self.dlq_latest.setdefault(topic, deque(maxlen=self.max_errors))
        if isinstance(ev, events.DeadLetter):
            v = views.event_view(ev)
            v["error"] = v["error"][:500]
            latest.append(v)
        else:
            latest.append({"error": f"not a dead letter: {ev.TYPE}"})

    @staticmethod
    def _trim(buckets: Counter) -> None:
        if len(buckets) > MAX_BUCKETS:
            for k in sorted(buckets)[: len(buckets) - MAX_BUCKETS]:
                del buckets[k]

    # ---- queries ------------------------------------------------------------------------------
    def _waiting(self) -> int:
        """Main turns still waiting: no next state, no sample yet, and their session has not ended."""
        n = 0
        for s in self.sessions.values():
            if s.end is not None:
                continue
            for t in s.turns:
                i = t["turn_index"]
                if t["turn_type"] == "main" and i not in s.next_states and i not in s.samples:
                    n += 1
        return n

    def overview(self, extra: dict | None = None) -> dict:
        """Everything the overview page shows, as plain data (``extra``: e.g. the scraper's view)."""
        with self.lock:
            samples = list(self.samples.values())
            kinds = Counter(s["kind"] for s in samples)
            masked = sum(1 for s in samples if not s["loss_mask"])
            trained_rewards = [s["reward"] for s in samples if s["loss_mask"] and s["reward"] is not None]
            prm = Counter()
            hint = Counter()
            for s in samples:
                for v in s["prm_votes"]:
                    prm["failed" if v is None else str(int(v))] += 1
                for v in s["hint_votes"]:
                    hint["failed" if v is None else ("accepted" if v == 1 else "rejected")] += 1
            hint_kinds = [s for s in samples if s["kind"] in ("opd", "opd+rl")]
            steps = [{k: v for k, v in r.items() if not k.startswith("_")} for _, r in sorted(self.steps.items())]
            syncs = []
            for s in sorted(self.syncs.values(), key=lambda v: v.get("pause_ms") or 0):
                d = dict(s)
                if d.get("pause_ms") and d.get("resume_ms"):
                    d["pause_s"] = (d["resume_ms"] - d["pause_ms"]) / 1000
                syncs.append(d)
            out = {
                "now_ms": events.now_ms(),
                "show_text": self.text,
                "topics": {"records": dict(self.records), "undecodable": dict(self.undecodable),
                           "unprocessable": dict(self.unprocessable),
                           "positions": {f"{t}[{p}]": o for (t, p), o in sorted(self.positions.items())}},
                "traffic": {
                    "turns": self.counts["turns"], "main_turns": self.counts["turns_main"],
                    "side_turns": self.counts["turns_side"], "housekeeping": dict(self.housekeeping),
                    "next_states": self.counts["next_states"],
                    "session_ends": self.counts["session_ends"], "sessions": len(self.session_ids),
                    "sessions_open": len(self.session_ids - self.ended), "waiting": self._waiting(),
                    "turns_timeline": sorted(self.turn_buckets.items()),
                    "samples_timeline": sorted(self.sample_buckets.items()), "bucket_s": BUCKET_S},
                "judge": {"prm_votes": {k: prm.get(k, 0) for k in ("1", "0", "-1", "failed")},
                          "hint_votes": {k: hint.get(k, 0) for k in ("accepted", "rejected", "failed")},
                          "hint_samples": len(hint_kinds),
                          "hint_samples_with_hint": sum(1 for s in hint_kinds if s["has_hint"])},
                "samples": {"total": len(samples), "by_kind": dict(kinds), "masked": masked,
                            "masked_share": masked / len(samples) if samples else None,
                            "duplicates": self.duplicate_samples, "trained": len(self.trained),
                            "reward_mean": sum(trained_rewards) / len(trained_rewards) if trained_rewards else None},
                "trainer": {"steps": steps, **self._next_step()},
                "syncs": syncs,
                "evaluations": [v for _, v in sorted(self.evaluations.items(), key=lambda kv: kv[0][1])],
                "versions": self.live_versions.snapshot(),
                "dlq": {"counts": {t: self.dlq_counts.get(t, 0) for t in sorted(set(self.dlq_counts) | set(
                    self._dlq_topics()))},
                        "latest": sorted((e for q in self.dlq_latest.values() for e in q),
                                         key=lambda e: e.get("created_at") or 0, reverse=True)[:20]},
            }
        out.update(extra or {})
        return out

    def _next_step(self) -> dict:
        """How far the next trainer step is, from the topics: ``batch_size``
        (``trainer.rollout_batch_size``), ``waiting``: trainable samples (loss mask 1; with
        ``trainer.count_masked_samples`` every sample) no step took yet, ``needs``: how many more
        the next step waits for. An estimate: samples the trainer drops (stale, duplicates) count
        here; the trainer's own count is ``live.trainer_batch_counted`` when it serves metrics."""
        tc = self.config.trainer
        waiting = sum(1 for sid, x in self.samples.items()
                      if (x["loss_mask"] or tc.count_masked_samples) and sid not in self.trained)
        return {"batch_size": tc.rollout_batch_size, "waiting": waiting, "needs": max(0, tc.rollout_batch_size - waiting)}

    def _dlq_topics(self) -> list[str]:
        return [self.config.topics.dlq(n) for n in ("turns", "samples", "control", "metrics")]

    def sessions_list(self, query: str = "", limit: int = 50) -> list[dict]:
        """Most recently active sessions first, optionally those whose id or tenant contains ``query``."""
        q = query.strip().lower()
        out = []
        with self.lock:
            for s in reversed(self.sessions.values()):
                if q and q not in s.session_id.lower() and q not in (s.tenant or "").lower():
                    continue
                smp = [v for d in s.samples.values() for v in d.values()]
                out.append({
                    "session_id": s.session_id, "tenant": s.tenant, "first_ms": s.first_ms, "last_ms": s.last_ms,
                    "turns": sum(1 for t in s.turns if t["turn_type"] == "main"),
                    "side_turns": sum(1 for t in s.turns if t["turn_type"] != "main"),
                    "samples": len(smp), "trained": sum(1 for v in smp if v["sample_id"] in self.trained),
                    "rewards": [v["reward"] for v in smp], "ended": s.end is not None})
                if len(out) >= limit:
                    break
        return out

    def session(self, session_id: str, tenant: str | None = None) -> dict | None:
        """One session (of ``tenant``; None: a session without a tenant): each turn with its next
        state(s), sample(s) and training outcome."""
        with self.lock:
            s = self.sessions.get(session_id if tenant is None else (tenant, session_id))
            if s is None:
                return None
            turns = []
            for t in s.turns:
                i = t["turn_index"]
                row = dict(t)
                if t["turn_type"] == "main":
                    row["next_states"] = list(s.next_states.get(i, []))
                    row["feedback"] = list(s.feedback.get(i, []))
                    samples = []
                    for sid, v in s.samples.get(i, {}).items():
                        v = dict(v)
                        tr = self.trained.get(sid)
                        v["trained"] = tr is not None
                        v["trained_step"] = tr["step"] if tr else None
                        v["mean_advantage"] = tr["advantage"] if tr else None
                        v["trained_into_version"] = tr["policy_version"] if tr else None
                        samples.append(v)
                    row["samples"] = samples
                turns.append(row)
            known = {t["turn_index"] for t in s.turns if t["turn_type"] == "main"}
            orphans = {i: list(v) for i, v in s.next_states.items() if i not in known}
            return {"session_id": s.session_id, "tenant": s.tenant, "first_ms": s.first_ms, "last_ms": s.last_ms, "end": s.end,
                    "turns": turns, "unmatched_next_states": orphans, "show_text": self.text}
