"""The eval set's ``judge`` checks (:mod:`pipeline.rollout.evalset`): the LLM judge asked whether a
reply satisfies a criterion in words.

The judge is the judge stage's endpoint and settings (``judge.url``, else ``engine.url``;
``judge.model``, ``votes``, ``temperature``, ``max_tokens``, ``vote_timeout_s``, ``retries``,
``retry_backoff_s``, ``api_key``), through the same client
(:class:`pipeline.engine_api.judging.HttpJudge`: time-outs, retries, back-off) and the same vote
rules (:func:`pipeline.votes.parse_score` on the last ``\\boxed{}``, :func:`pipeline.votes.majority_vote`).
Each check is ``judge.votes`` votes of ``\\boxed{1}`` (satisfied) or ``\\boxed{-1}`` (not); the
check passes when their majority is 1, fails otherwise (a tie too), and is **absent** (None) when
no vote is valid (every one timed out, failed or unparsable after its retries; logged). Only
``judge.backend=llm`` is such a judge: an eval set with judge checks and another backend is refused
(:func:`require_llm_judge`).
"""

from __future__ import annotations

import asyncio
import logging

from pipeline.engine_api.judging import HttpJudge
from pipeline.engine_api.render import content_text
from pipeline.rollout.evalset import EvalSet, EvalSetError
from pipeline.votes import majority_vote, parse_score

log = logging.getLogger(__name__)
JUDGE_CONCURRENCY = 8  # judge checks in flight (each its judge.votes votes)

SYSTEM = ("You grade one reply of an AI assistant against one criterion. Read the conversation, the "
          "assistant's reply and the criterion, think briefly, then end your answer with \\boxed{1} if the "
          "reply satisfies the criterion, or \\boxed{-1} if it does not.")


def criterion_messages(criterion: str, messages: list, reply: str) -> list[dict]:
    """The judge's prompt for one check: the item's conversation, the reply, the criterion."""
    convo = "\n".join(f"[{m.get('role', '?')}] {content_text(m.get('content'))}" for m in messages
                      if isinstance(m, dict))
    user = (f"## Conversation\n{convo}\n\n## The assistant's reply\n{reply}\n\n## Criterion\n{criterion}\n\n"
            "Does the reply satisfy the criterion? End with \\boxed{1} (yes) or \\boxed{-1} (no).")
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def require_llm_judge(config, eval_set: EvalSet) -> None:
    """Refuse an eval set with ``judge`` checks when no LLM judge is configured.

    Raises:
        EvalSetError: ``eval_set.uses_judge`` and ``judge.backend`` is not ``llm``.
    """
    if eval_set.uses_judge and config.judge.backend != "llm":
        raise EvalSetError(f"eval set {eval_set.name!r} has judge checks and judge.backend is "
                           f"{config.judge.backend!r}, not an LLM judge: set judge.backend=llm (with judge.url "
                           "or engine.url serving the judge model) or drop its judge checks")


class EvalJudge:
    """The LLM judge of ``judge`` checks (module docstring). Use it from one event loop; the client
    opens on the first :meth:`verdicts` and closes with :meth:`aclose`.

    Args:
        config: the process config (``judge``, ``engine.url``).
    """

    def __init__(self, config) -> None:
        self.config, self.jc = config, config.judge
        self.http: HttpJudge | None = None
        self.model = self.jc.model

    async def verdict(self, criterion: str, item: dict, reply: str) -> bool | None:
        """Whether ``reply`` to ``item``'s conversation satisfies ``criterion`` (None: no verdict)."""
        texts = await self.http.votes(self.model, criterion_messages(criterion, item["messages"], reply),
                                      self.jc.votes, self.jc.temperature, self.jc.max_tokens)
        decision = majority_vote([parse_score(t, allowed=(1, -1)) for t in texts])
        if decision is None:
            log.warning("evaluator: the judge gave no verdict on item %s (criterion %r: %d votes, none valid); "
                        "the check is absent", item.get("id"), criterion, len(texts))
            return None
        return decision == 1

    async def verdicts(self, items, replies: list[str]) -> dict[tuple[int, str], bool | None]:
        """Every ``judge`` check of ``items`` (each with its reply, in order), :data:`JUDGE_CONCURRENCY`
        at a time: ``(id(item), criterion) -> verdict``."""
        if self.http is None:
            self.http = HttpJudge.of(self.config, max_connections=max(16, JUDGE_CONCURRENCY * self.jc.votes * 2))
            self.model = await self.http.model_name(self.jc.model)
        gate = asyncio.Semaphore(JUDGE_CONCURRENCY)

        async def one(item: dict, criterion: str, reply: str):
            async with gate:
                return (id(item), criterion), await self.verdict(criterion, item, reply)

        asks = [one(item, check["judge"], reply) for item, reply in zip(items, replies)
                for check in item["checks"].values() if "judge" in check]
        return dict(await asyncio.gather(*asks))

    async def aclose(self) -> None:
        if self.http is not None:
            await self.http.aclose()
            self.http = None
