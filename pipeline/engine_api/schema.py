"""The chat-completion request body (``POST /v1/chat/completions``): one table of its fields.

:data:`CHAT_FIELDS` is the one list of the chat fields the package knows (OpenAI's and the
SGLang extensions the engines share), each with

- ``check``: its type/range check (:func:`check_chat_body` runs them all; a failure raises
  :class:`ChatBodyError` naming the field, e.g. ``messages[2].role: unknown role 'robot'``);
- ``role``: ``sampling`` (becomes a ``sampling_params`` key on the ``/generate`` path),
  ``prompt`` (shapes the prompt: sent to ``/v1/tokenize``), ``answer`` (shapes the answer) or
  ``answer_no_stream`` (an answer extra that SGLang refuses with ``stream: true``);
- ``sampling_key``: the ``sampling_params`` key of a sampling field, as SGLang's chat path maps
  it (``to_sampling_params``; the first field of the table wins where two map to one key:
  ``max_completion_tokens`` over ``max_tokens``);
- ``recorded``: kept as the turn's sampling parameters by the proxy.

Derived from it: the proxy's validation (:mod:`pipeline.proxy.validate`), the client's mapping
of chat fields onto ``/generate`` (:mod:`pipeline.engine_api.client`), the engine's request model
(:class:`pipeline.engine.protocol.ChatBody` types and defaults exactly these fields).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from pipeline.errors import PipelineError

ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ChatBodyError(PipelineError, ValueError):
    """A chat field fails its check.

    Attributes:
        param: the offending field, e.g. ``messages[2].role``.
        code: a short machine-readable code (``invalid_request``, ``missing_field``, ``invalid_role``).
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and (not isinstance(v, float) or math.isfinite(v)))


def _check_content(i: int, m: dict) -> None:
    role = m["role"]
    c = m.get("content")
    where = f"messages[{i}].content"
    if c is None:
        if role in ("assistant", "function"):
            return
        raise ChatBodyError(f"{where} is required for role '{role}'", param=where)
    if isinstance(c, str):
        return
    if isinstance(c, list):
        for j, part in enumerate(c):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ChatBodyError(f"{where}[{j}] must be an object with a string 'type'", param=f"{where}[{j}]")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise ChatBodyError(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
        return
    raise ChatBodyError(f"{where} must be a string, a list of content parts or null, got {type(c).__name__}",
                        param=where)


def _check_tool_calls(i: int, calls: Any) -> None:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ChatBodyError(f"{where} must be a list", param=where)
    for j, tc in enumerate(calls):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatBodyError(f"{where}[{j}] must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
                                param=f"{where}[{j}]")
        if "arguments" in fn and not isinstance(fn["arguments"], str):
            raise ChatBodyError(f"{where}[{j}].function.arguments must be a JSON string",
                                param=f"{where}[{j}].function.arguments")


def _check_messages(msgs: Any) -> None:
    if msgs is None:
        raise ChatBodyError("'messages' is required", param="messages", code="missing_field")
    if not isinstance(msgs, list):
        raise ChatBodyError(f"'messages' must be a list, got {type(msgs).__name__}", param="messages")
    if not msgs:
        raise ChatBodyError("'messages' must not be empty", param="messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ChatBodyError(f"messages[{i}] must be an object, got {type(m).__name__}", param=f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str):
            raise ChatBodyError(f"messages[{i}].role is required and must be a string", param=f"messages[{i}].role")
        if role not in ROLES:
            raise ChatBodyError(f"messages[{i}].role: unknown role {role[:40]!r} (expected one of {', '.join(ROLES)})",
                                param=f"messages[{i}].role", code="invalid_role")
        _check_content(i, m)
        if role == "assistant" and m.get("tool_calls") is not None:
            _check_tool_calls(i, m["tool_calls"])
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise ChatBodyError(f"messages[{i}].tool_call_id (string) is required for role 'tool'",
                                param=f"messages[{i}].tool_call_id")
        if "name" in m and m["name"] is not None and not isinstance(m["name"], str):
            raise ChatBodyError(f"messages[{i}].name must be a string", param=f"messages[{i}].name")


def _check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        raise ChatBodyError("'tools' must be a list", param="tools")
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ChatBodyError(f"tools[{j}] must be {{'type': 'function', 'function': {{...}}}}",
                                param=f"tools[{j}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatBodyError(f"tools[{j}].function.name must be a non-empty string",
                                param=f"tools[{j}].function.name")
        if "parameters" in fn and fn["parameters"] is not None and not isinstance(fn["parameters"], dict):
            raise ChatBodyError(f"tools[{j}].function.parameters must be a JSON schema object",
                                param=f"tools[{j}].function.parameters")


def _check_tool_choice(tc: Any) -> None:
    if isinstance(tc, str):
        if tc not in ("none", "auto", "required"):
            raise ChatBodyError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {tc[:40]!r}",
                                param="tool_choice")
        return
    if isinstance(tc, dict) and isinstance(tc.get("function"), dict) and isinstance(tc["function"].get("name"), str):
        return
    raise ChatBodyError("tool_choice must be a string or {'type': 'function', 'function': {'name': ...}}",
                        param="tool_choice")


def _range(body: dict, key: str, lo: float, hi: float, integer: bool = False, lo_open: bool = False) -> None:
    v = body.get(key)
    if v is None:
        return
    if integer and not _is_int(v):
        raise ChatBodyError(f"'{key}' must be an integer, got {type(v).__name__}", param=key)
    if not _is_num(v):
        raise ChatBodyError(f"'{key}' must be a number, got {type(v).__name__}", param=key)
    if v < lo or v > hi or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise ChatBodyError(f"'{key}' must be in {left}{lo}, {hi}], got {v}", param=key)


def _of_type(kind: type, noun: str) -> Callable[[dict, str], None]:
    """The check that ``body[key]``, when given, is a ``kind`` (``noun`` in the error)."""
    def check(body: dict, key: str) -> None:
        v = body.get(key)
        if v is not None and not isinstance(v, kind):
            raise ChatBodyError(f"'{key}' must be {noun}, got {type(v).__name__}", param=key)
    return check


_bool = _of_type(bool, "a boolean")
_string = _of_type(str, "a string")
_object = _of_type(dict, "an object")


def _ranged(lo: float, hi: float, integer: bool = False, lo_open: bool = False) -> Callable[[dict, str], None]:
    return lambda body, key: _range(body, key, lo, hi, integer, lo_open)


def _strings(body: dict, key: str) -> None:
    v = body.get(key)
    if v is not None and not isinstance(v, str) and not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        raise ChatBodyError(f"'{key}' must be a string or a list of strings", param=key)


def _ints(body: dict, key: str) -> None:
    v = body.get(key)
    if v is not None and not (isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v)):
        raise ChatBodyError(f"'{key}' must be a list of token ids (integers >= 0)", param=key)


def _check_stream_options(body: dict, key: str) -> None:
    so = body.get(key)
    if so is None:
        return
    if not isinstance(so, dict):
        raise ChatBodyError("'stream_options' must be an object", param="stream_options")
    for k in ("include_usage", "continuous_usage_stats"):
        if so.get(k) is not None and not isinstance(so[k], bool):
            raise ChatBodyError(f"'stream_options.{k}' must be a boolean", param=f"stream_options.{k}")


def _check_logit_bias(body: dict, key: str) -> None:
    lb = body.get(key)
    if lb is None:
        return
    if not isinstance(lb, dict) or not all(isinstance(k, str) and k.lstrip("-").isdigit() and _is_num(v)
                                           for k, v in lb.items()):
        raise ChatBodyError("'logit_bias' must map token ids (as strings) to numbers", param="logit_bias")


def _check_response_format(body: dict, key: str) -> None:
    rf = body.get(key)
    if rf is not None and not (isinstance(rf, dict) and isinstance(rf.get("type"), str)):
        raise ChatBodyError("'response_format' must be an object with a string 'type'", param="response_format")


def _optional(check: Callable[[Any], None]) -> Callable[[dict, str], None]:
    return lambda body, key: None if body.get(key) is None else check(body[key])


@dataclass(frozen=True)
class ChatField:
    """One row of :data:`CHAT_FIELDS` (see the module docstring)."""

    check: Callable[[dict, str], None]
    role: str
    sampling_key: str | None = None
    recorded: bool = False
    #: checked even when absent (``messages``); every other check passes an absent or null field,
    #: so :func:`check_chat_body` runs it only when the field is in the body
    required: bool = False


#: Every chat field the package knows (see the module docstring). An unknown field is forwarded
#: untouched by the proxy and ignored by the engine, as SGLang does.
CHAT_FIELDS: dict[str, ChatField] = {
    "model": ChatField(_string, "answer"),
    "messages": ChatField(lambda body, key: _check_messages(body.get(key)), "prompt", required=True),
    "stream": ChatField(_bool, "answer"),
    "stream_options": ChatField(_check_stream_options, "answer"),
    "logprobs": ChatField(_bool, "answer"),
    "top_logprobs": ChatField(_ranged(0, 20, integer=True), "answer"),
    "temperature": ChatField(_ranged(0.0, 2.0), "sampling", "temperature", recorded=True),
    "top_p": ChatField(_ranged(0.0, 1.0, lo_open=True), "sampling", "top_p", recorded=True),
    "top_k": ChatField(_ranged(-1, 1 << 30, integer=True), "sampling", "top_k", recorded=True),
    "min_p": ChatField(_ranged(0.0, 1.0), "sampling", "min_p", recorded=True),
    "presence_penalty": ChatField(_ranged(-2.0, 2.0), "sampling", "presence_penalty", recorded=True),
    "frequency_penalty": ChatField(_ranged(-2.0, 2.0), "sampling", "frequency_penalty", recorded=True),
    "repetition_penalty": ChatField(_ranged(0.0, 2.0, lo_open=True), "sampling", "repetition_penalty", recorded=True),
    "max_completion_tokens": ChatField(_ranged(1, 1 << 30, integer=True), "sampling", "max_new_tokens", recorded=True),
    "max_tokens": ChatField(_ranged(1, 1 << 30, integer=True), "sampling", "max_new_tokens", recorded=True),
    "min_tokens": ChatField(_ranged(0, 1 << 30, integer=True), "sampling", "min_new_tokens", recorded=True),
    "seed": ChatField(_ranged(-(1 << 63), (1 << 64) - 1, integer=True), "sampling", "sampling_seed", recorded=True),
    "n": ChatField(_ranged(1, 1 << 30, integer=True), "answer", recorded=True),
    "stop": ChatField(_strings, "sampling", "stop", recorded=True),
    "stop_token_ids": ChatField(_ints, "sampling", "stop_token_ids", recorded=True),
    "stop_regex": ChatField(_strings, "sampling", "stop_regex"),
    "ignore_eos": ChatField(_bool, "sampling", "ignore_eos", recorded=True),
    "no_stop_trim": ChatField(_bool, "sampling", "no_stop_trim"),
    "skip_special_tokens": ChatField(_bool, "sampling", "skip_special_tokens"),
    "logit_bias": ChatField(_check_logit_bias, "sampling", "logit_bias", recorded=True),
    "tools": ChatField(_optional(_check_tools), "prompt"),
    "tool_choice": ChatField(_optional(_check_tool_choice), "prompt", recorded=True),
    "parallel_tool_calls": ChatField(_bool, "answer", recorded=True),
    "response_format": ChatField(_check_response_format, "sampling", "json_schema", recorded=True),
    "regex": ChatField(_string, "sampling", "regex", True),
    "ebnf": ChatField(_string, "sampling", "ebnf", True),
    "user": ChatField(_string, "answer"),
    "continue_final_message": ChatField(_bool, "prompt"),
    "chat_template_kwargs": ChatField(_object, "prompt"),
    "input_ids": ChatField(_ints, "prompt"),
    "rid": ChatField(_string, "answer"),
    "return_token_ids": ChatField(_bool, "answer"),
    "return_prompt_token_ids": ChatField(_bool, "answer_no_stream"),
    "return_meta_info": ChatField(_bool, "answer_no_stream"),
}


def fields_with(role: str) -> tuple[str, ...]:
    """The names of the fields of ``role``, in table order."""
    return tuple(k for k, f in CHAT_FIELDS.items() if f.role == role)


def check_chat_body(body: Any) -> None:
    """Validate a parsed chat-completion body (nothing is changed): every field of
    :data:`CHAT_FIELDS` that is present.

    Raises:
        ChatBodyError: the first field that fails, named in ``param``.
    """
    if not isinstance(body, dict):
        raise ChatBodyError(f"the request body must be a JSON object, got {type(body).__name__}")
    for key, f in CHAT_FIELDS.items():
        if f.required or key in body:  # the others pass an absent field: not called for it
            f.check(body, key)


__all__ = ["CHAT_FIELDS", "ChatField", "ChatBodyError", "ROLES", "check_chat_body", "fields_with"]
