"""``pipeline demo --rollout``'s report from the records (pure: no stack): the versions in the
order published, each with its eval-set results, its decision and evidence, and the turns it
served; the eval set built from the held-out prompts; when the demo may stop."""

from __future__ import annotations

from pipeline import events
from pipeline.orchestrate.rollout_demo import finished, mark_poisoned, summary_lines, versions, write_eval_set
from pipeline.rollout.evalset import grade, load_eval_set

A1 = {"name": "alice@1", "version": "a" * 64, "sha256": "1" * 64}
A2 = {"name": "alice@2", "version": "b" * 64, "sha256": "2" * 64}


def _evidence(reason, cand, inc):
    return {"rule": "r", "reason": reason, "config": {}, "incumbent": None,
            "arms": {"candidate": {"reward": cand, "served": [cand[1], cand[1] + inc[1]]},
                     "incumbent": {"reward": inc, "served": [inc[1], cand[1] + inc[1]]}},
            "bounds": {"reward": [-0.6, -0.2]}}


def _records():
    ctl = [events.Control(action="weights", epoch=1, policy_version=1, tenant="alice", adapter=A1, location="/a",
                          sha256=A1["sha256"]),
           events.Control(action="promote", epoch=1, policy_version=1, tenant="alice", adapter=A1,
                          evidence=_evidence("non_inferior", [12, 40], [10, 40])),
           events.Control(action="weights", epoch=4, policy_version=4, tenant="alice", adapter=A2, location="/b",
                          sha256=A2["sha256"]),
           events.Control(action="rollback", epoch=4, policy_version=4, tenant="alice", adapter=A2,
                          evidence=_evidence("reward_fell", [2, 30], [15, 30]))]
    ev = events.Evaluation(policy_version=0, n=32, name="gsm8k-heldout",
                           metrics={"brief": 0.25, "brief_n": 32, "accuracy": 0.0625, "accuracy_n": 32})
    ev.tenant, ev.adapter = "alice", A2
    turns = [events.Turn(session_id=f"s{i}", turn_index=0, request_id=f"r{i}", messages=[], tenant="alice",
                         adapter=A2 if i < 3 else A1, canary="candidate" if i < 3 else "incumbent") for i in range(5)]
    return ctl, [ev], turns


def test_versions_carry_eval_decision_and_served_turns():
    ctl, metrics, turns = _records()
    rows = versions(ctl, metrics, turns)
    assert [(r["name"], r["update"], r["decision"]) for r in rows] == [("alice@1", 1, "promote"),
                                                                      ("alice@2", 4, "rollback")]
    assert rows[1]["eval"]["brief"] == {"rate": 0.25, "k": 8, "n": 32, "ci95": rows[1]["eval"]["brief"]["ci95"]}
    assert rows[1]["turns"] == 3 and rows[1]["sessions"] == 3 and rows[0]["turns"] == 2
    assert "eval" not in rows[0]
    assert not finished(rows[:1], 2) and finished(rows, 2) and finished(rows[:1], 0)
    assert not finished(rows[:1], 1)  # only the poisoned one was decided: no honest one yet
    marked = mark_poisoned(rows, 2, {4})
    assert [(r["poisoned"], r["trained_poisoned"]) for r in marked] == [(False, False), (True, True)]
    report = {"model": "m", "duration_s": 1.0, "turns": 5, "canary_turns": 3, "base_eval": None, "notes": [],
              "versions": [dict(r, poisoned=r["update"] == 4) for r in rows]}
    text = "\n".join(summary_lines(report))
    assert "POISONED" in text and "decision: rollback (reward_fell)" in text and "2/30 vs 15/30" in text


def test_the_eval_set_is_the_held_out_prompts_with_accuracy_as_its_guard(tmp_path):
    es = load_eval_set(write_eval_set(tmp_path / "es.jsonl", 32))
    assert es.guards == ("accuracy",) and len(es.items) == 32
    checks = es.items[0]["checks"]
    import re

    number = re.sub(r"\\", "", checks["accuracy"]["regex"].split(")", 1)[1].split("(")[0])
    assert grade(checks, f"So the answer is {number}.")["accuracy"]
    assert not grade(checks, f"So the answer is 1{number}7.")["accuracy"]
    assert not grade(checks, " ".join(["word"] * 41))["brief"]
