"""The official ``openai`` client through the proxy to the embedded CPU engine (tiny random model).

The tiny model writes nonsense, so tool calls rarely appear; what is checked is that requests
with tools work end to end, streaming and not, and that the ``turn`` events carry exactly the
token ids and log-probs the engine returned for that request (shown to the client because it
asked for them with ``logprobs`` and ``return_token_ids``).
"""

from __future__ import annotations

import openai
import pytest

from pipeline.testing.proxy import running_proxy
from pipeline.testing.topics import read_events, read_records


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def test_openai_client_stream_and_non_stream_with_tools_and_exact_ids(engine_url, kafka_config):
    with running_proxy(kafka_config, engine_url, api_keys=["secret"]) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="secret", max_retries=0)
        model = client.models.list().data[0].id
        msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
        out = client.chat.completions.create(
            model=model, messages=msgs, tools=TOOLS, max_tokens=12, temperature=0.8, logprobs=True,
            extra_body={"return_token_ids": True}, extra_headers={"X-Session-Id": "oa-1"})
        choice = out.choices[0]
        ids = choice.model_extra["token_ids"]
        prompt_ids = choice.model_extra["prompt_token_ids"]
        lps = [e.logprob for e in choice.logprobs.content]
        assert len(ids) == len(lps) > 0

        msgs += [choice.message.model_dump(exclude_none=True), {"role": "user", "content": "And tomorrow?"}]
        stream = client.chat.completions.create(
            model=model, messages=msgs, tools=TOOLS, max_tokens=12, stream=True, logprobs=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
            extra_headers={"X-Session-Id": "oa-1", "X-Session-Done": "true"})
        s_ids, s_lps, s_prompt, usage, text = [], [], None, None, ""
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if (chunk.model_extra or {}).get("prompt_token_ids"):
                s_prompt = chunk.model_extra["prompt_token_ids"]
            for c in chunk.choices:
                s_ids += (c.model_extra or {}).get("token_ids") or []
                if c.logprobs and c.logprobs.content:
                    s_lps += [e.logprob for e in c.logprobs.content]
                text += c.delta.content or ""
        assert len(s_ids) == len(s_lps) == usage.completion_tokens > 0
        assert s_prompt and len(s_prompt) == usage.prompt_tokens

        # a plain client call (no extras asked): nothing extra is shown, the turn is still recorded
        plain = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, extra_headers={"X-Session-Id": "oa-2"})
        assert plain.choices[0].logprobs is None and "token_ids" not in (plain.choices[0].model_extra or {})
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=[{"role": "robot", "content": "x"}])
        assert "unknown role" in str(e.value)

        assert app.publisher.wait_idle(10)
        recs = read_records(kafka_config, kafka_config.topics.name("turns"), 5)
    turns = [r.event for r in recs if r.event.TYPE == "turn" and r.key == "oa-1"]
    assert [r.event.TYPE for r in recs if r.key == "oa-1"] == ["turn", "next_state", "turn", "session_end"]
    t0, t1 = turns
    assert t0.response_token_ids == ids and t0.prompt_token_ids == prompt_ids
    assert t0.response_logprobs == pytest.approx(lps, abs=1e-6)
    assert t0.tools == TOOLS and t0.sampling == {"max_tokens": 12, "temperature": 0.8}
    assert t1.response_token_ids == s_ids and t1.prompt_token_ids == s_prompt
    assert t1.response_logprobs == pytest.approx(s_lps, abs=1e-6)
    assert t1.response["content"] == text and t1.turn_index == 1
    plain_turn = [r.event for r in recs if r.key == "oa-2"][0]
    assert len(plain_turn.response_token_ids) == len(plain_turn.response_logprobs) > 0


def test_stream_through_engine_client_path_used_for_sglang(engine_url, kafka_config):
    """Against SGLang (no token ids on streamed chat) the proxy streams via EngineClient.chat_stream;
    forced here on our engine to exercise the proxy's side of that path."""
    with running_proxy(kafka_config, engine_url) as (url, app):
        app._caps = (False, True)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ids, text = [], ""
        for chunk in client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True,
                extra_body={"return_token_ids": True}, extra_headers={"X-Session-Id": "sg"}):
            for c in chunk.choices:
                ids += (c.model_extra or {}).get("token_ids") or []
                text += c.delta.content or ""
        assert app.publisher.wait_idle(10)
        (turn,) = read_events(kafka_config, want=1)
    assert turn.response_token_ids == ids and len(ids) == len(turn.response_logprobs) > 0
    assert turn.response["content"] == text


def test_required_tool_call_through_the_proxy_is_recorded_as_constrained(engine_url, kafka_config):
    """``tool_choice="required"`` with the openai client: a tool call of the declared schema comes
    back (constrained decoding), and its turn lists ``tool_choice`` in ``logprob_processors`` (no
    OPD term) with the tool-call response and the exact ids and log-probs."""
    import json

    import jsonschema

    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    with running_proxy(kafka_config, engine_url) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=tools, tool_choice="required", max_tokens=80, temperature=0.8, seed=3, logprobs=True,
            extra_body={"return_token_ids": True}, extra_headers={"X-Session-Id": "tc-1"})
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), params)
        assert app.publisher.wait_idle(10)
        recs = read_records(kafka_config, kafka_config.topics.name("turns"), 1)
    (turn,) = [r.event for r in recs if r.event.TYPE == "turn" and r.key == "tc-1"]
    assert turn.logprob_processors == ["tool_choice"] and turn.finish_reason == "tool_calls"
    assert turn.response["tool_calls"][0]["function"]["name"] == "get_weather"
    assert turn.response_token_ids == choice.model_extra["token_ids"]
    assert turn.response_logprobs == pytest.approx([e.logprob for e in choice.logprobs.content], abs=1e-6)
