"""SmolLM2-135M-Instruct (fp32) on the engine: sampled log-probs equal a scoring pass; a real chat."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.engine_api.client import EngineClient

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write one sentence about the sea.",
             "List three colours.", "Say hello to my friend Bob, who likes long explanations of many things."]


ENGINE_SETTINGS = {"model": "smollm2-135m", "threads": 2, "max_batch_size": 8}  # for conftest.engine_url


def test_generation_logprobs_equal_scoring_pass(engine_url):
    """Done-criterion: |log-prob while sampling - /generate scoring log-prob| mean <= 1e-4 (fp32),
    for concurrent (batched, left-padded) chat requests, streaming and non-streaming."""

    async def one(c: EngineClient, q: str, stream: bool):
        body = {"messages": [{"role": "user", "content": q}], "max_tokens": 24, "temperature": 1.0,
                "logprobs": True, "seed": 1}
        if stream:
            prompt, ids, lps = None, [], []
            async for ch in c.chat_stream(body, token_ids=True):
                prompt = ch.get("prompt_token_ids", prompt)
                for choice in ch["choices"]:
                    ids += choice.get("token_ids") or []
                    lps += [x["logprob"] for x in ((choice.get("logprobs") or {}).get("content") or [])]
            return prompt, ids, lps
        out = await c.chat(dict(body, return_token_ids=True))
        ch = out["choices"][0]
        return ch["prompt_token_ids"], ch["token_ids"], [x["logprob"] for x in ch["logprobs"]["content"]]

    async def main():
        async with EngineClient(engine_url, 300) as c:
            runs = await asyncio.gather(*(one(c, q, stream=i % 2 == 1) for i, q in enumerate(QUESTIONS)))
            diffs = []
            for prompt, ids, lps in runs:
                assert ids and len(ids) == len(lps)
                scored = await c.score(prompt + ids, len(prompt))
                diffs += [abs(a - b) for a, b in zip(scored, lps)]
            return diffs

    diffs = asyncio.run(main())
    mean = sum(diffs) / len(diffs)
    print(f"smollm2 sampled vs scored log-probs: mean |diff| {mean:.2e}, max {max(diffs):.2e}, n={len(diffs)}")
    assert mean <= 1e-4, (mean, max(diffs))
    assert max(diffs) < 1e-3


def test_chat_answers_sensibly(engine_url):
    async def main():
        async with EngineClient(engine_url, 300) as c:
            return await c.chat({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                                 "max_tokens": 24, "temperature": 0})

    out = asyncio.run(main())
    ch = out["choices"][0]
    assert "Paris" in ch["message"]["content"]
    assert ch["finish_reason"] in ("stop", "length") and out["metadata"]["weight_version"] == "0"


def test_required_tool_call_is_schema_valid(engine_url):
    """Done-criterion (issue 23): ``tool_choice: "required"`` returns a schema-valid tool call from
    SmolLM2-135M on the CPU engine (constrained decoding), at the default temperature."""
    import json

    import jsonschema

    weather = {"type": "object", "properties": {"city": {"type": "string"},
                                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                               "parameters": weather}},
             {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                               "parameters": {"type": "object",
                                                              "properties": {"timezone": {"type": "string"}},
                                                              "required": ["timezone"]}}}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}

    async def main():
        async with EngineClient(engine_url, 550) as c:  # ~40 tokens: minutes on a busy 2-core machine
            return await c.chat({
                "messages": [{"role": "user", "content": "What's the weather like in Paris right now?"}],
                "tools": tools, "tool_choice": "required", "max_tokens": 80, "seed": 1})

    for out in [asyncio.run(main())]:
        ch = out["choices"][0]
        assert ch["finish_reason"] == "tool_calls", ch
        (call,) = ch["message"]["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, schemas[call["function"]["name"]])
        assert out["metadata"]["sampling_params"]["tool_choice"] == "required"
        print("smollm2 tool call:", call["function"]["name"], args)
