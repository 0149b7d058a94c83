"""Every chat field the proxy accepts is honoured on every path exactly as on the engine's own
chat path, or refused with a 4xx that names it. Table-driven over the proxy's schema
(:data:`pipeline.engine_api.schema.CHAT_FIELDS`): a field added to the schema without a case here
fails :func:`test_every_accepted_field_has_a_case`.

Paths: the proxy in front of our CPU engine (which streams token ids on chat: the request is
forwarded) and in front of an SGLang-style engine (which cannot: a streamed, recorded turn goes
through ``/v1/tokenize`` + ``/generate``), each non-streamed and streamed. The reference is the
CPU engine's own chat answer to the same body (the SGLang-style stand-in is that engine), in the
same streaming mode. The served model is tiny-random with ``repetition_penalty: 1.3`` in its
generation_config, a chat default that the ``/generate`` path must apply too.

Case kinds: ``effect`` fields change the reference answer (checked against the case's baseline,
so a dropped field cannot pass) and must be honoured on every path; ``same`` fields leave the
text alone and must be honoured; ``refuse`` fields are refused by the engine and must be refused
on every path; ``proxy-refuse``: the proxy itself refuses the value; ``either``: honoured
exactly or refused, as each path can.
"""

from __future__ import annotations

import json
import shutil
import uuid

import httpx
import orjson
import pytest

from pipeline.engine_api.schema import CHAT_FIELDS
from pipeline.models import resolve_model
from pipeline.testing.engine import running_engine
from pipeline.testing.proxy import running_proxy
from pipeline.testing.servers import serve_app
from pipeline.testing.sglang_style import SglangStyleEngine

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
BASE = {"model": "m", "messages": [{"role": "user", "content": "Tell me a story about a cat."}], "max_tokens": 6,
        "temperature": 1.0, "seed": 5, "return_token_ids": True}
EOS, SPECIAL = "2", "1"  # <|im_end|> ends a turn; <|im_start|> is special but not a stop token
ASSISTANT_END = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a"}]


def _stop_text(ref) -> dict:
    return {"stop": [ref["content"][3:6]]}


# id -> (field, kind, base extra (or callable of the baseline answer), case update (or callable))
CASES = {
    "model": ("model", "same", {}, {"model": "another-name"}),
    "messages": ("messages", "effect", {}, {"messages": [{"role": "system", "content": "Answer in one word."},
                                                         {"role": "user", "content": "Name a colour."}]}),
    "stream_options.include_usage": ("stream_options", "same", {}, {"stream_options": {"include_usage": True}}),
    "stream_options.continuous_usage_stats": ("stream_options", "refuse", {},
                                              {"stream_options": {"continuous_usage_stats": True}}),
    "logprobs": ("logprobs", "same", {}, {"logprobs": True}),
    "top_logprobs": ("top_logprobs", "same", {"logprobs": True}, {"top_logprobs": 3}),
    "temperature": ("temperature", "effect", {}, {"temperature": 0.0}),
    "top_p": ("top_p", "effect", {}, {"top_p": 0.01}),
    "top_k": ("top_k", "effect", {}, {"top_k": 1}),
    "min_p": ("min_p", "effect", {}, {"min_p": 0.5}),
    "presence_penalty": ("presence_penalty", "effect", {"temperature": 0.0}, {"presence_penalty": 2.0}),
    "frequency_penalty": ("frequency_penalty", "effect", {"temperature": 0.0}, {"frequency_penalty": 2.0}),
    "repetition_penalty": ("repetition_penalty", "effect", {}, {"repetition_penalty": 1.0}),  # default: 1.3
    "max_tokens": ("max_tokens", "effect", {}, {"max_tokens": 3}),
    "max_completion_tokens": ("max_completion_tokens", "effect", {}, {"max_completion_tokens": 2}),
    "min_tokens": ("min_tokens", "effect", {"logit_bias": {EOS: 100}}, {"min_tokens": 4}),
    "seed": ("seed", "effect", {}, {"seed": 99}),
    "n": ("n", "proxy-refuse", {}, {"n": 2}),  # the engine serves n > 1; a recorded turn is one sample
    "stop": ("stop", "effect", {}, _stop_text),
    "stop_token_ids": ("stop_token_ids", "effect", {}, lambda ref: {"stop_token_ids": [ref["token_ids"][2]]}),
    "stop_regex": ("stop_regex", "refuse", {}, {"stop_regex": "[a-z]"}),
    "ignore_eos": ("ignore_eos", "effect", {"logit_bias": {EOS: 100}}, {"ignore_eos": True}),
    "no_stop_trim": ("no_stop_trim", "effect", _stop_text, {"no_stop_trim": True}),
    "skip_special_tokens": ("skip_special_tokens", "effect", {"logit_bias": {SPECIAL: 100}, "max_tokens": 3},
                            {"skip_special_tokens": False}),
    "logit_bias": ("logit_bias", "effect", {}, {"logit_bias": {"1000": 100}}),
    "tools": ("tools", "effect", {}, {"tools": TOOLS}),
    "tool_choice.none": ("tool_choice", "effect", {"tools": TOOLS}, {"tool_choice": "none"}),
    "tool_choice.auto": ("tool_choice", "same", {"tools": TOOLS}, {"tool_choice": "auto"}),
    # constrained decoding: the streamed /generate path of an SGLang-style engine refuses them
    "tool_choice.required": ("tool_choice", "either", {"tools": TOOLS}, {"tool_choice": "required"}),
    "tool_choice.named": ("tool_choice", "either", {"tools": TOOLS},
                          {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    "parallel_tool_calls": ("parallel_tool_calls", "same", {"tools": TOOLS}, {"parallel_tool_calls": False}),
    "response_format.text": ("response_format", "same", {}, {"response_format": {"type": "text"}}),
    "response_format.json_object": ("response_format", "effect", {}, {"response_format": {"type": "json_object"}}),
    "response_format.json_schema": ("response_format", "effect", {}, {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}),
    "regex": ("regex", "effect", {}, {"regex": "[a-z]+"}),
    "ebnf": ("ebnf", "refuse", {}, {"ebnf": 'root ::= "a"'}),
    "user": ("user", "same", {}, {"user": "user-1"}),
    "continue_final_message": ("continue_final_message", "effect", {"messages": ASSISTANT_END},
                               {"continue_final_message": True}),
    "chat_template_kwargs": ("chat_template_kwargs", "same", {}, {"chat_template_kwargs": {"unused_flag": True}}),
    "input_ids": ("input_ids", "effect", {}, lambda ref: {"input_ids": _INPUT_IDS}),
    "rid": ("rid", "same", {}, lambda ref: {"rid": f"rid-{uuid.uuid4().hex}"}),
    "return_token_ids": ("return_token_ids", "same", {}, {"return_token_ids": False}),
    "return_prompt_token_ids": ("return_prompt_token_ids", "either", {}, {"return_prompt_token_ids": True}),
    "return_meta_info": ("return_meta_info", "either", {}, {"return_meta_info": True}),
    # not in the schema: forwarded to the engine (ours ignores it), refused where it cannot be served
    "unknown_field": ("x_vendor_field", "either", {}, {"x_vendor_field": 1}),
}
_INPUT_IDS: list[int] = []  # set by the engine fixture: another prompt, rendered by the engine


def test_every_accepted_field_has_a_case():
    covered = {field for field, *_ in CASES.values()}
    assert set(CHAT_FIELDS) - {"stream"} - covered == set()  # "stream" is the mode of every case


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """tiny-random with a chat default in generation_config.json."""
    out = tmp_path_factory.mktemp("fields") / "tiny-defaults"
    shutil.copytree(resolve_model("tiny-random"), out)
    gen = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps(dict(gen, repetition_penalty=1.3)))
    return out


@pytest.fixture(scope="module")
def defaults_engine_url(model_dir):
    """The CPU engine serving ``model_dir`` (its own generation defaults), the conftest's engine_url
    being tiny-random's."""
    with running_engine(str(model_dir), threads=2) as url:
        r = httpx.post(url + "/v1/tokenize", json={"messages": [{"role": "user", "content": "Count to five."}]})
        _INPUT_IDS[:] = r.json()["tokens"]
        yield url


@pytest.fixture(scope="module")
def proxies(defaults_engine_url, model_dir, broker_bootstrap):
    from tests.conftest import make_config

    from pipeline.bus.admin import apply_topics
    from pipeline.topics import load_topics

    config = make_config(broker_bootstrap, f"t-fields-{uuid.uuid4().hex[:6]}-")
    apply_topics(config, load_topics(config.topics.file))
    with serve_app(SglangStyleEngine(defaults_engine_url)) as sglang_url, \
            running_proxy(config, defaults_engine_url, tokenizer=str(model_dir)) as (cpu_proxy, _a), \
            running_proxy(config, sglang_url, tokenizer=str(model_dir)) as (sglang_proxy, _b):
        yield {"cpu": cpu_proxy, "sglang-style": sglang_proxy}


def _outcome(status: int, data, stream: bool, with_id: bool) -> dict:
    """What a chat answer says, in one shape for streamed and non-streamed answers."""
    if status != 200:
        err = data.get("error", data) if isinstance(data, dict) else {}
        return {"status": status, "message": str(err.get("message") if isinstance(err, dict) else err)}
    out = {"status": 200, "content": "", "token_ids": None, "prompt_token_ids": None, "finish_reason": None,
           "logprobs": None, "usage": None, "meta_info": False, "tool_calls": None}
    if not stream:
        c = data["choices"][0]
        out.update(content=c["message"]["content"], token_ids=c.get("token_ids"), finish_reason=c["finish_reason"],
                   prompt_token_ids=c.get("prompt_token_ids"), meta_info="meta_info" in c,
                   tool_calls=c["message"].get("tool_calls"), model=data["model"],
                   usage=(data["usage"]["prompt_tokens"], data["usage"]["completion_tokens"]))
        if c.get("logprobs"):
            out["logprobs"] = [(round(x["logprob"], 4), len(x["top_logprobs"])) for x in c["logprobs"]["content"]]
        if with_id:
            out["id"] = data["id"]
        return out
    lps = None
    for ch in data:
        out["model"] = ch["model"]
        if with_id:
            out["id"] = ch["id"]
        if ch.get("usage"):
            out["usage"] = (ch["usage"]["prompt_tokens"], ch["usage"]["completion_tokens"])
        if ch.get("prompt_token_ids") is not None:
            out["prompt_token_ids"] = ch["prompt_token_ids"]
        for c in ch["choices"]:
            out["content"] += c["delta"].get("content") or ""
            if c["delta"].get("tool_calls"):
                out["tool_calls"] = (out["tool_calls"] or []) + c["delta"]["tool_calls"]
            if c.get("token_ids") is not None:
                out["token_ids"] = (out["token_ids"] or []) + c["token_ids"]
            if c.get("logprobs"):
                lps = (lps or []) + [(round(x["logprob"], 4), len(x["top_logprobs"])) for x in c["logprobs"]["content"]]
            out["finish_reason"] = c.get("finish_reason") or out["finish_reason"]
            out["meta_info"] = out["meta_info"] or "meta_info" in c
    out["logprobs"] = lps
    return out


_REFS: dict[bytes, dict] = {}


def _direct(url: str, body: dict, stream: bool) -> dict:
    """The engine's own answer (deterministic: seeded), computed once per body and mode."""
    key = orjson.dumps([url, body, stream], option=orjson.OPT_SORT_KEYS)
    if key not in _REFS:
        _REFS[key] = _call(url, body, stream)
    return _REFS[key]


def _call(url: str, body: dict, stream: bool, headers: dict | None = None) -> dict:
    body = dict(body, stream=stream)
    with_id = "rid" in body
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=60)
        return _outcome(r.status_code, r.json(), False, with_id)
    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=60) as r:
        if r.status_code != 200:
            return _outcome(r.status_code, orjson.loads(r.read()), True, with_id)
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                obj = orjson.loads(line[6:])
                if "error" in obj:
                    return _outcome(400 if obj["error"].get("code") == 400 else 502, obj, True, with_id)
                chunks.append(obj)
    return _outcome(200, chunks, True, with_id)


def _resolve(v, ref):
    return v(ref) if callable(v) else v


@pytest.mark.parametrize("case", sorted(CASES))
def test_field_is_honoured_or_refused_on_every_path(case, defaults_engine_url, proxies):
    field, kind, base_extra, update = CASES[case]
    baseline0 = _direct(defaults_engine_url, BASE, False)
    base = {**BASE, **_resolve(base_extra, baseline0)}
    baseline = _direct(defaults_engine_url, base, False)
    served = httpx.get(f"{defaults_engine_url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {**base, **_resolve(update, baseline)}
    problems = []
    for stream in (False, True):
        ref = _direct(defaults_engine_url, body, stream)  # the engine's own chat path
        if kind == "refuse":
            assert 400 <= ref["status"] < 500 and field in ref["message"], (stream, ref)
        elif kind in ("effect", "same"):
            assert ref["status"] == 200, (stream, ref)
        if kind == "effect" and not stream:
            assert {k: v for k, v in ref.items() if k != "id"} != baseline, f"{case}: no effect on the engine"
        for engine, purl in proxies.items():
            got = _call(purl, body, stream, {"X-Session-Id": f"f-{uuid.uuid4().hex[:8]}"})
            where = f"{engine} {'stream' if stream else 'non-stream'}"
            refused = 400 <= got["status"] < 500
            if refused and field not in got["message"]:
                problems.append(f"{where}: refused without naming {field!r}: {got['message']}")
            elif refused and kind in ("effect", "same"):
                problems.append(f"{where}: {field} must be honoured, got {got['status']}: {got['message']}")
            elif not refused and kind in ("refuse", "proxy-refuse"):
                problems.append(f"{where}: {field} must be refused as on the engine's chat path, got {got}")
            elif not refused and ref["status"] != 200:
                problems.append(f"{where}: the engine refuses this body ({ref['message']}), the proxy answered {got}")
            elif not refused and "id" in ref and not str(got.get("id")).startswith("chatcmpl-"):
                problems.append(f"{where}: the answer's id must be the proxy's chatcmpl-<request id> (what "
                                f"feedback names, docs/feedback.md), got {got.get('id')!r}")
            elif not refused and got != {**ref, "model": served, **({"id": got["id"]} if "id" in ref else {})}:
                # the proxy names what served it, and the answer by its own id (a client's rid is the engine's)
                problems.append(f"{where}: differs from the engine's chat path:\n  proxy  {got}\n  engine {ref}")
    assert not problems, "\n".join(problems)


def test_only_a_required_field_is_checked_when_absent():
    """check_chat_body skips the checks of absent fields: that is the same only while every check
    but a required field's passes an absent (or null) field, as here for every row."""
    from pipeline.engine_api.schema import CHAT_FIELDS, ChatBodyError, check_chat_body

    for key, f in CHAT_FIELDS.items():
        if not f.required:
            f.check({}, key)
            f.check({key: None}, key)
    assert [k for k, f in CHAT_FIELDS.items() if f.required] == ["messages"]
    with pytest.raises(ChatBodyError, match="'messages' is required"):
        check_chat_body({"model": "m"})
    with pytest.raises(ChatBodyError, match="'temperature' must be in"):
        check_chat_body({"messages": [{"role": "user", "content": "q"}], "temperature": 9})
