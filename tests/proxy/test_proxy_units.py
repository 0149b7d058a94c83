"""Proxy logic without servers: session rules, metadata parsing, stream recording."""

from __future__ import annotations

import orjson
import pytest

from pipeline.proxy.errors import ProxyError
from pipeline.proxy.record import StreamRecorder, from_response, policy_version, strip_response
from pipeline.proxy.sessions import SessionTable
from pipeline.proxy.validate import check_request, session_meta


def _u(text):
    return {"role": "user", "content": text}


def _a(text, calls=None):
    return {"role": "assistant", "content": text, "tool_calls": calls}


def test_next_state_is_everything_after_the_previous_assistant_turn():
    t = SessionTable()
    first = t.begin("s", [{"role": "system", "content": "sys"}, _u("q1")])
    assert (first.turn_index, first.next_state) == (0, None)
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    t.complete("s", 0, None, call)
    tool1 = {"role": "tool", "tool_call_id": "c1", "content": "r1"}
    tool2 = {"role": "tool", "tool_call_id": "c2", "content": "r2"}
    # the client re-serialises the arguments: the fingerprint still matches turn 0
    echoed = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}]
    second = t.begin("s", [{"role": "system", "content": "sys"}, _u("q1"), _a(None, echoed), tool1, tool2])
    assert second.turn_index == 1
    assert second.after_turn_index == 0
    assert second.next_state == [tool1, tool2]  # all tool results, not only the last


def test_retry_and_regenerate_publish_no_second_next_state_and_never_reuse_an_index():
    t = SessionTable()
    t.begin("s", [_u("q1")])
    t.complete("s", 0, "a1", None, request_id="r0")
    msgs = [_u("q1"), _a("a1"), _u("q2")]
    b = t.begin("s", msgs)
    assert (b.turn_index, b.after_turn_index, b.after_request_id, b.next_state) == (1, 0, "r0", [_u("q2")])
    assert t.accept("s", b)  # the engine took it: publish the next state now
    # turn 1 was aborted by the engine after it started; the client retries the same messages
    c = t.begin("s", msgs)
    assert c.turn_index == 2 and c.next_state is None and not t.accept("s", c)
    t.complete("s", 2, "a2", None)
    # "regenerate" of turn 2: same history again -> new index, next state of turn 0 not repeated
    d = t.begin("s", msgs)
    assert d.turn_index == 3 and d.next_state is None


def test_a_refused_request_takes_no_index_and_its_retry_publishes_the_next_state():
    """Issue 24 case 9: the engine refused the request (4xx): :meth:`cancel` gives the index
    back and the next state was never marked published, so the retry is turn 1 with it."""
    t = SessionTable()
    t.begin("s", [_u("q1")])
    t.complete("s", 0, "a1", None)
    msgs = [_u("q1"), _a("a1"), _u("q2")]
    refused = t.begin("s", msgs)
    t.cancel("s", refused)
    retry = t.begin("s", msgs)
    assert (retry.turn_index, retry.after_turn_index, retry.next_state) == (1, 0, [_u("q2")])
    assert t.accept("s", retry)
    # a session whose only request was refused is forgotten, as if never sent
    first = t.begin("x", [_u("hello")])
    t.cancel("x", first)
    assert t.get("x") is None
    # a refusal overtaken by a later request of the session leaves a gap, never a duplicate
    a, b = t.begin("s", msgs), t.begin("s", msgs)
    t.cancel("s", a)
    assert t.begin("s", msgs).turn_index == b.turn_index + 1


def test_a_continued_assistant_message_is_this_turns_prefix_not_a_previous_turn():
    """``continue_final_message``: the trailing assistant message is the start of this turn's own
    reply. The user message before it is the previous turn's next state, the turn index follows
    on, and the next request, which echoes prefix + continuation, finds the continued turn.
    Was: the prefill counted as an answered turn: turn index 2 and turn 0's next state never
    published (turn 0 never judged)."""
    t = SessionTable()
    t.begin("s", [_u("q1")])
    t.complete("s", 0, "a1", None)
    msgs = [_u("q1"), _a("a1"), _u("wrong, in metres please"), _a("Sure, it is")]
    b = t.begin("s", msgs, continue_final=True)
    assert (b.turn_index, b.after_turn_index, b.next_state) == (1, 0, [_u("wrong, in metres please")])
    assert t.accept("s", b)
    t.complete("s", 1, " 330 m.", None, prefix="Sure, it is")
    # a prefill in a first request is not a turn either
    first = SessionTable().begin("f", [_u("q"), _a("Once upon")], continue_final=True)
    assert (first.turn_index, first.next_state) == (0, None)
    # without continue_final_message a trailing assistant message is an ordinary earlier answer
    other = SessionTable()
    other.begin("o", [_u("q")])
    other.complete("o", 0, "a", None)
    assert other.begin("o", [_u("q"), _a("a")]).turn_index == 1
    # the echoed full message (prefix + continuation) is recognised as turn 1 even when the
    # session's latest completed turn is a later one: a regenerate (turn 2) the client discarded
    r = t.begin("s", msgs, continue_final=True)
    assert (r.turn_index, r.next_state) == (2, None)
    t.complete("s", 2, " 400 m.", None, prefix="Sure, it is")
    c = t.begin("s", msgs[:3] + [_a("Sure, it is 330 m."), _u("thanks")])
    assert (c.turn_index, c.after_turn_index, c.next_state) == (3, 1, [_u("thanks")])


def test_state_lost_indices_continue_from_the_assistant_count():
    t = SessionTable(max_sessions=1)
    t.begin("a", [_u("q")])
    t.begin("b", [_u("q")])  # evicts "a"
    assert t.get("a") is None
    r = t.begin("a", [_u("q1"), _a("x"), _u("q2"), _a("y"), _u("q3")])
    assert r.turn_index == 2  # never 0 again: earlier turns 0 and 1 exist on the topic
    assert (r.after_turn_index, r.next_state) == (1, [_u("q3")])


def test_overlapping_requests_of_one_session_get_distinct_indices():
    """50 requests of one session begun before any of them ended (the proxy's event loop runs one
    ``begin`` at a time; real concurrency over HTTP: tests/proxy/test_proxy_http.py)."""
    t = SessionTable()
    got = [t.begin("s", [_u("q")]).turn_index for _ in range(50)]
    assert got == list(range(50))


def test_idle_sessions_expire():
    t = SessionTable(idle_s=10)
    t.begin("old", [_u("q")], now=0.0)
    t.begin("new", [_u("q")], now=15.0)
    assert t.expire(now=16.0) == 1
    assert t.get("old") is None and t.get("new") is not None


def test_session_meta_headers_win_and_body_fields_are_stripped():
    body = {"messages": [], "session_id": "body-s", "turn_type": "side", "session_done": True}
    m = session_meta({b"x-session-id": b"hdr-s"}, body, "main")
    assert (m.session_id, m.turn_type, m.done) == ("hdr-s", "side", True)
    assert set(body) == {"messages"}
    m = session_meta({b"x-session-done": b"no", b"x-turn-type": b"MAIN"}, {}, "main")
    assert (m.session_id, m.turn_type, m.done) == (None, "main", False)
    for headers in ({b"x-turn-type": b"other"}, {b"x-session-done": b"maybe"}, {b"x-session-id": b"has space"}):
        with pytest.raises(ProxyError) as e:
            session_meta(headers, {}, "main")
        assert e.value.status == 400


def test_check_request_accepts_a_full_openai_request():
    check_request({
        "model": "m", "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.7, "top_p": 0.9,
        "max_tokens": 16, "logprobs": True, "top_logprobs": 2, "stop": ["\n"], "seed": 1, "n": 1, "top_k": 5,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "q"}]},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c", "content": "r"}]})


def test_stream_recorder_merges_tool_call_deltas_by_index_and_strips_extras():
    rec = StreamRecorder(keep_logprobs=False, keep_ids=False, keep_prompt_ids=False)
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "prompt_token_ids": [1, 2],
         "metadata": {"weight_version": "7"}},
        {"choices": [{"index": 0, "delta": {"content": "Hi"}, "token_ids": [5],
                      "logprobs": {"content": [{"token": "Hi", "logprob": -0.5}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": ""}},
            {"index": 1, "id": "b", "type": "function", "function": {"name": "g", "arguments": "{"}}]},
            "token_ids": [6, 7], "logprobs": {"content": [{"logprob": -1.0}, {"logprob": -2.0}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 1, "function": {"arguments": "}"}},
                                                           {"index": 0, "function": {"arguments": "{}"}}]},
                      "token_ids": [8], "logprobs": {"content": [{"logprob": -3.0}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]
    forwarded = [orjson.loads(rec.feed(orjson.dumps(c))) for c in chunks]
    r = rec.finish()
    assert r.prompt_ids == [1, 2] and r.token_ids == [5, 6, 7, 8] and r.logprobs == [-0.5, -1.0, -2.0, -3.0]
    assert r.weight_version == "7" and r.finish_reason == "tool_calls" and r.complete
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"], c["index"])
            for c in r.response["tool_calls"]] == [("a", "f", "{}", 0), ("b", "g", "{}", 1)]
    assert "prompt_token_ids" not in forwarded[0]
    assert all("token_ids" not in c["choices"][0] and c["choices"][0].get("logprobs") is None for c in forwarded)
    assert forwarded[2]["choices"][0]["delta"] == chunks[2]["choices"][0]["delta"]



def test_stream_recorder_gives_each_chunk_the_answer_id_as_a_splice_or_a_rewrite():
    """A chunk the user gets unchanged but for its id: the engine's compact ``{"id":...`` head is
    replaced in the bytes (nothing re-serialised); any other layout, a null id, or a chunk with
    other changes is re-serialised; every chunk parses to the engine's with the answer's id."""
    rec = StreamRecorder(keep_logprobs=True, keep_ids=True, keep_prompt_ids=True, answer_id="chatcmpl-r1")
    body = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "é"}, "token_ids": [5],
                                                           "logprobs": {"content": [{"logprob": -0.5}]}}]}
    compact = orjson.dumps({"id": "chatcmpl-eng", **body}).replace("é".encode(), b"\\u00e9")  # as an engine may
    spaced = b'{"id": "chatcmpl-eng", ' + orjson.dumps(body)[1:]
    late = orjson.dumps({**body, "id": "chatcmpl-eng"})
    null = orjson.dumps({"id": None, **body})
    out = [rec.feed(d) for d in (compact, compact, spaced, late, null)]
    assert out[0] == out[1] == b'{"id":"chatcmpl-r1"' + compact[len(b'{"id":"chatcmpl-eng"'):]  # the engine's bytes
    assert b"\\u00e9" in out[0] and b"\\u00e9" not in out[4]  # spliced / re-serialised
    assert [orjson.loads(o) for o in out] == [{"id": "chatcmpl-r1", **body}] * 5
    assert rec.feed(out[0]) == out[0]  # already the answer's id: forwarded as it is
    assert rec.rec.token_ids == [5] * 6
    plain = StreamRecorder(keep_logprobs=True, keep_ids=True, keep_prompt_ids=True)
    assert plain.feed(compact) == compact  # no answer id: the engine's bytes

def test_from_response_and_strip():
    resp = {"model": "m", "choices": [{"message": {"role": "assistant", "content": "x"}, "finish_reason": "stop",
                                       "token_ids": [4, 5], "prompt_token_ids": [1],
                                       "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]}}],
            "metadata": {"weight_version": "3"}}
    r = from_response(resp)
    assert (r.token_ids, r.logprobs, r.prompt_ids, r.weight_version) == ([4, 5], [-0.1, -0.2], [1], "3")
    strip_response(resp, keep_logprobs=False, keep_ids=False, keep_prompt_ids=False, keep_meta=False)
    assert resp["choices"][0] == {"message": {"role": "assistant", "content": "x"}, "finish_reason": "stop",
                                  "logprobs": None}
    assert policy_version("12", 0) == 12 and policy_version("v3", 0) == 3 and policy_version("main", 5) == 5


def test_recorded_distribution_engine_report_first_then_sglang_rules():
    """The temperature a turn's log-probs are of, and the options a teacher cannot re-apply."""
    from pipeline.proxy.app import ProxyApp
    from pipeline.proxy.record import Recorded

    dist = ProxyApp._distribution
    reported = Recorded()
    reported.sampling_params = {"temperature": 1.0, "top_k": 1, "repetition_penalty": 1.0}
    assert dist(reported, {"temperature": 0}) == (1.0, [])  # the engine's word (greedy normalised)
    reported.sampling_params = {"temperature": 0.8, "repetition_penalty": 1.1}  # e.g. a generation-config default
    assert dist(reported, {}) == (0.8, ["repetition_penalty"])
    sglang = Recorded()  # an engine that does not report: the request under SGLang's rules
    assert dist(sglang, {"temperature": 0}) == (1.0, [])
    assert dist(sglang, {"temperature": 5e-7}) == (1.0, [])
    assert dist(sglang, {"temperature": 0.3, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "seed": 1}) == (0.3, [])
    assert dist(sglang, {}) == (1.0, [])
    assert dist(sglang, {"logit_bias": {"5": -100}, "presence_penalty": 0.5, "min_tokens": 3,
                         "response_format": {"type": "json_object"}, "tool_choice": "required"}) == (
        1.0, ["constrained_decoding", "logit_bias", "min_tokens", "presence_penalty", "tool_choice"])


def test_metric_children_are_resolved_once_and_count_as_labels_would():
    from prometheus_client import Counter, CollectorRegistry

    from pipeline.proxy.metrics import CACHE

    c = Counter("t_child_total", "test", ["kind"], registry=CollectorRegistry())
    assert CACHE.child(c, "a") is CACHE.child(c, "a") is c.labels("a")
    CACHE.child(c, "a").inc()
    CACHE.child(c, "b").inc(2)
    assert (c.labels("a")._value.get(), c.labels("b")._value.get()) == (1.0, 2.0)


def test_an_engine_stream_read_to_its_done_keeps_its_connection():
    """``_keep_alive``: a stream whose body ends a moment after ``[DONE]`` (as uvicorn-served
    engines write it) goes back to the pool once that end arrives, and the next stream reuses
    the connection; released at ``[DONE]`` (the old way) the connection is closed and the next
    stream opens another."""
    import asyncio

    from pipeline.engine_api.transport import Transport, sse_batches
    from pipeline.proxy.app import _DRAINING, _keep_alive
    from pipeline.testing.servers import serve_app

    ports: list[int] = []

    async def engine(scope, receive, send):
        if scope["type"] != "http":
            return
        ports.append(scope["client"][1])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b'data: {"x":1}\n\ndata: [DONE]\n\n', "more_body": True})
        await asyncio.sleep(0.05)
        await send({"type": "http.response.body", "body": b""})

    async def two_streams(url: str, keep: bool) -> None:
        t = Transport(url, 10)
        try:
            for _ in range(2):
                resp = await t.open_stream("/v1/chat/completions", b"{}")
                async for batch in sse_batches(resp):
                    if b"[DONE]" in batch:
                        break
                if keep:
                    _keep_alive(resp)
                    await asyncio.gather(*_DRAINING)
                else:
                    resp.release()
        finally:
            await t.close()

    with serve_app(engine) as url:
        asyncio.run(two_streams(url, keep=True))
        asyncio.run(two_streams(url, keep=False))
    assert ports[0] == ports[1] and ports[2] != ports[3]
