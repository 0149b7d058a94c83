"""FastAPI app: the subset of SGLang's HTTP API the pipeline uses, served by the CPU model thread.

Routes (shapes from SGLang at commit 004c82e):
``POST /generate`` (text or input_ids, sampling_params, return_logprob, logprob_start_len,
top_logprobs_num, token_ids_logprob, stream = cumulative SSE chunks), ``POST
/v1/chat/completions`` (stream and non-stream, logprobs, tools, return_token_ids /
return_prompt_token_ids / return_meta_info), ``POST /update_weights_from_disk``, ``POST
/v1/tokenize`` (and ``/tokenize``), ``POST /v1/detokenize``, ``GET /health``, ``/health_generate``,
``/ping``, ``/model_info`` (and ``/get_model_info``), ``/server_info`` (and ``/get_server_info``),
``/v1/models``, ``POST /pause_generation``, ``/continue_generation``, ``/abort_request``,
``/flush_cache``, ``POST /load_lora_adapter``, ``/unload_lora_adapter`` (with ``lora_path`` on
``/generate`` and ``model: "<base>:<adapter>"`` on chat; docs/sglang-api.md §6), and ``GET
/metrics`` (Prometheus).

Log-probs: of the temperature-scaled distribution softmax(logits/T) before top-p/top-k (SGLang's
default). A scoring pass (``max_new_tokens: 0`` + ``return_logprob``) uses the request's
temperature, 1.0 unless given (SGLang does this for prompt log-probs only when started with
``SGLANG_TEMP_SCALED_LOGPROBS=1``). Greedy (temperature < 1e-6) is temperature 1.0 with top_k 1,
as in SGLang.

Errors never surface as 500 for bad input: body validation -> 400 ``{"object": "error",
"message", "type": "Bad Request", "param": null, "code": 400}``; request-level ``ValueError`` on
``/generate`` -> 400 ``{"error": {"message"}}``; on ``/v1/*`` -> 400 ``{"object": "error", ...,
"type": "BadRequestError"}``; a prompt longer than the context -> 400.

Differences from SGLang (deliberate): ``return_token_ids`` is accepted with ``stream: true`` on
chat (vLLM-style ``token_ids`` deltas and first-chunk ``prompt_token_ids``); chat log-prob
``bytes`` are each token's raw bytes (SGLang sends the UTF-8 of the token decoded alone, wrong
for half a character); ``/server_info`` says both (``chat_stream_token_ids``,
``logprob_token_bytes``). Unknown keys inside ``sampling_params`` are a 400 (SGLang raises a
TypeError there); ``ebnf``, ``structural_tag`` and ``stop_regex`` are not implemented and
refused (400) rather than served as if absent; with ``n > 1`` and a seed, sample j is drawn with
``seed + j``. ``parallel_tool_calls: false``
keeps the first tool call of a turn. New weights must fit the served model
(:func:`pipeline.engine.model.check_fits`), else 400 and nothing changes.
Constrained decoding (:mod:`pipeline.engine.grammar`, llguidance): chat ``tool_choice``
``"required"`` / a named function (exactly one ``<tool_call>`` block of a declared tool's schema,
returned as ``tool_calls``), ``response_format`` json_object / json_schema and ``regex``;
``/generate`` ``sampling_params.json_schema`` / ``regex``. At most one constraint per request;
not with ``min_tokens``. The reported log-probs are of the masked distribution, and
``metadata.sampling_params`` names the constraint (``tool_choice``, ``json_schema``,
``response_format``, ``regex``) so the proxy records the turn as constrained.
Prompt prefixes are reused from the prefix cache (:mod:`pipeline.engine.prefix_cache`;
``meta_info.cached_tokens`` counts the tokens reused, as in SGLang); ``/flush_cache`` empties it
at once (SGLang refuses unless idle: here running rows keep their own KV, so it is always safe).
Chat responses (and the first and last stream chunks) carry the effective sampling parameters
in ``metadata.sampling_params`` (after greedy normalisation and generation-config defaults), so
a caller records the temperature the log-probs really are of.

Layout: the routes form four ``APIRouter`` objects: ``info_router`` (health, model and server info,
``/metrics``), ``openai_router`` (``/v1/chat/completions``, ``/v1/models``, tokenize /
detokenize; OpenAI error shapes), ``native_router`` (``/generate``, ``/update_weights_from_disk``,
the LoRA routes; SGLang's ``{"error": {"message"}}`` and ``{"success", ...}``) and ``control_router`` (pause, continue, abort, flush).
:func:`create_app` adds the middleware and error handlers and includes them; the routes reach the
one shared :class:`EngineState` in ``app.state.engine`` through the dependencies ``Engine`` and
``Running`` (the latter answers 503 before reading the body when the model thread is not running).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, AsyncIterator, Callable

import orjson
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.engine.generation import Generation, Item, RequestFailed
from pipeline.engine.grammar import check_grammar, json_grammar, regex_grammar, tool_call_grammar
from pipeline.engine.metrics import EngineMetrics
from pipeline.engine.params import SamplingParams
from pipeline.engine.lora import LoraError, LoraRegistry
from pipeline.engine.protocol import (AbortBody, ChatBody, DetokenizeBody, GenerateBody, LoadLoraBody, PauseBody,
                                      TokenizeBody, UnloadLoraBody, UpdateWeightsBody)
from pipeline.engine.worker import EngineWorker
from pipeline.engine_api.render import ChatRenderer, PromptSpec, normalise_tools
from pipeline.engine_api.sglang import chat_model_adapter, response_format_schema
from pipeline.engine_api.tokenbytes import TokenBytes
from pipeline.engine_api.tools import ToolStreamParser, parse_tool_calls
from pipeline.errors import PipelineError

log = logging.getLogger(__name__)
VERSION = "0.1.0"
ENGINE_NAME = "pipeline-cpu"


class ORJSONResponse(Response):
    """JSON response encoded with orjson (FastAPI's own class is deprecated)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class ApiError(PipelineError):
    """An error answered with SGLang's shapes: ``native`` -> ``{"error": {"message"}}``."""

    def __init__(self, status: int, message: str, *, native: bool = False, type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.native, self.type = status, message, native, type_

    def response(self) -> ORJSONResponse:
        if self.native:
            return ORJSONResponse({"error": {"message": self.message}}, status_code=self.status)
        return openai_error(self.status, self.message, self.type or "BadRequestError")


def openai_error(status: int, message: str, type_: str) -> ORJSONResponse:
    return ORJSONResponse({"object": "error", "message": message, "type": type_, "param": None, "code": status},
                          status_code=status)


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts)


@dataclass
class EngineState:
    """Everything the routes share."""

    worker: EngineWorker
    tokenizer: Any
    served_model_name: str
    model_path: str
    tokenizer_path: str
    context_length: int
    cache_dir: str | None = None
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    inflight: dict[str, Generation] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    shutting_down: bool = False

    def __post_init__(self) -> None:
        self.renderer = ChatRenderer(self.tokenizer)
        self.update_lock = asyncio.Lock()
        self.vocab_size = self.worker.loaded.vocab_size
        self.token_text = functools.lru_cache(maxsize=65536)(lambda t: self.tokenizer.decode([t]))
        self.token_bytes = TokenBytes(self.tokenizer)
        self.metrics.set_version(self.worker.version)
        self.worker.on_tokens = lambda n: self.metrics.generated_tokens.inc(n)
        self.worker.ll_tokenizer = self.token_bytes.ll
        self.worker.on_prefix = self.metrics.on_prefix
        self.lora = LoraRegistry(self.worker.lora, self.worker.lora_linears)

    # ---- validation helpers --------------------------------------------------------------------
    def check_ids(self, ids: list[int], what: str = "input_ids") -> None:
        if not ids:
            raise ValueError(f"{what} cannot be empty.")
        v = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < v), None)
        if bad is not None:
            raise ValueError(f"{what}: token id {bad} is outside the vocabulary [0, {v})")

    def check_length(self, n_prompt: int, max_new: int | None) -> None:
        c = self.context_length
        if n_prompt >= c:
            raise ValueError(f"The input ({n_prompt} tokens) is longer than the model's context length ({c} tokens).")
        if max_new is not None and n_prompt + max_new > c:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {c} tokens. You requested "
                f"a total of {n_prompt + max_new} tokens: {n_prompt} tokens from the input messages and "
                f"{max_new} tokens for the completion. Please reduce the number of tokens in the input messages "
                "or the completion to fit within the limit.")

    def new_rid(self, rid: str | None) -> str:
        rid = rid or uuid.uuid4().hex
        if rid in self.inflight:
            raise ValueError(f"Duplicate request ID detected: {rid}")
        return rid

    def unavailable(self) -> ApiError | None:
        """The 503 to answer while shutting down or once the model thread has died; None while serving."""
        if self.shutting_down or not self.worker.alive:
            return ApiError(503, "engine is not running", type_="503")
        return None


async def engine_state(request: Request) -> EngineState:
    """Dependency: the app's shared :class:`EngineState` (``app.state.engine``, set by :func:`create_app`)."""
    return request.app.state.engine


Engine = Annotated[EngineState, Depends(engine_state)]


async def running_engine(state: Engine) -> EngineState:
    """Dependency: the shared :class:`EngineState` of a route that needs the model thread.

    Raises:
        ApiError: 503 ``"engine is not running"`` (see :meth:`EngineState.unavailable`), before
            the body is read.
    """
    if (err := state.unavailable()) is not None:
        raise err
    return state


Running = Annotated[EngineState, Depends(running_engine)]


async def read_json(request: Request, *, openai: bool) -> dict:
    """Body as a JSON object (orjson). Raises ApiError 400 on a wrong content type or bad JSON."""
    if openai:
        ctype = request.headers.get("content-type", "")
        if "application/json" not in ctype.lower():
            raise ApiError(400, "Unsupported Media Type: Only 'application/json' is allowed", type_="Bad Request")
    body = await request.body()
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"JSON decode error: {e}", type_="Bad Request") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object", type_="Bad Request")
    return data


def validate(model: type, data: dict):
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(400, _validation_message(e), type_="Bad Request") from None


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_KNOWN = {"/generate", "/v1/chat/completions", "/update_weights_from_disk", "/load_lora_adapter",
          "/unload_lora_adapter", "/v1/tokenize", "/tokenize",
          "/v1/detokenize", "/health", "/health_generate", "/model_info", "/get_model_info", "/server_info",
          "/get_server_info", "/v1/models", "/metrics", "/pause_generation", "/continue_generation",
          "/abort_request", "/flush_cache", "/ping"}


class MetricsMiddleware:
    """Counts requests and observes latency until the last body chunk (so SSE streams too)."""

    def __init__(self, app, metrics: EngineMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in _KNOWN else "other"
        t0 = time.perf_counter()
        status = {"code": 500}
        done = False

        async def _send(msg):
            nonlocal done
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False) and not done:
                done = True
                self._observe(endpoint, status["code"], t0)
            await send(msg)

        try:
            await self.app(scope, receive, _send)
        finally:
            if not done:
                self._observe(endpoint, status["code"], t0)

    def _observe(self, endpoint: str, code: int, t0: float) -> None:
        if endpoint == "/metrics":
            return
        self.metrics.requests.labels(endpoint, str(code)).inc()
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)


class ApiKeyMiddleware:
    """Bearer-token check (SGLang ``--api-key``); health and metrics stay open."""

    OPEN = {"/health", "/ping", "/metrics"}

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") not in self.OPEN:
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            if auth != self.expected:
                resp = openai_error(401, "Unauthorized: a valid 'Authorization: Bearer <api key>' header is required",
                                    "401")
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


# ---------------------------------------------------------------------------------------------
# /generate
# ---------------------------------------------------------------------------------------------
def _per_item(value: Any, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for a batch of {n}")
        return value
    return [value] * n


def generate_items(state: EngineState, body: GenerateBody) -> tuple[list[Item], bool]:
    """Validate and tokenise a ``/generate`` body into sequences. Returns (items, is_batch).

    Raises:
        ValueError: any request-level problem (answered 400 ``{"error": {"message"}}``).
    """
    if body.input_ids is not None:
        if body.input_ids and isinstance(body.input_ids[0], list):
            prompts, is_batch = list(body.input_ids), True
        else:
            prompts, is_batch = [list(body.input_ids)], False
        for p in prompts:
            state.check_ids(p)
    elif body.text is not None:
        texts, is_batch = ([body.text], False) if isinstance(body.text, str) else (list(body.text), True)
        if not texts:
            raise ValueError("text cannot be an empty list.")
        prompts = [list(state.tokenizer.encode(t)) for t in texts]
        for p in prompts:
            if not p:
                raise ValueError("text tokenizes to no tokens.")
    else:
        raise ValueError("Either text or input_ids should be provided.")
    n_prompts = len(prompts)
    sps = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params or {}] * n_prompts
    if len(sps) != n_prompts:
        raise ValueError(f"sampling_params has {len(sps)} entries for a batch of {n_prompts}")
    params = [SamplingParams.from_dict(sp, state.vocab_size) for sp in sps]
    for p in params:
        if p.grammar is not None:
            check_grammar(p.grammar, state.token_bytes.ll, f"sampling_params.{next(iter(p.constraint))}")
    n = params[0].n
    if any(p.n != n for p in params):
        raise ValueError("The parallel_sample_num (n) should be the same for all samples in a batch.")
    rlp = _per_item(body.return_logprob, n_prompts, "return_logprob")
    starts = _per_item(body.logprob_start_len, n_prompts, "logprob_start_len")
    tops = _per_item(body.top_logprobs_num, n_prompts, "top_logprobs_num")
    if body.token_ids_logprob and isinstance(body.token_ids_logprob[0], list):
        fixed = _per_item(body.token_ids_logprob, n_prompts, "token_ids_logprob")
    else:
        fixed = [body.token_ids_logprob or None] * n_prompts
    if n > 1 and any(isinstance(v, list) for v in (body.return_logprob, body.logprob_start_len,
                                                     body.top_logprobs_num)):
        raise ValueError("Cannot use list logprob parameters with parallel_sample_num > 1")
    total = n_prompts * n
    if isinstance(body.rid, list):
        if len(body.rid) != total or len(set(body.rid)) != total:
            raise ValueError("The rid list must have one unique id per sequence of the batch")
        rids = list(body.rid)
    elif total == 1:
        rids = [body.rid or uuid.uuid4().hex]
    else:
        base = body.rid or uuid.uuid4().hex
        rids = [f"{base}_{i}" for i in range(total)]
    loras = state.lora.resolve(_per_item(body.lora_path, n_prompts, "lora_path"))
    items = []
    for i, ids in enumerate(prompts):
        p = params[i]
        state.check_length(len(ids), p.max_new_tokens)
        if rlp[i]:
            if starts[i] < -1:
                raise ValueError(f"logprob_start_len must be >= -1, got {starts[i]}")
            if starts[i] >= len(ids):
                raise ValueError(f"logprob_start_len ({starts[i]}) is higher than the number of input tokens "
                                 f"({len(ids)}). Request with a lower logprob_start_len.")
        if tops[i] < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {tops[i]}")
        if fixed[i]:
            state.check_ids(fixed[i], "token_ids_logprob")
        for j in range(n):
            rid = rids[i * n + j]
            items.append(Item(state.new_rid(rid), ids, _nth_sample(p, j), bool(rlp[i]),
                              int(starts[i]) if rlp[i] else -1, int(tops[i]) if rlp[i] else 0,
                              fixed[i] if rlp[i] else None, loras[i]))
    return items, is_batch or total > 1


def _nth_sample(p: SamplingParams, j: int) -> SamplingParams:
    """Params of parallel sample ``j`` (``n > 1``): with a seed, sample j uses ``seed + j`` so the n
    samples differ but stay reproducible."""
    if j == 0 or p.sampling_seed is None:
        return p
    return dataclasses.replace(p, sampling_seed=p.sampling_seed + j)


async def _merge(gens: list[Generation]) -> AsyncIterator[tuple[int, Generation]]:
    """Yield (index, generation) after every update of any of ``gens`` (interleaved)."""
    if len(gens) == 1:
        g = gens[0]
        while not g.done:
            await g.next()
            yield 0, g
        return
    pending = {asyncio.ensure_future(g.next()): i for i, g in enumerate(gens)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                fut.result()  # raises RequestFailed
                yield i, gens[i]
                if not gens[i].done:
                    pending[asyncio.ensure_future(gens[i].next())] = i
    finally:
        for fut in pending:
            fut.cancel()


async def wait_all(request: Request, gens: list[Generation], poll_s: float = 0.5) -> bool:
    """Wait for every generation; abort them and return False if the client disconnects first.

    Raises RequestFailed from a failed generation.
    """
    waiter = asyncio.ensure_future(asyncio.gather(*(g.wait() for g in gens)))
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=poll_s)
            if done:
                waiter.result()
                return True
            if await request.is_disconnected():
                return False
    finally:
        if not waiter.done():
            waiter.cancel()
            with contextlib.suppress(BaseException):
                await waiter
        for g in gens:
            g.cancel()


async def wait_response(request: Request, gens: list[Generation]) -> Response | None:
    """:func:`wait_all` for a non-streamed answer: None once every generation finished, else the
    response to send instead (499, empty, when the client went away; the failure's status with an
    OpenAI error body when a generation failed)."""
    try:
        if not await wait_all(request, gens):
            return Response(status_code=499)  # client closed the request; nobody reads this
    except RequestFailed as e:
        return openai_error(e.status, str(e), str(e.status))
    return None


async def generate_stream(gens: list[Generation], with_text: bool, prompt_ids: bool) -> AsyncIterator[bytes]:
    """SSE of a streamed ``/generate``: the cumulative output after every update (with ``index``
    when there are several sequences), an error event if a generation fails, then ``[DONE]``.
    ``gens`` are cancelled when it ends, whether finished, failed or closed by the client."""
    try:
        async for i, g in _merge(gens):
            out = g.generate_output(with_text=with_text, prompt_ids=prompt_ids)
            if len(gens) > 1:
                out["index"] = i
            yield sse(out)
    except RequestFailed as e:
        yield sse({"error": {"message": str(e), "type": "internal_error", "code": e.status, "retryable": True}})
    finally:
        for g in gens:
            g.cancel()
    yield SSE_DONE


# ---------------------------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------------------------
def chat_setup(state: EngineState, body: ChatBody) -> tuple[list[int], SamplingParams, list[dict] | None]:
    """Prompt ids, sampling params and the active tools of a chat request.

    Raises:
        ValueError: bad combination or content (answered 400).
    """
    if body.stream and (body.return_prompt_token_ids or body.return_meta_info):
        raise ValueError("return_prompt_token_ids and return_meta_info are not supported with stream=true")
    for key in ("ebnf", "stop_regex"):
        if getattr(body, key):
            raise ValueError(f"{key} needs EBNF grammars or regex matching, which this engine does not implement")
    if (body.stream_options or {}).get("continuous_usage_stats"):
        raise ValueError("stream_options.continuous_usage_stats is not supported by this engine")
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    spec = PromptSpec.from_request({"messages": body.messages, "tools": tools, "tool_choice": body.tool_choice,
                                    "continue_final_message": body.continue_final_message,
                                    "chat_template_kwargs": body.chat_template_kwargs})
    if body.input_ids is not None:
        state.check_ids(body.input_ids)
        prompt = list(body.input_ids)
    else:
        prompt = state.renderer.render_spec(spec)
    gen_defaults = state.worker.loaded.generation_defaults
    sp: dict[str, Any] = {}
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        v = getattr(body, key)
        if v is None:
            v = gen_defaults.get(key)
            if key == "top_k" and v is not None:
                v = int(v)
        if v is not None:
            sp[key] = v
    max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sp.update(max_new_tokens=max_new, n=body.n, stop=body.stop, stop_token_ids=body.stop_token_ids,
              ignore_eos=body.ignore_eos, no_stop_trim=body.no_stop_trim, min_new_tokens=body.min_tokens,
              sampling_seed=body.seed, logit_bias=body.logit_bias, skip_special_tokens=body.skip_special_tokens,
              frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty)
    params = SamplingParams.from_dict({k: v for k, v in sp.items() if v is not None}, state.vocab_size,
                                      default_max_new_tokens=None)
    params.grammar, params.constraint = chat_constraint(state, body, spec.tools)
    params.verify(state.vocab_size)
    if body.top_logprobs is not None and body.top_logprobs < 0:
        raise ValueError("top_logprobs must be >= 0")
    state.check_length(len(prompt), params.max_new_tokens)
    return prompt, params, spec.tools


def chat_constraint(state: EngineState, body: ChatBody, tools: list[dict] | None
                    ) -> tuple[str | None, dict | None]:
    """(grammar, reported constraint) of a chat request, (None, None) when unconstrained.

    ``tool_choice`` "required" / a named function: one call of the active ``tools`` (the named
    one only); ``response_format`` json_object / json_schema: that schema; ``regex``.

    Raises:
        ValueError: another response_format type, two constraints at once, a schema or regex
            that does not compile (answered 400).
    """
    found: list[tuple[str, str, dict]] = []
    choice = body.tool_choice
    if choice not in (None, "none", "auto") and tools:
        found.append(("tool_choice", tool_call_grammar(tools), {"tool_choice": choice}))
    rf = body.response_format or {}
    kind = rf.get("type", "text") if rf else "text"
    if kind != "text":
        schema = response_format_schema(rf)
        if schema is None:
            raise ValueError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)")
        found.append(("response_format", json_grammar(schema), {"response_format": {"type": kind}}))
    if body.regex:
        found.append(("regex", regex_grammar(body.regex), {"regex": body.regex}))
    if not found:
        return None, None
    if len(found) > 1:
        raise ValueError(f"{' and '.join(f[0] for f in found)} each constrain decoding: give at most one")
    what, grammar, reported = found[0]
    check_grammar(grammar, state.token_bytes.ll, what)
    return grammar, reported


def chat_items(state: EngineState, body: ChatBody, prompt: list[int], params: SamplingParams) -> tuple[str, list[Item]]:
    """Request id and sequences of a chat request; ``model: "<base>:<adapter>"`` selects a loaded
    LoRA adapter (SGLang's syntax: split at the first ``:``, the base part is not checked).

    Raises:
        ValueError: an unknown adapter or LoRA off (answered 400).
    """
    adapter = chat_model_adapter(body.model)[1]
    lora = state.lora.resolve([adapter])[0]
    rid = state.new_rid(body.rid)
    rids = [rid] if params.n == 1 else [state.new_rid(f"{rid}_{i}") for i in range(params.n)]
    top = (body.top_logprobs or 0) if body.logprobs else 0
    return rid, [Item(r, prompt, _nth_sample(params, j), body.logprobs, -1, top, None, lora)
                 for j, r in enumerate(rids)]


def chat_response(state: EngineState, body: ChatBody, rid: str, gens: list[Generation], tools) -> dict:
    choices = []
    for i, g in enumerate(gens):
        text = g.text()
        content, calls = parse_tool_calls(text, tools) if tools else (text, [])
        if not body.parallel_tool_calls:
            calls = calls[:1]  # at most one call per turn
        reason, matched = g.chat_finish_reason(bool(calls))
        choice: dict[str, Any] = {
            "index": i,
            "message": {"role": "assistant", "content": content, "reasoning_content": None,
                        "tool_calls": [c.to_openai(k) for k, c in enumerate(calls)] or None},
            "logprobs": {"content": g.chat_logprobs(0)} if body.logprobs else None,
            "finish_reason": reason,
            "matched_stop": matched,
        }
        if body.return_token_ids or body.return_prompt_token_ids:
            choice["prompt_token_ids"] = list(g.item.input_ids)
        if body.return_token_ids:
            choice["token_ids"] = list(g.output_ids)
        if body.return_meta_info:
            choice["meta_info"] = g.meta_info(with_text=True)
        choices.append(choice)
    n_prompt = len(gens[0].item.input_ids)
    n_out = sum(len(g.output_ids) for g in gens)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": body.model,
            "choices": choices,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                      "reasoning_tokens": 0},
            "metadata": {"weight_version": gens[0].version,
                         "sampling_params": gens[0].item.params.reported(), **gens[0].lora_info()}}


async def chat_stream(state: EngineState, body: ChatBody, rid: str, gens: list[Generation], tools
                      ) -> AsyncIterator[bytes]:
    created = int(time.time())
    want_ids = body.return_token_ids
    include_usage = bool((body.stream_options or {}).get("include_usage"))

    def chunk(index: int, delta: dict, **extra: Any) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": extra.pop("logprobs", None),
                  "finish_reason": extra.pop("finish_reason", None)}
        if "matched_stop" in extra:
            choice["matched_stop"] = extra.pop("matched_stop")
        if "token_ids" in extra:
            choice["token_ids"] = extra.pop("token_ids")
        out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
               "choices": [choice]}
        out.update(extra)
        return out

    parsers = [ToolStreamParser(tools) if tools else None for _ in gens]
    sent_ids = [0] * len(gens)
    n_calls = [0] * len(gens)
    try:
        for i, g in enumerate(gens):
            first: dict[str, Any] = {"metadata": {"weight_version": g.version,
                                                  "sampling_params": g.item.params.reported(), **g.lora_info()}}
            if want_ids:
                first["prompt_token_ids"] = list(g.item.input_ids)
            yield sse(chunk(i, {"role": "assistant", "content": ""}, **first))
        try:
            async for i, g in _merge(gens):
                start, end = sent_ids[i], len(g.output_ids)
                sent_ids[i] = end
                delta_text = g.text_delta()
                calls = []
                if parsers[i] is not None:
                    delta_text, calls = parsers[i].feed(delta_text)
                    if g.done:
                        rest, more = parsers[i].finish()
                        delta_text += rest
                        calls += more
                extra: dict[str, Any] = {}
                if body.logprobs and end > start:
                    extra["logprobs"] = {"content": g.chat_logprobs(start, end)}
                if want_ids and end > start:
                    extra["token_ids"] = g.output_ids[start:end]
                delta: dict[str, Any] = {}
                if delta_text:
                    delta["content"] = delta_text
                if calls and not body.parallel_tool_calls:
                    calls = calls[:max(0, 1 - n_calls[i])]  # at most one call per turn
                if calls:
                    delta["tool_calls"] = [c.to_openai(n_calls[i] + k) for k, c in enumerate(calls)]
                    n_calls[i] += len(calls)
                if delta or extra:
                    yield sse(chunk(i, delta, **extra))
                if g.done:
                    reason, matched = g.chat_finish_reason(n_calls[i] > 0)
                    yield sse(chunk(i, {}, finish_reason=reason, matched_stop=matched,
                                    metadata={"weight_version": g.version,
                                              "sampling_params": g.item.params.reported(), **g.lora_info()}))
        except RequestFailed as e:
            yield sse({"error": {"message": str(e), "type": "internal_error" if e.status >= 500 else
                                 "invalid_request_error", "code": e.status, "retryable": e.status >= 500}})
            yield SSE_DONE
            return
        if include_usage:
            n_prompt = len(gens[0].item.input_ids)
            n_out = sum(len(g.output_ids) for g in gens)
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                       "choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                                "total_tokens": n_prompt + n_out, "reasoning_tokens": 0}})
        yield SSE_DONE
    finally:
        for g in gens:
            g.cancel()


# ---------------------------------------------------------------------------------------------
# health, info and metrics routes
# ---------------------------------------------------------------------------------------------
info_router = APIRouter()


@info_router.get("/ping")
@info_router.get("/health")
async def health(state: Engine):
    """200 while serving, 503 when shutting down or the model thread died (empty bodies)."""
    return Response(status_code=503 if state.unavailable() else 200)


@info_router.get("/health_generate")
async def health_generate(state: Engine):
    """200 once a one-token greedy generation finished within 20 s; 503 otherwise (empty bodies)."""
    if state.unavailable():
        return Response(status_code=503)
    item = Item(state.new_rid(f"HEALTH_CHECK_{uuid.uuid4().hex}"), [0],
                SamplingParams(max_new_tokens=1, top_k=1))
    try:
        await asyncio.wait_for(Generation(state, item).start().wait(), 20.0)
    except (asyncio.TimeoutError, RequestFailed):
        return Response(status_code=503)
    return Response(status_code=200)


@info_router.get("/get_model_info")
@info_router.get("/model_info")
def model_info(state: Engine):
    lm = state.worker.loaded
    return {"model_path": state.model_path, "tokenizer_path": state.tokenizer_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": state.worker.version,
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": lm.model_type, "architectures": lm.architectures}


@info_router.get("/get_server_info")
@info_router.get("/server_info")
def server_info(state: Engine):
    running, waiting = state.worker.load
    return {"version": f"{ENGINE_NAME}-{VERSION}", "engine": ENGINE_NAME, "model_path": state.model_path,
            "served_model_name": state.served_model_name, "tokenizer_path": state.tokenizer_path,
            "context_length": state.context_length, "max_req_input_len": state.context_length - 1,
            "max_running_requests": state.worker.max_batch_size, "weight_version": state.worker.version,
            "incremental_streaming_output": False, "chat_stream_token_ids": True,
            "logprob_token_bytes": True,
            "tool_call_parser": "pipeline-tool-call", "reasoning_parser": None, "dtype": "float32",
            "device": "cpu", "startup_time": state.started,
            "enable_lora": state.lora.settings.enabled, "max_lora_rank": state.lora.settings.max_rank,
            "lora_target_modules": list(state.lora.settings.targets),
            "max_loras_per_batch": state.lora.settings.max_per_batch,
            "internal_states": [{"running_requests": running, "waiting_requests": waiting,
                                 "decode_steps": state.worker.steps, "prefix_cache": prefix_info(state),
                                 "lora_adapters": [a.info() for a in state.lora.adapters.values()]}]}


def prefix_info(state: EngineState) -> dict:
    """The prefix cache's bounds, size (``entries``, ``bytes``) and hit counters, for ``/server_info``."""
    pc = state.worker.prefix_cache
    return {"enabled": pc.enabled, "max_bytes": pc.max_bytes, "max_entries": pc.max_entries,
            "min_tokens": pc.min_tokens, "entries": len(pc), "bytes": pc.nbytes,
            **dataclasses.asdict(pc.stats)}


@info_router.get("/metrics")
async def metrics(state: Engine):
    """Prometheus text; the load and prefix-cache gauges are sampled at scrape time."""
    running, waiting = state.worker.load
    state.metrics.running.set(running)
    state.metrics.waiting.set(waiting)
    state.metrics.prefix_entries.set(len(state.worker.prefix_cache))
    state.metrics.prefix_bytes.set(state.worker.prefix_cache.nbytes)
    return Response(state.metrics.render(), media_type=state.metrics.content_type)


# ---------------------------------------------------------------------------------------------
# OpenAI-compatible routes: errors are {"object": "error", ...}
# ---------------------------------------------------------------------------------------------
openai_router = APIRouter()


@openai_router.post("/v1/chat/completions")
async def chat(request: Request, state: Running):
    body: ChatBody = validate(ChatBody, await read_json(request, openai=True))
    try:
        prompt, params, tools = chat_setup(state, body)
        rid, items = chat_items(state, body, prompt, params)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    gens = [Generation(state, it).start() for it in items]
    if body.stream:
        return StreamingResponse(chat_stream(state, body, rid, gens, tools), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    if (early := await wait_response(request, gens)) is not None:
        return early
    return ORJSONResponse(chat_response(state, body, rid, gens, tools))


def model_card(state: EngineState) -> dict:
    """The served model as an OpenAI ``model`` object (``created``: engine start, Unix seconds)."""
    return {"id": state.served_model_name, "object": "model", "created": int(state.started),
            "owned_by": ENGINE_NAME, "root": state.model_path, "parent": None,
            "max_model_len": state.context_length}


@openai_router.get("/v1/models")
async def models(state: Engine):
    """The served model, then one card per loaded LoRA adapter (SGLang: ``id`` the adapter's
    name, ``root`` its path, ``parent`` the served model, ``max_model_len`` null)."""
    cards = [model_card(state)] + [
        {"id": a.name, "object": "model", "created": int(state.started), "owned_by": ENGINE_NAME, "root": a.path,
         "parent": state.served_model_name, "max_model_len": None} for a in state.lora.adapters.values()]
    return ORJSONResponse({"object": "list", "data": cards})


@openai_router.get("/v1/models/{model_id:path}")
async def model_by_id(model_id: str, state: Engine):
    """The model card; 404 ``model_not_found`` (OpenAI's shape) for any other id."""
    if model_id != state.served_model_name:
        return ORJSONResponse({"error": {"message": f"The model '{model_id}' does not exist",
                                         "type": "invalid_request_error", "param": "model",
                                         "code": "model_not_found"}}, status_code=404)
    return ORJSONResponse(model_card(state))


@openai_router.post("/v1/tokenize")
@openai_router.post("/tokenize")
async def tokenize(request: Request, state: Engine):
    """Token ids of ``messages`` (rendered with the chat template) or of ``prompt`` (one string,
    or a list: then ``tokens`` and ``count`` are lists too)."""
    body: TokenizeBody = validate(TokenizeBody, await read_json(request, openai=True))
    try:
        if body.messages is not None:
            tools = normalise_tools([t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None)
            ids = state.renderer.render_ids(body.messages, tools,
                                            add_generation_prompt=body.add_generation_prompt,
                                            continue_final_message=body.continue_final_message,
                                            chat_template_kwargs=body.chat_template_kwargs)
            if body.add_special_tokens:
                ids = list(state.tokenizer.build_inputs_with_special_tokens(ids))
        elif body.prompt is not None:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            if isinstance(body.prompt, list):
                tokens = [list(state.tokenizer.encode(p, add_special_tokens=add)) for p in body.prompt]
                return ORJSONResponse({"tokens": tokens, "count": [len(t) for t in tokens],
                                       "max_model_len": state.context_length})
            ids = list(state.tokenizer.encode(body.prompt, add_special_tokens=add))
        else:
            raise ValueError("either prompt or messages is required")
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    return ORJSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.context_length})


@openai_router.post("/v1/detokenize")
@openai_router.post("/detokenize")
async def detokenize(request: Request, state: Engine):
    body: DetokenizeBody = validate(DetokenizeBody, await read_json(request, openai=True))
    try:
        state.check_ids(body.tokens, "tokens") if body.tokens else None
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    return ORJSONResponse({"text": state.tokenizer.decode(body.tokens)})


# ---------------------------------------------------------------------------------------------
# SGLang-native routes: /generate and weight updates (errors are {"error": {"message"}})
# ---------------------------------------------------------------------------------------------
native_router = APIRouter()


@native_router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request, state: Running):
    """One output object, or a list for a batch (several prompts or ``n > 1``); SSE when ``stream``."""
    body: GenerateBody = validate(GenerateBody, await read_json(request, openai=False))
    try:
        items, is_batch = generate_items(state, body)
    except ValueError as e:
        raise ApiError(400, str(e), native=True) from None
    gens = [Generation(state, it).start() for it in items]
    with_text, prompt_ids = body.return_text_in_logprobs, body.return_prompt_token_ids
    if body.stream:
        return StreamingResponse(generate_stream(gens, with_text, prompt_ids), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    if (early := await wait_response(request, gens)) is not None:
        return early
    outs = [g.generate_output(with_text=with_text, prompt_ids=prompt_ids) for g in gens]
    return ORJSONResponse(outs if is_batch else outs[0])


def _thread_future() -> tuple[asyncio.Future, Callable[[Any], None]]:
    """A future of the running loop and a callback, safe to call from the model thread, that sets
    its result (the first call wins; later ones are ignored)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def resolve(value: Any) -> None:
        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(value))

    return fut, resolve


def _weights_failed(state: EngineState, message: str) -> ORJSONResponse:
    """The 400 of a refused weight update (counted as a failure; the served weights are unchanged)."""
    state.metrics.weight_updates.labels("failure").inc()
    return ORJSONResponse({"success": False, "message": message, "num_paused_requests": 0}, status_code=400)


@native_router.post("/update_weights_from_disk")
async def update_weights(request: Request, state: Engine):
    """Load ``model_path`` (must fit the served model) and swap it in once no request runs on the
    old weights (or at once with ``abort_all_requests``); one update at a time."""
    body: UpdateWeightsBody = validate(UpdateWeightsBody, await read_json(request, openai=False))
    from pipeline.engine.model import ModelLoadError, load_model
    from pipeline.models import ModelNotFound, resolve_model

    async with state.update_lock:
        try:
            path = await asyncio.to_thread(resolve_model, body.model_path, state.cache_dir)
            loaded = await asyncio.to_thread(load_model, path, like=state.worker.loaded,
                                             tokenizer=state.tokenizer)
        except (ModelNotFound, ModelLoadError, OSError) as e:
            return _weights_failed(state, f"Failed to update weights: {e}")
        if loaded.vocab_size != state.vocab_size:
            return _weights_failed(state, f"Failed to update weights: vocabulary size {loaded.vocab_size} differs "
                                          f"from the served model's {state.vocab_size}")
        fut, on_done = _thread_future()
        version = None if body.weight_version is None else str(body.weight_version)
        state.worker.swap(loaded, version, on_done, abort_all=body.abort_all_requests)
        new_version = await fut
        if new_version is None:
            return _weights_failed(state, "Failed to update weights: superseded by another update")
        state.model_path = str(path)
        state.lora.linears = state.worker.lora_linears  # the new model's (same shapes, checked by load_model)
        state.metrics.set_version(new_version)
        state.metrics.weight_updates.labels("success").inc()
    msg = f"Succeeded to update model weights. Weight version updated to {new_version}."
    return ORJSONResponse({"success": True, "message": msg, "num_paused_requests": 0,
                           "weight_version": new_version})


def _lora_answer(state: EngineState, error: str | None) -> ORJSONResponse:
    """SGLang's ``LoRAUpdateOutput``: ``{success, error_message, loaded_adapters: {name: path}}``,
    200 on success and 400 on a refusal; plus this engine's ``adapter_versions: {name: content
    id}`` (the sha256 of the bytes it parsed; SGLang has no such field), which lets a syncer
    check what was loaded instead of hashing the folder a second time."""
    return ORJSONResponse({"success": error is None, "error_message": error, "loaded_adapters": state.lora.paths(),
                           "adapter_versions": state.lora.versions()},
                          status_code=200 if error is None else 400)


@native_router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request, state: Running):
    """Load the adapter folder ``lora_path`` as ``lora_name`` (read and checked off the model
    thread; running requests are not held). The same content under the same name again is a
    no-op (200); other content under a loaded name is refused (400: unload it first)."""
    body: LoadLoraBody = validate(LoadLoraBody, await read_json(request, openai=False))
    async with state.lora.lock:
        try:
            await asyncio.to_thread(state.lora.load_sync, body.lora_name, body.lora_path)
        except LoraError as e:
            return _lora_answer(state, str(e))
    return _lora_answer(state, None)


@native_router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request, state: Running):
    """Forget ``lora_name`` at once: later requests naming it get 400; requests already admitted
    finish on the version they started with (SGLang instead answers once they have finished)."""
    body: UnloadLoraBody = validate(UnloadLoraBody, await read_json(request, openai=False))
    async with state.lora.lock:
        try:
            state.lora.unload(body.lora_name)
        except LoraError as e:
            return _lora_answer(state, str(e))
    return _lora_answer(state, None)


# ---------------------------------------------------------------------------------------------
# control routes: pause / continue / abort / flush
# ---------------------------------------------------------------------------------------------
control_router = APIRouter()


@control_router.post("/pause_generation")
async def pause(request: Request, state: Engine):
    body: PauseBody = validate(PauseBody, await read_json(request, openai=False))
    state.worker.pause(body.mode)
    return ORJSONResponse({"message": "Generation paused successfully.", "status": "ok"})


@control_router.post("/continue_generation")
async def continue_generation(request: Request, state: Engine):
    await read_json(request, openai=False)
    state.worker.resume()
    return ORJSONResponse({"message": "Generation continued successfully.", "status": "ok"})


@control_router.post("/abort_request")
async def abort_request(request: Request, state: Engine):
    """Abort every in-flight request whose rid starts with ``rid`` (all with ``abort_all``); 200, empty."""
    body: AbortBody = validate(AbortBody, await read_json(request, openai=False))
    msg = body.abort_message or "Abort by user request."
    for rid, g in list(state.inflight.items()):
        if body.abort_all or (body.rid and rid.startswith(body.rid)):
            state.worker.abort(g.req, msg)
    return Response(status_code=200)


@control_router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(state: Running):
    """Empty the prefix cache between two decode steps (waits up to 60 s); plain-text answer."""
    fut, on_done = _thread_future()
    state.worker.flush_prefix_cache(on_done)
    dropped = await asyncio.wait_for(fut, 60.0)
    return PlainTextResponse(f"Cache flushed.\n{dropped} prefix-cache entries dropped.\n")


# ---------------------------------------------------------------------------------------------
# app
# ---------------------------------------------------------------------------------------------
async def _api_error(request: Request, exc: ApiError):
    return exc.response()


async def _validation_error(request: Request, exc: RequestValidationError):
    return openai_error(400, str(exc.errors()), "Bad Request")


async def _http_error(request: Request, exc: StarletteHTTPException):
    return openai_error(exc.status_code, str(exc.detail), str(exc.status_code))


async def _unexpected_error(request: Request, exc: Exception):
    log.exception("unexpected error on %s", request.url.path)
    return openai_error(500, f"internal error: {type(exc).__name__}: {exc}", "500")


def create_app(state: EngineState, api_key: str | None = None) -> FastAPI:
    """The ASGI app serving ``state`` (the worker thread must already be started).

    ``state`` is kept in ``app.state.engine``, where the routes' dependencies (``Engine``,
    ``Running``) find it. ``api_key``: when set, every route except ``/health``, ``/ping`` and
    ``/metrics`` needs ``Authorization: Bearer <api_key>`` (401 otherwise), like SGLang's
    ``--api-key``.
    """
    app = FastAPI(title="pipeline CPU engine (SGLang HTTP subset)", version=VERSION, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.engine = state
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    for router in (info_router, openai_router, native_router, control_router):
        app.include_router(router)
    return app
