"""SGLang's streamed chat with token ids, served through ``/v1/tokenize`` + ``POST /generate``.

SGLang (commit 004c82e) refuses ``return_token_ids`` with ``stream`` on its chat path; against
such a server :meth:`pipeline.engine_api.client.EngineClient.chat_stream` renders the prompt
with ``/v1/tokenize`` and streams ``/generate`` through :class:`GenerateChatStream`, which turns
its chunks into ``chat.completion.chunk`` dicts. The chat-field mapping onto ``sampling_params``
(:func:`chat_sampling_params`, :func:`response_format_schema`) is SGLang's chat path's, also
used by this package's CPU engine; :func:`generate_path_refusal` names a field the path cannot
serve (EngineError 400 before anything is generated).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Iterator

import orjson

from pipeline.engine_api.calls import EngineCalls
from pipeline.engine_api.errors import EngineError
from pipeline.engine_api.schema import CHAT_FIELDS, fields_with
from pipeline.engine_api.tools import ToolStreamParser
from pipeline.sampling import with_generation_defaults

log = logging.getLogger(__name__)


def _finish_to_openai(finish: dict | None, has_tool_calls: bool = False) -> tuple[str | None, Any]:
    """SGLang ``/generate`` finish_reason object -> (chat finish_reason string, matched_stop)."""
    if not finish:
        return None, None
    kind = finish.get("type")
    if kind == "stop":
        return ("tool_calls" if has_tool_calls else "stop"), finish.get("matched")
    return kind, None


class GenerateChatStream:
    """One streamed chat turn with token ids, served through ``POST /generate`` (SGLang).

    The adapter behind :meth:`EngineClient.chat_stream` against an engine whose chat path cannot
    stream token ids: the prompt is the body's ``input_ids`` or the rendering of
    ``POST /v1/tokenize``; the chat fields become ``sampling_params`` as SGLang's chat path maps
    them (:func:`chat_sampling_params`); each ``/generate`` chunk (cumulative, or deltas with the
    server's ``incremental_streaming_output``) becomes ``chat.completion.chunk`` dicts. In order:
    a first chunk with the role, ``prompt_token_ids`` and ``metadata`` (``weight_version`` and the
    ``sampling_params`` the engine samples with, ``temperature`` 1.0 when the body names none: the
    distribution the log-probs are of); a chunk per event with new tokens (``token_ids``,
    ``logprobs.content``, content and tool-call deltas); a finish chunk (``finish_reason``,
    ``matched_stop``, ``metadata``); a usage chunk for ``stream_options.include_usage``. A stream
    closed before the engine ended it aborts the generation (``/abort_request`` by its ``rid``).

    Args:
        client: the client whose transport, :attr:`EngineClient.token_bytes` and
            :attr:`EngineClient.chat_defaults` are used.
        body: the chat request.
        info: the engine's ``/server_info``.
    """

    def __init__(self, client: EngineCalls, body: dict, info: dict) -> None:
        self.client, self.body, self.info = client, body, info
        self.tools = chat_tools(body)
        self.want_lp = bool(body.get("logprobs"))
        self.incremental = bool(info.get("incremental_streaming_output"))
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.one_call = body.get("parallel_tool_calls") is False
        self.model, self.adapter = chat_model_adapter(body.get("model", "default"))
        self.prompt: list[int] = []
        self.origin: dict[str, str] = {}  # sampling key -> the chat field it came from
        self.used: dict[str, Any] = {}  # the sampling parameters the engine samples with
        self.gen_rid = ""  # the /generate request's rid (aborts it)
        self.rid: str | None = None  # the engine's id of the generation (meta_info.id): the chunks' id
        self.created = 0
        self.parser: ToolStreamParser | None = None  # when tools are offered
        self.ids: list[int] = []
        self.lps: list = []
        self.tops: list = []
        self.text = ""
        self.n_ids = self.n_text = self.n_calls = 0  # token ids, characters and tool calls sent so far
        self.first = True
        self.ended = False  # the engine ended the generation (finished or failed): nothing to abort

    async def run(self) -> AsyncIterator[dict]:
        """The chat chunks, in order (see the class). Raises :class:`EngineError`: 400 for a chat
        field this path cannot serve (nothing generated), or the engine's error (a 400 refusing
        a sampling parameter names the chat field it was sent for)."""
        gen_body = await self._payload()
        self.created = int(time.time())
        if self.tools:
            self.parser = ToolStreamParser(self.tools)
        try:
            async for ev in self.client._sse("/generate", gen_body):
                for out in self._on_event(ev):
                    yield out
        except EngineError as e:
            self.ended = True  # the engine ended it
            named = self._refused_fields(e)
            if named:
                raise EngineError(f"{e.message} [chat field {named}]", e.status, e.body) from None
            raise
        finally:
            if not self.ended:  # closed early (the caller's client left): stop the generation now
                await self._abort()

    async def _payload(self) -> dict:
        """The ``/generate`` body: the prompt ids, the chat body's sampling parameters
        (``max_new_tokens`` defaulting to what the context length leaves), a ``rid`` and, when
        ``logprobs`` is on, the log-prob flags. Sets :attr:`prompt`, :attr:`origin`, :attr:`used`
        and :attr:`gen_rid`. Raises EngineError 400 before any request for a field it cannot serve."""
        refused = generate_path_refusal(self.body)
        if refused is not None:
            raise EngineError(refused[1], 400, {"param": refused[0]})
        self.prompt, max_len = await self._prompt()
        sp, self.origin = chat_sampling_params(self.body, self.client.chat_defaults)
        if sp.get("max_new_tokens") is None and max_len:
            sp["max_new_tokens"] = int(max_len) - len(self.prompt)
        # an id of our own when the caller gave none: a stream closed early is aborted by it
        self.gen_rid = self.body.get("rid") or f"chat-{uuid.uuid4().hex}"
        gen_body: dict[str, Any] = {"input_ids": self.prompt, "sampling_params": sp, "stream": True,
                                    "rid": self.gen_rid}
        if self.adapter is not None:  # chat's "<base>:<adapter>" is /generate's lora_path (the adapter's name)
            gen_body["lora_path"] = self.adapter
        # what the engine samples with (its /generate default temperature is 1.0), reported as our
        # engine reports it (metadata.sampling_params) so a recorder knows the distribution
        self.used = {k: v for k, v in sp.items() if k != "max_new_tokens"}
        self.used.setdefault("temperature", 1.0)
        if self.want_lp:
            gen_body.update(return_logprob=True, top_logprobs_num=int(self.body.get("top_logprobs") or 0),
                            return_text_in_logprobs=True)
        return gen_body

    async def _prompt(self) -> tuple[list[int], Any]:
        """``(prompt ids, context length or None)``: the body's ``input_ids`` as they are (SGLang's
        chat path applies no template then), else the rendering of ``POST /v1/tokenize``
        (messages, tools, template options)."""
        body, info = self.body, self.info
        if body.get("input_ids") is not None:
            return list(body["input_ids"]), info.get("context_length")
        tok_body: dict[str, Any] = {"messages": body["messages"], "add_generation_prompt": True}
        for key in ("chat_template_kwargs", "continue_final_message", "model"):
            if body.get(key) is not None:
                tok_body[key] = body[key]
        if self.tools:
            tok_body["tools"] = self.tools
        tok = await self.client._request("POST", "/v1/tokenize", tok_body)
        return list(tok["tokens"]), tok.get("max_model_len") or info.get("context_length")

    def _on_event(self, ev: dict) -> Iterator[dict]:
        """The chat chunks of one ``/generate`` chunk, yielded one by one: the first chunk (on the
        first event, before its tokens), the new tokens' chunk, then on the last event the finish
        and usage chunks."""
        mi = ev.get("meta_info") or {}
        self.rid = self.rid or mi.get("id")
        if self.first:
            self.first = False
            yield self._chunk({"role": "assistant", "content": ""}, prompt_token_ids=self.prompt,
                              metadata=self._metadata(mi))
        self._absorb(ev, mi)
        finish = mi.get("finish_reason")
        delta_text, calls = self._text_delta(finish)
        extra = self._token_fields()
        delta: dict[str, Any] = {}
        if delta_text:
            delta["content"] = delta_text
        if calls:
            delta["tool_calls"] = [c.to_openai(self.n_calls + k) for k, c in enumerate(calls)]
            self.n_calls += len(calls)
        if delta or extra:
            yield self._chunk(delta, **extra)
        if finish:
            yield from self._final(mi, finish)

    def _absorb(self, ev: dict, mi: dict) -> None:
        """Take one event's ids, text and log-probs (appended when the server streams deltas, else
        replacing: SGLang's default is cumulative)."""
        if self.incremental:
            self.ids += ev.get("output_ids") or []
            self.text += ev.get("text") or ""
            self.lps += mi.get("output_token_logprobs") or []
            self.tops += mi.get("output_top_logprobs") or []
        else:
            self.ids = list(ev.get("output_ids") or [])
            self.text = ev.get("text") or ""
            self.lps = list(mi.get("output_token_logprobs") or [])
            self.tops = list(mi.get("output_top_logprobs") or [])

    def _text_delta(self, finish: dict | None) -> tuple[str, list]:
        """``(content delta, new tool calls)`` of the text not sent yet: with tools, what the tool
        parser lets through (flushed on ``finish``; one call at most for ``parallel_tool_calls:
        false``)."""
        delta_text = self.text[self.n_text:] if len(self.text) > self.n_text else ""
        self.n_text = max(self.n_text, len(self.text))
        calls: list = []
        if self.parser is not None:
            delta_text, calls = self.parser.feed(delta_text)
            if finish:
                rest, more = self.parser.finish()
                delta_text += rest
                calls += more
            if self.one_call:
                calls = calls[:max(0, 1 - self.n_calls)]
        return delta_text, calls

    def _token_fields(self) -> dict[str, Any]:
        """The new tokens' ``token_ids`` and (``logprobs`` on) ``logprobs.content`` entries, with
        raw ``bytes`` when the client has a byte table; ``{}`` when there are none."""
        extra: dict[str, Any] = {}
        n, new_ids = self.n_ids, self.ids[self.n_ids:]
        if new_ids:
            extra["token_ids"] = new_ids
            if self.want_lp:
                tops, token_bytes = self.tops, self.client.token_bytes
                extra["logprobs"] = {"content": [
                    _chat_lp(e, tops[n + k] if n + k < len(tops) else None, token_bytes)
                    for k, e in enumerate(self.lps[n:len(self.ids)])]}
        self.n_ids = len(self.ids)
        return extra

    def _final(self, mi: dict, finish: dict) -> Iterator[dict]:
        """The finish chunk (chat ``finish_reason``, ``matched_stop``, ``metadata``), then the usage
        chunk for ``stream_options.include_usage``; marks the generation ended."""
        reason, matched = _finish_to_openai(finish, self.n_calls > 0)
        self.ended = True
        yield self._chunk({}, finish_reason=reason, matched_stop=matched, metadata=self._metadata(mi))
        if self.include_usage:
            n_in, n_out = len(self.prompt), len(self.ids)
            yield {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                   "choices": [], "usage": {"prompt_tokens": n_in, "completion_tokens": n_out,
                                            "total_tokens": n_in + n_out, "reasoning_tokens": 0}}

    def _metadata(self, mi: dict) -> dict:
        """The ``metadata`` of the first and finish chunks: policy version and sampling parameters."""
        md = {"weight_version": mi.get("weight_version"), "sampling_params": self.used}
        for key in ("lora_name", "lora_sha256"):  # our engine: the adapter that served it, its content id
            if key in mi:
                md[key] = mi[key]
        return md

    def _chunk(self, delta: dict, **extra: Any) -> dict:
        """A ``chat.completion.chunk`` with one choice: ``logprobs``, ``finish_reason``,
        ``matched_stop`` and ``token_ids`` of ``extra`` go into the choice, the rest on top."""
        choice = {"index": 0, "delta": delta, "logprobs": extra.pop("logprobs", None),
                  "finish_reason": extra.pop("finish_reason", None)}
        for k in ("matched_stop", "token_ids"):
            if k in extra:
                choice[k] = extra.pop(k)
        out = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "choices": [choice]}
        out.update(extra)
        return out

    def _refused_fields(self, e: EngineError) -> str:
        """For the engine's 400 before any chunk: the chat fields whose ``sampling_params`` key its
        message names (``"field (sent as sampling_params.key)"``, comma-separated), else ``""``."""
        if e.status != 400 or not self.first:
            return ""
        return ", ".join(f"{field} (sent as sampling_params.{key})" for key, field in self.origin.items()
                         if key in e.message and key != field)

    async def _abort(self) -> None:
        """``/abort_request`` for the generation (SGLang would only abort ~2 s after a disconnect);
        a failure is logged, not raised: the caller is already leaving."""
        try:
            await asyncio.wait_for(self.client.abort_request(self.gen_rid), timeout=min(5.0, self.client.timeout_s))
        except (EngineError, asyncio.TimeoutError) as e:
            log.warning("could not abort generation %s: %s", self.gen_rid, e)


def chat_model_adapter(model: Any) -> tuple[Any, str | None]:
    """``(base, adapter)`` of a chat ``model``: SGLang's ``"<base>:<adapter>"`` is split at the
    first ``:`` (docs/sglang-api.md §6; an empty adapter part is none); ``(model, None)`` otherwise."""
    if not isinstance(model, str) or ":" not in model:
        return model, None
    base, adapter = model.split(":", 1)
    return base, adapter.strip() or None


def _lp_bytes(token_id: int, text: str, token_bytes: Callable[[int], bytes] | None) -> list[int] | None:
    """OpenAI ``bytes`` of one token: its raw bytes when a byte table is given; else the UTF-8 of
    its text unless that text holds a replacement character (half a character: unknown, None)."""
    if token_bytes is not None:
        try:
            return list(token_bytes(token_id))
        except KeyError:
            return None
    return None if "\ufffd" in text else list(text.encode("utf-8"))


def _chat_lp(entry: list, top: list | None, token_bytes: Callable[[int], bytes] | None = None) -> dict:
    """A ``/generate`` log-prob entry ``[lp, id, text]`` -> chat ``logprobs.content`` item."""
    s = entry[2] if len(entry) > 2 and entry[2] is not None else ""
    return {"token": s, "bytes": _lp_bytes(entry[1], s, token_bytes), "logprob": entry[0], "token_id": entry[1],
            "top_logprobs": [{"token": t[2] or "", "bytes": _lp_bytes(t[1], t[2] or "", token_bytes),
                              "logprob": t[0]} for t in (top or [])]}


# ---- chat fields on the /v1/tokenize + /generate path ------------------------------------------
#: chat field -> ``sampling_params`` key, as SGLang's chat path maps them (``to_sampling_params``);
#: derived from :data:`pipeline.engine_api.schema.CHAT_FIELDS` (table order: the first field for a key wins)
SAMPLING_FIELDS = {k: f.sampling_key for k, f in CHAT_FIELDS.items() if f.role == "sampling"}
#: chat fields that shape the prompt (sent to ``/v1/tokenize``) or the answer (handled here)
PROMPT_FIELDS = fields_with("prompt")
ANSWER_FIELDS = fields_with("answer")


def chat_tools(body: dict) -> list | None:
    """The tools a chat request makes available (None when ``tool_choice`` is ``none``)."""
    choice = body.get("tool_choice")
    if not body.get("tools") or choice == "none":
        return None
    return body["tools"]


def generate_path_refusal(body: dict) -> tuple[str, str] | None:
    """``(field, message)`` for the first chat field that the ``/v1/tokenize`` + ``/generate``
    path cannot serve as SGLang's chat path would, or None when it can serve every field.

    Refused: fields it does not know (it cannot tell what they would do), ``tool_choice``
    ``required`` / a named function (SGLang constrains decoding to the tool-call schema there),
    ``response_format`` types other than text / json_object / json_schema, ``n`` other than 1,
    ``stream_options.continuous_usage_stats``, and ``return_prompt_token_ids`` /
    ``return_meta_info`` (SGLang refuses them with ``stream``).
    """
    known = set(SAMPLING_FIELDS) | set(PROMPT_FIELDS) | set(ANSWER_FIELDS)
    for key in body:
        if key in known or body[key] is None:
            continue
        if key in fields_with("answer_no_stream"):
            if body[key]:
                return key, f"{key} is not supported with stream=true"
            continue
        return key, f"the chat field {key!r} cannot be served on the streamed path with token ids (this engine " \
                    "has no chat streaming with token ids, so the proxy streams /generate): send it without " \
                    "stream, or without it"
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto") and body.get("tools"):
        shown = choice if isinstance(choice, str) else "a named function"
        return "tool_choice", f"tool_choice {shown} needs the engine's constrained tool-call decoding, which the " \
                              "streamed path with token ids cannot apply: send it without stream"
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text", "json_object", "json_schema"):
        return "response_format", f"response_format {rf.get('type')!r} cannot be served on the streamed path " \
                                  "with token ids: send it without stream"
    if isinstance(rf, dict) and rf.get("type") == "json_schema" and not isinstance(
            (rf.get("json_schema") or {}).get("schema", rf.get("schema")), dict):
        return "response_format", "response_format json_schema needs json_schema.schema (an object)"
    if int(body.get("n") or 1) != 1:
        return "n", "n must be 1 on the streamed path with token ids"
    if (body.get("stream_options") or {}).get("continuous_usage_stats"):
        return "stream_options", "stream_options.continuous_usage_stats is not supported on the streamed path " \
                                 "with token ids"
    return None


def response_format_schema(rf: Any) -> str | None:
    """The JSON schema (a JSON string) a chat ``response_format`` constrains to, as SGLang's chat
    path maps it: json_object -> ``{"type": "object"}``, json_schema -> ``json_schema.schema``
    (or ``schema``); None for text or another type."""
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind == "json_schema":
        return orjson.dumps((rf.get("json_schema") or {}).get("schema", rf.get("schema"))).decode()
    return None


def chat_sampling_params(body: dict, defaults: dict | None = None) -> tuple[dict, dict]:
    """``/generate`` ``sampling_params`` for a chat body, as SGLang's chat path builds them.

    ``response_format`` json_object becomes the schema ``{"type": "object"}`` and json_schema its
    schema (a JSON string); ``max_completion_tokens`` wins over ``max_tokens``; ``defaults``
    (the model's generation_config values for :data:`pipeline.sampling.CHAT_DEFAULTED`) fill absent keys.
    Returns ``(sampling_params, {sampling key: chat field it came from})``.
    """
    sp: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for field_name, key in SAMPLING_FIELDS.items():
        v = body.get(field_name)
        if v is None or key in sp:
            continue
        if field_name == "response_format":
            v = response_format_schema(v)
            if v is None:
                continue
        elif field_name == "min_tokens" and not v:
            continue
        sp[key] = v
        origin[key] = field_name
    return with_generation_defaults(sp, defaults), origin
