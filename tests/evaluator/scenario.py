"""Records of a tenants' canary for the evaluator tests: control orders, turns and judged samples.

:func:`adapter` builds ``{name, version, sha256}`` of a tenant's adapter; :func:`sync` the
trainer's adapter sync on ``control`` (pause, weights, applied, resume: the candidate is live);
:func:`traffic` one turn and one judged sample per session, alternating candidate and incumbent
sessions, with a deterministic success pattern per arm; :func:`publish_all` writes them.
"""

from __future__ import annotations

from pipeline import events
from pipeline.evaluator.merge import ordered
from pipeline.testing.topics import read_records

RUN = "default"


def adapter(tenant: str, tag: str) -> dict:
    version = (tag * 64)[:64]
    return {"name": events.adapter_name(tenant, version), "version": version, "sha256": "f" * 64}


def sync(tenant: str, n: int, ad: dict, at: int) -> list[events.Control]:
    """The adapter sync of ``tenant``'s update ``n`` to ``ad``, created at ``at``, ``at+1``, ..."""
    about = {"tenant": tenant, "adapter": ad, "epoch": n, "policy_version": n, "run_id": RUN}
    return [events.Control(action="pause", created_at=at, **about),
            events.Control(action="weights", location=f"/w/{tenant}/{n}", sha256=ad["sha256"], created_at=at + 1,
                           **about),
            events.Control(action="applied", engine_id="engine-0", created_at=at + 2, **about),
            events.Control(action="resume", created_at=at + 3, **about)]


def traffic(tenant: str, cand: dict, rate: dict, start: int, count: int, at: int) -> list[events.Event]:
    """``count`` sessions from number ``start`` on (even: candidate ``cand``, odd: the base model),
    each a turn then its judged sample (created at ``at + 2k``, ``at + 2k + 1``). ``rate``:
    ``{"candidate": k, "incumbent": k}``: session ``i`` of an arm succeeds when ``i // 2 % 10 < k``."""
    out: list[events.Event] = []
    for i in range(start, start + count):
        arm = "candidate" if i % 2 == 0 else "incumbent"
        ad = cand if arm == "candidate" else None
        sid, t = f"{tenant}-s{i}", at + 2 * (i - start)
        reward = 1.0 if (i // 2) % 10 < rate[arm] else -1.0
        out.append(events.Turn(session_id=sid, turn_index=0, policy_version=0, created_at=t, tenant=tenant,
                               adapter=ad, canary=arm))
        out.append(events.Sample(sample_id=f"{tenant}/{sid}:0", session_id=sid, turn_index=0, policy_version=0,
                                 kind="rl", tokens=[1, 2], response_length=1, rollout_log_probs=[-0.1], reward=reward,
                                 created_at=t + 1, tenant=tenant, adapter=ad))
    return out


def publish_all(config, evs) -> None:
    """Each event to its topic (control and metrics keyed by run id, turns and samples by session
    key), waiting for the broker."""
    from pipeline.bus import EventProducer

    topic_of = {"control": "control", "turn": "turns", "sample": "samples", "evaluation": "metrics"}
    p = EventProducer(config, name="test-publisher")
    try:
        for ev in evs:
            topic = topic_of[ev.TYPE]
            key = events.session_key(ev.tenant, ev.session_id) if topic in ("turns", "samples") else RUN
            p.send(config.topics.name(topic), ev, key=key)
        p.flush(30)
    finally:
        p.close()
    assert p.failed == 0


def decisions(config, want=None, timeout_s: float = 5.0) -> list[events.Control]:
    """The promote/rollback records on ``control`` (waiting up to ``timeout_s`` for ``want`` of them)."""
    def enough(evs):
        return len([e for e in evs if getattr(e, "action", None) in events.ROLLOUT_DECISIONS]) >= (want or 0)
    recs = read_records(config, config.topics.name("control"), enough if want else None, timeout_s, 0.5)
    return [r.event for r in recs if r.event.action in events.ROLLOUT_DECISIONS]


def log_in_order(config) -> list[events.Event]:
    """Every decodable event of control, metrics, samples and turns (bad records left out, as the
    decider dead-letters them), in the decider's order."""
    from pipeline.bus import Record, TopicReader

    topics = [config.topics.name(t) for t in ("control", "metrics", "samples", "turns")]
    with TopicReader(config, topics, name="test-reader", wait_s=10.0) as reader:
        recs = [r for r in reader.read() if isinstance(r, Record)]
    return [r.event for r in ordered(recs, config.topics.name("control"))]
