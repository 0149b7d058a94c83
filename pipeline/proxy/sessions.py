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
- The next state is only proposed by :meth:`SessionTable.begin`; :meth:`SessionTable.accept`
  (the engine took the request) marks it published, :meth:`SessionTable.cancel` undoes a request
  the engine refused: its index is given back unless a later one was taken meanwhile.
- Side turns (``X-Turn-Type: side``) touch no state.
- Which session a request is in: :meth:`SessionTable.route` (a reused id's new conversation gets
  a sub-session ``<id>~<hash>``; ``docs/sessions.md``).

Sessions are keyed by ``(tenant, session id)``: two tenants sending one ``X-Session-Id`` are two
sessions (every method takes ``tenant``; None: no tenant).

State is bounded: at most ``max_sessions`` (least recently used dropped first) and sessions idle
for ``idle_s`` seconds are dropped by :meth:`SessionTable.expire`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from pipeline.proxy.identity import Chain, Conversations, assistant_parts, content_id

_FINGERPRINTS_KEPT = 32
_NOT_NEW = ("system", "developer")


def fingerprint(content: Any, tool_calls: Any) -> int:
    """A process-local hash of an assistant message in its normal form
    (:func:`pipeline.proxy.identity.assistant_parts`: a client that re-serialises it still matches)."""
    return hash(orjson.dumps(assistant_parts(content, tool_calls)))


@dataclass(slots=True)
class SessionState:
    """What the proxy remembers of one session."""

    next_index: int = 0
    last_done: int | None = None  # latest main turn whose response completed
    prints: OrderedDict = field(default_factory=OrderedDict)  # fingerprint -> turn index
    rids: OrderedDict = field(default_factory=OrderedDict)  # turn index -> request id (completed turns)
    next_state_for: OrderedDict = field(default_factory=OrderedDict)  # after_turn_index values published
    touched: float = 0.0
    #: request ids of turns recorded before this state existed that its requests continued
    #: (the session resumed after it was dropped)
    adopted: OrderedDict = field(default_factory=OrderedDict)


@dataclass(slots=True)
class MainTurn:
    """The outcome of :meth:`SessionTable.begin`.

    Attributes:
        turn_index: the index assigned to this request's turn.
        next_state: messages to publish as the previous turn's next state, or None.
        after_turn_index: the turn that next state follows.
        after_request_id: the request id of that turn, when this proxy recorded it.
        prev_next_index: the session's ``next_index`` before this request (for :meth:`SessionTable.cancel`).
        created: the session's state was created by this request.
    """

    turn_index: int
    next_state: list | None
    after_turn_index: int | None
    after_request_id: str | None = None
    prev_next_index: int = 0
    created: bool = False


class SessionTable:
    """Bounded LRU of :class:`SessionState` (see the module docstring for the rules).

    Args:
        max_sessions: sessions kept in memory (the least recently used is dropped).
        idle_s: seconds after which an untouched session is dropped by :meth:`expire`.
    """

    def __init__(self, max_sessions: int = 100_000, idle_s: float = 3600.0) -> None:
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self._s: OrderedDict[tuple[str | None, str], SessionState] = OrderedDict()  # (tenant, session id)

    def __len__(self) -> int:
        return len(self._s)

    def get(self, session_id: str, tenant: str | None = None) -> SessionState | None:
        """The state of a session, if held (does not touch it)."""
        return self._s.get((tenant, session_id))

    def _state(self, sid: tuple[str | None, str], now: float) -> SessionState:
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
              continue_final: bool = False, fresh: bool = False, continued: str | None = None,
              tenant: str | None = None) -> MainTurn:
        """Reserve the turn index of a main request and find its next state (atomic).

        The next state is only proposed: publish it after :meth:`accept` (the engine took the
        request); a request the engine refuses is undone with :meth:`cancel`.
        ``continue_final``: the request continues its trailing assistant message
        (``continue_final_message``); that message is the start of this turn's reply, not an
        earlier answer, and is left out of the rules. ``fresh``: the session was just derived
        for this request (``new``, or a sub-session of a new conversation): no next state.
        ``continued``: the request id of the recorded turn :meth:`route` found it continues
        (kept, so that the session's later requests continuing that turn stay in it).
        ``tenant``: the session's tenant (every method: a session is ``(tenant, session_id)``).
        """
        key = (tenant, session_id)
        created = key not in self._s
        st = self._state(key, time.monotonic() if now is None else now)
        if continued is not None:
            st.adopted[continued] = True
            while len(st.adopted) > _FINGERPRINTS_KEPT:
                st.adopted.popitem(last=False)
        if continue_final and messages and messages[-1].get("role") == "assistant":
            messages = messages[:-1]
        n_asst = 0
        last = -1
        for i, m in enumerate(messages):
            if m.get("role") == "assistant":
                n_asst += 1
                last = i
        prev = st.next_index
        index = max(prev, n_asst)
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
        if fresh or after is None or after >= index or not new or after in st.next_state_for:
            return MainTurn(index, None, None, prev_next_index=prev, created=created)
        return MainTurn(index, new, after, st.rids.get(after), prev, created)

    def accept(self, session_id: str, mt: MainTurn, tenant: str | None = None) -> bool:
        """The engine accepted the request of ``mt``: True when its next state is to be published
        now (once per previous turn: a concurrent or repeated request does not publish it again)."""
        if mt.next_state is None:
            return False
        st = self._s.get((tenant, session_id))
        if st is None:  # dropped meanwhile (capacity): the mark is gone with it
            return True
        if mt.after_turn_index in st.next_state_for:
            return False
        st.next_state_for[mt.after_turn_index] = True
        if len(st.next_state_for) > _FINGERPRINTS_KEPT:
            st.next_state_for.popitem(last=False)
        return True

    def cancel(self, session_id: str, mt: MainTurn, tenant: str | None = None) -> None:
        """Undo :meth:`begin` of a request the engine refused or never answered: the index is
        given back unless a later request of the session took one meanwhile (then it stays a
        gap, never a duplicate), and a session this request created is forgotten."""
        st = self._s.get((tenant, session_id))
        if st is None:
            return
        if st.next_index == mt.turn_index + 1:
            st.next_index = mt.prev_next_index
        if mt.created and st.next_index == 0 and st.last_done is None:
            del self._s[(tenant, session_id)]

    def route(self, claimed: str | None, chain: Chain, rid: str, convs: Conversations,
              tenant: str | None = None) -> tuple[str, bool, Any]:
        """``(session id, fresh, continued hit)`` of a request (see ``docs/sessions.md``).

        No claimed id: the session of the recorded turn it continues (:class:`Conversations`),
        else a new ``conv-<hash>`` (fresh). A claimed id (header, body, marker, user) ``S``: the
        continued turn's session when it is ``S`` or one of its sub-sessions; else ``S`` itself,
        or the one turn of ``S``'s family it continues when other sessions recorded the same one;
        unless ``S`` already has a completed turn here and the request is another conversation
        (it continues no turn of ``S``, or only an ambiguous or branched one, and its last
        assistant message is no answer of ``S``): that gets its own sub-session ``S~<hash>`` (fresh).
        A continued turn of ``S`` that ``S``'s state does not know (``S`` was dropped and another
        conversation took ``S`` since) is such another conversation too: continuing ``S`` would
        publish its reply as the next state of the other conversation's turn.
        ``tenant``: the request's tenant; ``chain`` must be its tenant's
        (:func:`~pipeline.proxy.identity.prompt_chain` with ``tenant``), so ``convs`` only finds
        turns of the same tenant.
        """
        hit = convs.find(chain)
        cont = convs.continues(hit, chain)
        if claimed is None:
            if cont is not None:
                return cont, False, hit
            return content_id("conv-", rid), True, None
        sub = claimed[:239] + "~"  # a sub-session id stays within 256 characters
        if cont is None or not (cont == claimed or cont.startswith(sub)):
            cont = convs.continues_claimed(hit, chain, claimed, sub)  # ambiguous only for unclaimed requests
        if cont is not None:
            if self._knows((tenant, cont), hit[1].request_of(cont)):
                return cont, False, hit
            return content_id(sub, rid), True, None
        st = self._s.get((tenant, claimed))
        if st is None or st.last_done is None:
            return claimed, False, None
        a = chain.last_assistant
        if hit is None and a is not None and fingerprint(a.get("content"), a.get("tool_calls")) in st.prints:
            return claimed, False, None  # S's conversation with an earlier message changed (a dated system prompt)
        if hit is None and len(chain.at_assistant) > st.last_done:
            return claimed, False, None  # it carries S's history by count: a client that rewrites its answers
        return content_id(sub, rid), True, None

    def _knows(self, session_id: tuple[str | None, str], request_id: str | None) -> bool:
        """The state of ``session_id`` is the conversation of the recorded turn of request
        ``request_id``: no state (it was dropped: it is re-created), no completed turn yet, or
        it completed or continued that turn."""
        st = self._s.get(session_id)
        return (st is None or st.last_done is None or request_id is None or request_id in st.adopted
                or request_id in st.rids.values())

    def complete(self, session_id: str, turn_index: int, content: Any, tool_calls: Any,
                 prefix: str | None = None, request_id: str | None = None, tenant: str | None = None) -> None:
        """Record that main turn ``turn_index`` (request ``request_id``) answered with this
        content / tool calls.

        ``prefix``: the assistant text the turn continued (``continue_final_message``); a client
        echoes the whole message, prefix + continuation, so that is recognised too.
        """
        st = self._s.get((tenant, session_id))
        if st is None:
            st = self._state((tenant, session_id), time.monotonic())
            st.next_index = max(st.next_index, turn_index + 1)
        if st.last_done is None or turn_index > st.last_done:
            st.last_done = turn_index
        st.prints[fingerprint(content, tool_calls)] = turn_index
        if prefix:
            st.prints[fingerprint(prefix + (content if isinstance(content, str) else ""), tool_calls)] = turn_index
        while len(st.prints) > _FINGERPRINTS_KEPT:
            st.prints.popitem(last=False)
        if request_id is not None:
            st.rids[turn_index] = request_id
            while len(st.rids) > _FINGERPRINTS_KEPT:
                st.rids.popitem(last=False)

    def end(self, session_id: str, tenant: str | None = None) -> None:
        """Forget a session (after ``X-Session-Done``)."""
        self._s.pop((tenant, session_id), None)

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
