"""Session identity without client changes, through the real proxy app over HTTP and a real
broker, in front of ``StandInEngine`` (a stand-in LLM: the rules do not depend on the model).

Clients: the ``openai`` SDK and the OpenAI Agents SDK (chat-completions mode) with no session
headers; raw HTTP for OpenClaw-shaped requests (its footer marker), unfilled header templates,
a static header shared by conversations, refused requests (issue 24 case 9) and a session the
proxy evicted (issue 24 case 4). Everything is checked from the ``turns`` topic.
"""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest

from pipeline.proxy import metrics as M
from pipeline.testing.proxy import stack
from pipeline.testing.servers import Reply
from pipeline.testing.topics import read_events

CHAT = "/v1/chat/completions"
FOOTER = "Runtime: agent=main | session=agent:main:main | sessionId={} | model=pipeline/m"


def _numbered():
    """A script whose answers all differ (``answer 1``, ``answer 2`` ...), as sampled ones do."""
    n = itertools.count(1)
    return lambda req: Reply(content=f"answer {next(n)}")


def _events(config, app, n):
    assert app.publisher.wait_idle(10)
    evs = read_events(config, "turns", n, timeout_s=15)
    assert len(evs) == n, [(e.TYPE, e.session_id) for e in evs]
    return evs


def _of(evs, kind):
    return [e for e in evs if e.TYPE == kind]


def _sessions_joined(evs, sid, n):
    """Assert session ``sid`` holds turns 0..n-1 and the next states after 0..n-2, each naming
    the request id of the turn it follows."""
    turns = [e for e in _of(evs, "turn") if e.session_id == sid]
    assert [t.turn_index for t in turns] == list(range(n))
    states = [e for e in _of(evs, "next_state") if e.session_id == sid]
    assert [(s.after_turn_index, s.after_request_id) for s in states] == [(k, turns[k].request_id)
                                                                         for k in range(n - 1)]
    return turns


def test_openai_sdk_without_headers_one_session_per_conversation(kafka_config):
    """Two conversations with the same opening, interleaved, three turns each (unary and
    streamed), no session metadata at all: one session each, indices 0..2, next states joined."""
    openai = pytest.importorskip("openai")
    with stack(kafka_config, _numbered()) as (url, app, up):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        convs = {"A": [{"role": "system", "content": "be brief"}], "B": [{"role": "system", "content": "be brief"}]}
        for k in range(3):
            for name, msgs in convs.items():
                msgs.append({"role": "user", "content": "hi" if k == 0 else f"{name} question {k}"})
                if k < 2:
                    out = client.chat.completions.create(model="m", messages=msgs)
                    text = out.choices[0].message.content
                else:
                    text = "".join(c.choices[0].delta.content or "" for c in
                                   client.chat.completions.create(model="m", messages=msgs, stream=True) if c.choices)
                msgs.append({"role": "assistant", "content": text})
        evs = _events(kafka_config, app, 10)
    sids = {e.session_id for e in _of(evs, "turn")}
    assert len(sids) == 2 and all(s.startswith("conv-") for s in sids)
    for sid in sids:
        turns = _sessions_joined(evs, sid, 3)
        assert [t.session_source for t in turns] == ["new", "continuation", "continuation"]
    assert not _of(evs, "session_end")


def test_openai_agents_sdk_chat_completions_three_turns_without_headers(kafka_config):
    """A second real agent client: the OpenAI Agents SDK driving the proxy as a chat-completions
    model, three turns from the run's own input list, no headers."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    with stack(kafka_config, _numbered()) as (url, app, up):
        async def chat() -> None:
            client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            model = agents.OpenAIChatCompletionsModel(model="m", openai_client=client)
            agent = agents.Agent(name="helper", instructions="Answer briefly.", model=model)
            items: list = []
            for k in range(3):
                items = items + [{"role": "user", "content": f"question {k}"}]
                result = await agents.Runner.run(agent, items)
                items = result.to_input_list()
            await client.close()

        asyncio.run(chat())
        evs = _events(kafka_config, app, 5)
    (sid,) = {e.session_id for e in _of(evs, "turn")}
    turns = _sessions_joined(evs, sid, 3)
    assert [t.session_source for t in turns] == ["new", "continuation", "continuation"]
    assert [s.messages[-1]["content"] for s in _of(evs, "next_state")] == ["question 1", "question 2"]


def test_openclaw_marker_names_the_session_and_the_prompt_goes_to_the_engine_unchanged(kafka_config):
    """OpenClaw's first user message carries ``sessionId=<id>`` and is replayed every turn: the
    session is ``openclaw:<id>`` (what the plugin's header gives), the marker beats ``user``, and
    the engine gets the messages byte for byte as sent."""
    with stack(kafka_config, _numbered()) as (url, app, up):
        sent = []
        for oc in ("7f3a-11", "9b2c-22"):
            msgs = [{"role": "system", "content": "You are OpenClaw."},
                    {"role": "user", "content": "hello\n\n" + FOOTER.format(oc)}]
            for k in range(3):
                body = {"model": "m", "messages": msgs, "stream": True, "user": "someone",
                        "stream_options": {"include_usage": True}, "tools": [], "tool_choice": "auto"}
                with httpx.stream("POST", url + CHAT, json=body) as s:
                    assert s.status_code == 200 and s.headers["x-session-id"] == f"openclaw:{oc}"
                    assert s.headers["x-session-source"] == "marker:openclaw"
                    s.read()
                sent.append([dict(m) for m in msgs])
                msgs = msgs + [{"role": "assistant", "content": up.answers[-1]["reply"].content},
                               {"role": "user", "content": f"more {k}"}]
        assert [r["messages"] for r in up.requests] == sent
        evs = _events(kafka_config, app, 10)
    for oc in ("7f3a-11", "9b2c-22"):
        turns = _sessions_joined(evs, f"openclaw:{oc}", 3)
        assert {t.session_source for t in turns} == {"marker:openclaw"}


def test_an_unfilled_header_template_is_served_with_a_warning_and_never_an_id(kafka_config):
    before = M.SESSION_IDS_IGNORED.labels("X-Session-Id", "template")._value.get()
    with stack(kafka_config, _numbered()) as (url, app, up):
        h = {"X-Session-Id": "${OC_RL_SESSION}"}
        msgs = [{"role": "user", "content": "q0"}]
        r = httpx.post(url + CHAT, json={"messages": msgs}, headers=h)
        assert r.status_code == 200 and "X-Session-Id ignored (template)" in r.headers["x-session-warning"]
        msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": "q1"}]
        r = httpx.post(url + CHAT, json={"messages": msgs, "session_id": "  "})
        assert r.status_code == 200 and "(empty)" in r.headers["x-session-warning"]
        assert r.headers["x-session-source"] == "continuation"
        r = httpx.post(url + "/v1/sessions/${OC_RL_SESSION}/end")  # no session to end: 400, not 500
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session_id"
        evs = _events(kafka_config, app, 3)
    assert M.SESSION_IDS_IGNORED.labels("X-Session-Id", "template")._value.get() == before + 1
    (sid,) = {e.session_id for e in _of(evs, "turn")}
    assert sid.startswith("conv-")
    _sessions_joined(evs, sid, 2)


def test_a_static_header_never_joins_two_conversations(kafka_config):
    """Issue 23 (3): one X-Session-Id for every conversation. The second conversation gets its
    own sub-session from index 0; its first message is nobody's next state."""
    with stack(kafka_config, _numbered()) as (url, app, up):
        h = {"X-Session-Id": "static"}
        for opening in ("first topic", "second topic"):
            msgs = [{"role": "user", "content": opening}]
            for k in range(2):
                r = httpx.post(url + CHAT, json={"messages": msgs}, headers=h)
                assert r.status_code == 200 and r.headers["x-turn-index"] == str(k)
                msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": f"{opening} {k}"}]
        evs = _events(kafka_config, app, 6)
    (sub,) = {t.session_id for t in _of(evs, "turn")} - {"static"}
    assert sub.startswith("static~")
    assert {t.messages[0]["content"] for t in _sessions_joined(evs, "static", 2)} == {"first topic"}
    assert {t.messages[0]["content"] for t in _sessions_joined(evs, sub, 2)} == {"second topic"}
    assert all(s.messages[0]["content"] != "second topic" for s in _of(evs, "next_state"))


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_request_is_not_a_turn(kafka_config, stream):
    """Issue 24 case 9: the engine refuses turn 1 (400). No turn, no index, no next state: the
    retry is turn 1 and publishes turn 0's next state; a refused request that ends the session
    still ends it."""
    answers = iter([Reply(content="a0"), Reply(status=400), Reply(content="a1"), Reply(status=400)])
    before = M.REFUSED.labels("400")._value.get()
    with stack(kafka_config, lambda req: next(answers)) as (url, app, up):
        h = {"X-Session-Id": f"refused-{stream}"}

        def post(msgs, **extra):
            with httpx.stream("POST", url + CHAT, json={"messages": msgs, "stream": stream},
                              headers={**h, **extra}) as s:
                s.read()
                return s

        msgs = [{"role": "user", "content": "q0"}]
        assert post(msgs).status_code == 200
        msgs += [{"role": "assistant", "content": "a0"}, {"role": "user", "content": "q1"}]
        assert post(msgs).status_code == 400
        r = post(msgs)
        assert r.status_code == 200 and r.headers["x-turn-index"] == "1"
        msgs += [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "bye"}]
        assert post(msgs, **{"X-Session-Done": "true"}).status_code == 400
        evs = _events(kafka_config, app, 4)
    assert [e.TYPE for e in evs] == ["turn", "next_state", "turn", "session_end"]
    assert [e.turn_index for e in _of(evs, "turn")] == [0, 1]
    ns = _of(evs, "next_state")[0]
    assert ns.after_turn_index == 0 and ns.request_id == _of(evs, "turn")[1].request_id
    assert M.REFUSED.labels("400")._value.get() == before + 2
    assert app.sessions.get(h["X-Session-Id"]) is None  # ended


def test_after_eviction_a_new_conversation_under_the_same_id_is_its_own(kafka_config):
    """Issue 24 case 4 (proxy side): the proxy drops session ``s`` (capacity 1), then a new
    conversation arrives under ``s``: its turns are 0, 1 and its next state names its own turn 0
    by request id, not the old conversation's."""
    with stack(kafka_config, _numbered(), max_sessions=1) as (url, app, up):
        def turns(sid, opening, n):
            msgs = [{"role": "user", "content": opening}]
            for k in range(n):
                r = httpx.post(url + CHAT, json={"messages": msgs}, headers={"X-Session-Id": sid})
                assert r.status_code == 200
                msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": f"{opening} {k}"}]

        turns("s", "old", 2)
        turns("t", "other", 1)  # evicts s
        assert app.sessions.get("s") is None
        turns("s", "new", 2)
        evs = _events(kafka_config, app, 7)
    s_turns = [e for e in _of(evs, "turn") if e.session_id == "s"]
    assert [t.turn_index for t in s_turns] == [0, 1, 0, 1]
    assert len({t.request_id for t in s_turns}) == 4
    states = [e for e in _of(evs, "next_state") if e.session_id == "s"]
    assert [(n.after_turn_index, n.after_request_id) for n in states] == [(0, s_turns[0].request_id),
                                                                         (0, s_turns[2].request_id)]
