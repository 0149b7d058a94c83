"""An agent's own housekeeping calls are never trainable turns nor sessions of their own
(issue 41): OpenClaw's compaction, titles, memory flushes and heartbeats, recognised from the
real prompt texts of OpenClaw 2026.9.6 (``tests/fixtures/openclaw_housekeeping.json``, copied
from its ``dist/`` bundle), with and without the plugin's headers.

Unit tests of :func:`pipeline.proxy.housekeeping.recognise`, then the real proxy over HTTP in
front of a stand-in engine and a real broker, checked from the ``turns`` topic; then the
dashboard's fold of such turns.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from pipeline import events
from pipeline.proxy import metrics as M
from pipeline.proxy.housekeeping import recognise
from pipeline.testing.proxy import stack
from pipeline.testing.servers import Reply
from pipeline.testing.topics import read_events

P = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "openclaw_housekeeping.json").read_text())
CHAT = "/v1/chat/completions"
FOOTER = "Runtime: agent=main | session=agent:main:main | sessionId={} | model=pipeline/m"
SYSTEM = "You are a personal assistant running inside OpenClaw."


def compaction(previous: str | None = None, prompt: str = P["SUMMARIZATION_PROMPT"]) -> list[dict]:
    """A compaction request as OpenClaw builds it (runSummarizationCompletion): the summariser's
    system prompt and one user message with the serialised conversation and the summary prompt."""
    text = "<conversation>\n[User]: plan my trip to Lyon\n\n[Assistant]: Sure, when?\n</conversation>\n\n"
    if previous:
        text += f"<previous-summary>\n{previous}\n</previous-summary>\n\n"
    return [{"role": "system", "content": P["SUMMARIZATION_SYSTEM_PROMPT"]},
            {"role": "user", "content": [{"type": "text", "text": text + prompt}]}]


def title() -> list[dict]:
    return [{"role": "system", "content": P["TITLE_SYSTEM_PROMPT"]}, {"role": "user", "content": "plan my trip to Lyon"}]


def in_session(oc: str, last_user: str, system: str = SYSTEM) -> list[dict]:
    """A request of OpenClaw session ``oc`` (its footer) whose latest user message is ``last_user``."""
    return [{"role": "system", "content": system},
            {"role": "user", "content": "plan my trip to Lyon\n\n" + FOOTER.format(oc)},
            {"role": "assistant", "content": "Sure, when?"},
            {"role": "user", "content": last_user}]


@pytest.mark.parametrize("messages,kind", [
    (compaction(), "compaction"),
    (compaction("## Goal\nA trip", P["UPDATE_SUMMARIZATION_PROMPT"]), "compaction"),
    (compaction(None, P["TURN_PREFIX_SUMMARIZATION_PROMPT"]), "compaction"),
    (title(), "title"),
    (in_session("s1", P["MEMORY_FLUSH_PROMPT"]), "memory"),
    (in_session("s1", "anything", SYSTEM + "\n\n" + P["MEMORY_FLUSH_SYSTEM_PROMPT"]), "memory"),
    (in_session("s1", P["HEARTBEAT_PROMPT"]), "heartbeat"),
    (in_session("s1", "[OpenClaw heartbeat poll]"), "heartbeat"),
])
def test_openclaw_housekeeping_prompts_are_recognised(messages, kind):
    hk = recognise(messages)
    assert hk is not None and (hk.agent, hk.kind) == ("openclaw", kind)
    assert hk.label == f"openclaw:{kind}" and hk.session_id == "housekeeping:openclaw"


@pytest.mark.parametrize("messages", [
    in_session("s1", "and book a hotel"),  # an ordinary turn
    in_session("s1", "what does 'Pre-compaction memory flush' mean?") + [],  # not where the flush puts it
    [{"role": "user", "content": P["SUMMARIZATION_SYSTEM_PROMPT"][:60]}],  # a user quoting a part of it
    in_session("s1", "thanks")[:2] + [{"role": "assistant", "content": P["HEARTBEAT_PROMPT"]},
                                      {"role": "user", "content": "ok"}],  # the text, but not the latest ask
    # a heartbeat earlier in the history: the latest user message decides
    in_session("s1", P["HEARTBEAT_PROMPT"]) + [{"role": "assistant", "content": "NO_REPLY"},
                                               {"role": "user", "content": "and book a hotel"}],
    [],
])
def test_ordinary_requests_are_not_housekeeping(messages):
    assert recognise(messages) is None


def _turns(config, app, n):
    assert app.publisher.wait_idle(10)
    evs = read_events(config, "turns", n, timeout_s=15)
    assert len(evs) == n, [(e.TYPE, e.session_id) for e in evs]
    return evs


def _count(kind: str) -> float:
    return M.HOUSEKEEPING.labels("openclaw", kind)._value.get()


def test_compaction_without_headers_is_a_side_turn_in_no_conversation(kafka_config):
    """OpenClaw's chat (footer only), its compaction call with no header at all in the middle, then
    the chat goes on: the compaction is a side turn of ``housekeeping:openclaw`` (no index, no next
    state, no ``conv-`` session), counted; the conversation's turns 0..2 and next states are joined."""
    oc = "6f1c-compact"
    before = _count("compaction")
    with stack(kafka_config, lambda req: Reply(content="## Goal\nA trip")) as (url, app, _up):
        with httpx.Client(base_url=url, timeout=30) as c:
            msgs = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "plan my trip to Lyon\n\n" + FOOTER.format(oc)}]
            for k in range(3):
                r = c.post(CHAT, json={"model": "m", "messages": msgs, "stream": k == 1})
                assert r.status_code == 200 and r.headers["x-session-id"] == f"openclaw:{oc}"
                msgs += [{"role": "assistant", "content": "## Goal\nA trip"}, {"role": "user", "content": f"more {k}"}]
                if k == 1:  # compaction between turns 1 and 2, streamed as OpenClaw does
                    h = c.post(CHAT, json={"model": "m", "messages": compaction(), "stream": True,
                                           "stream_options": {"include_usage": True}})
                    assert h.status_code == 200 and h.headers["x-session-id"] == "housekeeping:openclaw"
                    assert h.headers["x-session-source"] == "housekeeping" and "x-turn-index" not in h.headers
        evs = _turns(kafka_config, app, 6)  # 3 main turns, 2 next states, 1 side turn
    turns = [e for e in evs if e.TYPE == "turn"]
    side = [t for t in turns if t.turn_type == "side"]
    assert len(side) == 1 and side[0].session_id == "housekeeping:openclaw" and side[0].turn_index is None
    assert side[0].housekeeping == "openclaw:compaction" and side[0].session_source == "housekeeping"
    main = [t for t in turns if t.turn_type == "main"]
    assert [(t.session_id, t.turn_index, t.housekeeping) for t in main] == [(f"openclaw:{oc}", i, None) for i in range(3)]
    states = [e for e in evs if e.TYPE == "next_state"]
    assert [(s.session_id, s.after_turn_index) for s in states] == [(f"openclaw:{oc}", 0), (f"openclaw:{oc}", 1)]
    assert not any(e.session_id.startswith("conv-") for e in evs)
    assert _count("compaction") == before + 1


def test_housekeeping_with_the_plugins_headers_stays_in_its_session_as_side(kafka_config):
    """With the plugin's ``X-Session-Id`` (and even an explicit ``X-Turn-Type: main``) a
    heartbeat, a memory flush and a title call are side turns of that session: the session's
    main turns keep their indices 0, 1 and the next state of turn 0 is the user's next message."""
    oc = "77aa-plugin"
    sid = f"openclaw:{oc}"
    hdr = {"X-Session-Id": sid}
    with stack(kafka_config, lambda req: Reply(content="NO_REPLY")) as (url, app, _up):
        with httpx.Client(base_url=url, timeout=30) as c:
            first = in_session(oc, "plan my trip to Lyon")[:2]
            assert c.post(CHAT, json={"model": "m", "messages": first}, headers=hdr).headers["x-turn-index"] == "0"
            for msgs in (in_session(oc, P["HEARTBEAT_PROMPT"]), in_session(oc, P["MEMORY_FLUSH_PROMPT"]), title()):
                r = c.post(CHAT, json={"model": "m", "messages": msgs}, headers={**hdr, "X-Turn-Type": "main"})
                assert r.status_code == 200 and r.headers["x-session-id"] == sid and "x-turn-index" not in r.headers
            second = first + [{"role": "assistant", "content": "NO_REPLY"}, {"role": "user", "content": "in May"}]
            assert c.post(CHAT, json={"model": "m", "messages": second}, headers=hdr).headers["x-turn-index"] == "1"
        evs = _turns(kafka_config, app, 6)  # 2 main, 3 side, 1 next state
    turns = [e for e in evs if e.TYPE == "turn"]
    assert [(t.turn_type, t.housekeeping) for t in turns] == [
        ("main", None), ("side", "openclaw:heartbeat"), ("side", "openclaw:memory"), ("side", "openclaw:title"),
        ("main", None)]
    assert {t.session_id for t in turns} == {sid}
    (state,) = [e for e in evs if e.TYPE == "next_state"]
    assert state.after_turn_index == 0 and state.messages == [{"role": "user", "content": "in May"}]


def test_housekeeping_without_a_session_is_not_recorded_when_anonymous_is_skip(kafka_config):
    with stack(kafka_config, lambda req: Reply(content="Trip to Lyon"), anonymous="skip") as (url, app, _up):
        with httpx.Client(base_url=url, timeout=30) as c:
            r = c.post(CHAT, json={"model": "m", "messages": title()})
            assert r.status_code == 200 and "x-session-id" not in r.headers
            c.post(CHAT, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, headers={"X-Session-Id": "s"})
        evs = _turns(kafka_config, app, 1)
    assert [(e.session_id, e.turn_type) for e in evs] == [("s", "main")]


def test_a_housekeeping_turn_must_be_side():
    with pytest.raises(events.MalformedEvent):
        events.Turn(session_id="s", turn_index=0, housekeeping="openclaw:title").validate()
    events.Turn(session_id="s", turn_type="side", housekeeping="openclaw:title").validate()


def test_the_dashboard_counts_housekeeping_and_lists_no_session_for_it():
    """A housekeeping turn is counted; it is a side turn of a session listed for its conversation,
    never a session of its own (nor open)."""
    from pipeline.bus import Record
    from pipeline.config import load_config
    from pipeline.dashboard.state import DashboardState

    state = DashboardState(load_config(None))
    evs = [events.Turn(session_id="openclaw:a", turn_index=0, response_token_ids=[1], response_logprobs=[-1.0]),
           events.Turn(session_id="housekeeping:openclaw", turn_type="side", session_source="housekeeping",
                       housekeeping="openclaw:compaction"),
           events.Turn(session_id="openclaw:a", turn_type="side", session_source="header",
                       housekeeping="openclaw:heartbeat"),
           # OpenClaw runs its memory flush in an internal session of its own: not a conversation either
           events.Turn(session_id="openclaw:internal-session-effects-1", turn_type="side",
                       session_source="marker:openclaw", housekeeping="openclaw:memory")]
    for i, ev in enumerate(evs):
        state.apply(Record("turns", 0, i, ev.session_id, ev, events.now_ms()))
    t = state.overview()["traffic"]
    assert (t["sessions"], t["sessions_open"], t["main_turns"], t["side_turns"]) == (1, 1, 1, 3)
    assert t["housekeeping"] == {"openclaw:compaction": 1, "openclaw:heartbeat": 1, "openclaw:memory": 1}
    assert [s["session_id"] for s in state.sessions_list()] == ["openclaw:a"]
    assert [x["housekeeping"] for x in state.session("openclaw:a")["turns"]] == [None, "openclaw:heartbeat"]
