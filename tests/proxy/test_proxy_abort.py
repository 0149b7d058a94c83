"""Case 8 of issue 11: a generation that does not finish is never trained as a finished answer.

The client gets an OpenAI-style error (never ``finish_reason: "abort"``), the turn is recorded
with ``finish_reason: "abort"`` and counted, and the judge never scores it as an answer. Real
broker, real HTTP; the engine is the real CPU engine (tiny-random) where it aborts, else
``StandInEngine`` (a stand-in engine) to script the other ways a generation is cut off.
"""

from __future__ import annotations

import httpx
import orjson
import pytest
from prometheus_client import REGISTRY

from pipeline.testing.judge import JudgeThread, short_id
from pipeline.testing.proxy import running_proxy
from pipeline.testing.servers import Reply, StandInEngine, StandInJudge, serve_app
from pipeline.testing.topics import read_events
from pipeline.testing.waiting import sse_events


CHAT = "/v1/chat/completions"
VOTE_UP = "<<score: \\boxed{1}>>"


def _unfinished(cause: str) -> float:
    return REGISTRY.get_sample_value("pipeline_proxy_unfinished_generations_total", {"cause": cause}) or 0.0


def _finish_reasons(chunks) -> list:
    return [c["choices"][0].get("finish_reason") for c in chunks
            if isinstance(c, dict) and c.get("choices")]


def _judge(config, server):
    c = config
    c = c.replace(judge={"backend": "llm", "url": server.url, "mode": "rl", "group_id": f"{c.topics.prefix}judge",
                         "vote_timeout_s": 5.0, "retries": 0})
    return JudgeThread(c)


def test_engine_abort_mid_stream_is_an_error_for_the_client_and_never_trained(kafka_config):
    """A stream the real engine aborts after a few tokens; the user continues the session."""
    from pipeline.testing.engine import running_engine

    c = kafka_config
    before = _unfinished("engine_abort")
    with running_engine("tiny-random", threads=1, context_length=2048) as eng, \
            running_proxy(c, eng) as (url, app), httpx.Client(timeout=60) as http:
        h = {"X-Session-Id": "cut"}
        msgs = [{"role": "user", "content": "Tell me a long story."}]
        body = {"messages": msgs, "stream": True, "max_tokens": 1900, "ignore_eos": True, "temperature": 1.0}
        chunks, text = [], ""
        with http.stream("POST", url + CHAT, json=body, headers=h) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunks.append(line[6:] if line[6:] == "[DONE]" else orjson.loads(line[6:]))
                if len(chunks) == 4:  # a few tokens in: the engine aborts (pause, weight update, shutdown)
                    assert http.post(eng + "/abort_request", json={"abort_all": True}).status_code == 200
        assert chunks[-1] == "[DONE]"
        err = chunks[-2]["error"]
        assert (err["type"], err["code"]) == ("server_error", "generation_aborted") and "retry" in err["message"]
        assert "abort" not in _finish_reasons(chunks)  # never the non-OpenAI finish reason
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-2] if c.get("choices"))
        # the user continues the session (with the partial reply in its history)
        msgs = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": "Great! " + VOTE_UP}]
        r = http.post(url + CHAT, json={"messages": msgs, "max_tokens": 4}, headers={**h, "X-Session-Done": "true"})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert app.publisher.wait_idle(10)
    assert _unfinished("engine_abort") == before + 1
    turns = [e for e in read_events(c, want=4, timeout_s=15) if e.TYPE == "turn"]
    assert [(t.turn_index, t.finish_reason) for t in turns] == [(0, "abort"), (1, "length")]
    assert 0 < len(turns[0].response_token_ids) < 1900
    with StandInJudge() as server, _judge(c, server):
        got = {short_id(s.sample_id): s for s in read_events(c, "samples", 2, timeout_s=30)}
    cut = got["cut:0:rl"]
    assert (cut.loss_mask, cut.reward) == (0, None)  # not trained (no reward), although its next state says +1


def test_non_stream_abort_is_a_503_and_the_turn_is_marked(kafka_config):
    c = kafka_config
    up = StandInEngine(lambda req: Reply(content="half an ans", finish_reason="abort"))
    with serve_app(up) as up_url, running_proxy(c, up_url) as (url, app):
        r = httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": "q"}]},
                       headers={"X-Session-Id": "na"})
        assert r.status_code == 503 and r.headers.get("retry-after") == "1"
        assert r.json()["error"]["code"] == "generation_aborted"
        r = httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": "q"}]})  # no session: not recorded
        assert r.status_code == 503
        app.publisher.wait_idle(10)
        evs = [e for e in read_events(c, want=3, timeout_s=10) if e.TYPE == "turn"]
    assert evs and all(t.finish_reason == "abort" for t in evs)


@pytest.mark.parametrize("how", ["engine_abort", "engine_error", "timeout", "truncated"])
def test_every_cut_off_stream_ends_in_an_error_and_an_unfinished_turn(kafka_config, how):
    c = kafka_config
    reply = {"engine_abort": Reply(content="abcdefghijkl", finish_reason="abort"),
             "engine_error": Reply(content="abcdefghijkl", break_after=3),
             "timeout": Reply(content="abcdefghijkl"),
             "truncated": Reply(content="abcdefghijkl", cut=True)}[how]
    up = StandInEngine(lambda req: reply, token_interval_s=0.6 if how == "timeout" else 0.0)
    before = _unfinished(how)
    with serve_app(up) as up_url, running_proxy(c, up_url, engine_timeout_s=0.3) as (url, app):
        with httpx.stream("POST", url + CHAT, json={"messages": [{"role": "user", "content": how}], "stream": True},
                          headers={"X-Session-Id": f"s-{how}"}, timeout=30) as s:
            assert s.status_code == 200
            chunks = sse_events(s)
        app.publisher.wait_idle(10)
        turns = [e for e in read_events(c, want=1, timeout_s=5) if e.TYPE == "turn"]
    assert chunks[-1] == "[DONE]" and "error" in chunks[-2]
    assert "abort" not in _finish_reasons(chunks)
    assert _unfinished(how) == before + 1
    assert [t.finish_reason for t in turns] in ([], ["abort"])  # recorded only when tokens came
    if how in ("engine_abort", "truncated"):
        assert chunks[-2]["error"]["code"] == "generation_aborted" and turns
