"""Pure grading helpers of the simulated users: word counts, final numbers, GSM8K answers.

Nothing here does I/O; every function is deterministic and unit-tested
(``tests/simulate/test_simulate_grading.py``).

- :func:`count_words`: whitespace-separated chunks that contain a letter or a digit (so a lone
  ``-`` bullet or ``=`` is not a word; ``18.`` and ``$18`` are).
- :func:`extract_final_number`: the number a reply commits to, preferring explicit markers
  (``#### 42``, ``\\boxed{42}``, ``answer is 42``, ``Answer: 42``) over the last number in the text.
- :func:`parse_gsm8k_answer`: GSM8K's ``answer`` field -> worked steps (calculator annotations
  ``<<...>>`` removed) and the final number after ``####``.
- :func:`count_lines`: lines holding a word (:func:`count_words`), the *steps* preference's measure.
- :func:`grade_reply`: the facts the feedback policies decide on (brief? laid out in steps? correct?).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

_WORD = re.compile(r"\S+")
_ALNUM = re.compile(r"[^\W_]", re.UNICODE)
# a number: optional sign, digits with optional thousands commas, optional decimals; or .5
_NUM = r"[-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-−]?\.\d+"
_NUMBER = re.compile(rf"(?<![\w.])(?:{_NUM})")
_MARKERS = [
    re.compile(rf"####\s*\$?\s*({_NUM})"),
    re.compile(rf"\\boxed\{{\s*\$?\s*({_NUM})"),
    re.compile(rf"answer\s*(?:is|:|=)\s*(?:\*\*)?\s*\$?\s*({_NUM})", re.IGNORECASE),
]
_CALC = re.compile(r"<<[^>]*>>")


def count_words(text: str) -> int:
    """Number of words in ``text``: whitespace-separated chunks holding a letter or digit."""
    return sum(1 for w in _WORD.findall(text or "") if _ALNUM.search(w))


def count_lines(text: str) -> int:
    """Number of lines of ``text`` that hold at least one word (:func:`count_words`): blank lines
    and lines of punctuation only (``---``, ``=``) do not count."""
    return sum(1 for line in (text or "").splitlines() if count_words(line))


def normalize_number(s: str) -> Decimal | None:
    """``"1,234.50"`` -> ``Decimal('1234.50')``; ``"−3"`` (unicode minus) -> ``-3``; junk -> None."""
    s = s.strip().replace(",", "").replace("−", "-").rstrip(".")
    if not s:
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def extract_final_number(reply: str) -> Decimal | None:
    """The final numeric answer of a model reply, or None if it holds no number.

    Order: the last ``#### n``, else the last ``\\boxed{n}``, else the last ``answer is/:/= n``,
    else the last number anywhere (the GSM8K convention of lm-eval's "flexible extract").
    """
    text = reply or ""
    for pat in _MARKERS:
        found = pat.findall(text)
        if found:
            return normalize_number(found[-1])
    found = _NUMBER.findall(text)
    return normalize_number(found[-1]) if found else None


@dataclass(frozen=True)
class GSM8KAnswer:
    """A parsed GSM8K ``answer`` field: worked ``steps`` (plain text) and the ``final`` number."""

    steps: tuple[str, ...]
    final: Decimal


def parse_gsm8k_answer(answer: str) -> GSM8KAnswer:
    """Split GSM8K's ``answer`` (steps, then ``#### n``) into steps and the final number.

    Calculator annotations ``<<48/2=24>>`` are removed from the steps.

    Raises:
        ValueError: no ``####`` line, or its value is not a number.
    """
    if "####" not in answer:
        raise ValueError("GSM8K answer has no '####' final line")
    body, _, final = answer.rpartition("####")
    value = normalize_number(final)
    if value is None:
        raise ValueError(f"GSM8K final answer {final.strip()!r} is not a number")
    steps = tuple(s for s in (_CALC.sub("", line).strip() for line in body.splitlines()) if s)
    return GSM8KAnswer(steps=steps, final=value)


def numbers_equal(a: Decimal | None, b: Decimal | None) -> bool:
    """True when both are numbers and equal (``18`` == ``18.00``)."""
    return a is not None and b is not None and a == b


@dataclass(frozen=True)
class Grade:
    """What a simulated user sees in one reply.

    ``words``: :func:`count_words`; ``tokens``: completion tokens (None if the server did not say);
    ``brief``: at most ``max_words`` words, at most ``max_tokens`` tokens and not cut off by the
    length limit; ``correct``: the final number equals the gold one (None without a gold answer);
    ``lines``: :func:`count_lines`; ``stepwise``: at least ``min_lines`` such lines (the working
    laid out one step per line, the *steps* preference).
    """

    words: int
    tokens: int | None
    brief: bool
    correct: bool | None
    number: Decimal | None
    lines: int = 0
    stepwise: bool = False


def grade_reply(content: str, *, completion_tokens: int | None = None, finish_reason: str | None = None,
                gold: Decimal | None = None, max_words: int = 40, max_tokens: int = 64, min_lines: int = 4) -> Grade:
    """Grade one assistant reply (see :class:`Grade`).

    The brevity property follows docs/environment.md §7: a reply that finishes
    within ``max_tokens`` tokens and has at most ``max_words`` words; the 135M base model does
    this ~9% of the time on GSM8K prompts, so it is learnable by Binary RL. The steps property
    (at least ``min_lines`` lines with a word, whether or not the reply was cut off) is met by
    ~9% of its replies at 96 tokens (docs/tenants.md, Demo).
    """
    words = count_words(content)
    brief = (words <= max_words and finish_reason != "length"
             and (completion_tokens is None or completion_tokens <= max_tokens))
    number = extract_final_number(content)
    correct = None if gold is None else numbers_equal(number, gold)
    lines = count_lines(content)
    return Grade(words=words, tokens=completion_tokens, brief=brief, correct=correct, number=number, lines=lines,
                 stepwise=lines >= min_lines)
