"""Live metrics per version (pipeline/rollout/live.py): counts per scope and version from the
records alone, the same whatever the interleaving of the topics, roles and decisions from
``control``, eval-set results, the refusal heuristic, rollout off, bounded memory."""

from __future__ import annotations

import random

import pytest

from pipeline import events
from pipeline.rollout import live
from pipeline.rollout.live import LiveVersions, is_refusal
from pipeline.rollout.stats import wilson_interval
from tests.rollout.live_records import A1, A2, B1, EVIDENCE, canary_log, ctl, sync, turn_and_sample


def _fold(records, **kw) -> LiveVersions:
    v = LiveVersions(**kw)
    for ev in records:
        v.apply(ev)
    return v


def _in_order(log) -> list:
    return log["control"] + log["turns"] + log["samples"] + log["metrics"]


def _rows(snapshot) -> dict:
    return {(s["scope"], r["label"]): r for s in snapshot for r in s["versions"]}


def test_counts_rates_and_intervals_per_tenant_and_version():
    rows = _rows(_fold(_in_order(canary_log())).snapshot())
    a1, a2 = rows[("alice", A1["name"])], rows[("alice", A2["name"])]
    assert (a1["turns"], a1["canary_turns"], a1["samples"]) == (30, 30, 30)
    assert (a1["reward"]["k"], a1["reward"]["n"]) == (24, 30)
    assert (a1["reward"]["low"], a1["reward"]["high"]) == pytest.approx(wilson_interval(24, 30))
    assert (a2["reward"]["k"], a2["reward"]["n"], a2["reward"]["rate"]) == (2, 10, 0.2)
    assert (a2["reward"]["low"], a2["reward"]["high"]) == pytest.approx(wilson_interval(2, 10))
    assert a2["reward"]["high"] < a1["reward"]["low"]  # clearly worse
    assert (a2["refusals"]["k"], a2["refusals"]["n"], a1["refusals"]["k"]) == (3, 10, 0)
    assert (a2["unfinished"]["k"], a1["unfinished"]["k"]) == (1, 0)
    assert a2["words_per_reply"] == pytest.approx((3 * 7 + 7 * 1) / 10)
    assert a1["words_per_reply"] == 5
    assert (a1["feedback"]["k"], a1["feedback"]["n"], a2["feedback"]["k"], a2["feedback"]["n"]) == (2, 2, 0, 1)
    assert (a1["reward_feedback"], a2["reward_feedback"]) == (2, 1)
    b1 = rows[("bob", B1["name"])]
    assert (b1["turns"], b1["reward"]["k"], b1["reward"]["n"], b1["canary_turns"]) == (5, 5, 5, 0)
    v0 = rows[(None, "v0")]
    assert (v0["turns"], v0["samples"], v0["reward"]["k"], v0["reward"]["n"]) == (6, 6, 3, 5)  # side/import: not served
    (ev,) = v0["evals"]
    (acc, words) = ev["metrics"]
    assert (ev["name"], acc["metric"], acc["value"], acc["n"], acc["low"], acc["high"]) == (
        "gsm8k-eval", "accuracy", 0.6, 200, 0.53, 0.66)
    assert (words["metric"], words["low"], words["n"]) == ("words_per_reply", None, 200)  # a mean: no bounds


def test_roles_and_the_decisions_evidence():
    snap = _fold(_in_order(canary_log())).snapshot()
    scopes = {s["scope"]: s for s in snap}
    assert list(scopes) == [None, "alice", "bob"]
    alice = scopes["alice"]
    assert (alice["incumbent"], alice["candidate"], alice["live"]) == (A1["name"], None, False)
    rows = _rows(snap)
    a1, a2 = rows[("alice", A1["name"])], rows[("alice", A2["name"])]
    assert (a1["role"], a2["role"]) == ("incumbent", "rolled back")
    assert a2["decision"]["action"] == "rollback" and a2["decision"]["reason"] == "reward_fell"
    assert a2["decision"]["bounds"] == EVIDENCE["bounds"] and a2["decision"]["arms"] == EVIDENCE["arms"]
    assert a1["decision"]["action"] == "promote" and a1["decision"]["incumbent"] is None
    assert rows[("bob", B1["name"])]["role"] == "candidate"  # resumed, no decision yet: a live candidate
    assert rows[("bob", B1["name"])]["live"] and scopes["bob"]["live"]
    assert rows[(None, "v0")]["role"] == "incumbent"


def test_any_interleaving_of_the_topics_gives_the_same_view():
    log = canary_log()
    want = _fold(_in_order(log)).snapshot()
    rng = random.Random(7)
    for _ in range(5):  # each topic keeps its own order; the topics interleave at random
        queues = [list(log[k]) for k in ("control", "turns", "samples", "metrics")]
        merged = []
        while any(queues):
            q = rng.choice([q for q in queues if q])
            merged.append(q.pop(0))
        assert _fold(merged).snapshot() == want


def test_a_candidate_before_its_decision_and_rollout_off():
    records = sync(1, "alice", A1, 0) + sync(2, "alice", A2, 10)
    on = _rows(_fold(records).snapshot())
    assert (on[("alice", A1["name"])]["role"], on[("alice", A2["name"])]["role"]) == ("superseded", "candidate")
    off = _fold(records, rollout=False)
    rows = _rows(off.snapshot())
    assert (rows[("alice", A1["name"])]["role"], rows[("alice", A2["name"])]["role"]) == ("previous", "incumbent")
    full = _rows(_fold(sync(1, None, None, 0) + sync(2, None, None, 10), rollout=False).snapshot())
    assert (full[(None, "v1")]["role"], full[(None, "v2")]["role"]) == ("previous", "incumbent")
    assert (None, "v0") not in full  # a version appears with its order or its records
    log = _in_order(canary_log())  # its decisions and canary turns show a rollout: the same roles either way
    assert _fold(log, rollout=False).snapshot() == _fold(log).snapshot()
    other_run = _fold([ctl("weights", 1, "alice", A1, run_id="other")]).snapshot()
    assert [s["scope"] for s in other_run] == [None]  # another run's orders are not this run's versions


def test_a_tenants_base_turns_count_for_the_tenant_and_the_full_weights():
    turn, sample = turn_and_sample("s", 0, "carol", None, 1.0, 0)
    rows = _rows(_fold([turn, sample]).snapshot())
    assert rows[("carol", "base")]["turns"] == rows[(None, "v0")]["turns"] == 1
    assert rows[("carol", "base")]["role"] == "incumbent"  # a tenant never synced: the base serves it


def test_tenant_evaluations_when_the_record_has_the_fields():
    ev = events.Evaluation(policy_version=0, n=50, name="e", metrics={"exact": 0.5, "exact_n": 50})
    ev.tenant, ev.adapter = "alice", A2  # fields another branch adds; read with getattr
    rows = _rows(_fold(sync(2, "alice", A2, 0) + [ev]).snapshot())
    (m,) = rows[("alice", A2["name"])]["evals"][0]["metrics"]
    assert (m["metric"], m["value"], m["n"]) == ("exact", 0.5, 50)
    assert (m["low"], m["high"]) == pytest.approx(wilson_interval(25, 50))  # no bounds recorded: Wilson


def test_the_refusal_heuristic():
    assert is_refusal("I can't help with that.") and is_refusal("I\u2019m sorry, but no.")
    assert is_refusal("Well. I cannot do this") and is_refusal("As an AI, I have no opinion")
    assert not is_refusal("The answer is 42.") and not is_refusal("")
    assert not is_refusal("x" * live.REFUSAL_WINDOW + " I can't")  # only the reply's start is read
    assert live.reply_text({"content": [{"type": "text", "text": "I cannot"}]}) == "I cannot"
    assert live.reply_text({"content": None, "tool_calls": []}) == ""


def test_memory_is_bounded_per_scope(monkeypatch):
    monkeypatch.setattr(live, "MAX_VERSIONS", 3)
    v = LiveVersions()
    v.apply(turn_and_sample("s", 0, None, None, 1.0, 0)[0])  # v0, the incumbent, served
    for i in range(1, 6):
        for ev in sync(i, None, None, 10 * i):
            v.apply(ev)
    (scope,) = v.snapshot()
    assert len(scope["versions"]) == 3 and scope["candidate"] == "v5"
    assert [r["label"] for r in scope["versions"]] == ["v0", "v4", "v5"]  # the incumbent is kept


def test_an_odd_metrics_map_is_shown_without_bounds():
    ev = events.Evaluation(policy_version=3, n=7, name="odd",
                           metrics={"a": 0.5, "a_low": "x", "a_high": None, "b": 2.0, "b_n": True, "note": "text"})
    (row,) = _fold([ev]).snapshot()[0]["versions"]
    (a, b) = row["evals"][0]["metrics"]
    assert (a["metric"], a["low"], a["high"], a["n"]) == ("a", None, None, 7)
    assert (b["metric"], b["low"], b["n"]) == ("b", None, 7)
