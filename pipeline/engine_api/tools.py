"""Tool calling for models whose chat template may not know about tools (pure Python).

Prompt side (:mod:`pipeline.engine_api.render`): when the chat template does not reference ``tools``
(SmolLM2's does not), the tools are described in the system message and calls asked for in the
form::

    <tool_call>
    {"name": "<function name>", "arguments": {...}}
    </tool_call>

(the Hermes/Qwen convention, which SmolLM2-Instruct's function-calling data resembles).

With ``tool_choice`` ``"required"`` or a named function the CPU engine constrains the output to
exactly one such block of a declared tool's schema (:mod:`pipeline.engine.grammar`), which the
parsers below read back like any other.

Output side: :func:`parse_tool_calls` turns a finished completion into OpenAI ``tool_calls``;
:class:`ToolStreamParser` does the same incrementally for SSE streams, holding back text that
may turn out to be a tool call. Accepted call shapes: a JSON object with ``name`` and
``arguments`` (or ``parameters``; an object or a JSON string), or a list of them, either inside
``<tool_call>...</tool_call>`` blocks or as the whole reply. Names that are not among the
request's tools are not treated as calls (the text stays content). SGLang does the same job with
model-specific ``--tool-call-parser`` plug-ins; ids use SGLang's ``call_<24 hex>`` form.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pipeline.engine_api.render import CLOSE, OPEN


@dataclass
class ToolCall:
    """One parsed call: function name and its arguments as a JSON string."""

    name: str
    arguments: str
    id: str = ""

    def to_openai(self, index: int) -> dict:
        """OpenAI/SGLang ``tool_calls[i]`` object."""
        return {"id": self.id or new_call_id(), "index": index, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    """``call_`` + 24 hex digits (SGLang's format)."""
    return "call_" + uuid.uuid4().hex[:24]


def tool_names(tools: list[dict] | None) -> set[str]:
    """Function names declared in an OpenAI ``tools`` list."""
    names = set()
    for t in tools or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names


def _calls_from_json(obj: Any, names: set[str]) -> list[ToolCall] | None:
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for it in items:
        if isinstance(it, dict) and isinstance(it.get("function"), dict) and "name" not in it:
            it = it["function"]
        if not isinstance(it, dict) or not isinstance(it.get("name"), str) or it["name"] not in names:
            return None
        args = it.get("arguments", it.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(it["name"], json.dumps(args, ensure_ascii=False), new_call_id()))
    return calls or None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_tool_calls(text: str, tools: list[dict] | None) -> tuple[str, list[ToolCall]]:
    """Split a finished completion into (content, tool calls).

    Blocks that do not parse as calls to declared tools stay in the content verbatim.
    An unterminated last ``<tool_call>`` block (the model hit EOS first) is parsed too.
    """
    names = tool_names(tools)
    if not names:
        return text, []
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while True:
        i = text.find(OPEN, pos)
        if i < 0:
            content.append(text[pos:])
            break
        j = text.find(CLOSE, i + len(OPEN))
        body = text[i + len(OPEN): j if j >= 0 else len(text)]
        end = j + len(CLOSE) if j >= 0 else len(text)
        parsed = _calls_from_json(_loads(body.strip()), names)
        if parsed:
            content.append(text[pos:i])
            calls.extend(parsed)
        else:
            content.append(text[pos:end])
        pos = end
    rest = "".join(content)
    if not calls:
        stripped = rest.strip()
        if stripped[:1] in ("{", "["):
            parsed = _calls_from_json(_loads(stripped), names)
            if parsed:
                return "", parsed
        return text, []
    return rest.strip(), calls


class ToolStreamParser:
    """Incremental :func:`parse_tool_calls` for SSE.

    ``feed(delta)`` returns ``(content_delta, new_calls)``; text that may still become a call
    (a partial ``<tool_call>`` tag, an open block, or a reply that starts with ``{``/``[``) is held
    back until it resolves; ``finish()`` flushes whatever is left the same way.
    """

    def __init__(self, tools: list[dict] | None) -> None:
        self.names = tool_names(tools)
        self.buf = ""
        self.emitted_any = False  # any content emitted yet (a leading JSON reply is then impossible)
        self.n_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        if not self.names:
            return delta, []
        self.buf += delta
        out: list[str] = []
        calls: list[ToolCall] = []
        while self.buf:
            if not self.emitted_any and not out and self.buf.lstrip()[:1] in ("{", "["):
                break  # maybe a bare JSON call: wait for the end
            i = self.buf.find(OPEN)
            if i < 0:
                keep = _partial_suffix(self.buf, OPEN)
                if not self.emitted_any and not out and not self.buf[:len(self.buf) - keep].strip():
                    break  # only whitespace so far: keep it so a leading JSON call still parses
                out.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            j = self.buf.find(CLOSE, i + len(OPEN))
            if j < 0:
                out.append(self.buf[:i])
                self.buf = self.buf[i:]
                break
            parsed = _calls_from_json(_loads(self.buf[i + len(OPEN):j].strip()), self.names)
            if parsed:
                out.append(self.buf[:i])
                calls.extend(parsed)
            else:
                out.append(self.buf[:j + len(CLOSE)])
            self.buf = self.buf[j + len(CLOSE):]
        text = "".join(out)
        if text.strip():
            self.emitted_any = True
        self.n_calls += len(calls)
        return text, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """Flush at the end of the stream."""
        if not self.names:
            return "", []
        rest, self.buf = self.buf, ""
        if not rest:
            return "", []
        if self.emitted_any:
            # only an unterminated block can be left to parse
            i = rest.find(OPEN)
            if i >= 0:
                parsed = _calls_from_json(_loads(rest[i + len(OPEN):].strip()), self.names)
                if parsed:
                    self.n_calls += len(parsed)
                    return rest[:i], parsed
            return rest, []
        content, calls = parse_tool_calls(rest, [{"function": {"name": n}} for n in self.names])
        self.n_calls += len(calls)
        return content, calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
