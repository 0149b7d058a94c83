"""Per-session state of the proxy: turn indices and which messages are a turn's next state.

All methods run on the event loop thread and never await, so each call is atomic with respect to
every other request of the same session: turn indices are unique and increasing even when one
session sends concurrent requests (no lock is needed; an ``await`` inside these methods would
break that and is not allowed).

Rules (documented defaults, see :mod:`pipeline.proxy`):

- A main request gets ``turn_index = max(next_index, number of assistant messages in it)``. The
  second term keeps indices increasing after the state of a session was lost (proxy restart,
  LRU eviction, another replica): in a sequential conversation turn *k*'s request holds *k*
  assistant messages. A request that fails leaves a gap in the indices (never a duplicate).
- Its next state is every message after the last assistant message of the request (user
  replies, all tool results), published only when that assistant message belongs to a known
  turn: the turn whose response has the same fingerprint (content + tool calls), else the
  later of the latest main turn completed here and ``assistant count - 1``. The second term
  matters with several proxies behind a round-robin front: turn k-1 may have been answered by
  another replica, and this one's latest completed turn is then an older one (answering with
  it would attach turn k-1's next state to turn k-2, and turn k-1 would never be judged). A
  next state is published once per previous turn by a given proxy (a retry or a "regenerate"
  through the same proxy does not publish a second one; through another proxy it may, and the
  judge ignores the copy).
- A request with ``continue_final_message`` continues its trailing assistant message: that
  message is the start of this turn's own reply, so it is neither counted nor taken as the
  previous answer (the messages before it are the next state), and the continued turn is
  recognised later by prefix + continuation, as clients echo it.
- Side turns (``X-Turn-Type: side``) touch no state.

State is bounded: at most ``max_sessions`` (least recently used dropped first) and sessions idle
for ``idle_s`` seconds are dropped by :meth:`SessionTable.expire`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

_FINGERPRINTS_KEPT = 32
_NOT_NEW = ("system", "developer")


def fingerprint(content: Any, tool_calls: Any) -> int:
    """A process-local hash of an assistant message's content and tool calls.

    Whitespace at the ends of the content and the JSON formatting of tool-call arguments are
    normalised, so a client that re-serialises the message still matches.
    """
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    parts: list[Any] = [content.strip() if isinstance(content, str) else ""]
    for tc in tool_calls or ():
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict):
            continue
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = orjson.dumps(orjson.loads(args), option=orjson.OPT_SORT_KEYS).decode()
            except orjson.JSONDecodeError:
                args = args.strip()
        parts.append((fn.get("name"), args))
    return hash(tuple(parts))


@dataclass(slots=True)
class SessionState:
    """What the proxy remembers of one session."""

    next_index: int = 0
    last_done: int | None = None  # latest main turn whose response completed
    prints: OrderedDict = field(default_factory=OrderedDict)  # fingerprint -> turn index
    next_state_for: OrderedDict = field(default_factory=OrderedDict)  # after_turn_index values published
    touched: float = 0.0


@dataclass(slots=True)
class MainTurn:
    """The outcome of :meth:`SessionTable.begin`.

    Attributes:
        turn_index: the index assigned to this request's turn.
        next_state: messages to publish as the previous turn's next state, or None.
        after_turn_index: the turn that next state follows.
    """

    turn_index: int
    next_state: list | None
    after_turn_index: int | None


class SessionTable:
    """Bounded LRU of :class:`SessionState` (see the module docstring for the rules).

    Args:
        max_sessions: sessions kept in memory (the least recently used is dropped).
        idle_s: seconds after which an untouched session is dropped by :meth:`expire`.
    """

    def __init__(self, max_sessions: int = 100_000, idle_s: float = 3600.0) -> None:
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self._s: OrderedDict[str, SessionState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._s)

    def get(self, session_id: str) -> SessionState | None:
        """The state of a session, if held (does not touch it)."""
        return self._s.get(session_id)

    def _state(self, sid: str, now: float) -> SessionState:
        st = self._s.get(sid)
        if st is None:
            st = self._s[sid] = SessionState()
            if len(self._s) > self.max_sessions:
                self._s.popitem(last=False)
        else:
            self._s.move_to_end(sid)
        st.touched = now
        return st

    def begin(self, session_id: str, messages: list, now: float | None = None,
              continue_final: bool = False) -> MainTurn:
        """Assign the turn index of a main request and find its next state (atomic).

        ``continue_final``: the request continues its trailing assistant message
        (``continue_final_message``); that message is the start of this turn's reply, not an
        earlier answer, and is left out of the rules.
        """
        st = self._state(session_id, time.monotonic() if now is None else now)
        if continue_final and messages and messages[-1].get("role") == "assistant":
            messages = messages[:-1]
        n_asst = 0
        last = -1
        for i, m in enumerate(messages):
            if m.get("role") == "assistant":
                n_asst += 1
                last = i
        index = max(st.next_index, n_asst)
        st.next_index = index + 1
        if last >= 0:
            new = messages[last + 1:]
            a = messages[last]
            after = st.prints.get(fingerprint(a.get("content"), a.get("tool_calls")))
            if after is None:  # answered elsewhere (another replica, a lost state) or edited by the client
                after = max(st.last_done, n_asst - 1) if st.last_done is not None else n_asst - 1
        else:
            new = [m for m in messages if m.get("role") not in _NOT_NEW]
            after = st.last_done
        if after is None or after >= index or not new or after in st.next_state_for:
            return MainTurn(index, None, None)
        st.next_state_for[after] = True
        if len(st.next_state_for) > _FINGERPRINTS_KEPT:
            st.next_state_for.popitem(last=False)
        return MainTurn(index, new, after)

    def complete(self, session_id: str, turn_index: int, content: Any, tool_calls: Any,
                 prefix: str | None = None) -> None:
        """Record that main turn ``turn_index`` answered with this content / tool calls.

        ``prefix``: the assistant text the turn continued (``continue_final_message``); a client
        echoes the whole message, prefix + continuation, so that is recognised too.
        """
        st = self._s.get(session_id)
        if st is None:
            st = self._state(session_id, time.monotonic())
            st.next_index = max(st.next_index, turn_index + 1)
        if st.last_done is None or turn_index > st.last_done:
            st.last_done = turn_index
        st.prints[fingerprint(content, tool_calls)] = turn_index
        if prefix:
            st.prints[fingerprint(prefix + (content if isinstance(content, str) else ""), tool_calls)] = turn_index
        while len(st.prints) > _FINGERPRINTS_KEPT:
            st.prints.popitem(last=False)

    def end(self, session_id: str) -> None:
        """Forget a session (after ``X-Session-Done``)."""
        self._s.pop(session_id, None)

    def expire(self, now: float | None = None) -> int:
        """Drop sessions idle for more than ``idle_s``; returns how many were dropped."""
        now = time.monotonic() if now is None else now
        n = 0
        while self._s:
            sid, st = next(iter(self._s.items()))
            if now - st.touched < self.idle_s:
                break
            self._s.popitem(last=False)
            n += 1
        return n
