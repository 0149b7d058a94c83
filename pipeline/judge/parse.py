"""Parsing judge output: ``\\boxed{...}`` scores and hints (the vote in the last box,
:func:`pipeline.votes.parse_score`, and the majority vote live in :mod:`pipeline.votes`).

The PRM (process reward model) prompt of OpenClaw-RL's Binary RL asks the judge to end with
``\\boxed{1}``, ``\\boxed{0}`` or ``\\boxed{-1}``; the OPD hint prompt asks for ``\\boxed{1}`` plus a
hint between ``[HINT_START]`` and ``[HINT_END]``, or ``\\boxed{-1}``. Judges (especially small
ones) write ``\\boxed{+1}``, ``\\boxed{1.0}``, ``\\boxed{ -1 }``, ``\\boxed{\\text{1}}`` or several boxes
while thinking; the **last** box is the answer. Anything else is a failed vote (``None``).
"""

from __future__ import annotations

from pipeline.votes import last_boxed, parse_score  # noqa: F401 (the judge reads its votes with them)

HINT_START = "[HINT_START]"
HINT_END = "[HINT_END]"


def parse_hint(text: str | None, min_chars: int = 10) -> tuple[int | None, str | None]:
    """Parse one OPD hint vote: ``(vote, hint)``.

    ``vote`` is 1, -1 or None (unparseable). ``hint`` is the stripped text of the last complete
    ``[HINT_START]...[HINT_END]`` block (:func:`hint_block`) when the vote is 1 and the hint is
    **longer than** ``min_chars`` characters (OpenClaw-RL's rule), else None.
    """
    vote = parse_score(text, allowed=(1, -1))
    if vote != 1 or not text:
        return vote, None
    hint = hint_block(text)
    return vote, (hint if hint is not None and len(hint) > min_chars else None)


def hint_block(text: str | None) -> str | None:
    """The stripped text of the last complete ``[HINT_START]...[HINT_END]`` block, or None.

    The block ends at the last ``[HINT_END]`` and starts at the last ``[HINT_START]`` before it,
    so an unfinished block after a complete one (a truncated answer) does not hide it
    (OpenClaw-RL takes the last complete match).
    """
    if not text:
        return None
    end = text.rfind(HINT_END)
    if end < 0:
        return None
    start = text.rfind(HINT_START, 0, end)
    if start < 0:
        return None
    return text[start + len(HINT_START): end].strip()


def hint_rejection(texts: list[str | None], min_chars: int = 10) -> str | None:
    """Why no hint was accepted from these hint-vote answers (None: one was accepted).

    Reasons, in the order checked: ``all_votes_failed`` (no answer parsed to a vote: HTTP
    failures or no valid box), ``judged_no_hint`` (no vote was 1), ``no_hint_block`` (a 1 vote
    without a ``[HINT_START]...[HINT_END]`` block), ``hint_too_short`` (blocks of at most
    ``min_chars`` characters).
    """
    parsed = [(parse_score(t, allowed=(1, -1)), t) for t in texts]
    if all(v is None for v, _ in parsed):
        return "all_votes_failed"
    positive = [t for v, t in parsed if v == 1]
    if not positive:
        return "judged_no_hint"
    blocks = [hint_block(t) for t in positive]
    if any(b is not None and len(b) > min_chars for b in blocks):
        return None
    if all(b is None for b in blocks):
        return "no_hint_block"
    return "hint_too_short"


def best_hint(hints: list[str | None]) -> str | None:
    """The longest valid hint (ties: the first), or None."""
    best = None
    for h in hints:
        if h and (best is None or len(h) > len(best)):
            best = h
    return best
