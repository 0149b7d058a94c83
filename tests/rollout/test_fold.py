"""Issue 39: decisions folded from the records (pipeline/rollout/fold.py) and sticky canaries.

A simulated log: live sessions routed by :class:`SessionArms` (share 10%), each turn recorded
with the version and arm that served it, each judged sample with a Bernoulli reward of its
version's true rate. The fold must roll a poisoned version back having served at most about the
canary share (counted from the turns), promote an honest one, decide the same on a replay and
after a restart mid-canary, and keep tenants apart.
"""

from __future__ import annotations

import random

from pipeline import events
from pipeline.events import Control, Sample, Turn, decode, encode
from pipeline.rollout.assign import CANDIDATE, SessionArms
from pipeline.rollout.fold import RolloutFold, replay
from pipeline.rollout.rule import RolloutConfig

CONFIG = RolloutConfig(enabled=True, share=0.1)
#: the live-arm rule on the full weights' scope (several engines): these tests simulate routed arms
LIVE = "live"
EVALSET = "evalset"


def _adapter(tenant: str, tag: str) -> dict:
    version = (tag * 64)[:64]
    return {"name": events.adapter_name(tenant, version), "version": version, "sha256": "f" * 64}


def _weights(version: int, tenant: str | None = None, adapter: dict | None = None) -> Control:
    return Control(action="weights", epoch=version, policy_version=version, location=f"/w/{version}",
                   sha256=adapter["sha256"] if adapter else "a" * 64, tenant=tenant, adapter=adapter)


def _traffic(fold, rates, n_sessions, seed, tenant=None, log=None, router=None):
    """Sessions of 3 turns each; appends turns, samples and the fold's decisions to ``log``;
    returns ``(turns per arm while a canary ran, sessions switched incumbent->candidate)``."""
    rng, router = random.Random(seed), router or SessionArms()
    served, switched, t = {"candidate": 0, "incumbent": 0}, 0, 0
    state = fold.scopes.get(tenant) or fold.scopes[None]
    for s in range(n_sessions):
        sid, first = f"s{seed}-{s}", None
        for i in range(3):
            canary = (fold.scopes.get(tenant) or state).canary
            cand = canary.candidate if canary else None
            inc = (fold.scopes.get(tenant) or state).incumbent
            arm, version = router.serve(tenant, sid, inc, cand, CONFIG.share)
            first = first or arm
            switched += first == "incumbent" and arm == CANDIDATE
            if canary:
                served[arm] += 1
            t += 1
            adapter = _ADAPTERS.get((tenant, version)) if tenant else None
            pv = 0 if tenant else version
            turn = Turn(session_id=sid, turn_index=i, policy_version=pv, created_at=t, tenant=tenant,
                        adapter=adapter, canary=arm if canary else None)
            sample = Sample(sample_id=f"{tenant + '/' if tenant else ''}{sid}:{i}", session_id=sid, turn_index=i,
                            policy_version=pv, kind="rl", tokens=[1, 2], response_length=1, rollout_log_probs=[-0.1],
                            reward=1.0 if rng.random() < rates[version] else -1.0, created_at=t, tenant=tenant,
                            adapter=adapter)
            for ev in (turn, sample):
                log.append(ev)
                decision = fold.apply(ev)
                if decision is not None:
                    log.append(decode(encode(decision)))  # on the wire: domains checked
    return served, switched


_ADAPTERS: dict = {}


def _run(rates, log, seed=1, sessions=3000):
    fold = RolloutFold(CONFIG, full_weights=LIVE)
    log.append(_weights(1))
    fold.apply(log[-1])
    served, switched = _traffic(fold, rates, sessions, seed, log=log)
    return fold, served, switched


def test_a_poisoned_version_is_rolled_back_within_the_canary_share():
    log = []
    fold, served, switched = _run({0: 0.5, 1: 0.05}, log)
    decisions = [e for e in log if isinstance(e, Control) and e.action in ("promote", "rollback")]
    assert [(d.action, d.policy_version) for d in decisions] == [("rollback", 1)]
    ev = decisions[0].evidence
    assert ev["reason"] == "reward_fell" and ev["incumbent"] == 0 and ev["bounds"]["reward"][1] < 0
    assert served["candidate"] / (served["candidate"] + served["incumbent"]) <= 0.2
    assert ev["arms"]["candidate"]["served"][0] == served["candidate"]
    assert switched == 0 and fold.scopes[None].incumbent == 0 and 1 in fold.scopes[None].rolled_back
    assert not any(isinstance(e, Turn) and e.policy_version == 1 and e.turn_index == 0
                   for e in log[log.index(decisions[0]):])  # no new session on the rolled-back version


def test_an_honest_version_is_promoted():
    log = []
    fold, _, switched = _run({0: 0.5, 1: 0.65}, log, sessions=6000)
    decisions = [(e.action, e.policy_version) for e in log if isinstance(e, Control) and e.evidence]
    assert decisions == [("promote", 1)] and fold.scopes[None].incumbent == 1 and switched == 0


def test_replay_and_restart_decide_the_same():
    log = []
    _run({0: 0.5, 1: 0.45}, log, seed=7, sessions=6000)
    made = [e for e in log if isinstance(e, Control) and e.evidence]
    assert made, "the scenario must reach a decision"
    without = [e for e in log if not (isinstance(e, Control) and e.evidence)]
    assert replay(without, CONFIG, full_weights=LIVE) == made  # a replay of the same records decides the same
    assert replay(log, CONFIG, full_weights=LIVE) == []  # decisions read back are applied, never made twice
    cut = log.index(made[0]) // 2  # a restart mid-canary: a new fold reads the prefix, then goes on
    fold = RolloutFold(CONFIG, full_weights=LIVE)
    for ev in without[:cut]:
        assert fold.apply(ev) is None
    assert [d for d in map(fold.apply, without[cut:]) if d is not None] == made


def test_alices_rollback_leaves_bob_untouched():
    alice0, alice1, bob1 = _adapter("alice", "a"), _adapter("alice", "b"), _adapter("bob", "c")
    _ADAPTERS.update({("alice", alice1["version"]): alice1, ("bob", bob1["version"]): bob1})
    fold, log = RolloutFold(CONFIG, full_weights=LIVE), []
    for c in (_weights(1, "alice", alice1), _weights(1, "bob", bob1)):
        log.append(c)
        fold.apply(c)
    del alice0
    _traffic(fold, {None: 0.5, alice1["version"]: 0.02}, 800, 3, tenant="alice", log=log)
    _traffic(fold, {None: 0.5, bob1["version"]: 0.5}, 100, 4, tenant="bob", log=log)
    decisions = [(e.action, e.tenant) for e in log if isinstance(e, Control) and e.evidence]
    assert decisions == [("rollback", "alice")]
    assert fold.scopes["alice"].rolled_back == {alice1["version"]} and fold.scopes["alice"].incumbent is None
    bob = fold.scopes["bob"]
    assert bob.canary is not None and bob.canary.candidate == bob1["version"] and not bob.rolled_back
    assert fold.scopes[None].canary is None and fold.scopes[None].incumbent == 0


def test_a_republished_order_neither_restarts_a_canary_nor_revives_a_rolled_back_version():
    log = []
    fold, _, _ = _run({0: 0.5, 1: 0.05}, log, sessions=600)
    assert 1 in fold.scopes[None].rolled_back and fold.scopes[None].canary is None
    fold.apply(_weights(1))  # the trainer re-publishes version 1 (a restart): no canary again
    assert fold.scopes[None].canary is None
    fold.apply(_weights(2))
    canary = fold.scopes[None].canary
    canary.reward["candidate"] = canary.reward["candidate"].add(True)
    fold.apply(_weights(2))
    assert fold.scopes[None].canary is canary and canary.reward["candidate"].n == 1
    adapter = _adapter("carol", "d")
    fold.apply(_weights(1, "carol", adapter))
    assert fold.scopes["carol"].canary is not None
    fold.apply(Control(action="reset", epoch=1, tenant="carol"))
    assert fold.scopes["carol"].canary is None and fold.scopes["carol"].incumbent is None


def test_reward_hacking_through_the_records_a_fallen_guard_is_never_promoted():
    """The demo's case: brevity (the judged reward) learned, accuracy (the eval-set guard) lost.
    Without the eval set's results the candidate waits however high its reward; with them it is
    rolled back."""
    config = RolloutConfig(enabled=True, guards=("accuracy",))
    fold = RolloutFold(config, full_weights=LIVE)
    fold.apply(_weights(1))
    rng = random.Random(5)
    for i in range(6000):  # 600 judged candidate turns: past min_n, reward 0.9 vs 0.5
        version = 1 if i % 10 == 0 else 0
        assert fold.apply(Sample(sample_id=f"s{i}:0", session_id=f"s{i}", turn_index=0, policy_version=version,
                                 kind="rl", tokens=[1, 2], response_length=1, rollout_log_probs=[-0.1],
                                 reward=1.0 if rng.random() < (0.9 if version else 0.5) else -1.0,
                                 created_at=i)) is None
    assert fold.apply(events.Evaluation(policy_version=0, n=200, metrics={"accuracy": 0.5})) is None
    d = decode(encode(fold.apply(events.Evaluation(policy_version=1, n=200, metrics={"accuracy": 0.2}))))
    assert (d.action, d.evidence["reason"]) == ("rollback", "guard_fell:accuracy")
    ev = d.evidence
    assert ev["arms"]["candidate"]["accuracy"] == [40, 200] and ev["arms"]["incumbent"]["accuracy"] == [100, 200]
    assert ev["bounds"]["reward"][0] > 0  # the reward rose, significantly
    assert fold.scopes[None].incumbent == 0 and fold.scopes[None].rolled_back == {1}


def _evaluation(accuracy: float, version: int = 0, tenant=None, adapter=None, n: int = 200) -> events.Evaluation:
    return events.Evaluation(policy_version=version, n=n, metrics={"accuracy": accuracy, "accuracy_n": n},
                             tenant=tenant, adapter=adapter)


def test_a_tenants_guard_counts_from_evaluations_naming_its_adapter_and_base():
    """Scope by tenant: alice's candidate is evaluated by an Evaluation naming her adapter, her
    incumbent (the base model) by one naming her and no adapter; bob's canary is untouched."""
    config = RolloutConfig(enabled=True, guards=("accuracy",))
    a1, b1 = _adapter("alice", "e"), _adapter("bob", "f")
    fold = RolloutFold(config, full_weights=LIVE)
    for c in (_weights(1, "alice", a1), _weights(1, "bob", b1)):
        fold.apply(c)
    assert fold.apply(_evaluation(0.5, tenant="alice")) is None  # the base model serving alice
    assert fold.apply(_evaluation(0.5)) is None  # the full weights: another scope
    d = decode(encode(fold.apply(_evaluation(0.2, tenant="alice", adapter=a1))))
    assert (d.action, d.tenant, d.adapter, d.evidence["reason"]) == ("rollback", "alice", a1, "guard_fell:accuracy")
    assert d.evidence["arms"]["incumbent"]["accuracy"] == [100, 200] and d.evidence["incumbent"] is None
    assert fold.scopes["bob"].canary is not None and fold.scopes[None].canary is None


def test_an_evaluation_made_before_the_canary_opened_counts_for_its_version():
    """The incumbent is evaluated at start, before its successor's canary opens: kept per version."""
    fold = RolloutFold(RolloutConfig(enabled=True, guards=("accuracy",)), full_weights=EVALSET)
    assert fold.apply(_evaluation(0.6, version=0)) is None  # no canary yet
    fold.apply(_weights(1))
    assert fold.scopes[None].canary.guards["incumbent"]["accuracy"].n == 200
    d = fold.apply(_evaluation(0.1, version=1))
    assert d is not None and d.evidence["reason"] == "guard_fell:accuracy"


def test_the_first_recorded_decision_overrules_the_folds_own():
    """The fold decided promote (its records came in another order); the first decision recorded
    on control, which the proxy and the syncers followed, is a rollback: the record wins."""
    fold = RolloutFold(RolloutConfig(enabled=True, min_n=200, rollback_min_n=1), full_weights=LIVE)
    fold.apply(_weights(1))
    own = None
    for i, version in enumerate([0, 1] * 200):
        own = own or fold.apply(Sample(sample_id=f"s{i}:0", session_id=f"s{i}", turn_index=0, policy_version=version,
                                       kind="rl", tokens=[1, 2], response_length=1, rollout_log_probs=[-0.1],
                                       reward=1.0, created_at=i))
    assert own is not None and own.action == "promote" and fold.scopes[None].incumbent == 1
    recorded = Control(action="rollback", epoch=1, policy_version=1, evidence=own.evidence)
    fold.apply(recorded)
    assert fold.scopes[None].incumbent == 0 and fold.scopes[None].rolled_back == {1}
    fold.apply(own)  # a later record about the decided candidate changes nothing
    assert fold.scopes[None].incumbent == 0 and fold.scopes[None].rolled_back == {1}


def test_a_turn_recorded_without_ids_or_against_its_arm_counts_in_no_arm():
    """The proxy records a turn without token ids and adapter when the engine reports another
    adapter served it (or a vLLM version is unknown): its sample must not count for the base
    model, the incumbent of a tenant's first canary; its turn is routed to one arm and recorded
    as another, so it is in neither's ``served``."""
    cand = _adapter("alice", "d")
    fold = RolloutFold(RolloutConfig(enabled=True, share=0.5, rollback_min_n=1, min_n=1, max_n=10), full_weights=LIVE)
    fold.apply(_weights(1, "alice", cand))
    base = fold.scopes["alice"].canary
    lost = Turn(session_id="x", turn_index=0, tenant="alice", adapter=None, canary="candidate")
    side = Turn(session_id="y", turn_index=0, tenant="alice", adapter=None, canary="incumbent", turn_type="side")
    ok = Turn(session_id="z", turn_index=0, tenant="alice", adapter=None, canary="incumbent")
    for t in (lost, side, ok):
        fold.apply(t)
    assert base.turns == {"candidate": 0, "incumbent": 1}
    no_ids = Sample(sample_id="alice/x:0", session_id="x", turn_index=0, kind="rl", tokens=[1], response_length=0,
                    reward=1.0, tenant="alice", adapter=None, loss_mask=0)
    assert fold.apply(no_ids) is None and base.reward["incumbent"].n == 0


# ---- the full weights on one engine: the eval-set gate (the fold's default) --------------------

GATED = RolloutConfig(enabled=True, guards=("accuracy",), guard_min_n=20)


def _full_weight_log(accuracies: dict, sessions: int = 40) -> list:
    """The one engine serves v0 (evaluated), then candidate v1 to everyone: turns and judged
    samples of v1 only (no incumbent arm), then v1's evaluation; a v2 order after it."""
    log = [_evaluation(accuracies[0], version=0, n=40), _weights(1)]
    for i in range(sessions):
        log.append(Turn(session_id=f"f{i}", turn_index=0, policy_version=1, created_at=10 + i))
        log.append(Sample(sample_id=f"f{i}:0", session_id=f"f{i}", turn_index=0, policy_version=1, kind="rl",
                          tokens=[1, 2], response_length=1, rollout_log_probs=[-0.1], reward=-1.0,
                          created_at=10 + i))
    log.append(_evaluation(accuracies[1], version=1, n=40))
    log.append(_weights(2))
    return log


def test_full_weights_a_fallen_guard_rolls_back_and_a_held_one_promotes_on_the_eval_set_alone():
    for acc, want in ((0.4, ("rollback", "guard_fell:accuracy")), (1.0, ("promote", "guards_held"))):
        log = _full_weight_log({0: 1.0, 1: acc})
        made = replay(log, GATED, full_weights=EVALSET)
        assert [(d.action, d.policy_version, d.evidence["reason"]) for d in made] == [(want[0], 1, want[1])]
        ev = decode(encode(made[0])).evidence  # on the wire: domains checked
        assert ev["rule"] == "newcombe-evalset-v1" and ev["incumbent"] == 0
        assert ev["arms"]["candidate"]["accuracy"] == [round(40 * acc), 40]
        assert ev["arms"]["incumbent"]["accuracy"] == [40, 40]
        assert ev["arms"]["candidate"]["reward"] == [0, 40] and ev["arms"]["incumbent"]["reward"] == [0, 0]
        if want[0] == "promote":  # the live rule never promotes here: no incumbent arm, too few turns
            assert replay(log, GATED, full_weights=LIVE) == []
        assert made[0].created_at == log[-2].created_at


def test_full_weights_replay_and_restart_mid_canary_decide_the_same():
    log = _full_weight_log({0: 1.0, 1: 0.4})
    made = replay(log, GATED, full_weights=EVALSET)
    with_decisions = log[:-1] + made + log[-1:]
    assert replay(with_decisions, GATED, full_weights=EVALSET) == []  # decided already: never made twice
    for cut in range(1, len(log) - 1):  # a restart anywhere before the decision: same decision
        fold = RolloutFold(GATED, full_weights=EVALSET)
        for ev in log[:cut]:
            fold.apply(ev)
        restarted = RolloutFold(GATED, full_weights=EVALSET)
        assert [d for d in map(restarted.apply, log) if d is not None] == made
        assert [d for d in map(fold.apply, log[cut:]) if d is not None] == made
    fold = RolloutFold(GATED, full_weights=EVALSET)
    for ev in with_decisions:
        fold.apply(ev)
    assert fold.scopes[None].rolled_back == {1} and fold.scopes[None].canary.candidate == 2
    assert fold.scopes[None].incumbent == 0


def test_the_fold_refuses_an_unknown_full_weights_gate():
    import pytest

    with pytest.raises(ValueError, match="full_weights"):
        RolloutFold(GATED, full_weights="several")


def test_the_full_weights_gate_has_no_default():
    """The gate comes from the records' config (``rollout.full_weights_gate``), never a silent default."""
    import pytest

    with pytest.raises(TypeError, match="full_weights"):
        RolloutFold(GATED)
    with pytest.raises(TypeError, match="full_weights"):
        replay([], GATED)
