"""OPD teacher log-probs: the student's prompt with the hint, scored on the student's exact ids.

Hindsight On-Policy Distillation (OpenClaw-RL): the hint the judge extracted from the next state
is appended to the last user message of the turn's prompt (:func:`inject_hint`). The teacher's
prompt is rendered by the same renderer as the student's (:class:`pipeline.engine_api.render.ChatRenderer`)
from the same :class:`pipeline.engine_api.render.PromptSpec` (the turn's messages, tools and
``chat_options``) with only the messages swapped for the hinted ones. Before that, the student's
own spec is rendered and must reproduce ``turn.prompt_token_ids`` exactly; otherwise (another
template, a request sent as raw ``input_ids``, an engine that renders differently) the teacher
would not see "the student's context plus the hint", and the turn gets no teacher
(:class:`TeacherUnsupported`, reason ``prompt_mismatch``).

The student's exact response ids are appended, never re-tokenized. One ``POST /generate``
(:meth:`pipeline.engine_api.client.EngineClient.score_result`, the one scoring call of the package) with
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
missing entries are id 0 with log-prob -inf).

Whose weights score (OpenClaw-RL's teacher is a frozen model that never trains): the teacher is
``engine.teacher_url``, a fixed, named engine (``pipeline up`` starts one holding the initial
policy). Each sample records its identity (``teacher_model``: the engine's ``model_path``) and
the version that scored it (``teacher_version``: the scoring answer's ``weight_version``).
Without ``engine.teacher_url`` the only teacher left is the live policy (``engine.url``), whose
weights change at every sync: refused at start unless ``judge.live_policy_teacher`` is set, and
then a turn is scored only by the weights that generated it (the scoring answer's
``weight_version`` equals ``turn.policy_version``), else it gets no teacher (reason
``teacher_version``).

Start-up self-check (:meth:`Teacher.self_check`, ``judge.teacher_self_check``): a fixed
sequence is scored at T = 1 and T = 0.5 with the top-5 alternatives; under
``log_softmax(logits / T)`` the log-prob difference of two tokens at one position is
``(z_a - z_b) / T``, so the differences at T = 0.5 must be twice those at T = 1. A teacher that
fails (SGLang started without ``SGLANG_TEMP_SCALED_LOGPROBS=1`` scores prompts at T = 1
whatever is asked) is refused with :class:`TeacherMisconfigured`; one that cannot be reached at
start is checked again before its first OPD score.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field

from pipeline.engine_api.backend import engine_client
from pipeline.engine_api.errors import EngineError, retried
from pipeline.engine_api.render import ChatRenderer, ChatTemplateError, PromptSpec, load_tokenizer
from pipeline.errors import PipelineError
from pipeline.events import logprob_domain_error
from pipeline.judge.prompts import inject_hint
from pipeline.judge.samples import rollout_temperature

log = logging.getLogger(__name__)


class TeacherUnsupported(PipelineError):
    """The teacher cannot score this turn's distribution (a property of the turn, not a failure).

    ``reason``: ``prompt_mismatch`` (the student's prompt cannot be reproduced),
    ``logprob_processors`` (the rollout log-probs were shaped by options a prefill cannot apply)
    ``teacher_version`` (a live-policy teacher now serves other weights than the turn's) or
    ``temperature`` (the turn's log-probs are at a temperature the teacher engine cannot score at:
    vLLM scores prompt tokens at temperature 1 only).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class TeacherMisconfigured(PipelineError, RuntimeError):
    """The teacher engine cannot give the OPD signal: its log-probs ignore the temperature, or
    it is the live policy without ``judge.live_policy_teacher``. The message says what to fix."""


#: the fixed text the self-check scores (any text works: it only needs a few tokens)
SELF_CHECK_TEXT = "The quick brown fox jumps over the lazy dog. One, two, three, four, five, six."
#: alternatives per position compared by the self-check, and its relative tolerance
SELF_CHECK_TOP_K, SELF_CHECK_TOLERANCE = 5, 0.05


@dataclass
class TeacherOutput:
    """Teacher log-probs for R response tokens (and optional top-k, R*k row-major), with the
    teacher's identity (``model``: its model path) and the ``weight_version`` it reported for
    the scoring call (``version``); None: not known."""

    log_probs: list
    topk_ids: list = field(default_factory=list)
    topk_log_probs: list = field(default_factory=list)
    version: str | None = None
    model: str | None = None


def temperature_ratio(at_one, at_half) -> tuple[float | None, float]:
    """How the teacher's log-prob differences scale from T = 1 to T = 0.5.

    Args:
        at_one, at_half: :class:`pipeline.engine_api.client.ScoreResult` of the same sequence at T = 1 and
            T = 0.5, with top-k alternatives.
    Returns:
        ``(ratio, spread)``: the least-squares factor ``d_half / d_one`` over every pair (the
        position's most likely token, another of its top-k found at both temperatures), 2.0 for
        a teacher that honours T; None when no pair was found (no top-k returned). ``spread``:
        the largest ``|d_one|`` (nats), how much the check could see.
    """
    num = den = spread = 0.0
    for row1, row05 in zip(at_one.top, at_half.top):
        one, half = dict(row1), dict(row05)
        common = [t for t, _ in sorted(row1, key=lambda x: -x[1]) if t in half and math.isfinite(one[t])
                  and math.isfinite(half[t])]
        for b in common[1:]:
            d1, d05 = one[common[0]] - one[b], half[common[0]] - half[b]
            num, den, spread = num + d05 * d1, den + d1 * d1, max(spread, abs(d1))
    return (num / den if den > 0 else None), spread


def flatten_top_k(top: list[list[tuple[int, float]]], n_response: int, top_k: int) -> tuple[list[int], list[float]]:
    """The teacher's top-k per response position (``top``: rows of ``(token_id, log-prob)`` as
    :meth:`pipeline.engine_api.client.EngineClient.score_result` returns them) flattened row-major to
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
        #: no engine.teacher_url: the live policy scores (only with judge.live_policy_teacher)
        self.live = not config.engine.teacher_url
        self.url = config.engine.teacher_url or config.engine.url
        self.model: str | None = None  # the teacher engine's model_path (its identity), once known
        self.checked = not config.judge.teacher_self_check  # the self-check passed (or is off)
        self._refused: TeacherMisconfigured | None = None
        self._check_lock: asyncio.Lock | None = None

    async def start(self) -> None:
        """Open the connection pool to the teacher endpoint (inside the loop that uses it).

        Raises:
            TeacherMisconfigured: no ``engine.teacher_url`` and no ``judge.live_policy_teacher``.
        """
        if self.live and not self.config.judge.live_policy_teacher:
            raise TeacherMisconfigured(
                "engine.teacher_url is not set, so the OPD teacher would be the live policy at engine.url, whose "
                "weights change at every sync (a turn would be scored by weights that did not generate it): set "
                "engine.teacher_url to a frozen teacher engine (pipeline up starts one), or judge.live_policy_"
                "teacher=true to score each turn only with the policy version that generated it")
        e = self.config.engine
        self.client = engine_client(e.teacher_kind or e.kind, self.url, self.config.judge.teacher_timeout_s,
                                    initial_version=e.weight_version)
        #: the teacher engine scores at any temperature (vLLM: at 1 only; other turns get no OPD term)
        self.scales = getattr(self.client, "scores_temperature", True)
        self._check_lock = asyncio.Lock()

    async def check_at_start(self) -> None:
        """Learn the teacher's identity and run :meth:`self_check` now; an unreachable teacher
        is checked again before its first OPD score (logged).

        Raises:
            TeacherMisconfigured: the teacher answered and failed the check.
        """
        try:
            await self._ensure_checked()
        except TeacherMisconfigured:
            raise
        except EngineError as e:
            log.warning("OPD teacher at %s not checked at start (%s): checked before its first score", self.url, e)

    async def _ensure_checked(self) -> None:
        if self._refused is not None:
            raise self._refused
        if self.checked and self.model is not None:
            return
        async with self._check_lock:
            if self.model is None:
                try:
                    info = await self.client.model_info()
                except EngineError as e:
                    if e.status != 404:
                        raise e.within(f"teacher {self.url}: /model_info failed") from None
                    info = {}  # an engine without /model_info is named by its URL
                self.model = str(info.get("model_path") or self.url)[:256]
            if not self.checked:
                try:
                    await self.self_check()
                except TeacherMisconfigured as e:
                    self._refused = e
                    log.error("%s", e)
                    raise
                self.checked = True
                log.info("OPD teacher %s (%s) passed the temperature self-check", self.model, self.url)

    async def self_check(self) -> None:
        """Score :data:`SELF_CHECK_TEXT` at T = 1 and T = 0.5 (top-5) and check that the log-prob
        differences double (see the module docstring). Without top-k in the answer, the
        log-probs must at least differ between the two temperatures.

        Raises:
            TeacherMisconfigured: they do not scale as the temperature says.
            EngineError: the teacher could not be asked.
        """
        ids = self.tokenizer.encode(SELF_CHECK_TEXT, add_special_tokens=False)[:32]
        one = await self.client.score_result(ids, 1, temperature=1.0, top_logprobs_num=SELF_CHECK_TOP_K)
        if not self.scales:  # it says so itself: only turns at temperature 1 are scored (check())
            log.info("OPD teacher at %s scores at temperature 1 only: turns at another temperature get no OPD "
                     "term (counted as 'temperature')", self.url)
            return
        half = await self.client.score_result(ids, 1, temperature=0.5, top_logprobs_num=SELF_CHECK_TOP_K)
        ratio, spread = temperature_ratio(one, half)
        fix = (f"the OPD teacher at {self.url} does not compute its log-probs at the requested temperature, so a "
               "hint that changes nothing would still give a non-zero OPD advantage: an SGLang teacher must be "
               "started with SGLANG_TEMP_SCALED_LOGPROBS=1 (deploy/docker-compose.yml, deploy/k8s/engines.yaml)")
        if ratio is None:
            moved = max((abs(a - b) for a, b in zip(one.logprobs, half.logprobs)), default=0.0)
            if moved < 1e-6:
                raise TeacherMisconfigured(f"{fix}; its log-probs at T=0.5 equal those at T=1")
            return
        if spread > 1e-3 and abs(ratio - 2.0) > 2.0 * SELF_CHECK_TOLERANCE:
            raise TeacherMisconfigured(f"{fix}; its log-prob differences at T=0.5 are {ratio:.3f} times those at "
                                       "T=1, want 2")

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

    async def hinted_prompt(self, turn, hint: str | None) -> list[int]:
        """:meth:`prompt_ids`, rendered by whoever reproduces the student's recorded prompt: the
        teacher engine's own chat rendering first when it has one (vLLM's ``/tokenize``: its
        template, content parts joined by a newline, tools only as its template shows them), else
        this package's renderer (the CPU engine, SGLang, ``pipeline import``).

        Raises:
            TeacherUnsupported: neither reproduces ``turn.prompt_token_ids``.
        """
        if getattr(self.client, "renders_chat", False):
            try:
                return await self.engine_prompt_ids(turn, hint)
            except TeacherUnsupported:
                pass  # rendered elsewhere (an import, another engine): the package's renderer may match
        return await asyncio.to_thread(self.prompt_ids, turn, hint)

    async def engine_prompt_ids(self, turn, hint: str | None) -> list[int]:
        """:meth:`prompt_ids` from the teacher engine's ``tokenize`` of the turn's messages (and of
        the hinted ones). Raises :class:`TeacherUnsupported` when it does not give the turn's prompt."""
        spec = PromptSpec.from_turn(turn)
        kw: dict = {"add_generation_prompt": spec.add_generation_prompt and not spec.continue_final_message}
        if spec.continue_final_message:
            kw["continue_final_message"] = True
        if spec.chat_template_kwargs:
            kw["chat_template_kwargs"] = spec.chat_template_kwargs
        try:
            student = await self.client.tokenize(spec.messages, spec.tools, **kw)
        except EngineError as e:
            raise TeacherUnsupported("prompt_mismatch", f"the teacher engine cannot render the turn: {e}") from None
        if student != list(turn.prompt_token_ids):
            raise TeacherUnsupported("prompt_mismatch", "the teacher engine renders the turn's messages to other ids")
        if hint is None:
            return student
        return await self.client.tokenize(inject_hint(spec.messages, hint), spec.tools, **kw)

    def check(self, turn) -> None:
        """Raise :class:`TeacherUnsupported` when the rollout log-probs were shaped by options a
        scoring pass cannot re-apply (``turn.logprob_processors``)."""
        if turn.logprob_processors:
            raise TeacherUnsupported("logprob_processors",
                                     f"the rollout log-probs were shaped by {', '.join(turn.logprob_processors)}")
        if not self.scales and abs(rollout_temperature(turn) - 1.0) > 1e-9:
            raise TeacherUnsupported("temperature", f"the rollout log-probs are at temperature "
                                     f"{rollout_temperature(turn)}, the teacher engine scores at 1 only")

    async def log_probs(self, turn, hint: str | None) -> TeacherOutput:
        """Teacher log-probs ``[R]`` (nats) of ``turn.response_token_ids`` under the hinted prompt
        at the turn's effective temperature.

        Raises:
            TeacherUnsupported: see :meth:`check` and :meth:`prompt_ids`.
            TeacherMisconfigured: the teacher failed its self-check.
            EngineError: the endpoint failed after retries or answered with too few log-probs.
        """
        self.check(turn)
        await self._ensure_checked()
        prompt = await self.hinted_prompt(turn, hint)
        out = await self.score(prompt, list(turn.response_token_ids), rollout_temperature(turn))
        out.model = self.model
        if self.live and out.log_probs and out.version != str(turn.policy_version):
            raise TeacherUnsupported("teacher_version", f"the live-policy teacher scored with weight version "
                                     f"{out.version!r}, the turn was generated by v{turn.policy_version}")
        return out

    async def score(self, prompt: list[int], response: list[int], temperature: float) -> TeacherOutput:
        """Log-probs ``[R]`` of ``response`` after ``prompt`` under ``softmax(logits / temperature)``.

        Raises:
            EngineError: the endpoint failed after retries (a time-out, unreachable, 5xx or
                408/409/425/429: tried ``judge.retries`` more times) or answered with too few or misaligned log-probs.
        """
        if not response:
            return TeacherOutput([])
        jc = self.config.judge
        try:
            res = await retried(lambda: self.client.score_result(prompt + response, len(prompt),
                                                                 temperature=float(temperature),
                                                                 top_logprobs_num=self.top_k),
                                jc.retries + 1, jc.retry_backoff_s)
        except EngineError as e:
            raise e.within("teacher scoring failed") from None
        bad = logprob_domain_error(res.logprobs)
        if bad is not None:  # a broken engine: never a training signal (the sample would be refused anyway)
            raise EngineError(f"teacher scoring returned a value that is not a log-prob: log_probs{bad}")
        out = TeacherOutput(res.logprobs, version=None if res.weight_version is None else str(res.weight_version))
        if self.top_k > 0:
            out.topk_ids, out.topk_log_probs = flatten_top_k(res.top, len(response), self.top_k)
        return out
