"""Lexical cues of user replies (pipeline.judge.cpu.cues), on sentences written for this test."""

from __future__ import annotations

import pytest

from pipeline.judge.cpu.cues import CUE_DIM, cue_vector, read_cues, tail_clause


@pytest.mark.parametrize("text,polarity", [
    ("Works great, thank you!", 1),
    ("the layout is broken", -1),
    ("It still crashes on start", -1),
    ("It still works after the upgrade", 1),  # "still" alone is no complaint
    ("thanks, but the second link is dead", -1),  # praise, then a complaining contrast
    ("great, but otherwise I'd keep it", 1),  # "but otherwise": the praise stands
    ("Merci, c'est parfait", 1), ("Nein, das ist falsch", -1), ("不对，是12", -1), ("完美，谢谢", 1),
    ("Oh great, another crash", 0),  # praise next to irony and a complaint: no direction
    ("why does it use a set here?", 0), ("let me try it tomorrow", 0),
    ("no idea yet, let me look", 0),  # "no idea" is no complaint
    # "still broken", "I said ...", "please correct" in other languages
    ("J'avais dit sans sucre.", -1), ("Ik zei zonder uien.", -1),
    ("Prosiłem o wersję po angielsku.", -1), ("Ho chiesto una risposta breve.", -1), ("Я же просил без мяса.", -1),
    ("我要的是英文版。", -1), ("まだエラーが出ます。", -1), ("잘못 계산하신 것 같아요.", -1), ("ainda não abre", -1),
])
def test_polarity(text, polarity):
    assert read_cues(text).polarity == polarity, read_cues(text)


def test_sarcasm_hold_and_question_markers():
    assert read_cues("oh wonderful, just what I needed").sarcasm
    assert not read_cues("wonderful, thank you").sarcasm
    assert read_cues("hold on, checking").hold and read_cues("which one is faster?").question
    assert read_cues("Oh sure, a 40-step recipe for a weeknight. Very relaxing. /s").sarcasm
    assert read_cues("nothing says relaxing holiday like a 5am flight").sarcasm
    for deferral in ("brb, back in a bit", "sono fuori, domani lo provo"):
        assert read_cues(deferral).hold, deferral


def test_tail_clause():
    assert tail_clause("Thanks, but the date is wrong") == "the date is wrong"
    assert tail_clause("nice! the date is wrong though") == "the date is wrong"
    assert tail_clause("no contrast here") == ""


def test_relative_clause_is_no_praise():
    assert read_cues("I liked what was great before").positive == read_cues("I liked it before").positive


def test_cue_vector_shape():
    v = cue_vector("thanks!")
    assert len(v) == CUE_DIM and all(0.0 <= x <= 1.0 for x in v)
