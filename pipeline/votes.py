"""The reward of a Binary-RL sample from its judge votes: one rule for the judge that writes the
sample and for every reader that checks a sample's ``reward`` against its recorded ``votes``
(the dashboard).

Source: OpenClaw-RL's PRM aggregation (majority of the valid votes, failed votes ignored), with
one deliberate difference documented on :func:`majority_vote`.
"""

from __future__ import annotations

from collections import Counter


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
