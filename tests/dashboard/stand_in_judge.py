"""A stand-in PRM judge backend for tests (not a model, no I/O): deterministic votes derived from
a checksum of the judged reply and next state, covering +1, 0, -1 and failed votes. Used by the
browser test as ``judge.backend=tests.dashboard.stand_in_judge:StandInVotesBackend``; it starts instantly,
where the embedding judge loads a model."""

from __future__ import annotations

import zlib

from pipeline.judge.backends.base import Backend, HintVerdict, Verdict
from pipeline.votes import majority_vote
from pipeline.judge.prompts import JudgeInput


def stand_in_votes(inp: JudgeInput, n: int = 3) -> list[int | None]:
    """``n`` votes in {1, 0, -1, None} from a CRC-32 of the reply and the next state."""
    h = zlib.crc32((inp.response + repr(inp.next_state)).encode())
    out: list[int | None] = []
    for i in range(n):
        byte = (h >> (8 * i)) & 0xFF
        out.append(None if byte % 7 == 0 else byte % 3 - 1)
    return out


class StandInVotesBackend(Backend):
    """Stand-in judge: :func:`stand_in_votes`, majority as the score, never a hint."""

    name = "stand-in-votes"

    async def score(self, inp: JudgeInput) -> Verdict:
        votes = stand_in_votes(inp)
        return Verdict(majority_vote(votes), votes)

    async def hint(self, inp: JudgeInput) -> HintVerdict:
        return HintVerdict(None, [None])
