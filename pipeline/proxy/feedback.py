"""``POST /v1/feedback``: a client's explicit judgement of one turn, as a ``feedback`` event.

Body (JSON object; any other field is refused, 400)::

    {"response_id": "chatcmpl-...",          # or resp_... / msg_...: the id the client received
     "score": -1,                             # in [-1, 1]; thumbs are +-1
     "comment": "the file is config.yaml",    # optional: a correction (the turn's OPD hint)
     "source": "user"}                        # optional: user (default), reviewer or app

or ``{"session_id": "...", "turn_index": 3, "score": 1}`` in place of ``response_id``. The
request's API key and tenant are checked as on chat (401/403); the turn must be one of that
tenant's: an unknown id, and another tenant's turn, are both 404 ``turn_not_found`` (another
tenant's turn is never revealed to exist). A bad body or an out-of-range score is 400, in
OpenAI's error shape. The answer is ``{"id": "fb_<request id>", "object": "feedback", ...}``
once the event is on the proxy's durable buffer.

How an id is resolved (:class:`TurnIndex`): every main turn the proxy records is added to a
bounded index ``(tenant, response id) -> (session, turn index, request id)`` (and
``(tenant, session, turn index) -> ...``). With a durable buffer (``proxy.buffer_dir``) the index is
also appended to ``turn-index.jsonl`` in that folder and read back at start, so a restarted proxy
still resolves the turns it answered before (up to ``proxy.feedback_index_max`` turns, least
recent dropped first). Behind several proxy replicas, feedback must reach the replica that
answered the turn (as ``previous_response_id`` does), or name ``session_id`` + ``turn_index``
on a replica that answered that turn.
"""

from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import orjson

from pipeline import events
from pipeline.proxy.errors import ProxyError, bad_request

log = logging.getLogger(__name__)

_FIELDS = ("response_id", "session_id", "turn_index", "score", "comment", "source")
INDEX_FILE = "turn-index.jsonl"


@dataclass(frozen=True, slots=True)
class IndexedTurn:
    """Where a recorded main turn lives: its session, index, request id and response id."""

    tenant: str | None
    session_id: str
    turn_index: int
    request_id: str
    response_id: str | None

    def line(self) -> bytes:
        return orjson.dumps([self.tenant, self.session_id, self.turn_index, self.request_id, self.response_id]) + b"\n"


class TurnIndex:
    """Bounded index of the recorded main turns, by response id and by ``(session, turn index)``.

    Args:
        max_turns: turns kept (least recently recorded dropped first).
        folder: a folder to keep the index in across restarts (``turn-index.jsonl``), or None
            (memory only). The file is rewritten with the kept turns once it holds twice as many lines.
        deferred: :meth:`add` only queues the file's line and :meth:`flush` writes every queued
            line at once (the proxy runs it after each group commit of its event buffer,
            :meth:`pipeline.proxy.publisher.EventPublisher.add_commit_hook`: one write per group
            instead of one system call per turn, still in the file before the turn's response
            completes; that commit may run on the event loop, so the rewrite, which takes
            ~0.1 s at 200,000 turns, is left to :meth:`maintain`, a housekeeping hook of the
            publisher's writer thread); False: :meth:`add` writes at once and rewrites when due.
    """

    def __init__(self, max_turns: int, folder: str | None = None, deferred: bool = False) -> None:
        self.max = max(1, max_turns)
        self.by_response: OrderedDict[tuple, IndexedTurn] = OrderedDict()
        self.by_turn: OrderedDict[tuple, IndexedTurn] = OrderedDict()
        self.path = os.path.join(folder, INDEX_FILE) if folder else None
        self.deferred = deferred
        self._queued: deque = deque()  # lines of added turns not written yet (deferred)
        self._file = None
        self._lines = 0
        if self.path is not None:
            self._load()

    def _load(self) -> None:
        try:
            with open(self.path, "rb") as f:
                for raw in f:
                    self._lines += 1
                    try:
                        t, sid, idx, rid, resp = orjson.loads(raw)
                        self._put(IndexedTurn(t, sid, int(idx), rid, resp))
                    except (orjson.JSONDecodeError, ValueError, TypeError):
                        continue  # a line cut by a crash: the turns before it are kept
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("turn index %s unreadable (%s): feedback resolves only turns recorded from now", self.path, e)
        if self._lines > 2 * self.max:
            self._rewrite()

    def _put(self, entry: IndexedTurn) -> None:
        if entry.response_id:
            self.by_response[(entry.tenant, entry.response_id)] = entry
            self.by_response.move_to_end((entry.tenant, entry.response_id))
        key = (entry.tenant, entry.session_id, entry.turn_index)
        self.by_turn[key] = entry
        self.by_turn.move_to_end(key)
        while len(self.by_turn) > self.max:
            self.by_turn.popitem(last=False)
        while len(self.by_response) > self.max:
            self.by_response.popitem(last=False)

    def add(self, entry: IndexedTurn) -> None:
        """Index a recorded main turn (and append it to the file, when there is one: now, or
        at the next :meth:`flush` when ``deferred``)."""
        self._put(entry)
        if self.path is None:
            return
        self._queued.append(entry.line())
        if not self.deferred:
            self.flush()

    def flush(self) -> None:
        """Append the queued lines to the file in one write (thread-safe against :meth:`add`;
        one flushing thread at a time). Not deferred: also rewrites the file once it holds twice
        ``max_turns`` lines (deferred: :meth:`maintain` does)."""
        queued = self._queued
        if not queued:
            return
        lines = []
        while queued:
            lines.append(queued.popleft())
        try:
            if self._file is None:
                self._file = open(self.path, "ab", buffering=0)
            self._file.write(b"".join(lines))
            self._lines += len(lines)
            if self._lines > 2 * self.max and not self.deferred:
                self._rewrite()
        except OSError as e:  # the turns are served and recorded all the same; only their index is not kept
            log.warning("turn index %s: %s", self.path, e)

    def maintain(self) -> None:
        """Rewrite the file with the kept turns once it holds twice ``max_turns`` lines (after
        writing what is queued). Not beside :meth:`flush`: the proxy runs both holding its
        publisher's commit lock."""
        if self.path is None or self._lines + len(self._queued) <= 2 * self.max:
            return
        self.flush()
        try:
            self._rewrite()
        except OSError as e:
            log.warning("turn index %s: %s", self.path, e)

    def _rewrite(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        tmp = self.path + ".tmp"
        kept = list(self.by_turn.values())  # one C-level copy: the event loop may add turns meanwhile
        with open(tmp, "wb") as f:
            f.writelines(e.line() for e in kept)
        os.replace(tmp, self.path)
        self._lines = len(kept)

    def close(self) -> None:
        """Write what is queued and close the file."""
        if self.path is not None:
            self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None

    def find(self, tenant: str | None, ref: dict) -> IndexedTurn | None:
        """The turn ``ref`` (:func:`parse_feedback`) names among ``tenant``'s, or None."""
        if ref.get("response_id") is not None:
            return self.by_response.get((tenant, ref["response_id"]))
        return self.by_turn.get((tenant, ref["session_id"], ref["turn_index"]))


def _score(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(f"'score' must be a number in [-1, 1], got {str(v)[:40]!r}", param="score",
                          code="invalid_score")
    if not -1.0 <= v <= 1.0:
        raise bad_request(f"'score' must be in [-1, 1] (thumbs are -1 and 1), got {v!r}", param="score",
                          code="invalid_score")
    return float(v)


def _text(body: dict, name: str, check) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad_request(f"'{name}' must be a string, got {type(v).__name__}", param=name)
    err = check(v)
    if err is not None:
        raise bad_request(f"'{name}' {err}", param=name)
    return v


def parse_feedback(body: dict) -> dict:
    """The checked fields of a feedback body: ``response_id`` or ``session_id`` + ``turn_index``,
    ``score``, ``comment`` (None: none), ``source`` (default ``user``).

    Raises:
        ProxyError: 400 naming the field.
    """
    unknown = sorted(k for k in body if k not in _FIELDS)
    if unknown:
        raise bad_request(f"unknown field {unknown[0]!r} (feedback takes {', '.join(_FIELDS)})", param=unknown[0])
    if "score" not in body:
        raise bad_request("'score' is required: a number in [-1, 1]", param="score", code="invalid_score")
    out = {"score": _score(body["score"]),
           "comment": _text(body, "comment", events.FEEDBACK_CHECKS["comment"]),
           "source": _text(body, "source", events.FEEDBACK_CHECKS["source"]) or "user",
           "response_id": _text(body, "response_id", events.FEEDBACK_CHECKS["response_id"]),
           "session_id": _text(body, "session_id", events.FEEDBACK_CHECKS["session_id"]),
           "turn_index": body.get("turn_index")}
    if out["response_id"] is not None:
        if out["session_id"] is not None or out["turn_index"] is not None:
            raise bad_request("name the turn by 'response_id' or by 'session_id' + 'turn_index', not both",
                              param="response_id")
        return out
    if out["session_id"] is None or out["turn_index"] is None:
        raise bad_request("name the turn: 'response_id' (the id of the answer) or 'session_id' + 'turn_index'",
                          param="response_id")
    idx = out["turn_index"]
    if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx <= events.MAX_INDEX:
        raise bad_request(f"'turn_index' must be an integer in [0, {events.MAX_INDEX}], got {str(idx)[:40]!r}",
                          param="turn_index")
    return out


def not_found(ref: dict) -> ProxyError:
    """404 for a turn this tenant has not recorded here (another tenant's turn gets the same answer)."""
    what = (f"response {ref['response_id'][:80]!r}" if ref.get("response_id") is not None else
            f"turn {ref['turn_index']} of session {ref['session_id'][:80]!r}")
    return ProxyError(404, f"{what} not found (unknown, dropped from this proxy's index of "
                           f"recorded turns, or answered by another replica)", param="response_id",
                      code="turn_not_found")


def feedback_event(turn: IndexedTurn, ref: dict, feedback_id: str, created_at: int) -> events.Feedback:
    """The ``feedback`` event of a checked body (``ref``) about ``turn``."""
    return events.Feedback(session_id=turn.session_id, turn_index=turn.turn_index, score=ref["score"],
                           feedback_id=feedback_id, turn_request_id=turn.request_id or None,
                           response_id=turn.response_id, comment=ref["comment"], source=ref["source"],
                           created_at=created_at, tenant=turn.tenant)


def answer(ev: events.Feedback) -> dict:
    """The JSON answer to an accepted feedback."""
    return {"id": f"fb_{ev.feedback_id}", "object": "feedback", "session_id": ev.session_id,
            "turn_index": ev.turn_index, "response_id": ev.response_id, "score": ev.score, "source": ev.source,
            "comment": ev.comment}
