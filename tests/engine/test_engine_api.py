"""The engine's HTTP API against a real server (tiny-random model, in-process uvicorn)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pipeline.engine_api.client import EngineClient
from pipeline.testing.waiting import sse_events

MSG = [{"role": "user", "content": "What is 2 + 2?"}]


ENGINE_SETTINGS = {"threads": 2, "context_length": 256, "max_batch_size": 8}  # for conftest.engine_url


def gen(http, **body):
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# ---- /generate --------------------------------------------------------------------------------------
def test_generate_shape_and_weight_version(http):
    out = gen(http, text="Hello", sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert set(out) >= {"text", "output_ids", "meta_info"}
    mi = out["meta_info"]
    assert len(out["output_ids"]) == 4 and mi["completion_tokens"] == 4
    assert mi["finish_reason"] == {"type": "length", "length": 4}
    assert mi["weight_version"] == "0" and isinstance(mi["id"], str) and "input_token_logprobs" not in mi


def test_generate_logprob_alignment(http):
    ids = [1, 9690, 198, 2683, 359, 253, 5356]
    L = len(ids)
    full = gen(http, input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
               logprob_start_len=0)["meta_info"]
    assert full["finish_reason"] == {"type": "length", "length": 0} and full["output_token_logprobs"] == []
    entries = full["input_token_logprobs"]
    assert len(entries) == L and entries[0][0] is None and [e[1] for e in entries] == ids
    for k in (1, 3, L - 1):
        part = gen(http, input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                   logprob_start_len=k)["meta_info"]["input_token_logprobs"]
        assert len(part) == L - 1 - k and [e[1] for e in part] == ids[k + 1:]
        assert [e[0] for e in part] == pytest.approx([e[0] for e in entries[k + 1:]], abs=1e-5)
    default = gen(http, input_ids=ids, sampling_params={"max_new_tokens": 2}, return_logprob=True)["meta_info"]
    assert default["input_token_logprobs"] == [] and len(default["output_token_logprobs"]) == 2


def test_generate_output_logprobs_equal_scoring(http):
    ids = [1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198]
    out = gen(http, input_ids=ids, sampling_params={"max_new_tokens": 12, "ignore_eos": True, "temperature": 1.0},
              return_logprob=True, top_logprobs_num=3)
    mi = out["meta_info"]
    assert [e[1] for e in mi["output_token_logprobs"]] == out["output_ids"]
    assert len(mi["output_top_logprobs"]) == 12 and len(mi["output_top_logprobs"][0]) == 3
    assert mi["input_top_logprobs"] == []
    score = gen(http, input_ids=ids + out["output_ids"], sampling_params={"max_new_tokens": 0},
                return_logprob=True, logprob_start_len=len(ids) - 1)["meta_info"]["input_token_logprobs"]
    diff = [abs(a[0] - b[0]) for a, b in zip(score, mi["output_token_logprobs"])]
    assert len(score) == 12 and max(diff) < 1e-4


def test_generate_top_logprobs_and_text(http):
    mi = gen(http, input_ids=[1, 2, 3, 4], sampling_params={"max_new_tokens": 1}, return_logprob=True,
             logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True,
             token_ids_logprob=[5, 6])["meta_info"]
    assert mi["input_top_logprobs"][0] is None and len(mi["input_top_logprobs"][1]) == 2
    assert isinstance(mi["input_token_logprobs"][1][2], str)
    assert [t[1] for t in mi["output_token_ids_logprobs"][0]] == [5, 6]
    top = mi["input_top_logprobs"][1]
    assert top[0][0] >= top[1][0]


def test_generate_batch_n_and_rid(http):
    out = http.post("/generate", json={"text": ["a b", "c d e"], "sampling_params": {"max_new_tokens": 2},
                                       "rid": "batch"}).json()
    assert isinstance(out, list) and len(out) == 2
    assert [o["meta_info"]["id"] for o in out] == ["batch_0", "batch_1"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 3]
    n = http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "n": 3},
                                     "return_prompt_token_ids": True}).json()
    assert isinstance(n, list) and len(n) == 3 and n[0]["prompt_token_ids"] == [1, 2, 3]


def test_generate_stop_string_and_token(http):
    base = gen(http, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 10, "temperature": 0,
                                                             "ignore_eos": True})
    ids = base["output_ids"]
    stop_tok = ids[3]
    first = ids.index(stop_tok)  # greedy repeats are possible: stop at the first occurrence
    out = gen(http, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 10, "temperature": 0,
                                                            "stop_token_ids": [stop_tok], "ignore_eos": True})
    assert out["output_ids"] == ids[:first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    stop_str = base["text"][len(base["text"]) // 2:][:3]
    assert stop_str
    out = gen(http, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 10, "temperature": 0,
                                                            "stop": [stop_str], "ignore_eos": True})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
    assert stop_str not in out["text"] and base["text"].startswith(out["text"])
    kept = gen(http, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 10, "temperature": 0,
                                                             "stop": [stop_str], "no_stop_trim": True,
                                                             "ignore_eos": True})
    assert kept["text"].endswith(stop_str) or stop_str in kept["text"]


def test_generate_stream_is_cumulative(http):
    with http.stream("POST", "/generate", json={"input_ids": [1, 2, 3], "stream": True, "return_logprob": True,
                                                "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        ev = sse_events(r)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 5


# ---- chat -------------------------------------------------------------------------------------------
def test_chat_non_stream_flags(http):
    r = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 6, "logprobs": True,
                                                "top_logprobs": 2, "return_token_ids": True,
                                                "return_meta_info": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    out = r.json()
    ch = out["choices"][0]
    assert out["object"] == "chat.completion" and out["metadata"]["weight_version"] == "0"
    assert out["metadata"]["sampling_params"]["temperature"] == 1.0  # the effective parameters
    assert ch["message"]["role"] == "assistant" and isinstance(ch["message"]["content"], str)
    assert ch["finish_reason"] == "length" and len(ch["token_ids"]) == 6
    assert ch["prompt_token_ids"][:2] == [1, 9690] and ch["prompt_token_ids"][-3:] == [520, 9531, 198]
    assert out["usage"] == {"prompt_tokens": len(ch["prompt_token_ids"]), "completion_tokens": 6,
                            "total_tokens": len(ch["prompt_token_ids"]) + 6, "reasoning_tokens": 0}
    lp = ch["logprobs"]["content"]
    assert len(lp) == 6 and len(lp[0]["top_logprobs"]) == 2 and lp[0]["bytes"] == list(lp[0]["token"].encode())
    mi_lps = ch["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in mi_lps] == ch["token_ids"] and [e[0] for e in mi_lps] == [x["logprob"] for x in lp]
    assert ch["meta_info"]["weight_version"] == "0"


def test_chat_prompt_ids_match_tokenize_and_input_ids(http):
    toks = http.post("/v1/tokenize", json={"messages": MSG}).json()
    out = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2,
                                                  "return_prompt_token_ids": True}).json()
    assert out["choices"][0]["prompt_token_ids"] == toks["tokens"] and toks["count"] == len(toks["tokens"])
    assert toks["max_model_len"] == 256
    raw = http.post("/v1/chat/completions", json={"messages": MSG, "input_ids": [1, 2, 3], "max_tokens": 2,
                                                  "return_prompt_token_ids": True}).json()
    assert raw["choices"][0]["prompt_token_ids"] == [1, 2, 3]
    assert http.post("/v1/tokenize", json={"prompt": "hello world"}).json()["tokens"] == \
        http.post("/generate", json={"text": "hello world", "sampling_params": {"max_new_tokens": 0},
                                     "return_prompt_token_ids": True}).json()["prompt_token_ids"]


def test_chat_stream_sse(http):
    body = {"messages": MSG, "max_tokens": 5, "stream": True, "logprobs": True, "return_token_ids": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        ev = sse_events(r)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["prompt_token_ids"][-3:] == [520, 9531, 198]
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    lps = [x for c in chunks if c["choices"] for x in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert len(ids) == 5 and len(lps) == 5
    # one chunk per token: token by token
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0].get("token_ids")) == 5
    fin = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(fin) == 1 and fin[0]["choices"][0]["finish_reason"] == "length"
    assert fin[0]["metadata"]["weight_version"] == "0"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    # the streamed text equals the non-stream decode of the same ids
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    dec = http.post("/v1/detokenize", json={"tokens": ids}).json()["text"]
    assert text == dec


def test_chat_stream_rejects_sglang_non_stream_flags(http):
    r = http.post("/v1/chat/completions", json={"messages": MSG, "stream": True, "return_meta_info": True})
    assert r.status_code == 400 and r.json()["object"] == "error"


def test_chat_n_choices_and_seed(http):
    body = {"messages": MSG, "max_tokens": 4, "n": 2, "seed": 7, "ignore_eos": True, "return_token_ids": True}
    a = http.post("/v1/chat/completions", json=body).json()
    http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 3})  # moves the engine's generator
    b = http.post("/v1/chat/completions", json=body).json()
    c = http.post("/v1/chat/completions", json={**body, "seed": 8}).json()
    assert [ch["index"] for ch in a["choices"]] == [0, 1]
    assert [ch["token_ids"] for ch in a["choices"]] == [ch["token_ids"] for ch in b["choices"]]
    assert a["choices"][0]["token_ids"] != a["choices"][1]["token_ids"]  # sample j uses seed + j
    # the seed is what decides: another seed, other tokens
    assert [ch["token_ids"] for ch in c["choices"]] != [ch["token_ids"] for ch in a["choices"]]


def test_chat_with_tools_is_accepted(http):
    tools = [{"type": "function", "function": {"name": "add", "description": "add numbers",
                                                "parameters": {"type": "object", "properties": {}}}}]
    out = http.post("/v1/chat/completions", json={"messages": MSG, "tools": tools, "max_tokens": 5,
                                                  "return_prompt_token_ids": True})
    assert out.status_code == 200, out.text
    ch = out.json()["choices"][0]
    plain = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 1,
                                                    "return_prompt_token_ids": True}).json()["choices"][0]
    assert len(ch["prompt_token_ids"]) > len(plain["prompt_token_ids"])  # tools are in the prompt
    assert ch["finish_reason"] in ("stop", "length", "tool_calls")
    with http.stream("POST", "/v1/chat/completions", json={"messages": MSG, "tools": tools, "max_tokens": 5,
                                                           "stream": True}) as r:
        assert r.status_code == 200 and sse_events(r)[-1] == "[DONE]"


# ---- info & misc ------------------------------------------------------------------------------------------
def test_info_routes(http):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    mi = http.get("/model_info").json()
    assert mi == http.get("/get_model_info").json()
    assert mi["weight_version"] == "0" and mi["is_generation"] is True
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-random"
    assert models["data"][0]["max_model_len"] == 256
    assert http.get("/v1/models/nope").status_code == 404
    si = http.get("/server_info").json()
    assert si["incremental_streaming_output"] is False and si["chat_stream_token_ids"] is True
    assert http.get("/nope").json()["code"] == 404


def test_metrics(http):
    gen(http, input_ids=[1, 2], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    text = http.get("/metrics").text
    for name in ("pipeline_engine_requests_total", "pipeline_engine_generated_tokens_total",
                 "pipeline_engine_weight_version", "pipeline_engine_request_latency_seconds_bucket"):
        assert name in text
    assert 'pipeline_engine_requests_total{endpoint="/generate",status="200"}' in text


def test_concurrent_requests_do_not_corrupt_each_other(engine_url):
    prompts = [[1] + [100 + i] * (3 + 5 * i) for i in range(10)]

    async def main():
        async with EngineClient(engine_url, 120) as c:
            work = asyncio.ensure_future(asyncio.gather(*(
                c.generate(p, sampling_params={"max_new_tokens": 8 + 3 * i, "ignore_eos": True, "temperature": 0.8},
                           return_logprob=True) for i, p in enumerate(prompts))))
            peak = await _peak_running(engine_url, work)
            outs = await work
            scores = await asyncio.gather(*(c.score(p + o["output_ids"], len(p), temperature=0.8)
                                           for p, o in zip(prompts, outs)))
            return outs, scores, peak

    outs, scores, peak = asyncio.run(main())
    assert peak >= 2, "the requests never shared a decode batch: nothing concurrent was tested"
    for i, (p, o, s) in enumerate(zip(prompts, outs, scores)):
        assert o["meta_info"]["prompt_tokens"] == len(p)
        assert len(o["output_ids"]) == 8 + 3 * i
        lps = [e[0] for e in o["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(lps, s)) < 1e-4


async def _peak_running(engine_url: str, work: asyncio.Future) -> float:
    """The most rows the engine's decode batch held (``pipeline_engine_running_requests``) while
    ``work`` ran, sampled from ``/metrics``."""
    peak = 0.0
    async with httpx.AsyncClient(base_url=engine_url, timeout=10) as h:
        while not work.done():
            for line in (await h.get("/metrics")).text.splitlines():
                if line.startswith("pipeline_engine_running_requests "):
                    peak = max(peak, float(line.split()[1]))
            await asyncio.sleep(0.005)
    return peak


async def _until_engine_reports(engine_url: str, gauge: str, timeout_s: float = 30.0) -> None:
    """Wait until the engine's /metrics shows ``gauge`` >= 1 (e.g. a request in its decode batch)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with httpx.AsyncClient(base_url=engine_url, timeout=10) as h:
        while loop.time() < deadline:
            text = (await h.get("/metrics")).text
            if any(line.startswith(gauge + " ") and float(line.split()[1]) >= 1 for line in text.splitlines()):
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"engine never reported {gauge} >= 1")


def test_abort_request_and_pause(engine_url, http):
    async def main():
        async with EngineClient(engine_url, 60) as c:
            task = asyncio.create_task(c.generate([1, 2, 3], sampling_params={"max_new_tokens": 200,
                                                                              "ignore_eos": True}, rid="victim"))
            await _until_engine_reports(engine_url, "pipeline_engine_running_requests")  # the victim is decoding
            await c.abort_request("victim")
            out = await task
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            await c.pause_generation("in_place")
            held = asyncio.create_task(c.generate([1, 2], sampling_params={"max_new_tokens": 2}))
            await _until_engine_reports(engine_url, "pipeline_engine_waiting_requests")  # queued behind the pause
            assert not held.done()
            await c.continue_generation()
            assert len((await held)["output_ids"]) == 2

    asyncio.run(main())


def test_chat_stream_holds_back_stop_strings(http):
    sampled = {"messages": MSG, "max_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    base = http.post("/v1/chat/completions", json=sampled).json()["choices"][0]["message"]["content"]
    stop = base[len(base) // 2:][:4]
    assert stop.strip()
    body = dict(sampled, stop=[stop])
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    with http.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as r:
        chunks = [c for c in sse_events(r) if c != "[DONE]"]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert plain["finish_reason"] == "stop" and plain["matched_stop"] == stop
    assert streamed == plain["message"]["content"] and stop not in streamed
    assert base.startswith(streamed)
