"""``POST /v1/responses``: the OpenAI Responses API, translated to and from a chat request.

Request -> chat (:meth:`ResponsesDoor.translate`):

- ``instructions`` -> a leading ``system`` message (not carried over by ``previous_response_id``,
  as OpenAI rules); ``input``: a string -> one ``user`` message; a list of items: ``message``
  (roles ``user``/``assistant``/``system``/``developer``; content a string or ``input_text`` /
  ``output_text`` parts) -> that message; ``function_call`` -> an ``assistant`` message's
  ``tool_calls`` entry (``call_id`` is the tool call's id; calls that follow an assistant message
  join it, as the chat answer they came from had them); ``function_call_output`` -> a ``tool``
  message.
- ``previous_response_id``: the conversation of that response (its messages and output, kept in
  a bounded :class:`ResponseStore` of this proxy process) is put before ``input``, and its
  session is the request's session unless the request names one (``X-Session-Id`` or
  ``session_id``). An unknown, expired or ``store: false`` id -> 400 ``previous_response_not_found``;
  so is another tenant's response (the store is keyed by tenant and response id).
- function ``tools`` -> chat function tools; ``tool_choice`` ``none``/``auto``/``required`` or
  ``{"type": "function", "name"}``; ``max_output_tokens`` -> ``max_tokens``; ``temperature``,
  ``top_p``, ``parallel_tool_calls``, ``user`` as they are; ``text.format`` ``json_object`` /
  ``json_schema`` -> ``response_format``; ``stream`` -> a chat stream with usage.
- Accepted and not acted on: ``metadata`` (echoed), ``include``, ``truncation``,
  ``service_tier``, ``prompt_cache_key``, ``safety_identifier``, ``stream_options``,
  ``reasoning`` without an effort. Refused (400, naming the field): hosted tools (web search,
  file search, computer use, MCP ...), images/files/audio (text-only model), ``reasoning`` and
  ``item_reference`` items, ``background``, ``conversation``, ``prompt``, ``top_logprobs``,
  ``max_tool_calls``, any unknown field.

Chat -> response: the answer's content -> one ``message`` item (``output_text``), its tool calls
-> ``function_call`` items; ``finish_reason: length`` -> ``status: incomplete``
(``max_output_tokens``). Ids derive from the proxy's request id (``resp_<id>``,
``msg_<id>_<k>``, ``fc_<id>_<k>``). A stream is ``response.created``, ``response.in_progress``,
then per item ``response.output_item.added``, ``response.content_part.added`` /
``response.output_text.delta`` ... ``.done`` or ``response.function_call_arguments.delta`` /
``.done``, ``response.output_item.done``, and ``response.completed`` (or
``response.incomplete``) once the turn is recorded; a generation that fails mid-stream ends with
``error`` and ``response.failed``. Errors have OpenAI's shape ``{"error": {...}}``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import orjson

from pipeline.engine_api.render import TEXT_PARTS, content_text, part_text
from pipeline.proxy.doors import (Call, Door, DoorStream, Served, check_type, function_tools, refuse_unknown,
                                  session_fields, sse_event)
from pipeline.proxy.errors import ProxyError, bad_request

_KNOWN = frozenset(("model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature",
                    "top_p", "stream", "previous_response_id", "store", "parallel_tool_calls", "text", "user",
                    "metadata", "include", "truncation", "reasoning", "service_tier", "prompt_cache_key",
                    "safety_identifier", "stream_options", "background", "conversation", "prompt", "top_logprobs",
                    "max_tool_calls"))
_REFUSED = {"background": "background responses are not served: the proxy answers while the client waits",
            "conversation": "conversation objects are not kept: continue with previous_response_id",
            "prompt": "stored prompt templates are not kept: send instructions and input",
            "top_logprobs": "log-probs are recorded on the turn, not shown through /v1/responses",
            "max_tool_calls": "max_tool_calls is not enforced by the engine"}
_ROLES = ("user", "assistant", "system", "developer")
_HOSTED = "the proxy serves function tools only (the model runs no hosted tools)"


def _unsupported(message: str, param: str) -> ProxyError:
    return bad_request(message, param=param, code="unsupported_value")


# ---- the conversations kept for previous_response_id ------------------------------------------
class ResponseStore:
    """Response id -> ``(session id, messages before the answer, output items)``, bounded by memory.

    Entries are kept serialised (orjson bytes: the size that counts, and nobody can change them);
    the least recently used go first once ``max_bytes`` is exceeded. One store per proxy process:
    behind several proxy replicas a follow-up must reach the same replica (or send its full input).

    Args:
        max_bytes: the bound (0: nothing is kept).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._d: OrderedDict[Hashable, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def put(self, response_id: Hashable, session_id: str | None, messages: list, output: list) -> None:
        """Keep one response (an entry larger than the bound is not kept)."""
        data = orjson.dumps([session_id, messages, output])
        if len(data) > self.max_bytes:
            return
        old = self._d.pop(response_id, None)
        self.bytes += len(data) - (len(old) if old is not None else 0)
        self._d[response_id] = data
        while self.bytes > self.max_bytes:
            self.bytes -= len(self._d.popitem(last=False)[1])

    def get(self, response_id: Hashable) -> tuple[str | None, list, list] | None:
        """``(session id, messages, output items)`` of a kept response, or None."""
        data = self._d.get(response_id)
        if data is None:
            return None
        self._d.move_to_end(response_id)
        sid, messages, output = orjson.loads(data)
        return sid, messages, output


def _stored(tenant: str | None, response_id: str) -> tuple[str | None, str]:
    """The :class:`ResponseStore` key of a tenant's response, ``(tenant, id)``: a response is only
    continued by its own tenant, and no id a client sends can spell another tenant's key."""
    return tenant, response_id


# ---- request -> chat -------------------------------------------------------------------------
def _text(content: Any, where: str) -> str:
    """The text of a message item's ``content`` (a string, or text and refusal parts): checked
    (400 naming ``where`` for another part), then :func:`content_text` with a refusal read as
    the text it is."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            part = {"type": "text", "text": part["refusal"]}
        elif kind not in TEXT_PARTS or part_text(part) is None:
            raise _unsupported(f"{where}[{j}]: part type {str(kind)[:40]!r} is not supported (text-only model: "
                               f"{', '.join(TEXT_PARTS)})", f"{where}[{j}]")
        parts.append(part)
    return content_text(parts)


def _function_call(item: dict, where: str) -> dict:
    for k in ("call_id", "name"):
        if not isinstance(item.get(k), str) or not item[k]:
            raise bad_request(f"{where}.{k} (non-empty string) is required", param=f"{where}.{k}")
    args = item.get("arguments", "{}")
    if not isinstance(args, str):
        raise bad_request(f"{where}.arguments must be a JSON string", param=f"{where}.arguments")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": args}}


def input_messages(items: Any, param: str = "input") -> list[dict]:
    """Chat messages of a Responses ``input`` (a string or a list of items; see the module docstring).

    Raises:
        ProxyError: 400 naming the item, e.g. ``input[2].role``.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request(f"'{param}' must be a string or a non-empty list of items", param=param)
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}", param=f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = _function_call(item, where)
            if out and out[-1]["role"] == "assistant":  # the calls of one answer are one chat message
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise bad_request(f"{where}.call_id (non-empty string) is required", param=f"{where}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        else:
            raise _unsupported(f"{where}: item type {str(kind)[:40]!r} is not supported (message, function_call "
                               "and function_call_output are)", f"{where}.type")
    return out


def _tool_choice(tc: Any) -> Any:
    if tc is None or tc in ("none", "auto", "required"):
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}
    raise _unsupported("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                       "tool_choice")


def _text_format(text: Any) -> dict | None:
    fmt = check_type({"text": text}, "text", (dict,), "an object")
    fmt = (fmt or {}).get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if fmt.get(k) is not None}}
    raise bad_request("text.format must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                      param="text.format")


def _check_fields(body: dict) -> None:
    refuse_unknown(body, _KNOWN, "Responses API")
    for k, why in _REFUSED.items():
        if body.get(k) not in (None, False):
            raise _unsupported(f"'{k}' is not supported: {why}", k)
    reasoning = check_type(body, "reasoning", (dict,), "an object")
    if reasoning and (reasoning.get("effort") not in (None, "none") or reasoning.get("summary") is not None):
        raise _unsupported("'reasoning' is not supported: the served model does no separate reasoning", "reasoning")
    for k in ("model", "instructions", "previous_response_id", "user"):
        check_type(body, k, (str,), "a string")
    for k in ("stream", "store", "parallel_tool_calls"):
        check_type(body, k, (bool,), "a boolean")
    check_type(body, "metadata", (dict,), "an object")
    check_type(body, "include", (list,), "a list")
    mot = check_type(body, "max_output_tokens", (int,), "an integer")
    if mot is not None and mot < 1:
        raise bad_request(f"'max_output_tokens' must be at least 1, got {mot}", param="max_output_tokens")
    if body.get("input") is None:
        raise bad_request("'input' is required", param="input", code="missing_field")


# ---- chat -> response ------------------------------------------------------------------------
def _usage(u: Any) -> dict | None:
    if not isinstance(u, dict):
        return None
    p, c = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": c,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(item_id: str, tc: dict, status: str = "completed") -> dict:
    fn = tc.get("function") or {}
    return {"type": "function_call", "id": item_id, "call_id": tc.get("id") or item_id, "name": fn.get("name") or "",
            "arguments": fn.get("arguments") or "", "status": status}


def output_items(rid: str, content: Any, tool_calls: Any) -> list[dict]:
    """The ``output`` of a chat answer: its text as a message item (when there is text, or nothing
    else), then one ``function_call`` item per tool call."""
    out = []
    calls = [tc for tc in tool_calls or () if isinstance(tc, dict)]
    if content or not calls:
        out.append(_message_item(f"msg_{rid}_0", content or ""))
    out += [_call_item(f"fc_{rid}_{k}", tc) for k, tc in enumerate(calls)]
    return out


class ResponsesDoor(Door):
    """``POST /v1/responses`` (see the module docstring)."""

    api = "responses"
    id_prefix = "resp_"

    def __init__(self, app) -> None:
        super().__init__(app)
        self.store = ResponseStore(app.pc.responses_store_bytes)

    def translate(self, body: dict, headers: dict, tenant: str | None = None) -> Call:
        _check_fields(body)
        msgs = input_messages(body["input"])
        previous = None
        prev_id = body.get("previous_response_id")
        if prev_id is not None:
            prev = self.store.get(_stored(tenant, prev_id))  # another tenant's response is not found
            if prev is None:
                raise bad_request(f"previous response {prev_id[:80]!r} not found (unknown, stored with store: false, "
                                  "dropped from this proxy's bounded store, or answered by another replica)",
                                  param="previous_response_id", code="previous_response_not_found")
            sid, before, output = prev
            msgs = before + input_messages(output, "previous output") + msgs
            previous = sid  # the chat handler's session rule 1c (a client's own id still comes first)
        instructions = body.get("instructions")
        chat: dict[str, Any] = {"messages": ([{"role": "system", "content": instructions}] if instructions else [])
                                + msgs}
        tools = function_tools(body.get("tools"), "function", "parameters", _HOSTED)
        for src, dst, value in (("model", "model", body.get("model")), ("tools", "tools", tools),
                                ("tool_choice", "tool_choice", _tool_choice(body.get("tool_choice"))),
                                ("max_output_tokens", "max_tokens", body.get("max_output_tokens")),
                                ("temperature", "temperature", body.get("temperature")),
                                ("top_p", "top_p", body.get("top_p")),
                                ("parallel_tool_calls", "parallel_tool_calls", body.get("parallel_tool_calls")),
                                ("user", "user", body.get("user")),
                                ("text", "response_format", _text_format(body.get("text")))):
            if value is not None:
                chat[dst] = value
        stream = body.get("stream") is True
        if stream:
            chat.update(stream=True, stream_options={"include_usage": True})
        chat.update(session_fields(body))
        echo = {k: body.get(k) for k in ("instructions", "max_output_tokens", "model", "previous_response_id",
                                         "temperature", "top_p", "user")}
        echo.update(tools=body.get("tools") or [], tool_choice=body.get("tool_choice") or "auto",
                    parallel_tool_calls=body.get("parallel_tool_calls", True), metadata=body.get("metadata") or {},
                    store=body.get("store", True), text=body.get("text") or {"format": {"type": "text"}},
                    truncation=body.get("truncation") or "disabled")
        return Call(chat, stream, {"echo": echo, "conversation": msgs, "created": int(time.time())},
                    previous_session=previous)

    def error_body(self, status: int, err: dict) -> bytes:
        return orjson.dumps({"error": {k: err.get(k) for k in ("message", "type", "param", "code")}})

    def response(self, call: Call, served: Served, status: str, output: list, usage: dict | None,
                 model: str | None = None, error: dict | None = None) -> dict:
        """The Responses ``response`` object."""
        echo = call.ctx["echo"]
        return {"id": f"resp_{served.request_id}", "object": "response", "created_at": call.ctx["created"],
                "status": status, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                **echo, "model": echo["model"] or model or "", "output": output, "usage": usage,
                "reasoning": {"effort": None, "summary": None}}

    def keep(self, call: Call, served: Served, output: list) -> None:
        """Keep a finished response for ``previous_response_id`` (unless ``store: false``)."""
        if call.ctx["echo"]["store"] is not False and served.request_id:
            self.store.put(_stored(call.tenant, f"resp_{served.request_id}"), served.session_id,
                           call.ctx["conversation"], output)

    def answer(self, call: Call, resp: dict, served: Served) -> bytes:
        choice = resp["choices"][0]
        msg = choice.get("message") or {}
        output = output_items(served.request_id, msg.get("content"), msg.get("tool_calls"))
        status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
        self.keep(call, served, output)
        return orjson.dumps(self.response(call, served, status, output, _usage(resp.get("usage")), resp.get("model")))

    def stream(self, call: Call, served: Served) -> DoorStream:
        return _ResponsesStream(self, call, served)


class _ResponsesStream(DoorStream):
    """Chat chunks -> Responses streaming events (see the module docstring)."""

    def __init__(self, door: ResponsesDoor, call: Call, served: Served) -> None:
        self.door, self.call, self.served = door, call, served
        self.seq = 0
        self.items: list[dict] = []  # every output item so far, in output order
        self.open: dict | None = None  # the item being streamed
        self.tool_index: Any = None  # the chat tool-call index of the open function_call item
        self.finish: str | None = None
        self.usage: dict | None = None
        self.model: str | None = None

    def _ev(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return sse_event(kind, {"type": kind, "sequence_number": self.seq - 1, **fields})

    def _resp(self, status: str, error: dict | None = None) -> dict:
        return self.door.response(self.call, self.served, status, self.items if status != "in_progress" else [],
                                  self.usage, self.model, error)

    def start(self) -> bytes:
        r = self._resp("in_progress")
        return self._ev("response.created", response=r) + self._ev("response.in_progress", response=r)

    def _close(self) -> bytes:
        item, self.open = self.open, None
        if item is None:
            return b""
        idx = self.items.index(item)
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            return (self._ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                             text=part["text"], logprobs=[])
                    + self._ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                               part=part)
                    + self._ev("response.output_item.done", output_index=idx, item=item))
        return (self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                         name=item["name"], arguments=item["arguments"])
                + self._ev("response.output_item.done", output_index=idx, item=item))

    def _text(self, delta: str) -> bytes:
        out = b""
        if self.open is None or self.open["type"] != "message":
            out += self._close()
            self.open = _message_item(f"msg_{self.served.request_id}_{len(self.items)}", "", "in_progress")
            part = self.open["content"][0]
            self.items.append(self.open)
            idx = len(self.items) - 1
            empty = dict(self.open, content=[])
            out += (self._ev("response.output_item.added", output_index=idx, item=empty)
                    + self._ev("response.content_part.added", item_id=self.open["id"], output_index=idx,
                               content_index=0, part=dict(part)))
        self.open["content"][0]["text"] += delta
        return out + self._ev("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                              content_index=0, delta=delta, logprobs=[])

    def _tool(self, tc: dict) -> bytes:
        out = b""
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
        if self.open is None or self.open["type"] != "function_call" or tc.get("index", 0) != self.tool_index:
            out += self._close()
            self.tool_index = tc.get("index", 0)
            self.open = _call_item(f"fc_{self.served.request_id}_{len(self.items)}",
                                   {"id": tc.get("id"), "function": {"name": fn.get("name")}}, "in_progress")
            self.items.append(self.open)
            out += self._ev("response.output_item.added", output_index=len(self.items) - 1, item=dict(self.open))
        args = fn.get("arguments") or ""
        if args:
            self.open["arguments"] += args
            out += self._ev("response.function_call_arguments.delta", item_id=self.open["id"],
                            output_index=len(self.items) - 1, delta=args)
        return out

    def chunk(self, obj: dict) -> bytes:
        self.model = self.model or obj.get("model")
        if obj.get("usage") is not None:
            self.usage = _usage(obj["usage"])
        out = b""
        for c in obj.get("choices") or ():
            d = c.get("delta") if isinstance(c, dict) else None
            if isinstance(d, dict) and d.get("content"):
                out += self._text(d["content"])
            for tc in (d or {}).get("tool_calls") or ():
                if isinstance(tc, dict):
                    out += self._tool(tc)
            if isinstance(c, dict) and c.get("finish_reason") is not None:
                self.finish = c["finish_reason"]
        return out

    def done(self) -> bytes:
        out = self._close()
        if not self.items:  # an empty answer is still one (empty) message
            out += self._text("") + self._close()
        status = "incomplete" if self.finish == "length" else "completed"
        self.door.keep(self.call, self.served, self.items)
        return out + self._ev(f"response.{status}", response=self._resp(status))

    def fail(self, err: dict) -> bytes:
        code, message = err.get("code"), str(err.get("message") or "the generation failed")
        return (self._ev("error", code=None if code is None else str(code), message=message, param=err.get("param"))
                + self._ev("response.failed", response=self._resp("failed", {"code": str(code or "server_error"),
                                                                             "message": message})))


__all__ = ["ResponsesDoor", "ResponseStore", "input_messages", "output_items"]
