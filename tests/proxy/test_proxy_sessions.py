"""The proxy's session rules without I/O (docs/sessions.md): which rule names a request's session,
conversation continuation by prefix digests, sub-sessions of a reused id, unfilled templates.

:class:`_Proxy` drives :class:`SessionTable` + :class:`Conversations` in the order the app does
for a request the engine accepts (route, begin, accept, complete, record); the same rules over
real HTTP: tests/proxy/test_proxy_identity_http.py.
"""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import events
from pipeline.proxy.errors import ProxyError
from pipeline.proxy.identity import (MARKERS, Conversations, canonical, claim, marker_id, prompt_chain, unfilled,
                                     user_id)
from pipeline.proxy.sessions import SessionTable
from pipeline.proxy.validate import session_meta

FOOTER = "Runtime: host=box | session=agent:main:main | sessionId={} | model=pipeline/m"


def _u(text):
    return {"role": "user", "content": text}


def _a(text):
    return {"role": "assistant", "content": text}


class _Proxy:
    """One proxy's session state, driven as the app drives it for accepted requests."""

    def __init__(self, capacity: int = 200_000, max_sessions: int = 100_000) -> None:
        self.table = SessionTable(max_sessions)
        self.convs = Conversations(capacity)
        self.n = 0

    def turn(self, messages: list, answer: str, claimed: str | None = None) -> tuple[str, int, object]:
        """``(session id, turn index, MainTurn)`` of one answered request."""
        self.n += 1
        rid = f"r{self.n}"
        chain = prompt_chain(messages)
        sid, fresh, hit = self.table.route(claimed, chain, rid, self.convs)
        mt = self.table.begin(sid, messages, fresh=fresh, continued=hit[1].request_of(sid) if hit else None)
        self.convs.accepted(hit, chain)
        if not self.table.accept(sid, mt):
            mt.next_state = None
        self.table.complete(sid, mt.turn_index, answer, None, request_id=rid)
        self.convs.record(chain.with_answer(answer, None), sid, rid)
        return sid, mt.turn_index, mt


def _converse(proxy: _Proxy, questions: list[str], answers: list[str], claimed=None) -> list[tuple[str, int]]:
    msgs: list = []
    out = []
    for q, a in zip(questions, answers):
        msgs = msgs + [_u(q)]
        sid, idx, _ = proxy.turn(msgs, a, claimed)
        out.append((sid, idx))
        msgs = msgs + [_a(a)]
    return out


# ---- continuation -------------------------------------------------------------------------------
def test_a_conversation_without_headers_is_one_session_with_indices_and_joined_next_states():
    p = _Proxy()
    msgs = [{"role": "system", "content": "be brief"}, _u("q0")]
    sid0, i0, mt0 = p.turn(msgs, "a0")
    assert sid0 == "conv-" + hashlib.sha256(b"r1").hexdigest()[:16] and i0 == 0 and mt0.next_state is None
    msgs += [_a("a0"), _u("q1")]
    sid1, i1, mt1 = p.turn(msgs, "a1")
    assert (sid1, i1, mt1.after_turn_index, mt1.after_request_id, mt1.next_state) == (sid0, 1, 0, "r1", [_u("q1")])
    # a client that re-serialises the answer (text parts, spaces) still continues
    msgs += [{"role": "assistant", "content": [{"type": "text", "text": " a1 "}]}, _u("q2")]
    sid2, i2, mt2 = p.turn(msgs, "a2")
    assert (sid2, i2, mt2.after_turn_index) == (sid0, 2, 1)


def test_same_opening_same_answer_then_different_replies_are_never_merged():
    """Two users say "hi" and get the same (greedy) answer: the prefix is recorded by two
    sessions, so it is ambiguous and neither continuation joins the other's session."""
    p = _Proxy()
    (a0,) = _converse(p, ["hi"], ["hello!"])
    (b0,) = _converse(p, ["hi"], ["hello!"])
    assert a0[0] != b0[0]
    a1 = p.turn([_u("hi"), _a("hello!"), _u("weather?")], "sunny")[0]
    b1 = p.turn([_u("hi"), _a("hello!"), _u("a joke?")], "no")[0]
    assert len({a0[0], b0[0], a1, b1}) == 4


def test_a_branch_of_a_continued_turn_is_a_new_session():
    """A second, different request continuing a turn that was already continued (an edited
    message, a copied history) is another conversation: it never joins the first one's session."""
    p = _Proxy()
    s0, _, _ = p.turn([_u("q")], "a")
    s1, _, _ = p.turn([_u("q"), _a("a"), _u("first")], "b")
    s2, i2, mt2 = p.turn([_u("q"), _a("a"), _u("edited")], "c")
    assert s1 == s0 and s2 != s0 and mt2.next_state is None and i2 == 1
    # a retry of the first continuation (same prompt) stays in the session
    s3, _, _ = p.turn([_u("q"), _a("a"), _u("first")], "b")
    assert s3 == s0


def test_continue_final_message_echo_continues_the_session():
    p = _Proxy()
    chain = prompt_chain([_u("q"), _a("Once upon")], continue_final=True)
    sid, fresh, hit = p.table.route(None, chain, "r0", p.convs)
    mt = p.table.begin(sid, [_u("q"), _a("Once upon")], continue_final=True, fresh=fresh)
    p.table.complete(sid, mt.turn_index, " a time.", None, prefix="Once upon", request_id="r0")
    p.convs.record(chain.with_answer("Once upon a time.", None), sid)
    assert p.turn([_u("q"), _a("Once upon a time."), _u("more")], "x")[0] == sid


def test_the_prefix_memory_is_bounded_and_forgets_least_recently_used():
    p = _Proxy(capacity=3)
    sa = p.turn([_u("a")], "1")[0]
    p.turn([_u("b")], "2")
    p.turn([_u("a"), _a("1"), _u("a2")], "3")  # touches a's prefix, records a's turn 1
    p.turn([_u("c")], "4")  # evicts b (least recently used)
    assert len(p.convs) == 3
    assert p.turn([_u("b"), _a("2"), _u("b2")], "5")[0].startswith("conv-")  # b forgotten: a new session
    assert p.turn([_u("a"), _a("1"), _u("a2"), _a("3"), _u("a3")], "6")[0] == sa


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)


@settings(max_examples=150, deadline=None)
@given(common=st.integers(0, 3), qa=st.lists(st.tuples(_text, _text), min_size=1, max_size=5),
       qb=st.lists(st.tuples(_text, _text), min_size=1, max_size=5), order=st.lists(st.booleans(), max_size=12),
       header=st.sampled_from([None, "static"]))
def test_two_conversations_never_share_a_session_once_they_differ(common, qa, qb, order, header):
    """Property: conversations A and B share their first ``common`` exchanges, then go on with
    their own (any text, equal or not), interleaved in any order, without headers or under one
    static X-Session-Id. After the first turn at which their prompts differ, no session holds
    turns of both; and the turn indices within each session are distinct."""
    shared = qa[:common]
    a = shared + qa[common:] if len(qa) > common else qa
    b = shared + qb
    p = _Proxy()
    state = {"A": ([], iter(a)), "B": ([], iter(b))}
    got: dict[str, list] = {"A": [], "B": []}
    order = order + [True] * len(a) + [False] * len(b)
    for pick in order:
        name = "A" if pick else "B"
        msgs, it = state[name]
        nxt = next(it, None)
        if nxt is None:
            continue
        q, ans = nxt
        msgs.append(_u(q))
        sid, idx, _ = p.turn(list(msgs), ans, header)
        got[name].append((list(msgs), sid, idx))
        msgs.append(_a(ans))
    for ma, sa, _ in got["A"]:
        for mb, sb, _ in got["B"]:
            if sa == sb:  # only identical prompts so far may share (indistinguishable)
                assert _same_until(ma, mb), (ma, mb)
    by_sid: dict[str, list] = {}
    for name in got:
        for _, sid, idx in got[name]:
            by_sid.setdefault(sid, []).append(idx)
    assert all(len(v) == len(set(v)) for v in by_sid.values())


def _same_until(ma: list, mb: list) -> bool:
    """Is one prompt a prefix of the other's, up to the shorter one's last assistant message?"""
    n = min(len(ma), len(mb))
    return [canonical(m) for m in ma[:n - 1]] == [canonical(m) for m in mb[:n - 1]]


# ---- claimed ids and sub-sessions ------------------------------------------------------------------
def test_a_static_header_gives_each_new_conversation_its_own_sub_session():
    """Issue 23 (3): one X-Session-Id configured for every conversation. The second conversation
    neither continues the first's turn indices nor becomes its next state."""
    p = _Proxy()
    first = _converse(p, ["q0", "q1", "q2"], ["a0", "a1", "a2"], claimed="static")
    assert first == [("static", 0), ("static", 1), ("static", 2)]
    sid, idx, mt = p.turn([_u("new topic")], "x", "static")
    assert sid.startswith("static~") and len(sid) == len("static~") + 16 and idx == 0 and mt.next_state is None
    sid2, idx2, mt2 = p.turn([_u("new topic"), _a("x"), _u("more")], "y", "static")
    assert (sid2, idx2, mt2.after_turn_index) == (sid, 1, 0)
    # the first conversation goes on where it was
    sid3, idx3, _ = p.turn([_u("q0"), _a("a0"), _u("q1"), _a("a1"), _u("q2"), _a("a2"), _u("q3")], "a3", "static")
    assert (sid3, idx3) == ("static", 3)
    # a long id keeps the sub-session id within the 256-character alphabet
    long = "x" * 256
    p.turn([_u("q")], "a", long)
    sub = p.turn([_u("other")], "b", long)[0]
    assert len(sub) == 256 and p.turn([_u("other"), _a("b"), _u("go on")], "c", long)[0] == sub


def test_after_eviction_a_new_conversation_under_the_same_id_starts_at_zero_with_its_own_next_states():
    """Issue 24 case 4 (proxy side): the session was dropped (capacity); a new conversation with
    the same id gets indices 0.. again and next states naming its own turns' request ids."""
    p = _Proxy(max_sessions=1)
    _converse(p, ["q0", "q1"], ["a0", "a1"], claimed="s")
    p.turn([_u("other")], "z", "t")  # evicts "s"
    assert p.table.get("s") is None
    sid0, i0, mt0 = p.turn([_u("n0")], "b0", "s")
    sid1, i1, mt1 = p.turn([_u("n0"), _a("b0"), _u("n1")], "b1", "s")
    assert (sid0, i0, mt0.next_state) == ("s", 0, None)
    assert (sid1, i1, mt1.after_turn_index, mt1.after_request_id) == ("s", 1, 0, f"r{p.n - 1}")


def test_headers_win_then_body_then_marker_then_user():
    marker = [_u("hello\n" + FOOTER.format("abc-123"))]
    w: list = []
    assert claim("hdr", "header", marker, "u1", w) == ("hdr", "header") and w == []
    assert claim(None, None, marker, "u1", w) == ("openclaw:abc-123", "marker:openclaw")
    assert claim(None, None, [_u("plain")], "u1", w) == ("user:u1", "user")
    assert claim(None, None, [_u("plain")], None, w) == (None, None) and w == []
    meta = session_meta({b"x-session-id": b"h"}, {"session_id": "b"}, "main")
    assert (meta.session_id, meta.source) == ("h", "header")
    meta = session_meta({}, {"session_id": "b"}, "main")
    assert (meta.session_id, meta.source) == ("b", "body")


def test_openclaw_marker_in_text_parts_and_only_in_the_first_user_message():
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "\n" + FOOTER.format("S1")}]
    assert marker_id([{"role": "system", "content": FOOTER.format("SYS")}, {"role": "user", "content": parts}]) == (
        "openclaw:S1", "marker:openclaw", None)
    assert marker_id([_u("no footer"), _u(FOOTER.format("later"))]) == (None, None, None)
    assert marker_id([_u("sessionId=abc without the Runtime line")]) == (None, None, None)
    assert marker_id([_u(FOOTER.format("${SESSION}"))])[0] is None
    # the footer split over lines, the id followed by punctuation
    assert marker_id([_u("hi\nRuntime: agent=main\nsession=agent:main:x | sessionId=ab-1; more")])[0] == "openclaw:ab-1"
    assert all(m.source in events.SESSION_SOURCES for m in MARKERS)


_TEMPLATES = st.one_of(
    st.builds(lambda a, v, b: f"{a}${{{v}}}{b}", _text, st.text(max_size=10), _text),
    st.builds(lambda a, v, b: f"{a}{{{{{v}}}}}{b}", _text, st.text(max_size=10), _text),
    st.builds(lambda v: f"<{v}>", st.text(st.characters(blacklist_characters="<>"), max_size=12)),
    st.builds(lambda v: "$" + v, st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True)),
    st.text(st.sampled_from(" \t"), max_size=4),
    st.sampled_from(["undefined", "null", "None", "nil"]),
)


@settings(max_examples=200, deadline=None)
@given(value=_TEMPLATES, where=st.sampled_from(["header", "body", "user", "marker"]))
def test_an_unfilled_template_never_becomes_a_session_id(value, where):
    """Property: a template, empty or unset-variable value in any place a session id can come
    from is ignored with a warning (the request is never refused for it) and the next rule decides."""
    assert unfilled(value) is not None
    headers, body, user, messages = {}, {}, None, [_u("hi")]
    if where == "header":
        try:
            headers[b"x-session-id"] = value.encode("latin-1")
        except UnicodeEncodeError:
            return
    elif where == "body":
        body["session_id"] = value
    elif where == "user":
        user = value
    else:  # the footer is space- and |-separated: a placeholder in it has neither
        if not value.strip() or any(c.isspace() or c in "|,;)]" for c in value):
            return
        messages = [_u(FOOTER.format(value))]
    try:
        meta = session_meta(headers, body, "main")
    except ProxyError as e:  # pragma: no cover - the property is that this never happens
        pytest.fail(f"refused: {e.message}")
    warnings = list(meta.warnings)
    sid, source = claim(meta.session_id, meta.source, messages, user, warnings)
    assert sid is None and source is None and warnings


def test_usable_values_are_ids_and_bad_ones_are_refused_or_ignored():
    assert unfilled("openclaw:abc") is None and unfilled("conv-1") is None and unfilled("a$b") is None
    assert unfilled("none") is None  # a word, not what a template engine writes for an unset value
    assert user_id("alice@example.com") == ("user:alice@example.com", None)
    assert user_id("two words") == (None, "invalid") and user_id(7) == (None, "invalid")
    with pytest.raises(ProxyError) as e:  # an explicit id outside the alphabet is still a 400
        session_meta({b"x-session-id": "über".encode("latin-1")}, {}, "main")
    assert e.value.status == 400


def test_session_source_has_a_domain_at_decode():
    t = events.Turn(session_id="s", turn_index=0, session_source="continuation")
    assert events.decode(events.encode(t)).session_source == "continuation"
    t.session_source = "guess"
    with pytest.raises(events.MalformedEvent, match="session_source"):
        events.decode(events.encode(t))
    old = events.Turn(session_id="s", turn_index=0)
    assert events.decode(events.encode(old)).session_source is None
    ns = events.NextState(session_id="s", messages=[_u("x")], after_turn_index=0, after_request_id="r1")
    assert events.decode(events.encode(ns)).after_request_id == "r1"


def test_a_claimed_conversation_whose_system_prompt_changes_stays_in_its_session():
    """A dated system prompt changes every turn: no recorded prefix matches, but the request's
    last assistant message is an answer of ``S``, so it is ``S``'s conversation; a conversation
    whose history holds no answer of ``S`` (a few-shot example) is another one."""
    p = _Proxy()
    p.turn([{"role": "system", "content": "12:00"}, _u("q0")], "a0", "S")
    sid, idx, mt = p.turn([{"role": "system", "content": "12:01"}, _u("q0"), _a("a0"), _u("q1")], "a1", "S")
    assert (sid, idx, mt.after_turn_index) == ("S", 1, 0)
    few_shot = [_u("example"), _a("example answer"), _u("real question")]
    sid, idx, _ = p.turn(few_shot, "x", "S")
    assert sid.startswith("S~") and idx == 1  # index from its assistant count, in its own session


@settings(max_examples=100, deadline=None)
@given(qa=st.lists(st.tuples(_text, _text), min_size=1, max_size=6), header=st.sampled_from([None, "h"]))
def test_one_conversation_alone_is_one_session_with_joined_next_states(qa, header):
    """Property: any single conversation (texts empty, repeated, equal to each other), with no
    headers or one id, is one session with turn indices 0..n-1 and each next state after the
    turn before it."""
    p = _Proxy()
    msgs: list = []
    got = []
    for q, a in qa:
        msgs = msgs + [_u(q)]
        sid, idx, mt = p.turn(msgs, a, header)
        got.append((sid, idx, mt.after_turn_index, mt.after_request_id))
        msgs = msgs + [_a(a)]
    assert len({g[0] for g in got}) == 1 and (header is None or got[0][0] == header)
    assert [g[1] for g in got] == list(range(len(qa)))
    assert [g[2:] for g in got] == [(None, None)] + [(k, f"r{k + 1}") for k in range(len(qa) - 1)]


def test_two_named_sessions_with_the_same_opening_and_answer_each_continue_their_own():
    # the same opening answered the same way in sessions A and B (greedy decoding, a shared
    # script): the recorded turn is ambiguous for requests that claim nothing, but a request that
    # names its session continues that session's turn; the first to continue it (A) does not
    # make B's follow-up a new conversation
    p = _Proxy()
    assert p.turn([_u("weather?")], "call", "A")[:2] == ("A", 0)
    assert p.turn([_u("weather?")], "call", "B")[:2] == ("B", 0)
    sid, idx, mt = p.turn([_u("weather?"), _a("call"), _u("21 C")], "warm", "A")
    assert (sid, idx, mt.after_turn_index) == ("A", 1, 0)
    sid, idx, mt = p.turn([_u("weather?"), _a("call"), _u("19 C")], "mild", "B")
    assert (sid, idx, mt.after_turn_index, mt.next_state) == ("B", 1, 0, [_u("19 C")])
    # claiming nothing, the shared turn stays ambiguous: a new conversation, never A's or B's
    sid, idx, _ = p.turn([_u("weather?"), _a("call"), _u("20 C")], "ok")
    assert sid.startswith("conv-") and idx == 1


def test_an_old_conversation_resuming_after_eviction_never_joins_the_new_one_under_its_id():
    """A static id ``s``: conversation A, then ``s`` is dropped (capacity), conversation B takes
    ``s`` again (0, 1). A's user comes back: the request continues A's recorded turn of ``s``,
    but ``s`` now holds B. It must not continue B's state: A's reply would be published as the
    next state after turn 1, which is B's turn 1 (a cross-conversation join), and A's turn would
    take B's next index. It goes to its own sub-session, with no next state."""
    p = _Proxy(max_sessions=2)
    _converse(p, ["q0", "q1"], ["a0", "a1"], claimed="s")
    p.turn([_u("other")], "z", "t")
    p.turn([_u("another")], "z", "u")  # evicts "s"
    assert p.table.get("s") is None
    _converse(p, ["n0", "n1"], ["b0", "b1"], claimed="s")  # B: turns 0, 1 of "s"
    b1_rid = f"r{p.n}"
    sid, idx, mt = p.turn([_u("q0"), _a("a0"), _u("q1"), _a("a1"), _u("q2")], "a2", "s")
    assert mt.after_request_id != b1_rid
    assert sid != "s" and sid.startswith("s~") and mt.next_state is None and idx == 2
    # B goes on in "s" with its own next state; A goes on in its sub-session
    sid_b, idx_b, mt_b = p.turn([_u("n0"), _a("b0"), _u("n1"), _a("b1"), _u("n2")], "b2", "s")
    assert (sid_b, idx_b, mt_b.after_turn_index, mt_b.after_request_id) == ("s", 2, 1, b1_rid)
    sid_a, _, mt_a = p.turn([_u("q0"), _a("a0"), _u("q1"), _a("a1"), _u("q2"), _a("a2"), _u("q3")], "a3", "s")
    assert sid_a == sid and mt_a.after_turn_index == 2


def test_a_regenerate_of_the_first_request_after_eviction_stays_in_the_session():
    """After ``s`` was dropped, A's next request re-creates ``s``; a retry of that same request
    (regenerate) continues the same recorded turn and stays in ``s``."""
    p = _Proxy(max_sessions=1)
    _converse(p, ["q0"], ["a0"], claimed="s")
    p.turn([_u("other")], "z", "t")  # evicts "s"
    msgs = [_u("q0"), _a("a0"), _u("q1")]
    assert p.turn(msgs, "a1", "s")[0] == "s"
    assert p.turn(msgs, "a1 again", "s")[0] == "s"


def test_two_claimed_ids_sharing_a_recorded_turn_each_continue_their_own():
    """Users ``x`` and ``y`` get the same answer to the same opening (greedy): the recorded turn
    is ambiguous, and each one's next request still continues its own session (by its own turn's
    request id), never a sub-session."""
    p = _Proxy()
    (y0,) = _converse(p, ["hi"], ["hello!"], claimed="y")
    (x0,) = _converse(p, ["hi"], ["hello!"], claimed="x")
    x1 = p.turn([_u("hi"), _a("hello!"), _u("weather?")], "sunny", "x")
    y1 = p.turn([_u("hi"), _a("hello!"), _u("a joke?")], "no", "y")
    assert (x0[0], y0[0]) == ("x", "y")
    assert (x1[0], x1[2].after_turn_index) == ("x", 0) and (y1[0], y1[2].after_turn_index) == ("y", 0)


def test_a_reused_id_whose_new_conversation_opens_like_the_ended_one_keeps_its_next_states():
    """``s`` ends (``X-Session-Done``: the state is forgotten), then a new conversation under ``s``
    opens with the same message and gets the same answer, so it records the same turn as the
    ended one. Its next request continues that recorded turn: the state of ``s`` knows it by the
    new turn's request id, so it stays in ``s`` and its next state follows turn 0 (found when a
    proxy crash test reused its warm-up session id)."""
    p = _Proxy()
    _converse(p, ["q0"], ["ok"], claimed="s")
    p.table.end("s")
    sid0, i0, _ = p.turn([_u("q0")], "ok", "s")
    t0_rid = f"r{p.n}"
    sid1, i1, mt1 = p.turn([_u("q0"), _a("ok"), _u("q1")], "ok", "s")
    assert (sid0, i0) == ("s", 0)
    assert (sid1, i1, mt1.after_turn_index, mt1.after_request_id) == ("s", 1, 0, t0_rid)
    assert mt1.next_state == [_u("q1")]
