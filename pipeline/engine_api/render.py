"""The one chat renderer: an OpenAI-style chat request -> prompt token ids.

Used by the CPU engine (to serve ``/v1/chat/completions`` and ``/v1/tokenize``), by the OPD
teacher (the student's prompt with the hint inserted), by the ``choice`` judge backend and by
the importer. Because every one of them renders through :class:`ChatRenderer` from a
:class:`PromptSpec`, the teacher's prompt is, by construction, the student's prompt with the hint
inserted and nothing else changed: same tools, same ``tool_choice``, same template options.

What shapes the prompt (:data:`CHAT_OPTION_KEYS`, recorded on every turn as ``chat_options``):

- ``messages``; ``content`` may be a string, null (-> ``""``) or a list of ``{"type": "text",
  "text"}`` parts (joined); other part types are rejected (text-only model).
- ``tools`` as seen through ``tool_choice``: ``"none"`` renders no tools, a named function
  renders only that tool, ``"auto"``/``"required"`` (or no choice) render them all. Tools are
  normalised by :func:`normalise_tools` (the fields the engine's request model keeps).
- ``continue_final_message``: a trailing assistant message is continued instead of being turned
  into a user message (SGLang's rule when it is false).
- ``chat_template_kwargs``: passed to the Jinja template (``enable_thinking`` ...).

Message roles: ``developer`` becomes ``system``, ``function`` becomes ``tool``. When the
template references ``tools`` it gets them; otherwise (SmolLM2) they are described in the system
message (:func:`tools_system_prompt`) and an assistant message's ``tool_calls`` are rendered as
``<tool_call>`` blocks in its content (:func:`render_tool_calls`). Ids are produced by rendering
to text and encoding without adding special tokens, which is what
``apply_chat_template(tokenize=True)`` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from pipeline.errors import PipelineError
from pipeline.models import resolve_model

ROLES = {"system", "user", "assistant", "tool", "function", "developer"}
#: request fields besides ``messages`` and ``tools`` that change the rendered prompt
CHAT_OPTION_KEYS = ("tool_choice", "continue_final_message", "chat_template_kwargs")
#: the tool-call block the model is asked to write when its template does not know tools
OPEN, CLOSE = "<tool_call>", "</tool_call>"


class ChatTemplateError(PipelineError, ValueError):
    """The messages cannot be rendered (bad shape, unsupported content, template error)."""


# ---- tools ----------------------------------------------------------------------------------
def normalise_tools(tools: list | None) -> list[dict] | None:
    """OpenAI ``tools`` reduced to what the engine's request model keeps, in its field order:
    ``{"type": "function", "function": {name, description, parameters, strict}}`` without null
    fields. Idempotent; ``None``/``[]`` -> ``None``.

    Raises:
        ChatTemplateError: an entry is not ``{"function": {"name": str, ...}}``.
    """
    if not tools:
        return None
    out = []
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatTemplateError(f"tools[{j}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        out.append({"type": "function",
                    "function": {k: fn[k] for k in ("name", "description", "parameters", "strict")
                                 if fn.get(k) is not None}})
    return out


def active_tools(tools: list | None, tool_choice: Any) -> list[dict] | None:
    """The tools the prompt shows for ``tool_choice`` (see the module docstring).

    Raises:
        ChatTemplateError: a choice other than ``none``/``auto`` without tools, or a named
            function that is not among the tools.
    """
    tools = normalise_tools(tools)
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if choice not in ("none", "auto") and not tools:
        raise ChatTemplateError("tool_choice is set but no tools were given")
    if isinstance(choice, dict):
        fn = choice.get("function") if isinstance(choice.get("function"), dict) else {}
        name = fn.get("name")
        tools = [t for t in tools or [] if t["function"]["name"] == name]
        if not tools:
            raise ChatTemplateError(f"tool_choice names {name!r}, which is not in tools")
    return tools if choice != "none" else None


def tools_system_prompt(tools: list[dict]) -> str:
    """System-prompt text that lists ``tools`` and the expected call format."""
    lines = [json.dumps(t.get("function", t), ensure_ascii=False) for t in tools]
    return ("You can call the following functions. Their JSON schemas:\n<tools>\n" + "\n".join(lines)
            + "\n</tools>\nTo call a function, answer with one block per call:\n" + OPEN
            + '\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n' + CLOSE)


def render_tool_calls(tool_calls: list[dict]) -> str:
    """An assistant message's ``tool_calls`` as the text the model is asked to write."""
    out = []
    for tc in tool_calls or []:
        fn = tc.get("function", {}) if isinstance(tc, dict) else {}
        args = fn.get("arguments", "{}")
        try:
            args_obj = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            args_obj = args
        out.append(OPEN + "\n" + json.dumps({"name": fn.get("name", ""), "arguments": args_obj},
                                            ensure_ascii=False) + "\n" + CLOSE)
    return "\n".join(out)


# ---- the prompt of one request ----------------------------------------------------------------
@dataclass(frozen=True)
class PromptSpec:
    """Everything that determines a chat prompt's token ids (given the tokenizer).

    Attributes:
        messages: the request's messages, as sent.
        tools: the tools the prompt shows (after ``tool_choice``, normalised), or None.
        continue_final_message: continue a trailing assistant message.
        chat_template_kwargs: extra template variables, or None.
        add_generation_prompt: open an assistant turn at the end (ignored when continuing).
    """

    messages: list
    tools: list | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True

    @classmethod
    def from_request(cls, body: dict) -> "PromptSpec":
        """The prompt of a chat-completion request (``messages``, ``tools`` and
        :data:`CHAT_OPTION_KEYS`; other fields are ignored).

        Raises:
            ChatTemplateError: bad ``tools`` / ``tool_choice`` / option types.
        """
        cfm = body.get("continue_final_message")
        ctk = body.get("chat_template_kwargs")
        if cfm is not None and not isinstance(cfm, bool):
            raise ChatTemplateError("continue_final_message must be a boolean")
        if ctk is not None and not isinstance(ctk, dict):
            raise ChatTemplateError("chat_template_kwargs must be an object")
        return cls(messages=body.get("messages") or [], tools=active_tools(body.get("tools"), body.get("tool_choice")),
                   continue_final_message=bool(cfm), chat_template_kwargs=dict(ctk) if ctk else None)

    @classmethod
    def from_turn(cls, turn) -> "PromptSpec":
        """The prompt a recorded :class:`pipeline.events.Turn` was rendered from (its messages,
        tools and ``chat_options``)."""
        return cls.from_request({**(turn.chat_options or {}), "messages": turn.messages, "tools": turn.tools})

    def with_messages(self, messages: list) -> "PromptSpec":
        """The same prompt options with other messages (e.g. the hinted ones)."""
        return replace(self, messages=messages)


def chat_options(body: dict) -> dict:
    """The :data:`CHAT_OPTION_KEYS` a request set (non-null), to record on its turn."""
    return {k: body[k] for k in CHAT_OPTION_KEYS if body.get(k) is not None}


# ---- rendering --------------------------------------------------------------------------------
#: content-part types that carry text: chat's ``text``; the Responses API's ``input_text`` and
#: ``output_text`` (a part without ``type`` is a text part)
TEXT_PARTS = ("text", "input_text", "output_text")


def part_text(part: Any) -> str | None:
    """The text of one content part: a string as it is, a :data:`TEXT_PARTS` part's ``text``;
    None for any other part (an image, a refusal, a malformed part)."""
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type", "text") in TEXT_PARTS and isinstance(part.get("text"), str):
        return part["text"]
    return None


def content_text(content: Any) -> str:
    """The text of a message's ``content`` as the model sees it, the one joining rule of the package.

    None is ``""``; a string is itself; a list of parts is the text of its text parts
    (:func:`part_text`) joined with nothing in between, exactly what :class:`ChatRenderer` puts
    into the prompt; other parts (an image) carry no text and are left out; anything else is
    ``""``. Callers that must refuse such content validate it first (the renderer:
    :class:`ChatTemplateError`; the proxy's front doors: a 400 naming the field).
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(t for t in map(part_text, content) if t is not None)
    return ""


def _checked_text(content: Any, i: int) -> str:
    """:func:`content_text` of ``messages[i].content`` after checking it is null, a string or a
    list of chat text parts (a text-only model). Raises :class:`ChatTemplateError`."""
    if content is not None and not isinstance(content, (str, list)):
        raise ChatTemplateError(f"messages[{i}].content must be a string, null or a list of text parts")
    for part in content if isinstance(content, list) else ():
        if part_text(part) is None or (isinstance(part, dict) and part.get("type", "text") != "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatTemplateError(f"messages[{i}].content: part type {kind!r} is not supported "
                                    "(text-only model)")
    return content_text(content)


@dataclass
class ChatRenderer:
    """Renders chat prompts with a Hugging Face tokenizer's chat template (thread-safe: no state
    changes after construction)."""

    tokenizer: Any
    has_template: bool = field(init=False)
    template_tools: bool = field(init=False)
    template_tool_calls: bool = field(init=False)

    def __post_init__(self) -> None:
        template = self.tokenizer.chat_template or ""
        if not isinstance(template, str):  # a dict of named templates
            template = str(template)
        self.has_template = bool(template)
        self.template_tools = "tools" in template
        self.template_tool_calls = "tool_calls" in template

    def normalise(self, messages: list[Any], tools: list[dict] | None,
                  continue_final_message: bool = False) -> list[dict]:
        """Plain ``{"role", "content", ...}`` dicts the template can render.

        Raises:
            ChatTemplateError: a message is not an object, has an unknown role or bad content.
        """
        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError("messages must be a non-empty list")
        out: list[dict] = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ChatTemplateError(f"messages[{i}] must be an object")
            role = m.get("role")
            if role not in ROLES:
                raise ChatTemplateError(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}")
            role = {"developer": "system", "function": "tool"}.get(role, role)
            msg = {k: v for k, v in m.items() if k not in ("content", "role")}
            msg["role"] = role
            msg["content"] = _checked_text(m.get("content"), i)
            if role == "assistant" and m.get("tool_calls"):
                if not isinstance(m["tool_calls"], list):
                    raise ChatTemplateError(f"messages[{i}].tool_calls must be a list")
                if not self.template_tool_calls:
                    calls = render_tool_calls(m["tool_calls"])
                    msg["content"] = (msg["content"] + "\n" + calls) if msg["content"] else calls
                    msg.pop("tool_calls", None)
            out.append(msg)
        if out[-1]["role"] == "assistant" and not continue_final_message:
            out[-1] = {"role": "user", "content": out[-1]["content"]}
        if tools and not self.template_tools:
            text = tools_system_prompt(tools)
            if out[0]["role"] == "system":
                out[0] = dict(out[0], content=out[0]["content"] + "\n\n" + text)
            else:
                out.insert(0, {"role": "system", "content": text})
        return out

    def render_text(self, messages: list[Any], tools: list[dict] | None = None, *,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None) -> str:
        """The prompt text (``tools`` as given: use :meth:`render_spec` for request semantics).

        Raises:
            ChatTemplateError: see :meth:`normalise`, or the template itself raised.
        """
        if not self.has_template:
            raise ChatTemplateError("this model has no chat template; use /generate")
        msgs = self.normalise(messages, tools, continue_final_message)
        kwargs = dict(chat_template_kwargs or {})
        if continue_final_message:
            add_generation_prompt = False
        try:
            return self.tokenizer.apply_chat_template(
                msgs, tools=tools if (tools and self.template_tools) else None, tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **kwargs)
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja errors are caller errors here
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None

    def render_ids(self, messages: list[Any], tools: list[dict] | None = None, **kwargs: Any) -> list[int]:
        """Prompt token ids (text rendered, then encoded without extra special tokens)."""
        text = self.render_text(messages, tools, **kwargs)
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def render_spec(self, spec: PromptSpec) -> list[int]:
        """Prompt token ids of a :class:`PromptSpec` (``[P]`` ints).

        Raises:
            ChatTemplateError: as :meth:`render_text`.
        """
        return self.render_ids(spec.messages, spec.tools, add_generation_prompt=spec.add_generation_prompt,
                               continue_final_message=spec.continue_final_message,
                               chat_template_kwargs=spec.chat_template_kwargs)


def load_tokenizer(name: str, cache_dir: str | None = None):
    """A Hugging Face tokenizer for a model name (``smollm2-135m`` | ``tiny-random``, see
    :mod:`pipeline.models`) or an HF folder, loaded offline.

    Raises:
        pipeline.models.ModelNotFound: the name is unknown and no such folder exists.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model(name, cache_dir)))
