"""Issue 39 (rollout): ``trainer.poison_steps``, the test device that trains one update with every
reward negated. The stage's step is driven with a stand-in policy that records what it is handed
(the loss inputs), so the test needs no broker and no model."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from pipeline import events
from pipeline.config import load_config
from pipeline.trainer.policy import StepResult
from pipeline.trainer.stage import TrainerStage, poison
from pipeline.trainer.tenants import TenantTable


class RecordingPolicy:
    """Stands in for :class:`pipeline.trainer.policy.PolicyTrainer`: keeps the rewards of every
    batch handed to ``train_batch`` and reports one trained step."""

    optimizer_steps = 0

    def __init__(self) -> None:
        self.rewards: list[list] = []
        self.resets: list = []  # (adapter, index of the next batch) of each optimizer reset
        self.trained: set = set()

    def adapters(self) -> list[str]:
        return sorted(a for a in self.trained if a is not None)

    def reset_optimizer(self, adapter=None) -> None:
        self.resets.append((adapter, len(self.rewards)))

    def train_batch(self, samples, weights, policy_version=None, adapter=None) -> StepResult:
        self.rewards.append([s.reward for s in samples])
        self.trained.add(adapter)
        return StepResult({"train_samples": float(len(samples)), "train_tokens": 4.0 * len(samples)}, skipped=False)

    def nonfinite_weights(self) -> list[str]:
        return []


def _samples(rewards: list) -> list[events.Sample]:
    return [events.Sample(sample_id=f"s{i}", session_id=f"s{i}", turn_index=0, tokens=list(range(1, 11)),
                          response_length=4, rollout_log_probs=[-2.0] * 4, reward=r) for i, r in enumerate(rewards)]


def _stage(**trainer) -> TrainerStage:
    stage = TrainerStage(load_config(None, trainer=dict(model="tiny-random", **trainer)))
    stage.policy, stage.par = RecordingPolicy(), SimpleNamespace(is_main=True)
    return stage


def _step(stage: TrainerStage, rewards: list, tenant: str | None = None) -> dict:
    """One step as ``_one_step`` runs it: rank 0 decides the poison, then the batch trains."""
    _, record = stage._train(_samples(rewards), [1.0] * len(rewards), tenant, None, stage._poisoned(tenant))
    return record


def test_the_listed_policy_version_trains_on_negated_rewards_and_says_so(caplog):
    stage = _stage(poison_steps=[2])
    rewards = [1.0, -1.0, 0.5, None]
    with caplog.at_level(logging.WARNING, logger="pipeline.trainer.stage"):
        records = [_step(stage, rewards) for _ in range(3)]
    assert [r["policy_version"] for r in records] == [1, 2, 3]
    assert stage.policy.rewards == [rewards, [-1.0, 1.0, -0.5, None], rewards]  # only version 2's inputs flip
    assert [r.get("poisoned") for r in records] == [None, True, None]  # the others' records are untouched
    assert stage.policy.resets == [(None, 1)]  # the honest momentum is forgotten before the poisoned update
    warned = [r for r in caplog.records if "poison_steps" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING and "update 2" in warned[0].getMessage()


def test_with_lora_the_tenants_update_count_is_the_number():
    stage = _stage(poison_steps=[2], per_tenant=True, lora={"rank": 4, "alpha": 8})
    stage.adapters = SimpleNamespace(table=TenantTable())
    out = [(t, _step(stage, [1.0, -1.0], t).get("poisoned")) for t in ("alice", "bob", "alice", "bob", "alice")]
    assert out == [("alice", None), ("bob", None), ("alice", True), ("bob", True), ("alice", None)]
    assert stage.policy.rewards == [[1.0, -1.0]] * 2 + [[-1.0, 1.0]] * 2 + [[1.0, -1.0]]


def test_no_poison_by_default_and_the_samples_are_copies():
    stage = _stage()
    assert stage.cfg.poison_steps == [] and not stage._poisoned(None)
    sent = _samples([1.0])
    got = poison(sent)
    assert got[0].reward == -1.0 and sent[0].reward == 1.0 and got[0].tokens == sent[0].tokens


@pytest.mark.parametrize("bad", [["x"], 3])
def test_poison_steps_is_a_list_of_ints(bad):
    from pipeline.config import ConfigError

    with pytest.raises((ConfigError, ValueError)):
        load_config(None, trainer=dict(poison_steps=bad))


def test_the_opd_advantage_is_negated_too():
    s = events.Sample(sample_id="s", session_id="s", turn_index=0, tokens=list(range(1, 11)), response_length=3,
                      rollout_log_probs=[-2.0, -1.0, -0.5], teacher_log_probs=[-1.0, -3.0, -0.5], reward=1.0,
                      hint="shorter")
    got = poison([s])[0]
    advantage = [t - r for t, r in zip(s.teacher_log_probs, s.rollout_log_probs)]
    assert [t - r for t, r in zip(got.teacher_log_probs, got.rollout_log_probs)] == [-a for a in advantage]
    assert got.reward == -1.0 and got.rollout_log_probs == s.rollout_log_probs
    bare = events.Sample(sample_id="b", session_id="b", turn_index=0, tokens=list(range(1, 11)), response_length=3,
                         teacher_log_probs=[-1.0, -3.0, -0.5], hint="h", reward=None)
    assert poison([bare])[0].teacher_log_probs == bare.teacher_log_probs  # no rollout log-probs to mirror about


def test_with_rollout_the_number_is_the_candidate_the_update_is_published_in():
    from pipeline.rollout.serving import ServingView

    stage = _stage(poison_steps=[2], per_tenant=True, lora={"rank": 4, "alpha": 8})
    stage.adapters = SimpleNamespace(table=TenantTable())
    stage.view = ServingView(stage.cfg.run_id)
    adapter = {"name": "alice-1", "version": "a" * 64, "sha256": "1" * 64}
    assert not stage._poisoned("alice")  # held for candidate 1
    stage.view.apply(events.Control(action="weights", epoch=1, policy_version=1, run_id=stage.cfg.run_id,
                                    tenant="alice", adapter=adapter, location="/x", sha256=adapter["sha256"]))
    assert [stage._poisoned("alice") for _ in range(3)] == [2, 1, 1]  # every update held for candidate 2;
    # the first resets the optimizer's moments
    assert not stage._poisoned("bob")  # another scope's count
