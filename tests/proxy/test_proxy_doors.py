"""The Responses (``/v1/responses``) and Messages (``/v1/messages``) front doors, end to end.

The official clients (``openai``'s ``responses``, ``anthropic``) talk to the real proxy over HTTP,
and every answered request must be recorded on ``turns`` as the same kind of chat ``turn`` the
chat door records: exact token ids and log-probs, messages in the chat shape, the same session
rules. Two upstreams:

- the CPU engine with the tiny random model (real tokens; it writes nonsense and never calls a
  tool): basic and streamed requests; a turn's exactness is checked by replaying its recorded
  chat request (``messages``, ``tools``, ``sampling``) on the engine at temperature 0 and
  comparing prompt ids, answer ids and log-probs;
- ``StandInEngine``, a scripted stand-in (NOT a model), where a tool call is needed: the tool
  round trips, whose turns must carry exactly the ids and log-probs it answered.

Bad bodies are sent as raw HTTP: each gets its API's own error shape with a 4xx status.
"""

from __future__ import annotations

import contextlib
import types

import anthropic
import httpx
import openai
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.proxy.errors import ProxyError
from pipeline.proxy.messages import MessagesDoor, chat_messages, content_blocks, stop_reason
from pipeline.proxy.responses import ResponsesDoor, ResponseStore, input_messages, output_items
from pipeline.testing.proxy import running_proxy
from pipeline.testing.servers import Reply, StandInEngine, serve_app
from pipeline.testing.topics import read_records

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
R_TOOLS = [{"type": "function", "name": "get_weather", "description": "weather of a city", "parameters": WEATHER}]
A_TOOLS = [{"name": "get_weather", "description": "weather of a city", "input_schema": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                                "parameters": WEATHER}}]


def _session(config, key: str, n: int) -> list:
    """The events of session ``key`` on ``turns`` once there are at least ``n``."""
    recs = read_records(config, config.topics.name("turns"),
                        lambda evs: sum(getattr(e, "session_id", None) == key for e in evs) >= n, timeout_s=15)
    out = [r.event for r in recs if r.key == key]
    assert len(out) >= n, [e.TYPE for e in out]
    return out


def _assert_exact(engine_url: str, turn) -> None:
    """Replaying a greedy turn's chat request on the engine gives its prompt ids, ids and log-probs."""
    body = {"messages": turn.messages, **turn.sampling, **(turn.chat_options or {}), "logprobs": True,
            "return_token_ids": True}
    if turn.tools:
        body["tools"] = turn.tools
    r = httpx.post(engine_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert turn.prompt_token_ids == c["prompt_token_ids"]
    assert turn.response_token_ids == c["token_ids"] and len(c["token_ids"]) > 0
    assert turn.response_logprobs == pytest.approx([e["logprob"] for e in c["logprobs"]["content"]], abs=1e-5)


@contextlib.contextmanager
def stand_in(config, script, **proxy):
    up = StandInEngine(script)
    with serve_app(up) as up_url, running_proxy(config, up_url, **proxy) as (url, app):
        yield url, app, up


def _weather(req: dict) -> Reply:
    """Call the tool first; answer from its result once there is one."""
    if req["messages"][-1]["role"] == "tool":
        return Reply(content="It is " + req["messages"][-1]["content"] + " in Paris.")
    return Reply(content="", tool_calls=[("get_weather", '{"city": "Paris"}')])


# ---- translation units -------------------------------------------------------------------------
def test_translations_both_ways_give_one_chat_shape():
    # an answer's output items / content blocks read back as the chat message it came from
    call = {"id": "call_7", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    back = input_messages(output_items("r1", "thinking aloud", [call]))
    assert back == [{"role": "assistant", "content": "thinking aloud", "tool_calls": [call]}]
    blocks = content_blocks("", [call])
    assert blocks == [{"type": "tool_use", "id": "call_7", "name": "f", "input": {"a": 1}}]
    (asst,) = chat_messages(None, [{"role": "assistant", "content": blocks}])
    assert asst["tool_calls"][0]["id"] == "call_7" and orjson.loads(asst["tool_calls"][0]["function"]["arguments"]) == {
        "a": 1}
    # tool results come first, then the user's text
    msgs = chat_messages([{"type": "text", "text": "sys"}], [{"role": "user", "content": [
        {"type": "text", "text": "and then?"}, {"type": "tool_result", "tool_use_id": "call_7", "content": "2"}]}])
    assert msgs == [{"role": "system", "content": "sys"}, {"role": "tool", "tool_call_id": "call_7", "content": "2"},
                    {"role": "user", "content": "and then?"}]
    assert stop_reason("stop", "END", ["END"]) == ("stop_sequence", "END")
    assert stop_reason("stop", "END", None) == ("end_turn", None)
    assert stop_reason("length", None, None) == ("max_tokens", None)
    assert stop_reason("tool_calls", None, None) == ("tool_use", None)


def test_response_store_is_bounded_by_bytes_least_recent_first():
    store = ResponseStore(300)
    for i in range(10):
        store.put(f"r{i}", "s", [{"role": "user", "content": "x" * 20}], [])
    assert 0 < len(store) < 10 and store.bytes <= 300
    assert store.get("r0") is None and store.get("r9") == ("s", [{"role": "user", "content": "x" * 20}], [])
    store.put("big", None, [{"role": "user", "content": "y" * 400}], [])
    assert store.get("big") is None  # larger than the bound: not kept, nothing else lost
    assert ResponseStore(0).get("r9") is None


# ---- the official clients, the tiny model ------------------------------------------------------
def test_responses_client_basic_stream_and_previous_response_id_record_exact_turns(engine_url, kafka_config):
    with running_proxy(kafka_config, engine_url, api_keys=["secret"]) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="secret", max_retries=0)
        model = client.models.list().data[0].id
        r1 = client.responses.create(model=model, instructions="Be brief.", input="What is 2+2?",
                                     max_output_tokens=8, temperature=0, extra_headers={"X-Session-Id": "resp-1"})
        assert r1.status in ("completed", "incomplete") and r1.id.startswith("resp_")
        assert r1.output[0].type == "message" and r1.usage.output_tokens > 0
        # the follow-up names no session: previous_response_id continues resp-1
        types, text, final = [], "", None
        for ev in client.responses.create(model=model, instructions="Be brief.", input="And 3+3?",
                                          previous_response_id=r1.id, max_output_tokens=8, temperature=0,
                                          stream=True):
            types.append(ev.type)
            if ev.type == "response.output_text.delta":
                text += ev.delta
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
        assert types[:2] == ["response.created", "response.in_progress"]
        assert "response.output_item.added" in types and "response.output_item.done" in types
        assert [ev for ev in types if ev.startswith("response.") and ev.endswith(("completed", "incomplete"))] == [
            types[-1]]
        assert final.output_text == text and final.previous_response_id == r1.id
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=model, input="x", previous_response_id="resp_unknown")
        assert e.value.code == "previous_response_not_found"
        assert app.publisher.wait_idle(10)
        evs = _session(kafka_config, "resp-1", 3)
    assert [e.TYPE for e in evs[:3]] == ["turn", "next_state", "turn"]
    t0, ns, t1 = evs[:3]
    assert t0.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert t0.response["content"] == r1.output_text and t0.sampling == {"max_tokens": 8, "temperature": 0}
    assert t1.turn_index == 1 and t1.messages == t0.messages + [
        {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "And 3+3?"}]
    assert ns.messages == [{"role": "user", "content": "And 3+3?"}] and ns.after_turn_index == 0
    # which rule chose each turn's session: the client's header, then its previous response's
    assert (t0.session_source, t1.session_source) == ("header", "previous_response")
    assert t1.response["content"] == text and final.usage.output_tokens == len(t1.response_token_ids)
    for t in (t0, t1):
        _assert_exact(engine_url, t)


def test_anthropic_client_basic_and_stream_record_exact_turns(engine_url, kafka_config):
    with running_proxy(kafka_config, engine_url, api_keys=["secret"]) as (url, app):
        client = anthropic.Anthropic(base_url=url, api_key="secret", max_retries=0)
        msgs = [{"role": "user", "content": "What is 2+2?"}]
        m1 = client.messages.create(model="tiny", system="Be brief.", messages=msgs, max_tokens=8,
                                    extra_body={"temperature": 0}, extra_headers={"X-Session-Id": "anth-1"})
        assert m1.type == "message" and m1.role == "assistant" and m1.content[0].type == "text"
        assert m1.stop_reason in ("end_turn", "max_tokens") and m1.usage.output_tokens > 0
        msgs += [{"role": "assistant", "content": m1.content[0].text}, {"role": "user", "content": "And 3+3?"}]
        with client.messages.stream(model="tiny", system=[{"type": "text", "text": "Be brief."}], messages=msgs,
                                    max_tokens=8, extra_body={"temperature": 0}, tools=A_TOOLS,
                                    extra_headers={"X-Session-Id": "anth-1", "X-Session-Done": "true"}) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        assert final.content[0].text == text and final.usage.output_tokens > 0
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
                model="tiny", messages=msgs, max_tokens=4)
        assert app.publisher.wait_idle(10)
        evs = _session(kafka_config, "anth-1", 4)
    assert [e.TYPE for e in evs[:4]] == ["turn", "next_state", "turn", "session_end"]
    t0, t1 = evs[0], evs[2]
    assert t0.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert t0.response["content"] == m1.content[0].text and t0.sampling == {"max_tokens": 8, "temperature": 0}
    assert t1.turn_index == 1 and t1.tools == CHAT_TOOLS and t1.response["content"] == text
    assert len(t1.response_token_ids) == final.usage.output_tokens
    for t in (t0, t1):
        _assert_exact(engine_url, t)


# ---- tool round trips, the scripted stand-in ---------------------------------------------------
def test_responses_function_tool_round_trip_with_previous_response_id(kafka_config):
    with stand_in(kafka_config, _weather) as (url, app, up):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r1 = client.responses.create(model="scripted", input="Weather in Paris?", tools=R_TOOLS,
                                     extra_headers={"X-Session-Id": "tool-r"})
        (call,) = r1.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert orjson.loads(call.arguments) == {"city": "Paris"}
        out = [{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}]
        r2 = client.responses.create(model="scripted", input=out, tools=R_TOOLS, previous_response_id=r1.id)
        assert r2.output_text == "It is 21 C in Paris."
        # the same round trip streamed, stateless: the client sends the call back itself
        args, done = "", None
        for ev in client.responses.create(model="scripted", input="Weather in Paris?", tools=R_TOOLS, stream=True,
                                          extra_headers={"X-Session-Id": "tool-s"}):
            if ev.type == "response.function_call_arguments.delta":
                args += ev.delta
            if ev.type == "response.completed":
                done = ev.response
        (scall,) = done.output
        assert scall.arguments == args and orjson.loads(args) == {"city": "Paris"}
        items = [{"role": "user", "content": "Weather in Paris?"}, scall.model_dump(exclude_none=True),
                 {"type": "function_call_output", "call_id": scall.call_id, "output": "19 C"}]
        r3 = client.responses.create(model="scripted", input=items, tools=R_TOOLS,
                                     extra_headers={"X-Session-Id": "tool-s"})
        assert r3.output_text == "It is 19 C in Paris."
        assert app.publisher.wait_idle(10)
        evs, sevs = _session(kafka_config, "tool-r", 3), _session(kafka_config, "tool-s", 3)
    for es, answers in ((evs, up.answers[:2]), (sevs, up.answers[2:])):
        assert [e.TYPE for e in es[:3]] == ["turn", "next_state", "turn"]
        t0, ns, t1 = es[:3]
        assert t0.tools == CHAT_TOOLS and t0.response["tool_calls"][0]["function"]["name"] == "get_weather"
        assert ns.messages[0]["role"] == "tool" and ns.after_turn_index == 0 and t1.turn_index == 1
        assert t1.messages[1]["tool_calls"][0]["id"] == t0.response["tool_calls"][0]["id"]
        for t, a in zip((t0, t1), answers):
            assert (t.prompt_token_ids, t.response_token_ids) == (a["prompt_token_ids"], a["token_ids"])
            assert t.response_logprobs == pytest.approx(a["logprobs"], abs=1e-6)


def test_anthropic_tool_use_tool_result_round_trip(kafka_config):
    with stand_in(kafka_config, _weather) as (url, app, up):
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        h = {"X-Session-Id": "tool-a"}
        m1 = client.messages.create(model="scripted", messages=msgs, max_tokens=64, tools=A_TOOLS, extra_headers=h,
                                    tool_choice={"type": "auto"})
        assert m1.stop_reason == "tool_use"
        (use,) = m1.content
        assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
        msgs += [{"role": "assistant", "content": [b.model_dump() for b in m1.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}]
        with client.messages.stream(model="scripted", messages=msgs, max_tokens=64, tools=A_TOOLS,
                                    extra_headers=h) as s:
            final = s.get_final_message()
        assert final.content[0].text == "It is 21 C in Paris." and final.stop_reason == "end_turn"
        # streamed tool use: partial JSON accumulates into the input
        with client.messages.stream(model="scripted", messages=msgs[:1], max_tokens=64, tools=A_TOOLS,
                                    extra_headers={"X-Session-Id": "tool-b"}) as s:
            streamed = s.get_final_message()
        assert streamed.stop_reason == "tool_use" and streamed.content[0].input == {"city": "Paris"}
        assert app.publisher.wait_idle(10)
        evs = _session(kafka_config, "tool-a", 3)
    assert [e.TYPE for e in evs[:3]] == ["turn", "next_state", "turn"]
    t0, ns, t1 = evs[:3]
    assert ns.messages == [{"role": "tool", "tool_call_id": use.id, "content": "21 C"}] and ns.after_turn_index == 0
    assert t1.messages[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]}
    for t, a in zip((t0, t1), up.answers):
        assert (t.prompt_token_ids, t.response_token_ids) == (a["prompt_token_ids"], a["token_ids"])
        assert t.response_logprobs == pytest.approx(a["logprobs"], abs=1e-6)


def test_a_stream_broken_mid_answer_ends_with_each_apis_error_event(kafka_config):
    with stand_in(kafka_config, lambda req: Reply(content="a long answer that breaks", break_after=3)) as (
            url, app, up):
        r = httpx.post(url + "/v1/responses", json={"input": "hi", "stream": True}, timeout=30)
        assert r.status_code == 200
        names = [ln[7:] for ln in r.text.splitlines() if ln.startswith("event: ")]
        assert names[0] == "response.created" and names[-2:] == ["error", "response.failed"]
        assert "response.completed" not in names
        with pytest.raises(anthropic.APIStatusError):
            with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages.stream(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=9) as s:
                s.get_final_message()


# ---- bad bodies: raw HTTP ----------------------------------------------------------------------
_RESPONSES_BAD = [
    (b"{not json", "invalid_json"),
    (b"[1, 2]", None),
    ({"model": "m"}, "missing_field"),
    ({"input": 3}, None),
    ({"input": []}, None),
    ({"input": [{"role": "robot", "content": "x"}]}, None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "unsupported_value"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "unsupported_value"),
    ({"input": [{"type": "function_call", "name": "f"}]}, None),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "unsupported_value"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "unsupported_value"),
    ({"input": "x", "max_output_tokens": 0}, None),
    ({"input": "x", "max_output_tokens": "many"}, None),
    ({"input": "x", "temperature": 5}, None),  # refused by the shared chat validation, shown in this shape
    ({"input": "x", "background": True}, "unsupported_value"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "unsupported_value"),
    ({"input": "x", "frobnicate": 1}, "unknown_parameter"),
    ({"input": "x", "stream": "yes"}, None),
    ({"input": "x", "session_id": "has space"}, "invalid_session_id"),
]
_MESSAGES_BAD = [
    (b"{not json", {}),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, {}),  # no max_tokens
    ({"model": "m", "max_tokens": 5}, {}),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, {}),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, {}),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "x", "signature": "s"}]}]}, {}),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, {}),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, {}),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "top_p": 0}, {}),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "thinking": {"type": "enabled", "budget_tokens": 1024}}, {}),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "x"}},
     {}),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "extra": 1}, {}),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
     {"anthropic-version": "latest"}),
]


def test_bad_bodies_get_each_apis_error_shape_and_nothing_reaches_the_engine(kafka_config):
    with stand_in(kafka_config, None, api_keys=["k"]) as (url, app, up):
        auth = {"Authorization": "Bearer k"}
        for body, code in _RESPONSES_BAD:
            data = body if isinstance(body, bytes) else orjson.dumps(body)
            r = httpx.post(url + "/v1/responses", content=data, headers={**auth, "content-type": "application/json"})
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert isinstance(err["message"], str) and err["type"] == "invalid_request_error", (body, err)
            assert code is None or err["code"] == code, (body, err)
        for body, hdrs in _MESSAGES_BAD:
            data = body if isinstance(body, bytes) else orjson.dumps(body)
            r = httpx.post(url + "/v1/messages", content=data,
                           headers={"x-api-key": "k", "content-type": "application/json", **hdrs})
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", (body, r.text)
        # credentials, methods and media types, each in its API's shape
        r = httpx.post(url + "/v1/messages", json={}, headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(url + "/v1/responses", json={"input": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.get(url + "/v1/messages", headers={"x-api-key": "k"})
        assert r.status_code == 405 and r.json()["type"] == "error" and r.headers["allow"] == "POST"
        r = httpx.get(url + "/v1/responses", headers=auth)
        assert r.status_code == 405 and "error" in r.json()
        r = httpx.post(url + "/v1/messages", content=b"x", headers={"x-api-key": "k", "content-type": "text/plain"})
        assert r.status_code == 415 and r.json()["type"] == "error"
        assert up.requests == []
        # and a good one still passes
        r = httpx.post(url + "/v1/messages", headers={"x-api-key": "k", "anthropic-version": "2023-06-01"},
                       json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200 and r.json()["content"] == [{"type": "text", "text": "ok"}]
        assert r.headers["x-request-id"] and r.json()["id"] == "msg_" + r.headers["x-request-id"]
        # a trailing assistant message is a prefill: continued, not turned into a user message
        r = httpx.post(url + "/v1/messages", headers={"x-api-key": "k"},
                       json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"},
                                                                         {"role": "assistant", "content": "The"}]})
        assert r.status_code == 200 and up.requests[-1]["continue_final_message"] is True
        assert up.requests[0].get("continue_final_message") is None


def test_responses_stream_helper_text_and_call_in_one_answer_continue_as_one_chat_message(kafka_config):
    def script(req):
        if req["messages"][-1]["role"] == "tool":
            return Reply(content="done")
        return Reply(content="Let me check.", tool_calls=[("get_weather", '{"city": "Paris"}')])

    with stand_in(kafka_config, script) as (url, app, up):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with client.responses.stream(model="m", input="weather?", tools=R_TOOLS,
                                     extra_headers={"X-Session-Id": "mixed"}) as s:
            final = s.get_final_response()  # the SDK's own accumulation of the events
        assert [o.type for o in final.output] == ["message", "function_call"]
        assert final.output_text == "Let me check." and final.output[1].arguments == '{"city": "Paris"}'
        out = [{"type": "function_call_output", "call_id": final.output[1].call_id, "output": "sun"}]
        r2 = client.responses.create(model="m", input=out, previous_response_id=final.id, tools=R_TOOLS)
        assert r2.output_text == "done"
        assert app.publisher.wait_idle(10)
        evs = _session(kafka_config, "mixed", 3)
    t0, ns, t1 = evs[:3]
    assert ns.TYPE == "next_state" and ns.after_turn_index == 0  # the answer was recognised in the messages
    assert t1.messages[1] == {"role": "assistant", "content": "Let me check.",
                              "tool_calls": [{"id": "call_0", "type": "function", "function": {
                                  "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert t1.messages[1]["content"] == t0.response["content"]


def test_streams_through_the_sglang_path_and_two_tool_calls(engine_url, kafka_config):
    """Against SGLang (no token ids on streamed chat) a recorded stream goes through EngineClient
    (its ``[DONE]`` is the last body message): forced here on our engine, as in test_proxy_engine."""
    with running_proxy(kafka_config, engine_url) as (url, app):
        app._caps = (False, True)
        text = ""
        for ev in openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).responses.create(
                model="m", input="hi", max_output_tokens=6, stream=True, extra_headers={"X-Session-Id": "sg-r"}):
            text += ev.delta if ev.type == "response.output_text.delta" else ""
            last = ev.type
        assert last in ("response.completed", "response.incomplete")
        with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.stream(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                extra_headers={"X-Session-Id": "sg-a"}) as s:
            a_text = s.get_final_message().content[0].text
        assert app.publisher.wait_idle(10)
        r_turn, a_turn = _session(kafka_config, "sg-r", 1)[0], _session(kafka_config, "sg-a", 1)[0]
    assert r_turn.response["content"] == text and a_turn.response["content"] == a_text
    for t in (r_turn, a_turn):
        assert len(t.response_token_ids) == len(t.response_logprobs) > 0 and t.prompt_token_ids

    calls = [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]
    with stand_in(kafka_config, lambda req: Reply(content="", tool_calls=calls)) as (url, app, up):
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).responses.stream(
                model="m", input="weather?", tools=R_TOOLS) as s:
            r = s.get_final_response()
        with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.stream(
                model="m", messages=[{"role": "user", "content": "weather?"}], max_tokens=64, tools=A_TOOLS) as s:
            m = s.get_final_message()
    assert [(o.call_id, orjson.loads(o.arguments)) for o in r.output] == [("call_0", {"city": "Paris"}),
                                                                          ("call_1", {"city": "Rome"})]
    assert [(b.id, b.input) for b in m.content] == [("call_0", {"city": "Paris"}), ("call_1", {"city": "Rome"})]


_json = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=True) | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                         st.sampled_from(["type", "role", "content", "text", "name", "call_id", "arguments", "output",
                                          "input", "id", "tool_use_id", "input_schema", "parameters", "format",
                                          "effort", "schema"]), inner, max_size=4), max_leaves=12)


def _field_values(keys):
    return st.dictionaries(st.sampled_from(keys), _json, max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(r_body=_field_values(["input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature",
                             "text", "reasoning", "previous_response_id", "store", "metadata", "stream"]),
       m_body=_field_values(["model", "messages", "max_tokens", "system", "tools", "tool_choice", "stop_sequences",
                             "thinking", "output_config", "metadata", "temperature"]))
def test_any_body_translates_or_is_refused_with_a_4xx(r_body, m_body):
    """Whatever a client sends, translation gives a chat request or a 4xx, never another exception."""
    app = types.SimpleNamespace(pc=types.SimpleNamespace(responses_store_bytes=1000))
    for door, body in ((ResponsesDoor(app), r_body), (MessagesDoor(app), m_body)):
        try:
            call = door.translate(body, {})
        except ProxyError as e:
            assert 400 <= e.status < 500
        else:
            assert isinstance(call.chat["messages"], list) and call.chat["messages"]


def test_a_response_id_cannot_spell_another_tenants_key():
    """Keys are ``(tenant, id)``: an untenanted caller sending ``"alice\\nresp_1"`` finds nothing."""
    from pipeline.proxy.responses import _stored

    store = ResponseStore(10_000)
    store.put(_stored("alice", "resp_1"), "s", [], [])
    assert store.get(_stored("alice", "resp_1")) == ("s", [], [])
    assert store.get(_stored(None, "alice\nresp_1")) is None and store.get(_stored("bob", "resp_1")) is None
