"""The second, independently written development set of labelled next states.

``pipeline/judge/data/dev_next_states.jsonl`` exists so that changes to the judge can be checked
for generalisation on text nobody tuned on, while the held-out evaluation set
(``eval_next_states.jsonl``) stays the bar. It was written blind to the judge and used that way
once; since then it is tuned on, and its user replies are training rows of the CPU judge. These
tests check its shape (both next-state roles, all three labels, all five user categories, the
fields each row needs), that its replies are training rows and the evaluation set's never are,
and that its texts share no wording with the evaluation set, nor with the labelled sets earlier
tuning was measured on (no 8-word
shingle, no equal normalised text, no near-duplicate). On an overlap the message names only
development-set ids, never the other set's texts.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.judge.judge_overlap import overlaps
from pipeline.judge.evaluate import load_rows

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "pipeline" / "judge" / "data"
DEV = DATA / "dev_next_states.jsonl"
ROWS = DEV  # for judge/conftest.rows
EVAL = DATA / "eval_next_states.jsonl"
TUNED_ON = [ROOT / "tests" / "fixtures" / "judge_next_states.jsonl", DATA / "tuning_next_states.jsonl"]
USER_CATEGORIES = {"coding", "writing", "maths", "support", "casual"}


def _texts(rows):
    return [m.get("content") or "" for r in rows for m in r["next_state"] if isinstance(m, dict)]


def _owners(rows):
    return [r["id"] for r in rows for m in r["next_state"] if isinstance(m, dict)]


def test_dev_set_shape(rows):
    assert len(rows) >= 200
    assert {r["label"] for r in rows} == {1, 0, -1}
    assert {r["role"] for r in rows} == {"user", "tool"}
    assert {r["category"] for r in rows if r["role"] == "user"} == USER_CATEGORIES
    for r in rows:
        assert len(r["next_state"]) == 1 and r["next_state"][0]["role"] == r["role"], r["id"]
        assert r["id"].startswith("dev-user-" if r["role"] == "user" else "dev-tool-"), r["id"]
        assert isinstance(r["style"], list) and r["request"], r["id"]
        if r["role"] == "tool":
            assert r["category"] == "agentic-tool", r["id"]
            call = r["tool_calls"][0]["function"]
            json.loads(call["arguments"])  # arguments are a JSON string
            assert r["next_state"][0]["name"] == call["name"], r["id"]
    per_category = Counter(r["category"] for r in rows if r["role"] == "user")
    assert min(per_category.values()) >= 20, per_category


def test_dev_set_replies_are_training_rows_and_eval_rows_never_are(rows):
    """Since this set was tuned on, its user replies are training rows of the CPU judge
    (:func:`~pipeline.judge.cpu.classifier.labelled_replies`); the evaluation set's never are."""
    from pipeline.judge.cpu.classifier import LABELLED_SETS, training_examples

    assert DEV in LABELLED_SETS and EVAL not in LABELLED_SETS
    learned = {e["text"] for e in training_examples() if e.get("source") == DEV.name}
    users = {"\n".join(m["content"] for m in r["next_state"] if m.get("role") == "user") for r in rows}
    assert learned == {u for u in users if u}


def test_dev_set_shares_no_text_with_the_evaluation_set(rows):
    held_out = _texts(load_rows(EVAL))
    assert len(held_out) >= 200
    found = overlaps(held_out, _texts(rows))
    owners = _owners(rows)
    assert not found, "dev rows overlapping the evaluation set: " + ", ".join(
        sorted({f"{owners[j]} ({kind})" for _, j, kind in found}))


@pytest.mark.parametrize("path", TUNED_ON, ids=lambda p: p.name)
def test_dev_set_shares_no_text_with_the_sets_earlier_tuning_used(rows, path):
    """Those fixtures steered earlier judge changes; text from them would not measure generalisation."""
    found = overlaps(_texts(load_rows(path)), _texts(rows))
    owners = _owners(rows)
    assert not found, f"dev rows overlapping {path.name}: " + ", ".join(
        sorted({f"{owners[j]} ({kind})" for _, j, kind in found}))
