"""Validation of ``POST /v1/chat/completions`` bodies and of the session metadata.

:data:`CHAT_FIELDS` lists every chat field the proxy knows, each with its type/range check;
unknown fields are forwarded untouched. Every failure raises :class:`pipeline.proxy.errors.ProxyError` (400) naming
the field, e.g. ``messages[2].role: unknown role 'robot'``.

Session metadata comes from the headers ``X-Session-Id``, ``X-Turn-Type`` (``main``/``side``)
and ``X-Session-Done`` (``true``/``false``, also ``1``/``0``/``yes``/``no``), or from the body
fields ``session_id``, ``turn_type`` and ``session_done`` (for clients that can only set
``extra_body``). A header wins over a body field; body fields are always removed before the
request is forwarded.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from pipeline.proxy.errors import ProxyError, bad_request

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
SESSION_FIELDS = ("session_id", "turn_type", "session_done")
#: request fields recorded as the turn's sampling parameters
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids",
                 "seed", "n", "logit_bias", "min_tokens", "ignore_eos", "tool_choice", "response_format",
                 "parallel_tool_calls", "regex", "ebnf", "json_schema", "structural_tag")
_SESSION_ID = re.compile(r"^[\x21-\x7e]{1,256}$")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(slots=True)
class SessionMeta:
    """Who a request belongs to.

    Attributes:
        session_id: the client's id, or None when it sent none.
        turn_type: ``main`` (part of the trajectory) or ``side`` (auxiliary call, no turn index).
        done: the client says this request ends the session.
    """

    session_id: str | None
    turn_type: str
    done: bool


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and (not isinstance(v, float) or math.isfinite(v)))


def _parse_bool(raw: Any, name: str) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE:
        return True
    if isinstance(raw, str) and raw.strip().lower() in _FALSE:
        return False
    raise bad_request(f"{name} must be true or false, got {str(raw)[:40]!r}", param=name)


def session_meta(headers: dict[bytes, bytes], body: dict, default_turn_type: str) -> SessionMeta:
    """Read (and strip from ``body``) the session metadata.

    Args:
        headers: lower-cased raw header names -> raw values.
        body: the parsed request; ``session_id``/``turn_type``/``session_done`` are popped.
        default_turn_type: used when a session id is given without a turn type.
    Raises:
        ProxyError: 400 on an unusable session id, turn type or done flag.
    """
    b_sid = body.pop("session_id", None)
    b_type = body.pop("turn_type", None)
    b_done = body.pop("session_done", None)
    h = headers.get(b"x-session-id")
    if h is not None:
        sid: Any = h.decode("latin-1").strip()
    else:
        sid = b_sid
    if sid is not None:
        if not isinstance(sid, str) or not _SESSION_ID.match(sid):
            raise bad_request("session id (X-Session-Id) must be 1-256 printable ASCII characters without spaces",
                              param="X-Session-Id", code="invalid_session_id")
    h = headers.get(b"x-turn-type")
    tt: Any = h.decode("latin-1").strip().lower() if h is not None else b_type
    if tt is None or tt == "":
        tt = default_turn_type
    if tt not in ("main", "side"):
        raise bad_request(f"X-Turn-Type must be 'main' or 'side', got {str(tt)[:40]!r}", param="X-Turn-Type",
                          code="invalid_turn_type")
    h = headers.get(b"x-session-done")
    raw_done = h.decode("latin-1") if h is not None else b_done
    done = False if raw_done is None else _parse_bool(raw_done, "X-Session-Done")
    return SessionMeta(sid, tt, done)


def _check_content(i: int, m: dict) -> None:
    role = m["role"]
    c = m.get("content")
    where = f"messages[{i}].content"
    if c is None:
        if role in ("assistant", "function"):
            return
        raise bad_request(f"{where} is required for role '{role}'", param=where)
    if isinstance(c, str):
        return
    if isinstance(c, list):
        for j, part in enumerate(c):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_request(f"{where}[{j}] must be an object with a string 'type'", param=f"{where}[{j}]")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise bad_request(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
        return
    raise bad_request(f"{where} must be a string, a list of content parts or null, got {type(c).__name__}",
                      param=where)


def _check_tool_calls(i: int, calls: Any) -> None:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list", param=where)
    for j, tc in enumerate(calls):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}[{j}] must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
                              param=f"{where}[{j}]")
        if "arguments" in fn and not isinstance(fn["arguments"], str):
            raise bad_request(f"{where}[{j}].function.arguments must be a JSON string",
                              param=f"{where}[{j}].function.arguments")


def _check_messages(msgs: Any) -> None:
    if msgs is None:
        raise bad_request("'messages' is required", param="messages", code="missing_field")
    if not isinstance(msgs, list):
        raise bad_request(f"'messages' must be a list, got {type(msgs).__name__}", param="messages")
    if not msgs:
        raise bad_request("'messages' must not be empty", param="messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object, got {type(m).__name__}", param=f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_request(f"messages[{i}].role is required and must be a string", param=f"messages[{i}].role")
        if role not in ROLES:
            raise bad_request(f"messages[{i}].role: unknown role {role[:40]!r} (expected one of {', '.join(ROLES)})",
                              param=f"messages[{i}].role", code="invalid_role")
        _check_content(i, m)
        if role == "assistant" and m.get("tool_calls") is not None:
            _check_tool_calls(i, m["tool_calls"])
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise bad_request(f"messages[{i}].tool_call_id (string) is required for role 'tool'",
                              param=f"messages[{i}].tool_call_id")
        if "name" in m and m["name"] is not None and not isinstance(m["name"], str):
            raise bad_request(f"messages[{i}].name must be a string", param=f"messages[{i}].name")


def _check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", param="tools")
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{j}] must be {{'type': 'function', 'function': {{...}}}}", param=f"tools[{j}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{j}].function.name must be a non-empty string", param=f"tools[{j}].function.name")
        if "parameters" in fn and fn["parameters"] is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"tools[{j}].function.parameters must be a JSON schema object",
                              param=f"tools[{j}].function.parameters")


def _check_tool_choice(tc: Any) -> None:
    if isinstance(tc, str):
        if tc not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a function, got {tc[:40]!r}",
                              param="tool_choice")
        return
    if isinstance(tc, dict) and isinstance(tc.get("function"), dict) and isinstance(tc["function"].get("name"), str):
        return
    raise bad_request("tool_choice must be a string or {'type': 'function', 'function': {'name': ...}}",
                      param="tool_choice")


def _range(body: dict, key: str, lo: float, hi: float, integer: bool = False, lo_open: bool = False) -> None:
    v = body.get(key)
    if v is None:
        return
    if integer and not _is_int(v):
        raise bad_request(f"'{key}' must be an integer, got {type(v).__name__}", param=key)
    if not _is_num(v):
        raise bad_request(f"'{key}' must be a number, got {type(v).__name__}", param=key)
    if v < lo or v > hi or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise bad_request(f"'{key}' must be in {left}{lo}, {hi}], got {v}", param=key)


def _bool(body: dict, key: str) -> None:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise bad_request(f"'{key}' must be a boolean, got {type(v).__name__}", param=key)


def _ranged(lo: float, hi: float, integer: bool = False, lo_open: bool = False) -> Callable[[dict, str], None]:
    return lambda body, key: _range(body, key, lo, hi, integer, lo_open)


def _string(body: dict, key: str) -> None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise bad_request(f"'{key}' must be a string, got {type(v).__name__}", param=key)


def _strings(body: dict, key: str) -> None:
    v = body.get(key)
    if v is not None and not isinstance(v, str) and not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        raise bad_request(f"'{key}' must be a string or a list of strings", param=key)


def _ints(body: dict, key: str) -> None:
    v = body.get(key)
    if v is not None and not (isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v)):
        raise bad_request(f"'{key}' must be a list of token ids (integers >= 0)", param=key)


def _object(body: dict, key: str) -> None:
    v = body.get(key)
    if v is not None and not isinstance(v, dict):
        raise bad_request(f"'{key}' must be an object, got {type(v).__name__}", param=key)


def _check_n(body: dict, key: str) -> None:
    n = body.get(key)
    if n is not None:
        if not _is_int(n):
            raise bad_request(f"'n' must be an integer, got {type(n).__name__}", param="n")
        if n != 1:
            raise bad_request("'n' must be 1 through the proxy (each recorded turn is one sample)", param="n",
                              code="unsupported_value")


def _check_stream_options(body: dict, key: str) -> None:
    so = body.get(key)
    if so is None:
        return
    if not isinstance(so, dict):
        raise bad_request("'stream_options' must be an object", param="stream_options")
    for k in ("include_usage", "continuous_usage_stats"):
        if so.get(k) is not None and not isinstance(so[k], bool):
            raise bad_request(f"'stream_options.{k}' must be a boolean", param=f"stream_options.{k}")


def _check_logit_bias(body: dict, key: str) -> None:
    lb = body.get(key)
    if lb is None:
        return
    if not isinstance(lb, dict) or not all(isinstance(k, str) and k.lstrip("-").isdigit() and _is_num(v)
                                           for k, v in lb.items()):
        raise bad_request("'logit_bias' must map token ids (as strings) to numbers", param="logit_bias")


def _check_response_format(body: dict, key: str) -> None:
    rf = body.get(key)
    if rf is not None and not (isinstance(rf, dict) and isinstance(rf.get("type"), str)):
        raise bad_request("'response_format' must be an object with a string 'type'", param="response_format")


def _optional(check: Callable[[Any], None]) -> Callable[[dict, str], None]:
    return lambda body, key: None if body.get(key) is None else check(body[key])


#: Every chat-completion field the proxy knows (OpenAI's and the SGLang extensions the engines
#: share), each with its check. A known field is forwarded to the engine (the streamed path to an
#: engine without chat token-id streaming serves each as the engine's chat path would, or refuses
#: it naming it: :func:`pipeline.client.generate_path_refusal`). An unknown field is forwarded
#: untouched. The session fields (:data:`SESSION_FIELDS`) are the proxy's own and never forwarded.
CHAT_FIELDS: dict[str, Callable[[dict, str], None]] = {
    "model": _string,
    "messages": lambda body, key: _check_messages(body.get(key)),
    "stream": _bool,
    "stream_options": _check_stream_options,
    "logprobs": _bool,
    "top_logprobs": _ranged(0, 20, integer=True),
    "temperature": _ranged(0.0, 2.0),
    "top_p": _ranged(0.0, 1.0, lo_open=True),
    "top_k": _ranged(-1, 1 << 30, integer=True),
    "min_p": _ranged(0.0, 1.0),
    "presence_penalty": _ranged(-2.0, 2.0),
    "frequency_penalty": _ranged(-2.0, 2.0),
    "repetition_penalty": _ranged(0.0, 2.0, lo_open=True),
    "max_tokens": _ranged(1, 1 << 30, integer=True),
    "max_completion_tokens": _ranged(1, 1 << 30, integer=True),
    "min_tokens": _ranged(0, 1 << 30, integer=True),
    "seed": _ranged(-(1 << 63), (1 << 64) - 1, integer=True),
    "n": _check_n,
    "stop": _strings,
    "stop_token_ids": _ints,
    "stop_regex": _strings,
    "ignore_eos": _bool,
    "no_stop_trim": _bool,
    "skip_special_tokens": _bool,
    "logit_bias": _check_logit_bias,
    "tools": _optional(_check_tools),
    "tool_choice": _optional(_check_tool_choice),
    "parallel_tool_calls": _bool,
    "response_format": _check_response_format,
    "regex": _string,
    "ebnf": _string,
    "user": _string,
    "continue_final_message": _bool,
    "chat_template_kwargs": _object,
    "input_ids": _ints,
    "rid": _string,
    "return_token_ids": _bool,
    "return_prompt_token_ids": _bool,
    "return_meta_info": _bool,
}


def check_request(body: Any) -> None:
    """Validate a parsed chat-completion request in place (nothing is changed): every field of
    :data:`CHAT_FIELDS` that is present.

    Raises:
        ProxyError: 400 with the offending field in ``param``.
    """
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    for key, check in CHAT_FIELDS.items():
        check(body, key)


def content_type_ok(value: bytes | None) -> bool:
    """True for a missing Content-Type or any ``application/json`` variant."""
    if value is None:
        return True
    v = value.split(b";", 1)[0].strip().lower()
    return v in (b"application/json", b"") or v.endswith(b"+json")


__all__ = ["SessionMeta", "session_meta", "check_request", "content_type_ok", "ProxyError", "SAMPLING_KEYS", "CHAT_FIELDS",
           "SESSION_FIELDS", "ROLES"]
