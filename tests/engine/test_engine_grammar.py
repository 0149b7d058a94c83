"""Constrained decoding on the CPU engine (tiny-random, a real engine over HTTP; llguidance).

``tool_choice: "required"`` / a named function return a schema-valid tool call while batched with
unconstrained requests; the engine's log-probs are those of the masked distribution, which an
independent scoring pass (transformers forward + llguidance's own per-token mask) reproduces;
``response_format`` json and ``regex`` are served; bad constraints are 400s.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch

from pipeline.engine.grammar import Matcher, check_grammar, json_grammar, tool_call_grammar
from pipeline.engine.sampler import allowed_tokens
from pipeline.models import resolve_model
from pipeline.sampling import logprob_processors

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def ll_tok(tokenizer):
    return llguidance.hf.from_tokenizer(tokenizer)


ENGINE_SETTINGS = {"threads": 2, "max_batch_size": 8}  # for conftest.engine_url


# ---- grammar units ------------------------------------------------------------------------------
def _accepts(ll_tok, tokenizer, grammar: str, text: str) -> bool:
    m = Matcher(ll_tok, grammar)
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return all(m.advance(t) is None for t in ids)


def test_tool_call_grammar_accepts_exactly_one_declared_call(ll_tok, tokenizer):
    g = tool_call_grammar(TOOLS)
    check_grammar(g, ll_tok, "tool_choice")
    call = lambda name, args: "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
    assert _accepts(ll_tok, tokenizer, g, call("add", {"a": 1, "b": 2}))
    assert _accepts(ll_tok, tokenizer, g, call("get_weather", {"city": "Paris", "unit": "c"}))
    assert not _accepts(ll_tok, tokenizer, g, call("mul", {"a": 1, "b": 2}))  # undeclared tool
    assert not _accepts(ll_tok, tokenizer, g, call("add", {"a": 1}))  # missing required
    assert not _accepts(ll_tok, tokenizer, g, call("add", {"a": 1, "b": 2, "c": 3}))  # undeclared parameter
    assert not _accepts(ll_tok, tokenizer, g, call("add", {"a": 1, "b": 2}) + "\n" + call("add", {"a": 1, "b": 2}))
    named = tool_call_grammar(TOOLS[1:])
    assert not _accepts(ll_tok, tokenizer, named, call("get_weather", {"city": "Paris", "unit": "c"}))


def test_mask_bits_match_llguidance_logit_bias(ll_tok):
    """The sampler's bit unpacking agrees with llguidance's one-byte-per-token mask."""
    m = llguidance.LLMatcher(ll_tok, tool_call_grammar(TOOLS), log_level=0)
    for _ in range(3):
        ref = torch.frombuffer(bytearray(m.compute_logit_bias()), dtype=torch.uint8) > 0
        got = allowed_tokens(m.compute_bitmask(), ll_tok.vocab_size + 5)
        assert torch.equal(got[:ll_tok.vocab_size], ref[:ll_tok.vocab_size]) and not got[ll_tok.vocab_size:].any()
        assert 0 < int(ref.sum()) < ll_tok.vocab_size
        m.consume_token(int(ref.nonzero()[0, 0]))


def test_bad_schema_is_a_grammar_error(ll_tok):
    with pytest.raises(ValueError, match="json_schema"):
        json_grammar("{not json")
    with pytest.raises(ValueError, match="tool_choice"):
        check_grammar(tool_call_grammar([{"function": {"name": "f", "parameters": {"type": "bogus"}}}]), ll_tok,
                      "tool_choice")


# ---- the engine -------------------------------------------------------------------------------
def _body(**extra) -> dict:
    return {"messages": MSG, "tools": TOOLS, "max_tokens": 120, "temperature": 0.8, "logprobs": True,
            "return_token_ids": True, **extra}


def _check_call(resp: dict, names: set[str]) -> dict:
    ch = resp["choices"][0]
    assert ch["finish_reason"] == "tool_calls", ch
    calls = ch["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] in names, calls
    args = json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(args, SCHEMAS[calls[0]["function"]["name"]])
    return ch


def test_required_and_named_batch_with_unconstrained(engine_url):
    """Four concurrent requests decode in one batch: two constrained, two not; each gets its own
    outcome, and the constrained answers say so in metadata.sampling_params."""
    named = {"type": "function", "function": {"name": "add"}}
    bodies = [_body(tool_choice="required", seed=s) for s in (1, 2)] + [_body(tool_choice=named, seed=3)] + \
        [_body(tool_choice="auto", seed=s, max_tokens=40) for s in (4, 5)]

    async def main():
        async with httpx.AsyncClient(base_url=engine_url, timeout=120) as c:
            steps = lambda r: r.json()["internal_states"][0]["decode_steps"]
            before = steps(await c.get("/server_info"))
            rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))
            after = steps(await c.get("/server_info"))
        return [r.json() for r in rs], after - before

    outs, steps = asyncio.run(main())
    for out in outs[:2]:
        _check_call(out, {"get_weather", "add"})
        sp = out["metadata"]["sampling_params"]
        assert sp["tool_choice"] == "required" and logprob_processors(sp) == ["tool_choice"]
    _check_call(outs[2], {"add"})
    assert outs[2]["metadata"]["sampling_params"]["tool_choice"] == named
    for out in outs[3:]:  # the unconstrained rows are not forced into a call
        assert out["choices"][0]["message"]["tool_calls"] is None
        assert logprob_processors(out["metadata"]["sampling_params"]) == []
    total = sum(len(o["choices"][0]["token_ids"]) for o in outs)
    # one-at-a-time decoding would take total - 5 steps (each first token comes from its prefill)
    assert steps <= (total - len(bodies)) // 2, (steps, total)


def test_streamed_required_call(engine_url):
    calls, finish = [], None
    with httpx.stream("POST", engine_url + "/v1/chat/completions", json=_body(tool_choice="required", seed=7, stream=True),
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    calls += ch["delta"].get("tool_calls") or []
                    finish = ch.get("finish_reason") or finish
    assert finish == "tool_calls" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMAS[calls[0]["function"]["name"]])


def _masked_scores(prompt: list[int], output: list[int], grammar: str, temperature: float, ll_tok) -> tuple:
    """Independent scoring pass: transformers fp32 forward of prompt + output; at each output
    position, llguidance's own byte mask (compute_logit_bias) -> masked and plain log-probs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model("tiny-random")), dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float() / temperature
    m = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    masked, plain = [], []
    for pos, tok in enumerate(output):
        allowed = torch.zeros(logits.shape[1], dtype=torch.bool)
        bias = torch.frombuffer(bytearray(m.compute_logit_bias()), dtype=torch.uint8) > 0
        allowed[:bias.shape[0]] = bias[:logits.shape[1]]
        row = logits[pos].masked_fill(~allowed, float("-inf"))
        masked.append(float(torch.log_softmax(row, -1)[tok]))
        plain.append(float(torch.log_softmax(logits[pos], -1)[tok]))
        assert m.consume_token(tok)
    return masked, plain


def test_logprobs_equal_a_scoring_pass_under_the_same_mask(engine_url, ll_tok):
    """The recorded log-probs are of the distribution sampled from (masked, renormalised, at the
    request temperature): |engine - scoring pass with the mask| <= 1e-4 (fp32), while the
    unmasked scoring pass differs (the check can fail)."""
    out = httpx.post(engine_url + "/v1/chat/completions", json=_body(tool_choice="required", seed=11), timeout=120).json()
    ch = _check_call(out, {"get_weather", "add"})
    lps = [x["logprob"] for x in ch["logprobs"]["content"]]
    masked, plain = _masked_scores(ch["prompt_token_ids"], ch["token_ids"], tool_call_grammar(TOOLS), 0.8, ll_tok)
    diffs = [abs(a - b) for a, b in zip(lps, masked)]
    assert len(lps) == len(masked) == len(ch["token_ids"])
    assert max(diffs) <= 1e-4, max(diffs)
    assert max(abs(a - b) for a, b in zip(lps, plain)) > 0.1


def test_response_format_and_regex(engine_url):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    body = {"messages": MSG, "max_tokens": 60, "seed": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    out = httpx.post(engine_url + "/v1/chat/completions", json=body, timeout=120).json()
    assert out["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), schema)
    assert logprob_processors(out["metadata"]["sampling_params"]) == ["constrained_decoding"]
    gen = httpx.post(engine_url + "/generate", json={"text": "hi", "sampling_params": {
        "regex": "[a-z]{2,5}", "max_new_tokens": 20, "sampling_seed": 1}}, timeout=120).json()
    assert gen["meta_info"]["finish_reason"]["type"] == "stop"
    assert 2 <= len(gen["text"]) <= 5 and gen["text"].isalpha() and gen["text"].islower(), gen["text"]


@pytest.mark.parametrize("body, says", [
    ({"messages": MSG, "tool_choice": "required"}, "no tools"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tool_choice"),
    ({"messages": MSG, "tools": TOOLS, "tool_choice": "required", "min_tokens": 3}, "min_new_tokens"),
    ({"messages": MSG, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "at most one"),
    ({"messages": MSG, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": MSG, "regex": "[a-"}, "regex"),
])
def test_bad_constraints_are_400(engine_url, body, says):
    r = httpx.post(engine_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and says in r.json()["message"], r.text


def test_bad_generate_constraints_are_400(engine_url):
    for sp, says in [({"json_schema": "{nope"}, "json_schema"), ({"regex": "[a-"}, "regex"),
                     ({"regex": "a", "json_schema": "{}"}, "at most one"), ({"regex": 5}, "regex")]:
        r = httpx.post(engine_url + "/generate", json={"text": "hi", "sampling_params": sp}, timeout=60)
        assert r.status_code == 400 and says in r.json()["error"]["message"], (sp, r.text)


def test_an_empty_mask_leaves_the_logits_alone_and_a_bad_token_is_reported(ll_tok):
    """A mask that allows nothing (a failed matcher) does not make an all -inf row (no NaN): the
    sampler leaves that row unmasked, and feeding a token the grammar refuses reports the error
    (the worker then ends the row with an abort)."""
    from pipeline.engine.params import SamplingParams
    from pipeline.engine.sampler import RowSpec, sample_step

    m = Matcher(ll_tok, tool_call_grammar(TOOLS))
    full = m.mask()
    V = ll_tok.vocab_size
    rows = [RowSpec(SamplingParams(), [], [], None, allowed=bytes(len(full))),
            RowSpec(SamplingParams(), [], [], None, allowed=full)]
    res = sample_step(torch.randn(2, V), rows, torch.Generator().manual_seed(0))
    assert all(torch.isfinite(torch.tensor(res.logprobs)))
    assert m.advance(res.token_ids[1]) is None  # the masked row drew an allowed token
    assert Matcher(ll_tok, tool_call_grammar(TOOLS)).advance(0) is not None  # 0 cannot start "<tool_call>"
