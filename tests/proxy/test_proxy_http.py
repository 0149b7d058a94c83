"""The proxy over real HTTP and a real broker, in front of ``StandInEngine`` (a stand-in engine).

What is checked: events on ``turns`` (order, partition, exact token ids / log-probs / prompt ids
as the upstream returned them), user-facing answers (extras stripped, tool-call deltas and the
usage chunk forwarded), session metadata rules, malformed input (4xx, never 5xx), API keys,
engine failures (502/504), health, readiness and metrics.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import orjson
import pytest

from pipeline.testing.proxy import running_proxy, stack
from pipeline.testing.servers import Reply, StandInEngine, serve_app
from pipeline.testing.topics import read_events, read_records
from pipeline.testing.waiting import sse_events


CHAT = "/v1/chat/completions"


def _turns(config, n):
    """``(partition, offset, key, event)`` of the first ``n`` records of ``turns``."""
    evs = [(r.partition, r.offset, r.key, r.event) for r in read_records(config, config.topics.name("turns"), n,
                                                                          timeout_s=15)]
    assert len(evs) == n, [e[3].TYPE for e in evs]
    return evs


def test_conversation_events_carry_exactly_what_the_engine_returned(kafka_config):
    call = ("lookup", '{"city": "Paris"}')
    script = iter([Reply(content="", tool_calls=[call, ("time", "{}")]), Reply(content="It is sunny.", reasoning="r")])
    with stack(kafka_config, lambda req: next(script)) as (url, app, up):
        h = {"X-Session-Id": "conv-1"}
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"}]
        r = httpx.post(url + CHAT, json={"model": "m", "messages": msgs, "temperature": 0.5}, headers=h)
        assert r.status_code == 200, r.text
        assert r.headers["x-turn-index"] == "0"
        body = r.json()
        choice = body["choices"][0]
        # the extras the proxy asked for are not shown to a user who did not ask for them
        assert choice["logprobs"] is None and "token_ids" not in choice and "prompt_token_ids" not in choice
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["lookup", "time"]
        assert up.requests[0]["logprobs"] is True and up.requests[0]["return_token_ids"] is True
        tools = [{"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
                 {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
        msgs = msgs + [choice["message"]] + tools
        with httpx.stream("POST", url + CHAT, json={"model": "m", "messages": msgs, "stream": True},
                          headers={**h, "X-Session-Done": "true"}) as s:
            assert s.status_code == 200 and s.headers["x-turn-index"] == "1"
            chunks = sse_events(s)
        assert chunks[-1] == "[DONE]"
        text = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks[:-1] if c["choices"])
        assert text == "It is sunny."
        assert all("token_ids" not in c["choices"][0] for c in chunks[:-1] if c["choices"])
        assert app.publisher.wait_idle(10)
        evs = _turns(kafka_config, 4)
    assert {p for p, *_ in evs} == {evs[0][0]} and all(k == "conv-1" for _, _, k, _ in evs)
    types = [e.TYPE for *_, e in evs]
    assert types == ["turn", "next_state", "turn", "session_end"]
    t0, ns, t1, end = (e for *_, e in evs)
    for turn, ans in ((t0, up.answers[0]), (t1, up.answers[1])):
        assert turn.response_token_ids == ans["token_ids"]
        assert turn.prompt_token_ids == ans["prompt_token_ids"]
        assert turn.response_logprobs == pytest.approx(ans["logprobs"], abs=1e-6)
        assert turn.policy_version == 0 and turn.source == "proxy"
    assert (t0.turn_index, t1.turn_index) == (0, 1)
    assert t0.sampling == {"temperature": 0.5} and t0.messages == msgs[:2]
    assert [c["function"]["arguments"] for c in t0.response["tool_calls"]] == [call[1], "{}"]
    assert t0.finish_reason == "tool_calls"
    assert ns.after_turn_index == 0 and ns.messages == tools
    assert t1.response["content"] == "It is sunny." and t1.response["reasoning_content"] == "r"
    assert t1.finish_reason == "stop"
    assert end.reason == "header"


def test_stream_forwards_tool_call_deltas_with_indices_and_usage_when_asked(kafka_config):
    reply = Reply(content="", tool_calls=[("a", '{"x": 1}'), ("b", '{"y": [1, 2]}')])
    with stack(kafka_config, lambda req: reply) as (url, app, up):
        req = {"model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True,
               "stream_options": {"include_usage": True}, "logprobs": True}
        with httpx.stream("POST", url + CHAT, json=req, headers={"X-Session-Id": "s"}) as s:
            chunks = sse_events(s)
        deltas = [tc for c in chunks[:-1] if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls") or []]
        assert {d["index"] for d in deltas} == {0, 1}
        args = {i: "".join(d["function"].get("arguments") or "" for d in deltas if d["index"] == i) for i in (0, 1)}
        assert args == {0: '{"x": 1}', 1: '{"y": [1, 2]}'}
        assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] == len(up.answers[0]["token_ids"])
        # logprobs were asked for: kept, and equal to the upstream's
        lps = [e["logprob"] for c in chunks[:-1] if c["choices"] and c["choices"][0].get("logprobs")
               for e in c["choices"][0]["logprobs"]["content"]]
        assert lps == up.answers[0]["logprobs"]
        req.pop("stream_options")
        with httpx.stream("POST", url + CHAT, json=req, headers={"X-Session-Id": "s2"}) as s:
            chunks = sse_events(s)
        assert all(c["choices"] for c in chunks[:-1])  # no usage chunk unless asked


def test_session_defaults_anonymous_side_and_body_fields(kafka_config):
    from pipeline.proxy import metrics as M

    before = M.WITHOUT_SESSION._value.get()
    with stack(kafka_config) as (url, app, up):
        msgs = [{"role": "user", "content": "hi"}]
        r = httpx.post(url + CHAT, json={"messages": msgs})  # no session metadata at all
        assert r.status_code == 200 and "x-turn-index" in r.headers
        r = httpx.post(url + CHAT, json={"messages": msgs, "session_id": "body-s", "turn_type": "side"})
        assert r.status_code == 200 and "x-turn-index" not in r.headers
        assert all(k not in up.requests[1] for k in ("session_id", "turn_type", "session_done"))
        assert app.publisher.wait_idle(10)
        evs = _turns(kafka_config, 2)
    assert M.WITHOUT_SESSION._value.get() == before + 1
    # no session metadata: a new derived session (docs/sessions.md), left open for its next turns
    anon = [e for _, _, k, e in evs if k.startswith("conv-")]
    assert len(anon) == 1 and anon[0].turn_index == 0 and anon[0].session_source == "new"
    side = [e for _, _, k, e in evs if k == "body-s"]
    assert len(side) == 1 and side[0].turn_type == "side" and side[0].turn_index is None
    assert side[0].session_source == "body"


def test_anonymous_reject_and_skip(kafka_config):
    msgs = [{"role": "user", "content": "hi"}]
    with stack(kafka_config, anonymous="reject") as (url, app, up):
        r = httpx.post(url + CHAT, json={"messages": msgs})
        assert r.status_code == 400 and "X-Session-Id" in r.json()["error"]["message"]
    with stack(kafka_config, anonymous="skip") as (url, app, up):
        r = httpx.post(url + CHAT, json={"messages": msgs})
        assert r.status_code == 200 and "logprobs" not in up.requests[0]
        assert app.publisher.stats()["delivered"] == 0 and app.publisher.buffered == 0


def test_concurrent_requests_of_one_session_get_unique_indices(kafka_config):
    """24 requests of one session in flight at once (each held 0.3 s by the engine), all
    continuing its turn 0 (so none is a new conversation under a reused id): every turn gets its
    own index, and the engine saw them overlap."""
    with stack(kafka_config, lambda req: Reply(content="a", delay_s=0.3)) as (url, app, up):
        first = [{"role": "user", "content": "q"}]
        assert httpx.post(url + CHAT, json={"messages": first}, headers={"X-Session-Id": "par"}).status_code == 200
        msgs = first + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "again"}]

        async def go():
            async with httpx.AsyncClient() as c:
                rs = await asyncio.gather(*[c.post(url + CHAT, json={"messages": msgs},
                                                   headers={"X-Session-Id": "par"}) for _ in range(24)])
            return rs
        rs = asyncio.run(go())
        assert all(r.status_code == 200 and r.headers["x-session-id"] == "par" for r in rs)
        assert up.peak_in_flight >= 2, "the requests never overlapped: nothing concurrent was tested"
        assert sorted(int(r.headers["x-turn-index"]) for r in rs) == list(range(1, 25))
        assert app.publisher.wait_idle(10)
        evs = _turns(kafka_config, 26)
    assert sorted(e.turn_index for *_, e in evs if e.TYPE == "turn") == list(range(25))
    assert [e.after_turn_index for *_, e in evs if e.TYPE == "next_state"] == [0]


MALFORMED = [
    ("invalid json", b"{bad", {}),
    ("empty body", b"", {}),
    ("array body", b"[]", {}),
    ("string body", b'"hi"', {}),
    ("NaN", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', {}),
    ("deep nesting", b"[" * 3000 + b"]" * 3000, {}),
    ("bad utf-8", b'{"messages": "\xff\xfe"}', {}),
    ("missing messages", {"model": "m"}, {}),
    ("messages not a list", {"messages": "hi"}, {}),
    ("empty messages", {"messages": []}, {}),
    ("message not an object", {"messages": ["hi"]}, {}),
    ("missing role", {"messages": [{"content": "x"}]}, {}),
    ("role not a string", {"messages": [{"role": 5, "content": "x"}]}, {}),
    ("unknown role", {"messages": [{"role": "robot", "content": "x"}]}, {}),
    ("content is a number", {"messages": [{"role": "user", "content": 5}]}, {}),
    ("user content null", {"messages": [{"role": "user", "content": None}]}, {}),
    ("part without type", {"messages": [{"role": "user", "content": [{"text": "x"}]}]}, {}),
    ("text part not a string", {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, {}),
    ("tool without tool_call_id", {"messages": [{"role": "tool", "content": "r"}]}, {}),
    ("tool_calls not a list", {"messages": [{"role": "assistant", "content": None, "tool_calls": {}}]}, {}),
    ("tool call without name", {"messages": [{"role": "assistant", "content": None,
                                              "tool_calls": [{"type": "function", "function": {}}]}]}, {}),
    ("arguments not a string", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]}, {}),
    ("name not a string", {"messages": [{"role": "user", "content": "x", "name": 3}]}, {}),
    ("model not a string", {"model": 123, "messages": [{"role": "user", "content": "x"}]}, {}),
    ("stream as a string", {"stream": "yes", "messages": [{"role": "user", "content": "x"}]}, {}),
    ("temperature as a string", {"temperature": "hot", "messages": [{"role": "user", "content": "x"}]}, {}),
    ("temperature out of range", {"temperature": 5, "messages": [{"role": "user", "content": "x"}]}, {}),
    ("top_p zero", {"top_p": 0, "messages": [{"role": "user", "content": "x"}]}, {}),
    ("max_tokens zero", {"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, {}),
    ("max_tokens float", {"max_tokens": 1.5, "messages": [{"role": "user", "content": "x"}]}, {}),
    ("n > 1", {"n": 2, "messages": [{"role": "user", "content": "x"}]}, {}),
    ("stop a number", {"stop": 5, "messages": [{"role": "user", "content": "x"}]}, {}),
    ("tools not a list", {"tools": {}, "messages": [{"role": "user", "content": "x"}]}, {}),
    ("tool without name", {"tools": [{"type": "function", "function": {}}],
                           "messages": [{"role": "user", "content": "x"}]}, {}),
    ("tool_choice unknown", {"tool_choice": "sometimes", "messages": [{"role": "user", "content": "x"}]}, {}),
    ("logprobs a string", {"logprobs": "true", "messages": [{"role": "user", "content": "x"}]}, {}),
    ("top_logprobs too large", {"top_logprobs": 50, "messages": [{"role": "user", "content": "x"}]}, {}),
    ("stream_options a string", {"stream_options": "x", "messages": [{"role": "user", "content": "x"}]}, {}),
    ("response_format a string", {"response_format": "json", "messages": [{"role": "user", "content": "x"}]}, {}),
    ("presence_penalty out of range", {"presence_penalty": 3, "messages": [{"role": "user", "content": "x"}]}, {}),
    ("bad turn type header", {"messages": [{"role": "user", "content": "x"}]}, {"X-Turn-Type": "other"}),
    ("bad session done header", {"messages": [{"role": "user", "content": "x"}]}, {"X-Session-Done": "maybe"}),
    ("session id with a space", {"messages": [{"role": "user", "content": "x"}]}, {"X-Session-Id": "a b"}),
    ("session id in body not a string", {"session_id": 5, "messages": [{"role": "user", "content": "x"}]}, {}),
    ("wrong content type", b'{"messages": []}', {"Content-Type": "text/plain"}),
    ("oversize body", {"messages": [{"role": "user", "content": "x" * 5000}]}, {}),
]


def test_malformed_requests_get_clear_4xx_never_5xx(kafka_config):
    with stack(kafka_config, max_body_bytes=4000) as (url, app, up):
        with httpx.Client(base_url=url) as c:
            statuses = {}
            for name, body, headers in MALFORMED:
                h = {"Content-Type": "application/json", **headers}
                data = body if isinstance(body, bytes) else orjson.dumps(body)
                r = c.post(CHAT, content=data, headers=h)
                assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
                err = r.json()["error"]
                assert isinstance(err["message"], str) and len(err["message"]) > 10, name
                assert err["type"] == "invalid_request_error", name
                statuses[name] = r.status_code
            assert statuses["oversize body"] == 413 and statuses["wrong content type"] == 415
            r = c.get(CHAT)
            assert r.status_code == 405 and "POST" in r.json()["error"]["message"]
            r = c.post("/v1/completions", json={})
            assert r.status_code == 404 and r.json()["error"]["message"]
            assert up.requests == []  # nothing malformed reached the engine
            r = c.post(CHAT, json={"messages": [{"role": "user", "content": "fine"}]}, headers={"X-Session-Id": "ok"})
            assert r.status_code == 200
    assert len(MALFORMED) >= 30


def test_api_keys(kafka_config):
    with stack(kafka_config, api_keys=["k-one", "k-two"]) as (url, app, up):
        body = {"messages": [{"role": "user", "content": "x"}]}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k-one"}):
            r = httpx.post(url + CHAT, json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert httpx.get(url + "/v1/models", headers=headers).status_code == 401
        assert httpx.post(url + CHAT, json=body, headers={"Authorization": "Bearer k-two"}).status_code == 200
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k-one"}).json()["data"]
        assert httpx.get(url + "/healthz").status_code == 200  # probes need no key
        assert up.requests and len(up.requests) == 1


def _closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def test_engine_failures_map_to_502_504_and_4xx(kafka_config):
    replies = {"500": Reply(status=500), "400": Reply(status=400), "slow": Reply(delay_s=1.5),
               "break": Reply(content="abcdefghijkl", break_after=3)}
    with stack(kafka_config, lambda req: replies[req["messages"][0]["content"]], engine_timeout_s=0.5) as (url, app, up):
        def ask(kind, **kw):
            return httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": kind}], **kw},
                              headers={"X-Session-Id": f"f-{kind}"}, timeout=10)
        r = ask("500")
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
        r = ask("400")
        assert r.status_code == 400 and "scripted failure 400" in r.json()["error"]["message"]
        r = ask("slow")
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        with httpx.stream("POST", url + CHAT, json={"messages": [{"role": "user", "content": "break"}], "stream": True},
                          headers={"X-Session-Id": "f-break"}) as s:
            assert s.status_code == 200
            chunks = sse_events(s)
        assert "error" in chunks[-2] and chunks[-1] == "[DONE]"
        assert httpx.get(url + "/readyz").status_code == 200
    with running_proxy(kafka_config, _closed_port_url()) as (url, app):
        r = httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": "x"}]}, headers={"X-Session-Id": "z"})
        assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
        r = httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": "x"}], "stream": True})
        assert r.status_code == 502
        assert httpx.get(url + "/readyz").status_code == 503


def test_metrics_endpoint_exposes_the_proxy_metrics(kafka_config):
    with stack(kafka_config) as (url, app, up):
        httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": "x"}], "stream": True},
                   headers={"X-Session-Id": "m"})
        app.publisher.wait_idle(10)
        text = httpx.get(url + "/metrics").text
    for name in ("pipeline_proxy_requests_total", "pipeline_proxy_request_latency_seconds", "pipeline_proxy_ttft_seconds",
                 "pipeline_proxy_requests_without_session_total", "pipeline_proxy_events_buffered",
                 "pipeline_proxy_events_dropped_total", "pipeline_proxy_events_not_durable_total", "pipeline_proxy_buffer_commit_seconds",
                 "pipeline_proxy_sync_hold_seconds", "pipeline_proxy_policy_version", "pipeline_events_produced_total"):
        assert name in text, name
    assert 'pipeline_proxy_requests_total{status="200",stream="true"}' in text


def test_openai_client_assembles_tool_calls_from_forwarded_deltas(kafka_config):
    import openai

    calls = [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", '{"tz": "CET"}')]
    with stack(kafka_config, lambda req: Reply(content="", tool_calls=calls)) as (url, app, up):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n, _ in calls]
        msgs = [{"role": "user", "content": "weather and time?"}]
        out = client.chat.completions.create(model="m", messages=msgs, tools=tools,
                                             extra_headers={"X-Session-Id": "oa-tools"})
        assert [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls] == calls
        assert out.choices[0].finish_reason == "tool_calls"
        acc: dict = {}
        finish = None
        for chunk in client.chat.completions.create(model="m", messages=msgs, tools=tools, stream=True,
                                                    extra_headers={"X-Session-Id": "oa-tools-2"}):
            for c in chunk.choices:
                for tc in c.delta.tool_calls or []:
                    e = acc.setdefault(tc.index, {"name": "", "arguments": ""})
                    e["name"] += (tc.function.name or "") if tc.function else ""
                    e["arguments"] += (tc.function.arguments or "") if tc.function else ""
                finish = c.finish_reason or finish
        assert [(acc[i]["name"], acc[i]["arguments"]) for i in sorted(acc)] == calls
        assert finish == "tool_calls"


def test_client_leaving_mid_stream_records_the_partial_turn_and_session_end_route(kafka_config):
    up = StandInEngine(lambda req: Reply(content="word " * 200), token_interval_s=0.02)
    with serve_app(up) as up_url, running_proxy(kafka_config, up_url) as (url, app):
        with httpx.stream("POST", url + CHAT, json={"messages": [{"role": "user", "content": "long"}], "stream": True},
                          headers={"X-Session-Id": "leaver"}) as s:
            seen = 0
            for line in s.iter_lines():
                seen += line.startswith("data: {")
                if seen == 4:
                    break  # the user closes the tab
        assert len(read_events(kafka_config, want=1, timeout_s=15)) == 1  # the partial turn
        r = httpx.post(url + "/v1/sessions/leaver/end")
        assert r.status_code == 200 and r.json() == {"session_id": "leaver", "ended": True}
        assert httpx.post(url + "/v1/sessions/bad%20id/end").status_code == 400
        evs = read_events(kafka_config, want=2, timeout_s=15)
    turn, end = evs
    assert turn.TYPE == "turn" and turn.finish_reason == "abort"
    assert 3 <= len(turn.response_token_ids) < len(up.answers[0]["token_ids"])
    assert turn.response_token_ids == up.answers[0]["token_ids"][:len(turn.response_token_ids)]
    assert end.TYPE == "session_end" and end.reason == "api"
    assert up.disconnects == 1  # the proxy hung up on the engine too (an engine aborts the generation)


def test_default_temperature_is_sent_and_recorded(kafka_config):
    with stack(kafka_config, default_temperature=0.6) as (url, app, up):
        for body in ({"messages": [{"role": "user", "content": "a"}]},
                     {"messages": [{"role": "user", "content": "b"}], "temperature": 0.9}):
            assert httpx.post(url + CHAT, json=body, headers={"X-Session-Id": "t"}).status_code == 200
        assert [r["temperature"] for r in up.requests] == [0.6, 0.9]
        app.publisher.wait_idle(10)
        evs = read_events(kafka_config, want=2)  # two conversations: two sessions (docs/sessions.md)
    assert {e.messages[0]["content"]: e.sampling.get("temperature") for e in evs if e.TYPE == "turn"} == {
        "a": 0.6, "b": 0.9}


def test_an_unknown_distribution_is_recorded_without_log_probs(kafka_config, tmp_path):
    """The engine reports no sampling parameters (a plain OpenAI server) and the served model's
    generation_config cannot be read: a request that leaves its temperature to the model was
    sampled from a distribution nobody knows, so its turn carries no token ids and log-probs (as
    from an engine that gave none; never a guessed T = 1); a request that names every
    defaultable parameter keeps them."""
    c = kafka_config.replace(engine={"model": str(tmp_path / "no-such-model")})
    with stack(c) as (url, app, up):
        asked = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
        for sid, extra in (("unknown", {}), ("named", asked)):
            r = httpx.post(url + CHAT, json={"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra},
                           headers={"X-Session-Id": sid})
            assert r.status_code == 200, r.text
        assert app.publisher.wait_idle(10)
        turns = {e.session_id: e for _, _, _, e in _turns(c, 2)}
    assert turns["unknown"].response["content"] == "ok"  # what the client received is still recorded
    assert turns["unknown"].response_token_ids == [] and turns["unknown"].response_logprobs == []
    assert turns["unknown"].logprob_temperature is None
    assert len(turns["named"].response_logprobs) == len(turns["named"].response_token_ids) > 0
    assert turns["named"].logprob_temperature == pytest.approx(0.7)
