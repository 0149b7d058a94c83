"""Cues of a user's reply that a classifier of the reply's text alone does not read.

The verdict words of a reply ("thanks", "still broken", "falsch", "不对") are learned by the
fine-tuned encoder from the labelled rows (:mod:`pipeline.judge.cpu.finetune`); this module keeps
only what the text classifier cannot see or tends to miss:

- the clause after a contrast ("thanks, but ..." -> "..."; "aber", "mais", "pero", "但是",
  "でも"), which the judge scores on its own, since praise before it does not settle the turn;
  not after "but otherwise/overall ...", nor when the contrast follows a new request
  ("great. next: X but Y");
- irony markers next to praise ("oh great, ...", "just what I needed");
- two cues from the turn: a short reply stating a number the response did not give ("it's 210"
  after "350"), and a short reply repeating the request's words ("vegan. VEGAN."); and a terse
  one- or two-word correction trailing off ("shakespeare...").

Word lists that named single training rows were removed (``docs/judge.md``, the measurement).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_CONTRAST = re.compile(
    r"(?<![\w])(?:but|however|though|although|except|apart from|other than|only thing|just one thing|only problem|"
    r"aber|jedoch|mais|cependant|pero|sin embargo|però|ma|mas|porém|maar|но|однако|ale|ama)(?![\w])"
    r"|但是|但|不过|可是|でも|けど|하지만|그런데", re.I)
_CONTINUATION = re.compile(r"(?:otherwise|overall|all in all|anyway|in general|apart from that|other than that|"
                           r"still (?:great|good|perfect|helpful|useful)|sonst|ansonsten|sinon|por lo demás|"
                           r"per il resto)\b", re.I)
_MOVING_ON = re.compile(r"(?<![\w])(?:next|another|also|now (?:can|could|would|do|let'?s|write|make|try|show|help))"
                        r"(?![\w])", re.I)
_SARCASM = re.compile(r"(?<![\w])(?:" + "|".join([  # irony markers: praise next to them is not trusted
    r"oh (?:great|perfect|wonderful|brilliant|fantastic|joy|lovely|sure|awesome)",
    r"(?:great|perfect|wonderful|brilliant|fantastic|lovely|awesome|amazing|excellent|super),? (?:just|now|another|so)",
    r"yeah,? sure", r"just what i (?:needed|wanted|asked for)", r"real(?:ly)? helpful", r"thanks a lot[.!]*$",
    r"(?:^|[.!] )(?:brilliant|genius|great|perfect|wonderful|fantastic|amazing|lovely)\.(?= \w)"]) + r")(?![\w])", re.I)
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:[.,]\d+)*")
# one or two words trailing off ("shakespeare...") or starred ("ankara*"): a terse correction
_TERSE_CORRECTION = re.compile(r"^(?!(?:hmm+|ok|okay|well|so|uh+|um+|sure|right|wait|yes|yeah|and|but|oh|ah|ha+|lol)\b)"
                               r"[^\W\d_][\w'-]*(?: [\w'-]+)?(?:\.\.\.|…|\*)$", re.I)
_CONTENT_WORD = re.compile(r"[^\W\d_]{4,}")
_STOP = {"that", "this", "with", "have", "from", "what", "your", "will", "just", "please", "about", "would", "could",
         "should", "there", "their", "them", "then", "than", "they", "were", "been", "being", "into", "also", "only",
         "some", "more", "less", "very", "much", "does", "want", "need", "make", "like", "here", "when", "where"}


def _numbers(text: str) -> set[str]:
    return {n.replace(",", "") for n in _NUMBER.findall(text or "")}


def conflicting_number(reply: str, response: str) -> bool:
    """A short reply that states a number the assistant's response did not give, while the
    response gave numbers ("it's 210" after "350"): the user is correcting a value."""
    if not response or len((reply or "").split()) > 8 or (reply or "").rstrip().endswith(("?", "？")):
        return False
    said, told = _numbers(reply), _numbers(response)
    return bool(said and told and said - told)


def restates_request(reply: str, request: str) -> bool:
    """A short reply made mostly of the request's own content words ("vegan. VEGAN." after
    "recommend a vegan restaurant"): the user repeats what was asked, the reply missed it."""
    if not request or len((reply or "").split()) > 12 or (reply or "").rstrip().endswith(("?", "？")):
        return False
    words = {w.lower() for w in _CONTENT_WORD.findall(reply)} - _STOP
    asked = {w.lower() for w in _CONTENT_WORD.findall(request)} - _STOP
    return bool(words) and len(words & asked) / len(words) >= 0.6


def tail_clause(text: str) -> str:
    """The text after the last contrast word ("thanks, but X" -> "X"), or "" without one. A
    contrast word closing the text ("nice! X is wrong though") marks the sentence it closes."""
    last = None
    for last in _CONTRAST.finditer(text):
        pass
    if not last:
        return ""
    after = text[last.end():].strip(" .!?,;")
    if after:
        return text[last.end():].strip()
    before = re.split(r"(?<=[.!?])\s+|[,;]\s*", text[: last.start()].strip())
    return before[-1].strip() if len(before) > 1 else ""


@dataclass(frozen=True)
class Cues:
    """What :func:`read_cues` found in one reply."""

    tail: str  # the clause after a contrast that may overturn praise before it ("" when none)
    sarcasm: bool  # irony markers ("oh great, ...", "just what I needed")
    correction: bool  # a conflicting number, the request restated, or a terse correction


def read_cues(text: str, response: str = "", request: str = "") -> Cues:
    """The :class:`Cues` of a user's reply (``response``: the assistant's reply it answers, for
    :func:`conflicting_number`; ``request``: the user's request, for :func:`restates_request`)."""
    stripped = (text or "").strip()
    t = " ".join(stripped.replace("…", " ").replace("...", " ").split())
    tail = tail_clause(t)
    if _CONTINUATION.match(tail) or (tail and _MOVING_ON.search(t[: len(t) - len(tail)])):
        tail = ""  # "but otherwise ...": the praise stands; "great. next: X but Y": the contrast is the new request's
    correction = (bool(_TERSE_CORRECTION.match(stripped)) or conflicting_number(stripped, response)
                  or restates_request(stripped, request))
    return Cues(tail=tail, sarcasm=bool(_SARCASM.search(t)), correction=correction)
