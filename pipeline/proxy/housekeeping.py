"""An agent's own housekeeping calls, recognised from what they are: never trainable turns.

Agents call the model for their own upkeep as well as for the user: OpenClaw summarises a long
transcript (compaction), names a session (titles), lets the model write memories before a
compaction (memory flush) and polls it on a timer (heartbeats). Such a call is not a turn of
the conversation: it has no next state from the user, and a reward for it would teach the
policy to summarise when asked to chat. Agents send them with or without session headers
(OpenClaw's compaction and title calls carry no session id at all, and its plugin cannot
always label them), so the proxy recognises them from their prompts:

=============  ===================================================  ==============================
kind           the request has                                      OpenClaw's source
=============  ===================================================  ==============================
compaction     a system message with the summariser's role text     compaction, branch summaries,
                                                                    split-turn prefixes
title          a system message with the labeller's role text       session titles, topic labels
memory         a last user message that opens the memory flush      memory-core's pre-compaction
               (or the flush's system text)                         flush
heartbeat      a last user message with the heartbeat prompt, or    heartbeat runs (default prompt)
               OpenClaw's internal heartbeat / cron wake note
=============  ===================================================  ==============================

The texts are OpenClaw 2026.9.6's own (its ``dist/`` bundle: ``SUMMARIZATION_SYSTEM_PROMPT``,
the conversation labeller's system prompt, ``DEFAULT_MEMORY_FLUSH_PROMPT`` /
``DEFAULT_MEMORY_FLUSH_SYSTEM_PROMPT``, ``HEARTBEAT_CONTEXT_PROMPT`` and
``INTERNAL_WAKE_TRANSCRIPT_PROMPTS``). A fixed sentence of each is matched, not the whole text,
so the parts OpenClaw fills in (dates, custom instructions) do not matter. A heartbeat prompt
the user configured (``agents.defaults.heartbeat.prompt``) is not recognisable here: the plugin
marks those runs ``side`` from their trigger. ``docs/openclaw.md`` says what the proxy does with
them (a ``side`` turn, in the agent's own session when the request names one, counted in
``pipeline_proxy_housekeeping_total``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.engine_api.render import content_text

#: the session of a housekeeping call that names none: ``housekeeping:<agent>`` (one per agent
#: and tenant, holding only side turns; never a conversation)
SESSION_PREFIX = "housekeeping:"


@dataclass(frozen=True, slots=True)
class Sign:
    """One recognisable housekeeping prompt.

    Attributes:
        agent: whose prompt it is (``openclaw``).
        kind: ``compaction``, ``title``, ``memory`` or ``heartbeat``.
        where: ``system`` (any system/developer message) or ``last_user`` (the last user message).
        text: a fixed sentence of the prompt, matched as a substring.
    """

    agent: str
    kind: str
    where: str
    text: str


SIGNS: tuple[Sign, ...] = (
    Sign("openclaw", "compaction", "system",
         "You are a context summarization assistant. Your task is to read a conversation between a user and "
         "an AI assistant, then produce a structured summary"),
    Sign("openclaw", "title", "system",
         "You are labeling the supplied message, not participating in its conversation."),
    Sign("openclaw", "memory", "last_user", "Pre-compaction memory flush."),
    Sign("openclaw", "memory", "system", "Pre-compaction memory flush turn."),
    Sign("openclaw", "heartbeat", "last_user",
         "Follow the heartbeat monitor scratch context when provided."),
    Sign("openclaw", "heartbeat", "last_user", "[OpenClaw heartbeat poll]"),
    Sign("openclaw", "heartbeat", "last_user", "[OpenClaw cron wake]"),
)
KINDS = ("compaction", "title", "memory", "heartbeat")
assert all(s.kind in KINDS and s.where in ("system", "last_user") for s in SIGNS)


@dataclass(frozen=True, slots=True)
class Housekeeping:
    """A recognised housekeeping call: whose (``agent``) and what (``kind``)."""

    agent: str
    kind: str

    @property
    def label(self) -> str:
        """``<agent>:<kind>``, what the turn records in ``housekeeping``."""
        return f"{self.agent}:{self.kind}"

    @property
    def session_id(self) -> str:
        """The session of such a call that names none: ``housekeeping:<agent>``."""
        return SESSION_PREFIX + self.agent


def _text(m: Any) -> str:
    c = m.get("content") if isinstance(m, dict) else None
    return (content_text(c) or "") if isinstance(c, (str, list)) else ""


def recognise(messages: list) -> Housekeeping | None:
    """The housekeeping call ``messages`` are (the first :data:`SIGNS` entry that matches), or None."""
    system = [_text(m) for m in messages if isinstance(m, dict) and m.get("role") in ("system", "developer")]
    last_user = next((_text(m) for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "user"), "")
    for s in SIGNS:
        texts = system if s.where == "system" else [last_user]
        if any(s.text in t for t in texts):
            return Housekeeping(s.agent, s.kind)
    return None
