"""Bad input never gets a 500: malformed bodies get 4xx with a message, in SGLang's error shapes."""

from __future__ import annotations

import pytest



MSG = [{"role": "user", "content": "hi"}]
LONG = "word " * 400  # > the 128-token context configured below

GENERATE_BAD = [
    b"not json", b"[1, 2]", b'{"text": "a"', b'{"text": NaN}', b'{"input_ids": [99999999999999999999999]}',
    {}, {"text": 5}, {"text": []}, {"input_ids": []}, {"input_ids": ["a"]}, {"input_ids": [1, 2.5]},
    {"input_ids": [49152]}, {"input_ids": [-1]}, {"input_ids": [[1], []]},
    {"text": "a", "sampling_params": "hot"}, {"text": "a", "sampling_params": {"temperature": -1}},
    {"text": "a", "sampling_params": {"top_p": 0}}, {"text": "a", "sampling_params": {"max_new_tokens": -1}},
    {"text": "a", "sampling_params": {"n": 0}}, {"text": "a", "sampling_params": {"stop": 5}},
    {"text": "a", "sampling_params": {"unknown_knob": 1}}, {"text": "a", "sampling_params": {"regex": "[a-"}},
    {"text": "a", "sampling_params": {"ebnf": 'root ::= "a"'}},
    {"text": "a", "return_logprob": "yes"}, {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2},
    {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": -5},
    {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": -1},
    {"text": ["a", "b"], "sampling_params": [{}]}, {"text": ["a", "b"], "rid": ["x"]},
    {"input_ids": [1], "token_ids_logprob": [10 ** 6], "return_logprob": True},
    {"text": LONG}, {"text": "a", "sampling_params": {"max_new_tokens": 500}},
]

CHAT_BAD = [
    b"{", b"null", {}, {"messages": []}, {"messages": "hi"}, {"messages": ["hi"]},
    {"messages": [{"role": "robot", "content": "x"}]}, {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": MSG, "temperature": "hot"}, {"messages": MSG, "temperature": -1}, {"messages": MSG, "n": 0},
    {"messages": MSG, "max_tokens": 10 ** 6}, {"messages": MSG, "stream": True, "return_meta_info": True},
    {"messages": MSG, "stream": True, "return_prompt_token_ids": True},
    {"messages": MSG, "tools": [{"type": "function"}]}, {"messages": MSG, "tools": "x"},
    {"messages": MSG, "tool_choice": "sometimes"}, {"messages": MSG, "tool_choice": "required"},
    {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
     "tool_choice": {"type": "function", "function": {"name": "g"}}},
    {"messages": MSG, "response_format": {"type": "xml"}}, {"messages": MSG, "logit_bias": {"x": 1}},
    {"messages": MSG, "logprobs": "yes"}, {"messages": MSG, "top_logprobs": -2, "logprobs": True},
    {"messages": [{"role": "user", "content": LONG}]}, {"messages": MSG, "input_ids": []},
    {"messages": MSG, "stop_token_ids": [10 ** 7]},
]

OTHER_BAD = [
    ("/update_weights_from_disk", {}), ("/update_weights_from_disk", {"model_path": 5}),
    ("/update_weights_from_disk", {"model_path": "/nonexistent/model"}), ("/update_weights_from_disk", b"x"),
    ("/v1/tokenize", {}), ("/v1/tokenize", {"messages": [{"role": "x"}]}), ("/v1/detokenize", {"tokens": [-3]}),
    ("/pause_generation", {"mode": "sideways"}), ("/abort_request", b"[]"),
]



ENGINE_SETTINGS = {"threads": 2, "context_length": 128}  # for conftest.engine_url (http: engine/conftest.py)


def _post(http, path, body):
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json=body)


@pytest.mark.parametrize("body", GENERATE_BAD, ids=range(len(GENERATE_BAD)))
def test_generate_bad_input_is_4xx(http, body):
    r = _post(http, "/generate", body)
    assert 400 <= r.status_code < 500, r.text
    data = r.json()
    msg = data.get("message") or data["error"]["message"]
    assert isinstance(msg, str) and msg


@pytest.mark.parametrize("body", CHAT_BAD, ids=range(len(CHAT_BAD)))
def test_chat_bad_input_is_4xx(http, body):
    r = _post(http, "/v1/chat/completions", body)
    assert 400 <= r.status_code < 500, r.text
    data = r.json()
    assert data["object"] == "error" and data["code"] == r.status_code and data["message"]


@pytest.mark.parametrize("path,body", OTHER_BAD, ids=range(len(OTHER_BAD)))
def test_other_routes_bad_input_is_4xx(http, path, body):
    r = _post(http, path, body)
    assert 400 <= r.status_code < 500, r.text


def test_error_shapes_follow_sglang(http):
    # request-level ValueError on the native route: {"error": {"message"}}
    r = http.post("/generate", json={"text": LONG})
    assert r.status_code == 400 and "longer than the model's context length" in r.json()["error"]["message"]
    # body validation: {"object": "error", "type": "Bad Request", "code": 400}
    r = http.post("/generate", json={"text": 5})
    assert r.json()["type"] == "Bad Request" and r.json()["code"] == 400 and r.json()["param"] is None
    # OpenAI routes need application/json
    r = http.post("/v1/chat/completions", content=b'{"messages": []}', headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "application/json" in r.json()["message"]
    # weight update failure: SGLang's {success: false, message}
    r = http.post("/update_weights_from_disk", json={"model_path": "/nonexistent/model"})
    assert r.status_code == 400 and r.json()["success"] is False


def test_unknown_top_level_fields_are_ignored(http):
    r = http.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1}, "mystery": 1})
    assert r.status_code == 200
    r = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 1, "mystery": {"x": 1}})
    assert r.status_code == 200
    # and the server still serves after all the bad input
    assert http.get("/health").status_code == 200
