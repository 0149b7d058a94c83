"""The evaluator's eval runner against a stand-in engine (pipeline/evaluator/runner.py).

Alice's candidate adapter learned to please the judge (its live judged reward rose) and lost the
eval set's guard: the stand-in engine (scripted answers, not a model) answers every eval item
right with the base model and wrong with alice's candidate. The runner evaluates the base model
serving alice and the candidate once it is live, publishes both as ``Evaluation`` records that
name alice's adapter, and the decider rolls the candidate back on the guard although its reward
rose. An engine error on the first request is retried.
"""

from __future__ import annotations

import json

import pytest

from pipeline import events
from pipeline.evaluator import Evaluator
from pipeline.testing.servers import Reply, StandInEngine
from pipeline.testing.topics import read_events
from pipeline.testing.waiting import wait_for
from tests.evaluator.scenario import adapter, publish_all, sync, traffic

A1 = adapter("alice", "a")


def _eval_set(path) -> str:
    rows = [{"eval_set": "team", "guards": ["accuracy"]}]
    rows += [{"id": f"q{i}", "prompt": f"what is 6*7? ({i})", "checks": {"accuracy": {"exact": "42"}}} for i in range(8)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


@pytest.fixture
def engine():
    calls = []

    def script(req):
        calls.append(req)
        if len(calls) == 1:
            return Reply(status=500)  # an engine error: logged, retried
        return "41" if A1["name"] in req["model"] else "42"

    with StandInEngine(script) as eng:
        eng.calls_seen = calls
        yield eng


def test_a_fallen_guard_of_alices_adapter_rolls_it_back_although_its_reward_rose(kafka_config, engine, tmp_path):
    config = kafka_config.replace(
        engine={"url": engine.url}, trainer={"run_id": "default", "lora": {"rank": 4}},
        rollout={"enabled": True, "min_n": 100, "rollback_min_n": 50, "max_n": 200, "guard_min_n": 8,
                 "eval_set": _eval_set(tmp_path / "team.jsonl"), "eval_max_tokens": 16, "eval_seed": 7})
    publish_all(config, sync("alice", 1, A1, 1) + traffic("alice", A1, {"candidate": 9, "incumbent": 5}, 0, 40, 100))
    ev = Evaluator(config)
    ev.runner.retry_s = 0.2
    ev.start()
    try:
        wait_for(lambda: ev.decider.published, "the decision", timeout_s=90)
        wait_for(ev.runner.idle.is_set, "the runner to have evaluated every version", timeout_s=60)
    finally:
        ev.close()
    (d,) = ev.decider.published
    assert (d.action, d.tenant, d.adapter, d.evidence["reason"]) == ("rollback", "alice", A1, "guard_fell:accuracy")
    cand, inc = d.evidence["arms"]["candidate"], d.evidence["arms"]["incumbent"]
    assert cand["accuracy"] == [0, 8] and inc["accuracy"] == [8, 8]
    assert cand["reward"][0] / cand["reward"][1] > inc["reward"][0] / inc["reward"][1]  # the reward rose
    evals = [e for e in read_events(config, "metrics", 3, 20.0) if isinstance(e, events.Evaluation)]
    by_scope = {(e.tenant, (e.adapter or {}).get("version")): e for e in evals}
    assert set(by_scope) == {(None, None), ("alice", None), ("alice", A1["version"])} and len(evals) == 3
    assert by_scope[("alice", A1["version"])].adapter == A1 and by_scope[("alice", A1["version"])].metrics["accuracy"] == 0
    assert by_scope[("alice", None)].metrics["accuracy"] == 1 and by_scope[(None, None)].policy_version == 0
    asked = {r["model"] for r in engine.calls_seen}
    assert asked == {config.engine.model, f"{config.engine.model}:{A1['name']}"}  # as the proxy names an adapter
    assert all(r["temperature"] == 0 and r["seed"] == 7 and r["max_tokens"] == 16 for r in engine.calls_seen)
