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
    fold = RolloutFold(RolloutConfig(enabled=True, guards=es.guards, guard_min_n=10), full_weights="evalset")
    fold.apply(Control(action="weights", epoch=3, policy_version=3, location="/w", sha256="a" * 64))
    fold.apply(ev)
    assert fold.scopes[None].canary.guards["candidate"]["accuracy"].successes == 5


def test_a_bad_eval_set_is_refused(tmp_path):
    with pytest.raises(EvalSetError, match="checks"):
        load_eval_set(_write(tmp_path, [{"prompt": "x"}]))
    with pytest.raises(EvalSetError, match="one of"):
        load_eval_set(_write(tmp_path, [{"prompt": "x", "checks": {"a": {"grader": 1}}}]))
    with pytest.raises(EvalSetError, match="line 1: check 'a': 'judge' takes a criterion"):
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


# ---- function checks and judge checks ---------------------------------------------------------

CALLS: list = []
NOT_CALLABLE = 3


def answer_matches(reply: str, item: dict) -> bool:
    """A function check of this module: the reply is the item's own ``answer`` field."""
    CALLS.append(item["id"])
    return reply.strip() == item["answer"]


def explodes(reply: str, item: dict) -> bool:
    raise RuntimeError(f"cannot grade {reply!r}")


def test_a_function_check_is_called_with_the_reply_and_the_item_and_a_raise_fails_only_its_check(tmp_path, caplog):
    here = "tests.rollout.test_evalset"
    rows = [{"id": f"q{i}", "prompt": f"{i}+{i}?", "answer": str(2 * i),
             "checks": {"accuracy": {"function": f"{here}:answer_matches"}, "odd": {"function": f"{here}.explodes"},
                        "brief": {"max_words": 1}}} for i in range(4)]
    es = load_eval_set(_write(tmp_path, rows))
    CALLS.clear()
    ev = evaluate(es, lambda m: "4" if m[0]["content"] == "2+2?" else "0", policy_version=1)
    assert CALLS == ["q0", "q1", "q2", "q3"]  # each item graded once, with its own fields
    assert (ev.metrics["accuracy"], ev.metrics["accuracy_n"]) == (0.5, 4)  # q0 ("0") and q2 ("4") right
    assert (ev.metrics["odd"], ev.metrics["odd_n"], ev.metrics["brief"]) == (0.0, 4, 1.0)  # raised: failed
    assert "cannot grade" in caplog.text and "explodes" in caplog.text


def test_a_function_check_that_does_not_import_or_is_not_callable_is_refused_at_load(tmp_path):
    ok = {"prompt": "x", "checks": {"a": {"exact": "y"}}}
    for path, why in (("tests.rollout.no_such_module:f", "ModuleNotFoundError"),
                      ("tests.rollout.test_evalset:no_such_function", "AttributeError"),
                      ("tests.rollout.test_evalset:NOT_CALLABLE", "not a callable"), ("nocolon", "import path")):
        with pytest.raises(EvalSetError, match=f"line 2: check 'a': function '{path}'.*{why}"):
            load_eval_set(_write(tmp_path, [ok, {"prompt": "x", "checks": {"a": {"function": path}}}]))
    with pytest.raises(EvalSetError, match="line 1: check 'a': 'function' takes an import path"):
        load_eval_set(_write(tmp_path, [{"prompt": "x", "checks": {"a": {"function": 7}}}]))


def test_an_absent_judge_check_counts_in_neither_the_rate_nor_n(tmp_path):
    rows = [{"id": f"q{i}", "prompt": f"q{i}", "checks": {"polite": {"judge": "the reply is polite"},
                                                          "brief": {"max_words": 3}}} for i in range(4)]
    es = load_eval_set(_write(tmp_path, rows))
    assert es.uses_judge
    seen = []

    def judge(criterion, item, reply):  # q0 passes, q1 fails, q2 and q3 get no verdict
        seen.append((criterion, item["id"], reply))
        return {"q0": True, "q1": False}.get(item["id"])

    ev = evaluate(es, lambda m: "hello", policy_version=2, judge=judge)
    assert seen[0] == ("the reply is polite", "q0", "hello") and len(seen) == 4
    assert (ev.n, ev.metrics["polite"], ev.metrics["polite_n"], ev.metrics["brief_n"]) == (4, 0.5, 2, 4)
    assert grade(es.items[2]["checks"], "hi", es.items[2], judge) == {"polite": None, "brief": True}
    ev = evaluate(es, lambda m: "hello", policy_version=2, judge=lambda *_: None)  # no verdict at all
    assert "polite" not in ev.metrics and "polite_n" not in ev.metrics and ev.metrics["brief_n"] == 4
    with pytest.raises(EvalSetError, match="no judge"):
        evaluate(es, lambda m: "hello", policy_version=2)


# ---- guards the eval set can never decide are refused (docs/rollout.md "The rule") --------------

def _team(tmp_path, n=32, guards=("accuracy",)):
    rows = [{"eval_set": "team", "guards": list(guards)}]
    rows += [{"id": f"q{i}", "prompt": f"q{i}", "checks": {"accuracy": {"exact": "42"}}} for i in range(n)]
    return str(_write(tmp_path, rows))


def _evaluator(tmp_path, n=32, declared=("accuracy",), **rollout):
    from pipeline.config import Config
    from pipeline.evaluator import Evaluator

    config = Config().replace(rollout={"enabled": True, "eval_set": _team(tmp_path, n, declared), **rollout})
    return Evaluator(config)


def test_a_configured_guard_no_item_checks_is_refused_with_its_name(tmp_path):
    with pytest.raises(EvalSetError, match=r"guard 'accurracy' is checked by no item of eval set 'team'"):
        _evaluator(tmp_path, guards=["accurracy"])


def test_the_eval_set_gate_refuses_a_guard_checked_by_fewer_than_guard_min_n_items(tmp_path):
    with pytest.raises(EvalSetError, match=r"guard 'accuracy' is checked by 32 items of eval set .team. and rollout.guard_min_n is 100"):
        _evaluator(tmp_path)  # the default guard_min_n vs a 32-item eval set: too_few forever
    ev = _evaluator(tmp_path, guard_min_n=32)
    assert ev.decider.rule.guards == ("accuracy",) and ev.decider.rule.guard_min_n == 32


def test_the_eval_set_gate_needs_guards_configured_or_declared(tmp_path):
    with pytest.raises(EvalSetError, match="there are no guards: set rollout.guards"):
        _evaluator(tmp_path, declared=(), guard_min_n=32)
    ev = _evaluator(tmp_path, declared=(), guard_min_n=32, guards=["accuracy"])  # configured guards suffice
    assert ev.decider.rule.guards == ("accuracy",)


def test_live_gates_do_not_need_guard_min_n_items_but_refuse_unchecked_guards(tmp_path):
    from pipeline.config import Config
    from pipeline.evaluator import Evaluator

    config = Config().replace(trainer={"lora": {"rank": 4}, "per_tenant": True},
                              rollout={"enabled": True, "eval_set": _team(tmp_path)})
    assert Evaluator(config).eval_set.name == "team"  # adapters: live arms decide, 32 items are fine
    with pytest.raises(EvalSetError, match="'safety' is checked by no item"):
        Evaluator(config.replace(rollout={"guards": ["safety"]}))


def test_the_eval_set_gate_refuses_a_set_too_small_to_ever_show_a_guard_non_inferior(tmp_path):
    from pipeline.rollout.stats import newcombe_difference

    best = newcombe_difference(16, 16, 16, 16, 1.645)[0]
    assert best < -0.10  # 16/16 vs 16/16 cannot clear the default margin: every candidate inconclusive
    with pytest.raises(EvalSetError, match=rf"16 items .* lower bound of {best:.3f}, not above -rollout.guard_margin"):
        _evaluator(tmp_path, n=16, guard_min_n=16)
    assert _evaluator(tmp_path, n=16, guard_min_n=16, guard_margin=0.2).decider.rule.guard_margin == 0.2
    assert _evaluator(tmp_path, n=32, guard_min_n=32).eval_set is not None  # 32/32: -0.078 clears -0.10
