"""Cues of user replies the text classifier does not read (pipeline.judge.cpu.cues), on sentences
written for this test. The verdict words themselves are the fine-tuned encoder's to learn."""

from __future__ import annotations

import pytest

from pipeline.judge.cpu.cues import conflicting_number, read_cues, restates_request, tail_clause


@pytest.mark.parametrize("text,tail", [
    ("thanks, but the second link is dead", "the second link is dead"),  # praise, then a contrast
    ("great, but otherwise I'd keep it", ""),  # "but otherwise": the praise stands
    ("nice. next: the same for CSV but only the header", ""),  # the contrast belongs to the new request
    ("Merci, mais la date est fausse", "la date est fausse"), ("好的，但是还是报错", "还是报错"),
    ("Works great, thank you!", ""),
])
def test_contrast_tail(text, tail):
    assert read_cues(text).tail == tail, read_cues(text)


def test_irony_markers():
    assert read_cues("oh wonderful, just what I needed").sarcasm
    assert read_cues("Oh great, another crash").sarcasm
    assert not read_cues("wonderful, thank you").sarcasm


def test_tail_clause():
    assert tail_clause("Thanks, but the date is wrong") == "the date is wrong"
    assert tail_clause("nice! the date is wrong though") == "the date is wrong"
    assert tail_clause("no contrast here") == ""


def test_context_cues():
    assert conflicting_number("it's 64", "8 times 8 is 56")
    assert not conflicting_number("yes, 56", "8 times 8 is 56")
    assert not conflicting_number("what about 9 times 9?", "8 times 8 is 56")
    assert restates_request("Spanish. In SPANISH.", "Translate this into Spanish please")
    assert not restates_request("lovely, thanks", "Translate this into Spanish please")
    assert read_cues("it's 64", "56").correction and read_cues("shakespeare...").correction
    assert not read_cues("lovely, thanks", "56", "Translate this into Spanish please").correction
