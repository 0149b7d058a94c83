"""What the judge sees, and the prompts it is asked (our own wording).

A :class:`JudgeInput` holds the three things a judgement needs: the user's request that the
assistant answered (the last user message of the turn's prompt), the assistant's output (text
and tool calls) and the next state (the user's reply and/or tool results, each with its role).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pipeline.engine_api.render import TEXT_PARTS, content_text
from pipeline.judge.parse import HINT_END, HINT_START

MAX_CHARS = 4000  # per part; long tool outputs are cut in the middle


def clip(text: str, limit: int = MAX_CHARS) -> str:
    """Cut ``text`` to about ``limit`` characters, keeping its head and tail."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters omitted ...]\n{text[-half:]}"


def render_tool_calls(tool_calls) -> str:
    """``name(arguments)`` lines for an assistant message's ``tool_calls``."""
    lines = []
    for tc in tool_calls or []:
        if not isinstance(tc, dict):
            continue
        fn = tc.get("function") or {}
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        lines.append(f"{fn.get('name', '?')}({args})")
    return "\n".join(lines)


@dataclass
class JudgeInput:
    """One turn to judge.

    ``request``: the last user message the output answered. ``response``: the assistant's
    visible output (content + rendered tool calls). ``next_state``: the messages that followed,
    each a dict with ``role`` (``user``/``tool``/...) and ``content``.
    """

    request: str
    response: str
    next_state: list = field(default_factory=list)

    @classmethod
    def from_turn(cls, turn, next_state_messages: list) -> "JudgeInput":
        """Build from a :class:`pipeline.events.Turn` and the next state's messages."""
        request = ""
        for m in reversed(turn.messages or []):
            if isinstance(m, dict) and m.get("role") == "user":
                request = content_text(m.get("content"))
                break
        resp = turn.response or {}
        text = content_text(resp.get("content"))
        calls = render_tool_calls(resp.get("tool_calls"))
        if calls:
            text = f"{text}\n[tool calls]\n{calls}" if text else f"[tool calls]\n{calls}"
        return cls(request=request, response=text, next_state=list(next_state_messages or []))

    def next_state_text(self, with_roles: bool = True) -> str:
        """The next state as text; with roles: ``[user] ...`` / ``[tool result: name] ...``."""
        out = []
        for m in self.next_state:
            if not isinstance(m, dict):
                continue
            text = content_text(m.get("content"))
            if not with_roles:
                out.append(text)
                continue
            role = m.get("role", "?")
            if role == "tool":
                label = f"tool result: {m['name']}" if m.get("name") else "tool result"
            elif role == "user":
                label = "user reply"
            else:
                label = str(role)
            out.append(f"[{label}] {text}")
        return "\n".join(out)

    def next_state_role(self) -> str:
        """``user``, ``tool`` or ``mixed`` (several roles), ``none`` if empty."""
        roles = {m.get("role") for m in self.next_state if isinstance(m, dict)}
        if not roles:
            return "none"
        return roles.pop() if len(roles) == 1 else "mixed"


PRM_SYSTEM = (
    "You grade one reply of an AI assistant by looking at what happened right after it.\n"
    "You get three parts: the user's request, the assistant's reply (text and any tool calls), "
    "and the next state: the user's next message, or the result of the tool the assistant called.\n"
    "The next state is evidence. A user who thanks, agrees, or moves on to a new task means the reply "
    "worked. A user who corrects, complains, repeats the request or asks for a fix means it did not. "
    "A tool result that shows success means the call was right; an error, an exception, 'not found' or "
    "a wrong result means it was not. If the next state says nothing either way, the score is 0.\n"
    "Reason briefly, then end with exactly one score: \\boxed{1} (good), \\boxed{0} (unclear) "
    "or \\boxed{-1} (bad)."
)

HINT_SYSTEM = (
    "You help an AI assistant learn in hindsight. You get the user's request, the assistant's reply, "
    "and the next state (the user's next message or a tool result).\n"
    "Decide whether the next state contains information that would have let the assistant write a "
    "better reply: a correction, a missing requirement, a preference, an error message that shows "
    "what went wrong.\n"
    "If it does, answer \\boxed{1} followed by a short instruction the assistant should have been "
    f"given, written as a hint to the assistant, between {HINT_START} and {HINT_END}. "
    "Do not reveal the next state itself, state what to do.\n"
    "If it does not (the reply was fine, or the next state teaches nothing), answer \\boxed{-1}."
)


def _user_block(inp: JudgeInput) -> str:
    return (
        f"## User's request\n{clip(inp.request) or '(none)'}\n\n"
        f"## Assistant's reply\n{clip(inp.response) or '(empty)'}\n\n"
        f"## Next state ({inp.next_state_role()})\n{clip(inp.next_state_text()) or '(empty)'}\n\n"
    )


def prm_messages(inp: JudgeInput) -> list[dict]:
    """Chat messages of the PRM (score) prompt."""
    user = _user_block(inp) + "Grade the assistant's reply. End with \\boxed{1}, \\boxed{0} or \\boxed{-1}."
    return [{"role": "system", "content": PRM_SYSTEM}, {"role": "user", "content": user}]


def hint_messages(inp: JudgeInput) -> list[dict]:
    """Chat messages of the OPD hint prompt."""
    user = _user_block(inp) + (
        f"Answer \\boxed{{1}} and a hint in {HINT_START}...{HINT_END}, or \\boxed{{-1}}.")
    return [{"role": "system", "content": HINT_SYSTEM}, {"role": "user", "content": user}]


def inject_hint(messages: list, hint: str) -> list:
    """A copy of ``messages`` with ``hint`` appended to the last user message (OPD teacher prompt).

    A content given as parts gets the hint at the end of its last text part (a new text part
    when the last part is not text). Without a user message, a user message carrying the hint is
    appended. The hint is marked so
    the teacher reads it as guidance: ``\\n\\n[Hint] <hint>``.
    """
    out = [dict(m) if isinstance(m, dict) else m for m in messages]
    suffix = f"\n\n[Hint] {hint}"
    for m in reversed(out):
        if isinstance(m, dict) and m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, list):  # extend the last part when it is text: every engine's joining of
                # parts (nothing, a newline) then gives the same text as for a string content
                last = c[-1] if c else None
                text_part = isinstance(last, dict) and last.get("type", "text") in TEXT_PARTS
                if text_part and isinstance(last.get("text"), str):
                    m["content"] = list(c[:-1]) + [dict(last, text=last["text"] + suffix)]
                else:
                    m["content"] = list(c) + [{"type": "text", "text": suffix}]
            else:
                m["content"] = content_text(c) + suffix
            return out
    out.append({"role": "user", "content": suffix.strip()})
    return out
