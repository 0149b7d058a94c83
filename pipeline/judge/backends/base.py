"""The judge backend interface and its results."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.judge.prompts import JudgeInput


@dataclass
class Verdict:
    """A PRM judgement: ``score`` in {-1, 0, 1}, the majority of ``votes`` (a vote is None when
    it failed), or None when every vote failed (no judgement: no RL signal, never a 0)."""

    score: int | None
    votes: list = field(default_factory=list)

    @property
    def all_failed(self) -> bool:
        """True when there were votes and none of them produced a valid answer."""
        return bool(self.votes) and all(v is None for v in self.votes)


@dataclass
class HintVerdict:
    """An OPD hint judgement: the winning ``hint`` (None: no usable hint) and the raw votes.

    ``reason``: why there is no hint (a short snake_case word such as ``judged_no_hint`` or
    ``hint_too_short``; counted in ``pipeline_judge_hints_rejected_total``); None with a hint.
    """

    hint: str | None
    votes: list = field(default_factory=list)
    reason: str | None = None


class Backend:
    """A judge backend. Subclasses implement :meth:`score` and :meth:`hint` (both async).

    Backends are created once per process with the :class:`pipeline.config.Config` and used
    from one asyncio event loop; :meth:`start` runs on that loop before the first call and
    :meth:`aclose` after the last. A backend never raises for a bad judge answer: failures are
    failed votes. Users plug their own with ``judge.backend=package.module:ClassName``.
    """

    name = "base"

    def __init__(self, config) -> None:
        self.config = config

    async def start(self) -> None:
        """Open clients, load models (called on the judge's event loop)."""

    async def aclose(self) -> None:
        """Release clients."""

    async def score(self, inp: JudgeInput) -> Verdict:
        """PRM score of the assistant's reply given the next state."""
        raise NotImplementedError

    async def hint(self, inp: JudgeInput) -> HintVerdict:
        """Hindsight hint for OPD, or ``HintVerdict(None)``."""
        raise NotImplementedError
