"""Events as plain JSON-able dicts for people: ``pipeline tail`` and the dashboard use these views.

Conversation text (request messages, replies, reasoning, tool definitions and call arguments,
next-state messages, hints) is included only with ``text=True``; otherwise each piece of text
becomes its length in characters (``chars``), so a view shows ids, lengths and scores.
Token-id and log-prob arrays become their length and a mean unless ``arrays=True``. A dead
letter's raw bytes are never shown (only their size): they may hold any of the above.

Fields are read with defaults, so a view also works on events whose optional fields are absent.
Every record that can carry a ``tenant`` shows it (None: no tenant), and turns and samples show
their LoRA ``adapter`` (``{name, version, sha256}``; None: the base model's full weights), as the
``to_dict`` views of session ends, controls and train steps do.
"""

from __future__ import annotations

from typing import Any

from pipeline import events
from pipeline.votes import majority_vote


def text_chars(value: Any) -> int:
    """Characters of text in a message ``content`` (a string, or a list of parts with ``text``)."""
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(text_chars(p.get("text") if isinstance(p, dict) else p) for p in value)
    if isinstance(value, dict):
        return text_chars(value.get("text"))
    return len(str(value))


def _tool_names(calls: Any) -> list[str]:
    out = []
    for c in calls or []:
        fn = c.get("function") if isinstance(c, dict) else None
        out.append(str(fn.get("name", "")) if isinstance(fn, dict) else "")
    return out


def message_view(m: Any, text: bool) -> dict:
    """One chat message: role, text length, tool-call names (and the message itself with ``text``)."""
    if not isinstance(m, dict):
        return {"role": None, "chars": text_chars(m)}
    out: dict[str, Any] = {"role": m.get("role"), "chars": text_chars(m.get("content"))}
    if m.get("tool_calls"):
        out["tool_calls"] = _tool_names(m.get("tool_calls"))
    if m.get("tool_call_id"):
        out["tool_call_id"] = m.get("tool_call_id")
    if text:
        out["content"] = m.get("content")
        if m.get("tool_calls"):
            out["tool_calls_full"] = m.get("tool_calls")
        if m.get("reasoning_content"):
            out["reasoning_content"] = m.get("reasoning_content")
    return out


def _mean(xs) -> float | None:
    xs = list(xs or [])
    return sum(xs) / len(xs) if xs else None


def _vote(v: Any) -> int | None:
    """A recorded vote as 1, 0 or -1; anything else (None, a value outside the three) is a failed vote."""
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v in (1, 0, -1) else None


def split_votes(sample: events.Sample) -> tuple[list, list]:
    """``(prm_votes, hint_votes)`` of a sample: rl carries PRM votes, opd hint votes, opd+rl both.

    A vote is 1, 0, -1 or None (failed). Unknown shapes give two empty lists.
    """
    votes = list(getattr(sample, "votes", None) or [])
    kind = getattr(sample, "kind", "")
    if len(votes) == 2 and all(isinstance(v, list) for v in votes):
        return [_vote(v) for v in votes[0]], [_vote(v) for v in votes[1]]
    if any(isinstance(v, (list, dict)) for v in votes):
        return [], []
    if kind == "opd":
        return [], [_vote(v) for v in votes]
    return [_vote(v) for v in votes], []


def majority(votes: list) -> int | None:
    """Majority of the valid PRM votes (a tie: 0); None when there are no votes or none is valid
    (every vote failed: no judgement, no reward).

    The judge's rule (:func:`pipeline.votes.majority_vote`), recomputed here from the
    recorded votes so a reader can check the sample's reward against them.
    """
    if not votes:
        return None
    return majority_vote(votes)


def sample_view(s: events.Sample, text: bool = False, arrays: bool = False) -> dict:
    """A sample's ids, scores and lengths (see the module docstring)."""
    tokens = list(getattr(s, "tokens", None) or [])
    r = int(getattr(s, "response_length", 0) or 0)
    rollout = getattr(s, "rollout_log_probs", None)
    teacher = getattr(s, "teacher_log_probs", None)
    prm, hint_votes = split_votes(s)
    hint = getattr(s, "hint", None)
    out: dict[str, Any] = {
        "sample_id": s.sample_id, "session_id": s.session_id, "turn_index": s.turn_index,
        "tenant": getattr(s, "tenant", None), "adapter": getattr(s, "adapter", None),
        "policy_version": getattr(s, "policy_version", None), "kind": getattr(s, "kind", None),
        "reward": getattr(s, "reward", None), "loss_mask": getattr(s, "loss_mask", None),
        "reward_source": getattr(s, "reward_source", None), "reward_rule": getattr(s, "reward_rule", None),
        "feedback_score": getattr(s, "feedback_score", None), "outcome_reward": getattr(s, "outcome_reward", None),
        "hint_source": getattr(s, "hint_source", None),
        "prm_votes": prm, "majority": majority(prm), "hint_votes": hint_votes,
        "hint_chars": len(hint) if hint else 0, "has_hint": bool(hint),
        "has_teacher": bool(teacher), "prompt_length": max(0, len(tokens) - r), "response_length": r,
        "rollout_temperature": getattr(s, "rollout_temperature", None), "judge": getattr(s, "judge", ""),
        "source": getattr(s, "source", None), "created_at": getattr(s, "created_at", None),
        "turn_created_at": getattr(s, "turn_created_at", None),
        "rollout_log_prob_mean": _mean(rollout),
    }
    if teacher and rollout and len(teacher) == len(rollout):
        # OPD's per-token advantage before weighting: teacher minus rollout log-prob (nats)
        out["teacher_minus_rollout_mean"] = _mean(t - o for t, o in zip(teacher, rollout))
    if text:
        out["hint"] = hint
    if arrays:
        for name in ("tokens", "rollout_log_probs", "teacher_log_probs", "teacher_topk_ids", "teacher_topk_log_probs"):
            out[name] = list(getattr(s, name, None) or [])
    return out


def turn_view(t: events.Turn, text: bool = False, arrays: bool = False) -> dict:
    """A turn's ids, policy version, finish reason and lengths (see the module docstring)."""
    resp = t.response if isinstance(t.response, dict) else {}
    out: dict[str, Any] = {
        "session_id": t.session_id, "tenant": getattr(t, "tenant", None), "adapter": getattr(t, "adapter", None),
        "turn_type": t.turn_type, "turn_index": t.turn_index,
        "request_id": t.request_id, "response_id": getattr(t, "response_id", None),
        "session_source": t.session_source, "created_at": t.created_at,
        "housekeeping": getattr(t, "housekeeping", None),
        "policy_version": t.policy_version,
        "model": t.model, "source": t.source, "engine_id": t.engine_id, "finish_reason": t.finish_reason,
        "sampling": t.sampling, "messages": [message_view(m, text) for m in t.messages or []],
        "tools": len(t.tools or []),
        "response": {"chars": text_chars(resp.get("content")),
                     "reasoning_chars": text_chars(resp.get("reasoning_content")),
                     "tool_calls": _tool_names(resp.get("tool_calls"))},
        "prompt_tokens": len(t.prompt_token_ids or []), "response_tokens": len(t.response_token_ids or []),
        "response_logprob_mean": _mean(t.response_logprobs),
    }
    if text:
        out["response"].update(content=resp.get("content"), reasoning_content=resp.get("reasoning_content"),
                               tool_calls_full=resp.get("tool_calls"))
        out["tools_full"] = t.tools
    if arrays:
        out["prompt_token_ids"] = list(t.prompt_token_ids or [])
        out["response_token_ids"] = list(t.response_token_ids or [])
        out["response_logprobs"] = list(t.response_logprobs or [])
    return out


def event_view(ev: events.Event, text: bool = False, arrays: bool = False) -> dict:
    """Any event as a plain dict with its ``type`` (text and arrays as the module docstring says)."""
    if isinstance(ev, events.Turn):
        body = turn_view(ev, text, arrays)
    elif isinstance(ev, events.Sample):
        body = sample_view(ev, text, arrays)
    elif isinstance(ev, events.NextState):
        body = {"session_id": ev.session_id, "tenant": getattr(ev, "tenant", None),
                "after_turn_index": ev.after_turn_index, "request_id": ev.request_id,
                "created_at": ev.created_at, "messages": [message_view(m, text) for m in ev.messages or []]}
    elif isinstance(ev, events.Feedback):  # the comment is conversation text: its length unless text
        body = ev.to_dict()
        body.pop("type", None)
        body.pop("v", None)
        comment = body.pop("comment")
        body["comment_chars"] = len(comment) if comment else 0
        if text:
            body["comment"] = comment
    elif isinstance(ev, events.DeadLetter):
        key = ev.key.decode("utf-8", "replace") if isinstance(ev.key, (bytes, bytearray)) else ev.key
        body = {"source_topic": ev.source_topic, "partition": ev.partition, "offset": ev.offset, "error": ev.error,
                "stage": ev.stage, "key": key, "raw_bytes": len(ev.raw or b""), "created_at": ev.created_at}
    else:  # control, session_end, train_step, evaluation: no conversation text, no large arrays
        body = ev.to_dict()
        body.pop("type", None)
        body.pop("v", None)
    return {"type": ev.TYPE, **body}
