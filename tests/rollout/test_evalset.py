"""Issue 39: eval sets with guards, graded per version into an Evaluation the fold reads."""

from __future__ import annotations

import json

import pytest

from pipeline.events import Control, decode, encode
from pipeline.rollout.evalset import EvalSetError, evaluate, grade, load_eval_set
from pipeline.rollout.fold import RolloutFold
from pipeline.rollout.rule import RolloutConfig


def _write(tmp_path, rows):
    p = tmp_path / "eval.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_checks_grade_as_documented():
    checks = {"accuracy": {"regex": r"\b42\b"}, "brevity": {"max_words": 3}, "exact": {"exact": "42"},
              "has": {"contains": "4"}}
    assert grade(checks, " 42 ") == {"accuracy": True, "brevity": True, "exact": True, "has": True}
    assert grade(checks, "the answer is 420 here") == {"accuracy": False, "brevity": False, "exact": False,
                                                       "has": True}


def test_an_eval_set_gives_rates_with_intervals_and_guards(tmp_path):
    rows = [{"eval_set": "gsm8k-brevity", "guards": ["accuracy"]}]
    rows += [{"id": f"q{i}", "prompt": f"{i}+{i}?", "checks": {"accuracy": {"exact": str(2 * i)},
                                                               "brevity": {"max_words": 2}}} for i in range(10)]
    es = load_eval_set(_write(tmp_path, rows))
    assert es.name == "gsm8k-brevity" and es.guards == ("accuracy",) and len(es.items) == 10
    wrong_half = lambda m: str(2 * int(m[0]["content"].split("+")[0]) + (int(m[0]["content"][0]) % 2))  # noqa: E731
    ev = decode(encode(evaluate(es, wrong_half, policy_version=3)))
    assert ev.n == 10 and ev.metrics["accuracy"] == 0.5 and ev.metrics["brevity"] == 1.0
    assert ev.metrics["accuracy_n"] == 10 and ev.metrics["accuracy_low"] < 0.5 < ev.metrics["accuracy_high"]
    fold = RolloutFold(RolloutConfig(enabled=True, guards=es.guards, guard_min_n=10))
    fold.apply(Control(action="weights", epoch=3, policy_version=3, location="/w", sha256="a" * 64))
    fold.apply(ev)
    assert fold.scopes[None].canary.guards["candidate"]["accuracy"].successes == 5


def test_a_bad_eval_set_is_refused(tmp_path):
    with pytest.raises(EvalSetError, match="checks"):
        load_eval_set(_write(tmp_path, [{"prompt": "x"}]))
    with pytest.raises(EvalSetError, match="one of"):
        load_eval_set(_write(tmp_path, [{"prompt": "x", "checks": {"a": {"judge": 1}}}]))
    with pytest.raises(EvalSetError, match="bad regex"):
        load_eval_set(_write(tmp_path, [{"prompt": "x", "checks": {"a": {"regex": "("}}}]))
    with pytest.raises(EvalSetError, match="checked by no item"):
        load_eval_set(_write(tmp_path, [{"eval_set": "e", "guards": ["accuracy"]},
                                        {"prompt": "x", "checks": {"a": {"exact": "y"}}}]))


def test_the_documented_example_loads_and_grades_as_documented():
    from pathlib import Path

    es = load_eval_set(Path(__file__).resolve().parents[2] / "docs" / "examples" / "eval_set.jsonl")
    assert (es.name, es.guards, len(es.items)) == ("team-example", ("accuracy",), 4)
    right = {"capital-fr": "Paris.", "sum-17-25": "42", "json-ok": '{"ok": true}', "refuse-nothing": "Blue"}
    assert all(grade(item["checks"], right[item["id"]])["accuracy"] for item in es.items)
    assert not any(grade(item["checks"], "I do not know, 41")["accuracy"] for item in es.items)
