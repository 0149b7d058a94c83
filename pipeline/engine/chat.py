"""Chat messages -> prompt token ids with the model's own chat template.

Message handling (SGLang's ``serving_chat`` semantics where they matter):
- ``content`` may be a string, null (-> ``""``) or a list of ``{"type": "text", "text"}`` parts
  (joined); other part types are rejected (400: this engine is text-only).
- a trailing assistant message is turned into a user message unless ``continue_final_message``
  (then the template continues that message instead of opening a new turn) — as SGLang does.
- ``developer`` becomes ``system``; ``function`` becomes ``tool``.
- tools: when the template references ``tools`` it gets them; otherwise (SmolLM2) they are
  described in the system message (:func:`pipeline.engine.tools.tools_system_prompt`), and an
  assistant message's ``tool_calls`` are rendered as ``<tool_call>`` blocks in its content.
The ids are produced by rendering to text and encoding without adding special tokens, which is
what ``apply_chat_template(tokenize=True)`` does.
"""

from __future__ import annotations

from typing import Any

from pipeline.engine.tools import render_tool_calls, tools_system_prompt
from pipeline.errors import PipelineError

ROLES = {"system", "user", "assistant", "tool", "function", "developer"}


class ChatTemplateError(PipelineError, ValueError):
    """The messages cannot be rendered (bad shape, unsupported content, template error)."""


def _content_text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatTemplateError(f"messages[{i}].content: part type {kind!r} is not supported "
                                        "(text-only model)")
        return "".join(parts)
    raise ChatTemplateError(f"messages[{i}].content must be a string, null or a list of text parts")


class ChatRenderer:
    """Renders OpenAI-style chat requests with a tokenizer's chat template."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        template = tokenizer.chat_template or ""
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
            msg["content"] = _content_text(m.get("content"), i)
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
        """The prompt text.

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
        return list(self.tokenizer.encode(text, add_special_tokens=False))
