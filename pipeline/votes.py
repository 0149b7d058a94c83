"""Judge votes: the vote in an answer's last ``\\boxed{}`` (:func:`parse_score`) and their majority
(:func:`majority_vote`), the reward of a Binary-RL sample. One rule for the judge that writes the
sample, for every reader that checks a sample's ``reward`` against its recorded ``votes`` (the
dashboard) and for the eval set's ``judge`` checks (:mod:`pipeline.evaluator.judged`).

Source: OpenClaw-RL's PRM aggregation (majority of the valid votes, failed votes ignored), with
one deliberate difference documented on :func:`majority_vote`.
"""

from __future__ import annotations

import re
from collections import Counter

_BOX = "\\boxed{"
_WRAPPERS = re.compile(r"^\\(?:text|textbf|mathrm|mathbf)\{(.*)\}$", re.S)
_NUMBER = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)$")


def majority_vote(votes: list[int | None]) -> int | None:
    """Majority of the valid votes; a tie between the top values gives 0; no valid vote gives
    None (no judgement: the turn carries no RL signal).

    OpenClaw-RL's PRM aggregation (failed votes are ignored, not counted as 0), except that
    OpenClaw-RL also scores a turn whose votes all failed as 0; here that is absent, not a
    vote of 0 (a backend outage must not train the policy toward "neutral").

    Args:
        votes: one entry per judge call: -1, 0 or 1, or None for a failed vote.
    """
    tally = Counter(v for v in votes if v is not None)
    if not tally:
        return None
    top = max(tally.values())
    winners = [v for v, n in tally.items() if n == top]
    return int(winners[0]) if len(winners) == 1 else 0


def last_boxed(text: str | None) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces balanced), or None."""
    if not text:
        return None
    pos = text.rfind(_BOX)
    while pos >= 0:
        depth, i = 1, pos + len(_BOX)
        while i < len(text) and depth:
            c = text[i]
            depth += (c == "{") - (c == "}")
            i += 1
        if depth == 0:
            return text[pos + len(_BOX): i - 1]
        pos = text.rfind(_BOX, 0, pos)  # unterminated box (truncated output): try an earlier one
    return None


def parse_score(text: str | None, allowed: tuple[int, ...] = (1, 0, -1)) -> int | None:
    """The vote in the last ``\\boxed{}``: an int in ``allowed``, or None (failed vote).

    Accepts ``1``, ``+1``, ``-1``, ``0``, ``1.0``, ``-1.00``, surrounding spaces or ``$``,
    and one ``\\text{..}``-style wrapper. Rejects other numbers (``2``, ``0.5``), words and
    missing boxes.
    """
    inner = last_boxed(text)
    if inner is None:
        return None
    s = inner.strip().strip("$").strip()
    m = _WRAPPERS.match(s)
    if m:
        s = m.group(1).strip()
    s = s.replace(" ", "")
    if not _NUMBER.match(s):
        return None
    value = float(s)
    if value != int(value) or int(value) not in allowed:
        return None
    return int(value)
