"""The evaluator's decider against a real broker (pipeline/evaluator/decider.py).

Two tenants' canaries are written as the trainer and the proxy would (adapter syncs on
``control``, a turn and a judged sample per session on ``turns``/``samples``): alice's candidate
is poisoned (1 success in 10 against the base model's 9), bob's is as good as his base. The
decider must publish alice's rollback once, with its evidence, leave bob's canary open, decide
what a replay of the topics decides, and decide the same, once, across restarts.
"""

from __future__ import annotations

import pytest

from pipeline import events
from pipeline.evaluator.decider import Decider
from pipeline.rollout.fold import replay
from pipeline.testing.topics import publish, read_records
from pipeline.testing.waiting import wait_for
from tests.evaluator.scenario import adapter, decisions, log_in_order, publish_all, sync, traffic

RULE = {"enabled": True, "min_n": 20, "rollback_min_n": 10, "max_n": 100}
A1, B1 = adapter("alice", "a"), adapter("bob", "b")
POISONED, EQUAL = {"candidate": 1, "incumbent": 9}, {"candidate": 5, "incumbent": 5}


def _replay(records, decider) -> list:
    """:func:`replay` with the decider's rule, run and full weights' gate (the records' config)."""
    return replay(records, decider.rule, decider.run_id, full_weights=decider.config.rollout.full_weights_gate)


@pytest.fixture
def config(kafka_config):
    return kafka_config.replace(rollout=RULE, trainer={"lora": {"rank": 4}})  # tenants' adapters


def _run(config) -> Decider:
    """A decider started, waited for until it folded every record on the broker, and stopped."""
    d = Decider(config).start()
    try:
        wait_for(d.caught_up.is_set, "the decider to fold every record", timeout_s=60)
    finally:
        d.close()
    return d


def _without_decisions(log):
    return [e for e in log if not (isinstance(e, events.Control) and e.action in events.ROLLOUT_DECISIONS)]


def test_alices_poisoned_adapter_is_rolled_back_once_with_evidence_and_bobs_canary_stays_open(config):
    publish_all(config, sync("alice", 1, A1, 1) + sync("bob", 1, B1, 10)
                + traffic("alice", A1, POISONED, 0, 60, 100) + traffic("bob", B1, EQUAL, 0, 60, 101))
    publish(config, [b"\x93not an event"], topic="samples", key="x")  # one bad record: DLQ, goes on
    d = _run(config)
    assert [(x.action, x.tenant, x.adapter) for x in d.published] == [("rollback", "alice", A1)]
    ev = d.published[0].evidence
    cand, inc = ev["arms"]["candidate"], ev["arms"]["incumbent"]
    assert ev["reason"] == "reward_fell" and ev["incumbent"] is None and ev["bounds"]["reward"][1] < 0
    assert cand["reward"][1] >= RULE["rollback_min_n"] and inc["reward"][1] >= RULE["rollback_min_n"]
    assert cand["reward"][0] / cand["reward"][1] < inc["reward"][0] / inc["reward"][1]
    assert cand["served"][0] == cand["reward"][1] and cand["served"][1] == cand["served"][0] + inc["served"][0]
    assert decisions(config) == d.published  # on control, exactly once
    bob = d.fold.scopes["bob"]
    assert bob.canary is not None and bob.canary.candidate == B1["version"] and not bob.rolled_back
    dead = [r.event for r in read_records(config, config.topics.name("samples.dlq"), 1, 10.0)]
    assert [(x.stage, x.source_topic) for x in dead] == [("evaluator", config.topics.name("samples"))]
    log = log_in_order(config)
    assert _replay(_without_decisions(log), d) == d.published  # a replay of the topics decides the same
    assert _replay(log, d) == []  # and finds nothing undecided


def test_a_restart_mid_canary_decides_the_same_once(config):
    publish_all(config, sync("alice", 1, A1, 1) + traffic("alice", A1, POISONED, 0, 12, 100))
    assert _run(config).published == []  # 6 judged sessions per arm: too few to decide
    publish_all(config, traffic("alice", A1, POISONED, 12, 48, 124))
    second = _run(config)  # restarted mid-canary: reads everything again and decides
    assert [(x.action, x.tenant) for x in second.published] == [("rollback", "alice")]
    assert _replay(_without_decisions(log_in_order(config)), second) == second.published
    third = _run(config)  # restarted after the decision: applied from control, not published again
    assert third.published == [] and third.fold.scopes["alice"].rolled_back == {A1["version"]}
    assert decisions(config) == second.published


def test_the_decider_refuses_to_run_without_rollout(kafka_config):
    from pipeline.config import ConfigError
    from pipeline.evaluator import Evaluator

    with pytest.raises(ConfigError, match="rollout.enabled"):
        Evaluator(kafka_config)


# ---- the full weights on one engine: the eval set alone decides ---------------------------------

def _full_weights(version: int, at: int, accuracy: float | None) -> list:
    """v``version``'s sync (one engine applies it to everyone), two judged sessions it served and,
    with ``accuracy``, its evaluation (16 items) once it is live."""
    about = {"epoch": version, "policy_version": version, "run_id": "default"}
    out = [events.Control(action="pause", created_at=at, **about),
           events.Control(action="weights", location=f"/w/v{version}", sha256="a" * 64, created_at=at + 1, **about),
           events.Control(action="applied", engine_id="engine-0", created_at=at + 2, **about),
           events.Control(action="resume", created_at=at + 3, **about)]
    for i in range(2):
        sid = f"fw{version}-{i}"
        out.append(events.Turn(session_id=sid, turn_index=0, policy_version=version, created_at=at + 4 + i))
        out.append(events.Sample(sample_id=f"{sid}:0", session_id=sid, turn_index=0, policy_version=version,
                                 kind="rl", tokens=[1, 2], response_length=1, rollout_log_probs=[-0.1],
                                 reward=-1.0, created_at=at + 6 + i))
    if accuracy is not None:
        out.append(events.Evaluation(policy_version=version, n=16, name="team", run_id="default", created_at=at + 9,
                                     metrics={"accuracy": accuracy, "accuracy_n": 16}))
    return out


@pytest.fixture
def gated(kafka_config, tmp_path):
    return kafka_config.replace(rollout={"enabled": True, "eval_set": str(tmp_path / "team.jsonl"),
                                         "guards": ["accuracy"], "guard_min_n": 16, "guard_margin": 0.5})


def test_full_weights_the_eval_set_gate_decides_once_and_a_restart_mid_canary_decides_the_same(gated):
    base = [events.Evaluation(policy_version=0, n=16, name="team", run_id="default", created_at=1,
                              metrics={"accuracy": 1.0, "accuracy_n": 16})]
    publish_all(gated, base + _full_weights(1, 10, None))
    first = _run(gated)
    assert first.published == []  # the candidate is not evaluated yet: the live reward alone never decides
    publish_all(gated, [_full_weights(1, 10, 0.25)[-1]])  # restarted mid-canary: its evaluation arrives
    second = _run(gated)
    assert [(d.action, d.policy_version, d.evidence["rule"], d.evidence["reason"]) for d in second.published] == [
        ("rollback", 1, "newcombe-evalset-v1", "guard_fell:accuracy")]
    publish_all(gated, _full_weights(2, 100, 1.0))  # the next candidate keeps the incumbent's answers
    third = _run(gated)  # the rollback is read back, not published again; v2 is promoted
    assert [(d.action, d.policy_version, d.evidence["reason"]) for d in third.published] == [
        ("promote", 2, "guards_held")]
    assert decisions(gated, 2) == second.published + third.published
    log = log_in_order(gated)
    assert _replay(_without_decisions(log), third) == second.published + third.published
    assert _replay(log, third) == []
    assert third.fold.scopes[None].incumbent == 2 and third.fold.scopes[None].rolled_back == {1}
