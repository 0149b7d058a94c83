"""The three labelled reply sets the CPU judge learns from (``pipeline/judge/data/replies_*``).

They were written blind to the judge and to the other sets (``replies_next_states.md``). These
tests check their shape (user replies only, all three labels, the fields each row needs), that
every reply is a training row of the judge, and that they share no wording with the held-out
evaluation set or with the other labelled sets (no 8-word shingle, no equal normalised text, no
near-duplicate). On an overlap the message names only this set's ids, never the other set's text.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.judge.judge_overlap import overlaps
from pipeline.judge.evaluate import load_rows

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "pipeline" / "judge" / "data"
SETS = sorted(DATA.glob("replies_*_next_states.jsonl"))
EVAL = DATA / "eval_next_states.jsonl"
OTHERS = [EVAL, DATA / "dev_next_states.jsonl", DATA / "tuning_next_states.jsonl",
          ROOT / "tests" / "fixtures" / "judge_next_states.jsonl"]
CATEGORIES = {"coding", "writing", "maths", "support", "casual"}


def _texts(rows):
    return [m.get("content") or "" for r in rows for m in r["next_state"]]


def _owners(rows):
    return [r["id"] for r in rows for _ in r["next_state"]]


def test_there_are_three_sets():
    assert [p.name.split("_")[1] for p in SETS] == ["coding", "everyday", "hard"]


@pytest.mark.parametrize("path", SETS, ids=lambda p: p.name)
def test_shape(path):
    rows = load_rows(path)
    assert len(rows) >= 150
    assert Counter(r["label"] for r in rows).keys() == {1, 0, -1}
    assert min(Counter(r["label"] for r in rows).values()) >= 30
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert r["role"] == "user" and r["category"] in CATEGORIES, r["id"]
        assert len(r["next_state"]) == 1 and r["next_state"][0]["role"] == "user", r["id"]
        assert r["request"] and r["response"] and r["next_state"][0]["content"].strip(), r["id"]
        assert isinstance(r["style"], list), r["id"]
    replies = [r["next_state"][0]["content"] for r in rows]
    assert len(set(replies)) == len(replies)


@pytest.mark.parametrize("path", SETS, ids=lambda p: p.name)
def test_every_reply_is_a_training_row_and_no_eval_row_is(path):
    from pipeline.judge.cpu.classifier import LABELLED_SETS, training_examples

    assert path in LABELLED_SETS and EVAL not in LABELLED_SETS
    learned = Counter(e["label"] for e in training_examples() if e.get("source") == path.name)
    assert learned == Counter(r["label"] for r in load_rows(path))


@pytest.mark.parametrize("other", OTHERS + SETS, ids=lambda p: p.name)
@pytest.mark.parametrize("path", SETS, ids=lambda p: p.name)
def test_no_shared_wording(path, other):
    if other == path:
        return
    rows = load_rows(path)
    found = overlaps(_texts(load_rows(other)), _texts(rows))
    owners = _owners(rows)
    assert not found, f"{path.name} rows overlapping {other.name}: " + ", ".join(
        sorted({f"{owners[j]} ({kind})" for _, j, kind in found}))
