"""``constant`` backend: an instant in-process scorer (benchmarks, wiring checks; not a judge).

``score`` returns +1 with one vote and ``hint`` a fixed hint, without any I/O, so a run with it
measures the judge's stream path alone (consume, join, state, produce, commit).
"""

from __future__ import annotations

from pipeline.judge.backends.base import Backend, HintVerdict, Verdict
from pipeline.judge.prompts import JudgeInput

FIXED_HINT = "State the final answer first, then explain briefly."


class ConstantBackend(Backend):
    """Always +1 and always the same hint (instant)."""

    name = "constant"

    async def score(self, inp: JudgeInput) -> Verdict:
        return Verdict(1, [1])

    async def hint(self, inp: JudgeInput) -> HintVerdict:
        return HintVerdict(FIXED_HINT, [1])
