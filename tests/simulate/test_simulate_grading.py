"""Unit tests of the simulated users' pure rules: grading, feedback policies, shipped data."""

from __future__ import annotations

import random
from decimal import Decimal

import pytest

from pipeline.simulate.datasets import DATA_DIR, load_gsm8k, load_mt_bench, pick
from pipeline.simulate.feedback import NOT_STEPWISE, THANKS_BRIEF, THANKS_CORRECT, THANKS_STEPS, decide
from pipeline.simulate.grading import (count_lines, count_words, extract_final_number, grade_reply, normalize_number,
                                       parse_gsm8k_answer)


@pytest.mark.parametrize("text,n", [
    ("", 0), ("one", 1), ("The answer is 18.", 4), ("- a\n- b", 2), ("x = 3 + 4", 3),
    ("$18 per day", 3), ("  spaced\t\tout\nwords  ", 3), ("**Answer:** 42", 2),
])
def test_count_words(text, n):
    assert count_words(text) == n


@pytest.mark.parametrize("reply,want", [
    ("She makes 9 * 2 = $18 every day.", "18"),
    ("So the profit is $70,000.", "70000"),
    ("#### 42\nI hope 7 helps", "42"),
    ("The answer is 3.5 hours, not 7", "3.5"),
    ("Answer: **12** (from 3 and 4)", "12"),
    ("\\boxed{-4} is it, though 9 appears", "-4"),
    ("It went down by −3 degrees", "-3"),
    ("No numbers here.", None),
    ("Step 1: 3 apples. Step 2: 5 pears.", "5"),
    ("version2 has 0.5 of it", "0.5"),
])
def test_extract_final_number(reply, want):
    got = extract_final_number(reply)
    assert got == (Decimal(want) if want is not None else None)


def test_normalize_number():
    assert normalize_number("1,234.50") == Decimal("1234.5")
    assert normalize_number("18.") == Decimal("18")
    assert normalize_number("abc") is None
    assert normalize_number(" ") is None


def test_parse_gsm8k_answer_strips_calculator_and_reads_final():
    a = parse_gsm8k_answer("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
                           "She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18")
    assert a.final == Decimal("18")
    assert a.steps == ("Janet sells 16 - 3 - 4 = 9 duck eggs a day.", "She makes 9 * 2 = $18 every day.")
    assert parse_gsm8k_answer("x\n#### 70,000").final == Decimal("70000")
    with pytest.raises(ValueError, match="####"):
        parse_gsm8k_answer("no final line")
    with pytest.raises(ValueError, match="not a number"):
        parse_gsm8k_answer("#### twelve")


def test_grade_reply_brevity_and_correctness():
    g = grade_reply("The answer is 18.", completion_tokens=6, finish_reason="stop", gold=Decimal(18))
    assert g.brief and g.correct and g.words == 4
    long = " ".join(["word"] * 41)
    assert not grade_reply(long, completion_tokens=41).brief  # 41 words > 40
    assert not grade_reply("short", completion_tokens=65).brief  # 65 tokens > 64
    assert not grade_reply("short", completion_tokens=10, finish_reason="length").brief  # cut off
    assert grade_reply("short", completion_tokens=None).brief  # tokens unknown: words decide
    assert grade_reply("It is 17", gold=Decimal(18)).correct is False
    assert grade_reply("It is 17").correct is None


def test_feedback_policies():
    gold = parse_gsm8k_answer("First 2 + 2 = <<2+2=4>>4.\nThen 4 * 3 = <<4*3=12>>12.\n#### 12")
    rng = random.Random(0)
    short_wrong = grade_reply("It is 7.", completion_tokens=5, gold=gold.final)
    long_wrong = grade_reply(" ".join(["blah"] * 50) + " 7", completion_tokens=60, gold=gold.final)
    right_long = grade_reply(" ".join(["blah"] * 50) + " 12", completion_tokens=60, gold=gold.final)

    fb = decide("brevity", short_wrong, gold, rng, max_words=40)
    assert fb.kind == "thanks" and fb.success and fb.text in THANKS_BRIEF
    fb = decide("brevity", long_wrong, gold, rng, max_words=40)
    assert fb.kind == "too_long" and not fb.success and fb.text == "Too long — answer in at most 40 words."
    fb = decide("brevity", right_long, gold, rng, max_words=40)
    assert fb.kind == "thanks" and fb.success and fb.text in THANKS_CORRECT

    fb = decide("correctness", short_wrong, gold, rng, max_words=40)
    assert fb.kind == "correction" and not fb.success and fb.hint == "First 2 + 2 = 4." and fb.hint in fb.text
    fb = decide("correctness", short_wrong, gold, rng, max_words=40, corrections_so_far=1)
    assert fb.hint == "Then 4 * 3 = 12."
    fb = decide("correctness", short_wrong, gold, rng, max_words=40, corrections_so_far=5)
    assert fb.hint == "Then 4 * 3 = 12."  # the last step repeats
    fb = decide("correctness", long_wrong, gold, rng, max_words=25)
    assert fb.kind == "too_long" and "25 words" in fb.text
    with pytest.raises(ValueError, match="unknown feedback policy"):
        decide("kindness", short_wrong, gold, rng, max_words=40)


@pytest.mark.parametrize("text,n", [
    ("", 0), ("one line", 1), ("a\nb", 2), ("a\n\n\nb\n", 2), ("1. x\n---\n2. y\n=\n", 2),
    ("  \n\t\n", 0), ("a\r\nb\r\nc", 3),
])
def test_count_lines(text, n):
    assert count_lines(text) == n


def test_steps_policy_wants_one_step_per_line_whatever_the_length_or_number():
    gold = parse_gsm8k_answer("First 2 + 2 = <<2+2=4>>4.\nThen 4 * 3 = <<4*3=12>>12.\n#### 12")
    rng = random.Random(0)
    four = "2 + 2 = 4\n4 * 3 = 12\nso twelve\nThe answer is 12."
    assert grade_reply(four).stepwise and grade_reply(four).lines == 4
    assert not grade_reply(four, min_lines=5).stepwise
    right_on_one_line = grade_reply("2 + 2 = 4, 4 * 3 = 12, the answer is 12.", completion_tokens=20, gold=gold.final)
    assert right_on_one_line.correct and right_on_one_line.brief and not right_on_one_line.stepwise
    fb = decide("steps", right_on_one_line, gold, rng, max_words=40)  # right and brief, but not laid out
    assert fb.kind == "not_stepwise" and not fb.success and fb.text in NOT_STEPWISE and fb.hint is None
    long_steps = grade_reply("\n".join(["blah " * 20] * 5) + "7", completion_tokens=96, finish_reason="length",
                             gold=gold.final)
    fb = decide("steps", long_steps, gold, rng, max_words=40)  # long, cut off and wrong: still laid out
    assert fb.kind == "thanks" and fb.success and fb.text in THANKS_STEPS
    assert decide("brevity", long_steps, gold, rng, max_words=40).success is False  # the two users disagree


def test_shipped_data_is_complete_and_licensed():
    train, held = load_gsm8k("train"), load_gsm8k("heldout")
    assert len(train) == 300 and len(held) == 32
    assert not {p.id for p in train} & {p.id for p in held}
    assert all(p.answer.steps for p in train + held)
    mt = load_mt_bench()
    assert len(mt) == 80 and all(len(q.turns) == 2 for q in mt)
    assert len({q.category for q in mt}) == 8
    for d in ("gsm8k", "mt_bench"):
        assert (DATA_DIR / d / "LICENSE").read_text().strip()
        assert "Origin" in (DATA_DIR / d / "SOURCE.md").read_text()
    with pytest.raises(ValueError, match="unknown GSM8K split"):
        load_gsm8k("test")


def test_pick_is_seeded_and_covers_without_repeats():
    items = list(range(10))
    a, b = pick(items, 25, seed=3), pick(items, 25, seed=3)
    assert a == b and len(a) == 25
    assert sorted(a[:10]) == items and sorted(a[10:20]) == items
    assert pick(items, 10, seed=4) != pick(items, 10, seed=5)
    assert pick([], 5, seed=0) == []
