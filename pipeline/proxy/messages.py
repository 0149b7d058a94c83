"""``POST /v1/messages``: the Anthropic Messages API, translated to and from a chat request.

Request -> chat (:meth:`MessagesDoor.translate`):

- ``system`` (a string or text blocks) -> a leading ``system`` message; each message (``user`` /
  ``assistant``, content a string or blocks): ``text`` blocks -> the message's text;
  ``tool_use`` blocks -> the assistant message's ``tool_calls`` (the block's ``id``, ``name``,
  ``input`` as JSON arguments); ``tool_result`` blocks -> ``tool`` messages (in order, before
  the user's text, as Anthropic requires them first), their content a string or text blocks.
  ``cache_control`` is ignored; ``is_error`` is not represented (chat has no such field). A
  trailing assistant message is a prefill: ``continue_final_message`` (the answer continues it).
- ``tools`` (``name``, ``description``, ``input_schema``) -> chat function tools;
  ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` -> ``auto`` / ``required`` / the
  named function / ``none``, ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``;
  ``max_tokens`` (required) -> ``max_tokens``; ``stop_sequences`` -> ``stop``;
  ``temperature`` (0-1), ``top_p``, ``top_k`` as they are; ``metadata.user_id`` -> ``user``;
  ``output_config.format`` (``json_schema``) -> ``response_format``; ``stream`` -> a chat stream
  with usage. Accepted and not acted on: ``output_config.effort``, ``cache_control``,
  ``service_tier``, ``speed``, ``inference_geo``, ``diagnostics``, ``user_profile_id``,
  ``workspace_id``.
- Headers: ``x-api-key`` is the API key (as ``Authorization: Bearer``); ``anthropic-version``,
  when sent, must be a date (``2023-06-01``); ``anthropic-beta`` is ignored.
- Refused (400, naming the field): images, documents and other non-text blocks (text-only
  model), ``thinking`` / ``redacted_thinking`` blocks and ``thinking`` enabled (the model does
  no separate reasoning), server tools (web search, bash, text editor ...), ``container``,
  unknown fields.

Chat -> message: the answer's text -> a ``text`` block (when there is text, or nothing else), its
tool calls -> ``tool_use`` blocks (``input``: the arguments object); ``stop_reason``:
``tool_calls`` -> ``tool_use``, ``length`` -> ``max_tokens``, a stop from ``stop_sequences`` ->
``stop_sequence`` (named in ``stop_sequence``), otherwise ``end_turn``. The id is ``msg_<request
id>``. A stream is ``message_start``, then per block ``content_block_start``,
``content_block_delta`` (``text_delta`` / ``input_json_delta``), ``content_block_stop``, then
``message_delta`` (stop reason, usage) and ``message_stop`` once the turn is recorded; a
generation that fails mid-stream ends with an ``error`` event. Errors have Anthropic's shape
``{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}``.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from pipeline.engine_api.render import content_text
from pipeline.proxy.doors import (Call, Door, DoorStream, Served, check_type, function_tools, json_object,
                                  refuse_unknown, session_fields, sse_event)
from pipeline.proxy.errors import ProxyError, bad_request

_KNOWN = frozenset(("model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p",
                    "top_k", "tools", "tool_choice", "metadata", "thinking", "output_config", "container",
                    "service_tier", "cache_control", "inference_geo", "speed", "diagnostics", "user_profile_id",
                    "workspace_id"))
_VERSION = re.compile(rb"^\d{4}-\d{2}-\d{2}$")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}
_STOP = {"tool_calls": "tool_use", "length": "max_tokens"}


def _unsupported(message: str, param: str) -> ProxyError:
    return bad_request(message, param=param, code="unsupported_value")


def error_type(status: int) -> str:
    """Anthropic's error ``type`` of an HTTP status."""
    return _ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


# ---- request -> chat -------------------------------------------------------------------------
def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks", param=where)
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise bad_request(f"{where}[{j}] must be a block with a string 'type'", param=f"{where}[{j}]")
        if b["type"] == "text" and not isinstance(b.get("text"), str):
            raise bad_request(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
    return content


def _text_of(content: Any, where: str) -> str:
    """The text of a string or of text-only blocks (``system``, ``tool_result`` content): checked
    (400 naming ``where`` for another block type), then :func:`content_text`."""
    blocks = _blocks(content, where)
    for j, b in enumerate(blocks):
        if b["type"] != "text":
            raise _unsupported(f"{where}[{j}]: block type {b['type'][:40]!r} is not supported here (text only: "
                               "text-only model)", f"{where}[{j}].type")
    return content_text(blocks)


def _user(blocks: list[dict], where: str) -> list[dict]:
    tools, text = [], []
    for j, b in enumerate(blocks):
        if b["type"] == "text":
            text.append(b["text"])
        elif b["type"] == "tool_result":
            if not isinstance(b.get("tool_use_id"), str) or not b["tool_use_id"]:
                raise bad_request(f"{where}[{j}].tool_use_id (string) is required", param=f"{where}[{j}].tool_use_id")
            c = b.get("content")
            tools.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                          "content": "" if c is None else _text_of(c, f"{where}[{j}].content")})
        else:
            raise _unsupported(f"{where}[{j}]: block type {b['type'][:40]!r} is not supported in a user message "
                               "(text and tool_result are: text-only model)", f"{where}[{j}].type")
    return tools + ([{"role": "user", "content": "".join(text)}] if text or not tools else [])


def _assistant(blocks: list[dict], where: str) -> dict:
    text, calls = [], []
    for j, b in enumerate(blocks):
        if b["type"] == "text":
            text.append(b["text"])
        elif b["type"] == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise bad_request(f"{where}[{j}]: tool_use needs a string 'id' and 'name'", param=f"{where}[{j}]")
            inp = b.get("input", {})
            if not isinstance(inp, dict):
                raise bad_request(f"{where}[{j}].input must be an object", param=f"{where}[{j}].input")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": orjson.dumps(inp).decode()}})
        else:
            raise _unsupported(f"{where}[{j}]: block type {b['type'][:40]!r} is not supported in an assistant "
                               "message (text and tool_use are; the model does no separate reasoning)",
                               f"{where}[{j}].type")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def chat_messages(system: Any, messages: Any) -> list[dict]:
    """Chat messages of an Anthropic ``system`` and ``messages`` (see the module docstring).

    Raises:
        ProxyError: 400 naming the block, e.g. ``messages[1].content[0].type``.
    """
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required and must be a non-empty list", param="messages")
    out = [{"role": "system", "content": _text_of(system, "system")}] if system is not None else []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be 'user' or 'assistant'", param=f"{where}.role")
        blocks = _blocks(m.get("content"), f"{where}.content")
        if m["role"] == "user":
            out += _user(blocks, f"{where}.content")
        else:
            out.append(_assistant(blocks, f"{where}.content"))
    return out


def _tool_choice(tc: Any, chat: dict) -> None:
    if tc is None:
        return
    kind = tc.get("type") if isinstance(tc, dict) else None
    if kind not in ("auto", "any", "tool", "none") or (kind == "tool" and not isinstance(tc.get("name"), str)):
        raise bad_request("tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
                          param="tool_choice")
    chat["tool_choice"] = ({"type": "function", "function": {"name": tc["name"]}} if kind == "tool" else
                           {"any": "required"}.get(kind, kind))
    if tc.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def _check_fields(body: dict) -> None:
    refuse_unknown(body, _KNOWN, "Messages API")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise bad_request("'model' (string) is required", param="model", code="missing_field")
    mt = body.get("max_tokens")
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise bad_request("'max_tokens' (an integer >= 1) is required", param="max_tokens", code="missing_field")
    t = check_type(body, "temperature", (int, float), "a number")
    if t is not None and not 0 <= t <= 1:
        raise bad_request(f"'temperature' must be in [0, 1], got {t}", param="temperature")
    check_type(body, "stream", (bool,), "a boolean")
    stops = check_type(body, "stop_sequences", (list,), "a list of strings")
    if stops is not None and not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop_sequences' must be a list of strings", param="stop_sequences")
    thinking = check_type(body, "thinking", (dict,), "an object")
    if thinking and thinking.get("type") != "disabled":
        raise _unsupported("'thinking' is not supported: the served model does no separate reasoning", "thinking")
    if body.get("container") is not None:
        raise _unsupported("'container' is not supported: the proxy runs no code-execution containers", "container")
    md = check_type(body, "metadata", (dict,), "an object") or {}
    check_type(md, "user_id", (str,), "a string", "metadata.user_id")


# ---- chat -> message -------------------------------------------------------------------------
def stop_reason(finish: Any, matched: Any, stops: list | None) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a chat ``finish_reason`` and ``matched_stop``."""
    if finish == "stop" and isinstance(matched, str) and matched in (stops or ()):
        return "stop_sequence", matched
    return _STOP.get(finish, "end_turn"), None


def content_blocks(content: Any, tool_calls: Any) -> list[dict]:
    """The ``content`` of a chat answer: a text block (when there is text, or nothing else), then
    one ``tool_use`` block per tool call."""
    calls = [tc for tc in tool_calls or () if isinstance(tc, dict)]
    out = [{"type": "text", "text": content or ""}] if content or not calls else []
    for tc in calls:
        fn = tc.get("function") or {}
        out.append({"type": "tool_use", "id": tc.get("id") or "", "name": fn.get("name") or "",
                    "input": json_object(fn.get("arguments"))})
    return out


def _usage(u: Any) -> dict:
    u = u if isinstance(u, dict) else {}
    return {"input_tokens": int(u.get("prompt_tokens") or 0), "output_tokens": int(u.get("completion_tokens") or 0)}


class MessagesDoor(Door):
    """``POST /v1/messages`` (see the module docstring)."""

    api = "messages"
    id_prefix = "msg_"

    def auth_headers(self, headers: dict) -> None:
        key = headers.get(b"x-api-key")
        if key is not None and b"authorization" not in headers:
            headers[b"authorization"] = b"Bearer " + key.strip()
        version = headers.get(b"anthropic-version")
        if version is not None and not _VERSION.match(version.strip()):
            raise bad_request("anthropic-version must be a date such as 2023-06-01", param="anthropic-version")

    def translate(self, body: dict, headers: dict, tenant: str | None = None) -> Call:
        _check_fields(body)
        chat: dict[str, Any] = {"model": body["model"], "max_tokens": body["max_tokens"],
                                "messages": chat_messages(body.get("system"), body.get("messages"))}
        last = chat["messages"][-1]
        if last["role"] == "assistant" and not last.get("tool_calls"):  # a prefill: the answer continues it
            chat["continue_final_message"] = True
        tools = function_tools(body.get("tools"), "custom", "input_schema", "the proxy serves client tools only (name, "
                               "description, input_schema)", default_kind="custom", schema_required=True)
        if tools:
            chat["tools"] = tools
        _tool_choice(body.get("tool_choice"), chat)
        for src, dst in (("stop_sequences", "stop"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("top_k", "top_k")):
            if body.get(src) is not None:
                chat[dst] = body[src]
        fmt = (check_type(body, "output_config", (dict,), "an object") or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise bad_request("output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                                  param="output_config.format")
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": fmt["schema"]}}
        user = (body.get("metadata") or {}).get("user_id")
        if user is not None:
            chat["user"] = user
        stream = body.get("stream") is True
        if stream:
            chat.update(stream=True, stream_options={"include_usage": True})
        chat.update(session_fields(body))
        return Call(chat, stream, {"model": body["model"], "stops": body.get("stop_sequences")})

    def error_body(self, status: int, err: dict) -> bytes:
        return orjson.dumps({"type": "error", "error": {"type": error_type(status),
                                                        "message": str(err.get("message") or f"HTTP {status}")}})

    def answer(self, call: Call, resp: dict, served: Served) -> bytes:
        choice = resp["choices"][0]
        msg = choice.get("message") or {}
        reason, seq = stop_reason(choice.get("finish_reason"), choice.get("matched_stop"), call.ctx["stops"])
        return orjson.dumps({"id": f"msg_{served.request_id}", "type": "message", "role": "assistant",
                             "model": call.ctx["model"], "content": content_blocks(msg.get("content"),
                                                                                    msg.get("tool_calls")),
                             "stop_reason": reason, "stop_sequence": seq, "usage": _usage(resp.get("usage"))})

    def stream(self, call: Call, served: Served) -> DoorStream:
        return _MessagesStream(call, served)


class _MessagesStream(DoorStream):
    """Chat chunks -> Messages streaming events (see the module docstring)."""

    def __init__(self, call: Call, served: Served) -> None:
        self.call, self.served = call, served
        self.index = -1  # the open content block's index
        self.kind: str | None = None  # its type (text / tool_use), None when none is open
        self.tool_index: Any = None
        self.finish: Any = None
        self.matched: Any = None
        self.usage = _usage(None)

    def start(self) -> bytes:
        msg = {"id": f"msg_{self.served.request_id}", "type": "message", "role": "assistant",
               "model": self.call.ctx["model"], "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": self.usage}
        return sse_event("message_start", {"type": "message_start", "message": msg})

    def _close(self) -> bytes:
        if self.kind is None:
            return b""
        self.kind = None
        return sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _open(self, block: dict) -> bytes:
        out = self._close()
        self.index += 1
        self.kind = block["type"]
        return out + sse_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                       "content_block": block})

    def _delta(self, delta: dict) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def chunk(self, obj: dict) -> bytes:
        if obj.get("usage") is not None:
            self.usage = _usage(obj["usage"])
        out = b""
        for c in obj.get("choices") or ():
            if not isinstance(c, dict):
                continue
            d = c.get("delta") if isinstance(c.get("delta"), dict) else {}
            if d.get("content"):
                if self.kind != "text":
                    out += self._open({"type": "text", "text": ""})
                out += self._delta({"type": "text_delta", "text": d["content"]})
            for tc in d.get("tool_calls") or ():
                if not isinstance(tc, dict):
                    continue
                fn = tc.get("function") if isinstance(tc.get("function"), dict) else {}
                if self.kind != "tool_use" or tc.get("index", 0) != self.tool_index:
                    self.tool_index = tc.get("index", 0)
                    out += self._open({"type": "tool_use", "id": tc.get("id") or "", "name": fn.get("name") or "",
                                       "input": {}})
                if fn.get("arguments"):
                    out += self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
            if c.get("finish_reason") is not None:
                self.finish, self.matched = c["finish_reason"], c.get("matched_stop")
        return out

    def done(self) -> bytes:
        out = self._open({"type": "text", "text": ""}) if self.index < 0 else b""  # never an empty content list
        reason, seq = stop_reason(self.finish, self.matched, self.call.ctx["stops"])
        return (out + self._close()
                + sse_event("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": reason, "stop_sequence": seq},
                                              "usage": self.usage})
                + sse_event("message_stop", {"type": "message_stop"}))

    def fail(self, err: dict) -> bytes:
        code = err.get("code")
        status = 503 if code == "generation_aborted" else 502
        return sse_event("error", {"type": "error", "error": {"type": error_type(status),
                                                              "message": str(err.get("message") or "failed")}})


__all__ = ["MessagesDoor", "chat_messages", "content_blocks", "error_type", "stop_reason"]
