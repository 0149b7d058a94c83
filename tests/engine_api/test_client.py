"""EngineClient against a real engine (tiny-random): typed errors, scoring alignment, both
streaming paths (native token ids and the SGLang fallback via /v1/tokenize + /generate)."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.engine_api.client import EngineClient
from pipeline.engine_api.errors import EngineError, EngineTimeout, EngineUnavailable
from pipeline.procutil import free_port
from pipeline.testing.engine import running_engine

MSG = [{"role": "user", "content": "Name a fruit."}]


ENGINE_SETTINGS = {"threads": 2, "api_key": None}  # for conftest.engine_url


def run(coro):
    return asyncio.run(coro)


def test_errors_are_typed(engine_url):
    async def main():
        async with EngineClient(engine_url, 30) as c:
            with pytest.raises(EngineError) as ei:
                await c.generate([1, 2], sampling_params={"temperature": -1})
            assert ei.value.status == 400 and "temperature" in ei.value.message and not ei.value.retryable
            with pytest.raises(EngineError) as ei:
                await c.chat({"messages": "nope"})
            assert ei.value.status == 400
        async with EngineClient(engine_url, 0.05) as c:
            with pytest.raises(EngineTimeout):
                await c.generate([1, 2], sampling_params={"max_new_tokens": 1000, "ignore_eos": True})
        async with EngineClient(f"http://127.0.0.1:{free_port()}", 5) as c:
            with pytest.raises(EngineUnavailable) as ei:
                await c.model_info()
            assert ei.value.retryable and ei.value.status is None
            assert await c.health() is False
            with pytest.raises(EngineTimeout):
                await c.wait_ready(0.3)

    run(main())


def test_score_alignment(engine_url):
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646]

    async def main():
        async with EngineClient(engine_url, 30) as c:
            await c.wait_ready(5)
            full = await c.score(ids, 1)  # logprob_start_len 0: the null pad entry is dropped
            assert len(full) == len(ids) - 1
            for start in (2, 5, len(ids) - 1):
                part = await c.score(ids, start)
                assert len(part) == len(ids) - start
                assert part == pytest.approx(full[start - 1:], abs=1e-5)
            assert await c.score(ids, len(ids)) == []
            with pytest.raises(ValueError):
                await c.score(ids, 0)
            res = await c.score_result(ids, 3, top_logprobs_num=2)
            assert res.weight_version == "0" and len(res.top) == len(ids) - 3 and len(res.top[0]) == 2
            t2 = await c.score(ids, 3, temperature=2.0)
            assert t2 != pytest.approx(res.logprobs, abs=1e-3)

    run(main())


def test_chat_stream_native_and_fallback_agree(engine_url):
    body = {"messages": MSG, "max_tokens": 6, "logprobs": True, "seed": 5, "temperature": 1.0,
            "ignore_eos": True, "stop": ["\n\n\n\n"]}

    async def collect(c: EngineClient):
        prompt, ids, lps, text, finish, versions = None, [], [], "", None, set()
        async for ch in c.chat_stream(body, token_ids=True):
            prompt = ch.get("prompt_token_ids", prompt)
            if ch.get("metadata"):
                versions.add(ch["metadata"]["weight_version"])
            for choice in ch["choices"]:
                ids += choice.get("token_ids") or []
                lps += [x["logprob"] for x in ((choice.get("logprobs") or {}).get("content") or [])]
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
        return prompt, ids, lps, text, finish, versions

    async def main():
        async with EngineClient(engine_url, 30) as c:
            native = await collect(c)
            assert (await c.server_info())["chat_stream_token_ids"] is True
            c._server_info = {"context_length": 2048}  # pretend to be SGLang: no streamed chat ids
            fallback = await collect(c)
            expect_prompt = await c.tokenize(MSG)
            plain = await c.chat(dict(body, return_token_ids=True))
            return native, fallback, expect_prompt, plain

    native, fallback, expect_prompt, plain = run(main())
    assert native[0] == fallback[0] == expect_prompt == plain["choices"][0]["prompt_token_ids"]
    assert native[1] == fallback[1] == plain["choices"][0]["token_ids"] and len(native[1]) == 6
    assert native[2] == pytest.approx(fallback[2], abs=1e-5)
    assert native[3] == fallback[3] == plain["choices"][0]["message"]["content"]
    assert native[4] == fallback[4] == "length"
    assert native[5] == fallback[5] == {"0"}


def test_chat_stream_without_ids_is_plain_openai(engine_url):
    async def main():
        async with EngineClient(engine_url, 30) as c:
            return [ch async for ch in c.chat_stream({"messages": MSG, "max_tokens": 3})]

    chunks = run(main())
    assert all("token_ids" not in ch["choices"][0] for ch in chunks if ch["choices"])
    assert "prompt_token_ids" not in chunks[0]


def test_api_key():
    with running_engine("tiny-random", threads=2, api_key="sekret") as u:
        async def main():
            async with EngineClient(u, 30) as anon:
                assert await anon.health() is True  # health stays open
                with pytest.raises(EngineError) as ei:
                    await anon.model_info()
                assert ei.value.status == 401
            async with EngineClient(u, 30, api_key="sekret") as c:
                assert (await c.model_info())["weight_version"] == "0"
                out = await c.generate([1, 2], sampling_params={"max_new_tokens": 1})
                assert len(out["output_ids"]) == 1

        run(main())
