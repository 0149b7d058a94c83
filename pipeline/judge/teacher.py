"""OPD teacher log-probs: the student's prompt with the hint, scored on the student's exact ids.

Hindsight On-Policy Distillation (OpenClaw-RL): the hint the judge extracted from the next state
is appended to the last user message of the turn's prompt (:func:`inject_hint`). The teacher's
prompt is rendered by the same renderer as the student's (:class:`pipeline.chat.ChatRenderer`)
from the same :class:`pipeline.chat.PromptSpec` (the turn's messages, tools and
``chat_options``) with only the messages swapped for the hinted ones. Before that, the student's
own spec is rendered and must reproduce ``turn.prompt_token_ids`` exactly; otherwise (another
template, a request sent as raw ``input_ids``, an engine that renders differently) the teacher
would not see "the student's context plus the hint", and the turn gets no teacher
(:class:`TeacherUnsupported`, reason ``prompt_mismatch``).

The student's exact response ids are appended, never re-tokenized. One ``POST /generate``
(:meth:`pipeline.client.EngineClient.score_result`, the one scoring call of the package) with
``input_ids``, ``sampling_params = {max_new_tokens: 0, temperature: T}``,
``return_logprob=true`` and ``logprob_start_len = P - 1`` (P = hinted prompt length) returns
``input_token_logprobs`` for positions P .. P+R-1 (SGLang's ``logprob_start_len`` semantics),
i.e. log p_teacher(response[i] | hinted prompt, response[:i]) in nats under
``softmax(logits / T)``, one per response token, aligned one to one with the rollout log-probs.
T is the turn's effective temperature (:func:`pipeline.judge.samples.rollout_temperature`), so a
hint that changes nothing gives teacher log-probs equal to the rollout log-probs (OPD advantage
0) at any temperature. An SGLang teacher must be started with ``SGLANG_TEMP_SCALED_LOGPROBS=1``
for its prompt log-probs to honour T (the CPU engine always does).

Options that shaped the student's log-probs and that a prefill cannot reproduce
(``turn.logprob_processors``: logit bias, penalties, ``min_tokens``, constrained decoding) make
the turn unsupported too (reason ``logprob_processors``): such a turn carries no OPD signal.

With ``judge.teacher_top_k`` = k > 0 the same call returns the teacher's top-k
(``top_logprobs_num``) per response position, flattened row-major (R*k ids and R*k log-probs;
missing entries are id 0 with log-prob -inf). The teacher endpoint is ``engine.teacher_url`` (a
frozen copy of the policy), else ``engine.url``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field

from pipeline.chat import ChatRenderer, ChatTemplateError, PromptSpec, load_tokenizer
from pipeline.client import EngineClient, EngineError, EngineTimeout, EngineUnavailable
from pipeline.errors import PipelineError
from pipeline.judge.prompts import inject_hint
from pipeline.judge.samples import rollout_temperature
from pipeline.retry import Transient, retrying

log = logging.getLogger(__name__)


class TeacherError(PipelineError, RuntimeError):
    """The teacher endpoint did not return log-probs for every response token."""


class TeacherUnsupported(TeacherError):
    """The teacher cannot score this turn's distribution (a property of the turn, not a failure).

    ``reason``: ``prompt_mismatch`` (the student's prompt cannot be reproduced) or
    ``logprob_processors`` (the rollout log-probs were shaped by options a prefill cannot apply).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class TeacherOutput:
    """Teacher log-probs for R response tokens (and optional top-k, R*k row-major)."""

    log_probs: list
    topk_ids: list = field(default_factory=list)
    topk_log_probs: list = field(default_factory=list)


def flatten_top_k(top: list[list[tuple[int, float]]], n_response: int, top_k: int) -> tuple[list[int], list[float]]:
    """The teacher's top-k per response position (``top``: rows of ``(token_id, log-prob)`` as
    :meth:`pipeline.client.EngineClient.score_result` returns them) flattened row-major to
    ``R*k`` ids and log-probs (nats); missing rows or entries are id 0 with log-prob -inf."""
    ids: list[int] = []
    lps: list[float] = []
    rows = top if len(top) == n_response else [[]] * n_response
    for row in rows:
        row = list(row)[:top_k]
        ids += [int(t) for t, _ in row] + [0] * (top_k - len(row))
        lps += [float(lp) for _, lp in row] + [-math.inf] * (top_k - len(row))
    return ids, lps


class Teacher:
    """Computes teacher log-probs for (turn, hint). One per judge process; async, thread-safe rendering.

    Args:
        config: the process config (``engine.model``/``cache_dir`` for the tokenizer,
            ``engine.teacher_url``/``url``, ``judge.teacher_top_k``, ``judge.teacher_timeout_s``,
            ``judge.retries``, ``judge.retry_backoff_s``).
        tokenizer: an already loaded tokenizer (tests), else loaded from ``engine.model``.
    """

    def __init__(self, config, tokenizer=None) -> None:
        self.config = config
        self.top_k = config.judge.teacher_top_k
        self.tokenizer = tokenizer or load_tokenizer(config.engine.model, config.engine.cache_dir)
        self.renderer = ChatRenderer(self.tokenizer)
        self.client: EngineClient | None = None

    async def start(self) -> None:
        """Open the connection pool to the teacher endpoint (inside the loop that uses it)."""
        self.client = EngineClient(self.config.engine.teacher_url or self.config.engine.url,
                                   self.config.judge.teacher_timeout_s)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    def prompt_ids(self, turn, hint: str | None) -> list[int]:
        """Token ids ``[P]`` of the turn's prompt with ``hint`` injected (None: no hint, i.e. the
        student's own prompt), rendered from the turn's :class:`PromptSpec`.

        Raises:
            TeacherUnsupported: the turn's spec does not reproduce ``turn.prompt_token_ids``.
        """
        try:
            spec = PromptSpec.from_turn(turn)
            student = self.renderer.render_spec(spec)
        except ChatTemplateError as e:
            raise TeacherUnsupported("prompt_mismatch", f"the turn's prompt cannot be rendered: {e}") from None
        if student != list(turn.prompt_token_ids):
            raise TeacherUnsupported(
                "prompt_mismatch", f"rendering the turn's messages gives {len(student)} prompt ids that differ from "
                f"the {len(turn.prompt_token_ids)} the engine used (another template or raw input_ids)")
        if hint is None:
            return student
        return self.renderer.render_spec(spec.with_messages(inject_hint(spec.messages, hint)))

    def check(self, turn) -> None:
        """Raise :class:`TeacherUnsupported` when the rollout log-probs were shaped by options a
        scoring pass cannot re-apply (``turn.logprob_processors``)."""
        if turn.logprob_processors:
            raise TeacherUnsupported("logprob_processors",
                                     f"the rollout log-probs were shaped by {', '.join(turn.logprob_processors)}")

    async def log_probs(self, turn, hint: str | None) -> TeacherOutput:
        """Teacher log-probs ``[R]`` (nats) of ``turn.response_token_ids`` under the hinted prompt
        at the turn's effective temperature.

        Raises:
            TeacherUnsupported: see :meth:`check` and :meth:`prompt_ids`.
            TeacherError: the endpoint failed after retries or answered with too few log-probs.
        """
        self.check(turn)
        prompt = await asyncio.to_thread(self.prompt_ids, turn, hint)
        return await self.score(prompt, list(turn.response_token_ids), rollout_temperature(turn))

    async def score(self, prompt: list[int], response: list[int], temperature: float) -> TeacherOutput:
        """Log-probs ``[R]`` of ``response`` after ``prompt`` under ``softmax(logits / temperature)``.

        Raises:
            TeacherError: the endpoint failed after retries or answered with too few log-probs.
        """
        if not response:
            return TeacherOutput([])
        jc = self.config.judge
        try:
            async for attempt in retrying(jc.retries + 1, jc.retry_backoff_s):
                with attempt:
                    try:
                        res = await self.client.score_result(prompt + response, len(prompt),
                                                             temperature=float(temperature),
                                                             top_logprobs_num=self.top_k)
                    except (EngineTimeout, EngineUnavailable) as e:
                        raise Transient(str(e)) from None
                    except EngineError as e:
                        if e.status is not None and e.retryable:  # 429 / 5xx (not a misaligned answer)
                            raise Transient(str(e)) from None
                        raise
        except (Transient, EngineError) as e:
            raise TeacherError(f"teacher scoring failed: {e}") from None
        out = TeacherOutput(res.logprobs)
        if self.top_k > 0:
            out.topk_ids, out.topk_log_probs = flatten_top_k(res.top, len(response), self.top_k)
        return out
