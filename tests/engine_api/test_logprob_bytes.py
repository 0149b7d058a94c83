"""Log-prob ``bytes`` are each token's raw bytes, so joining them rebuilds the content exactly (the
OpenAI contract), also for a character split over two tokens: an emoji whose two byte-level BPE
halves are forced with ``logit_bias``. Checked in ``logprobs.content`` and in ``top_logprobs``,
streaming and not, on the CPU engine, through the proxy in front of it, and through the proxy in
front of an SGLang-style engine (which sends the UTF-8 of the replacement character, as SGLang does).

The expected bytes come from an independent reference: the token's string in the tokenizer's
vocabulary mapped back through GPT-2's byte-to-unicode table.
"""

from __future__ import annotations

import httpx
import orjson
import pytest

from pipeline.testing.proxy import running_proxy
from pipeline.testing.servers import serve_app
from pipeline.testing.sglang_style import SglangStyleEngine

EMOJI = " \U0001F602"  # " 😂": b" \xf0\x9f\x98" + b"\x82" in SmolLM2's tokenizer


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte -> printable-unicode table, inverted (written from its definition)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@pytest.fixture(scope="module")
def raw_bytes(tokenizer):
    dec = _byte_decoder()
    return lambda t: bytes(dec[ch] for ch in tokenizer.convert_ids_to_tokens(t))


#: the conftest ``engine_url`` engine's settings
ENGINE_SETTINGS = {"threads": 2}


@pytest.fixture(scope="module")
def sglang_url(engine_url):
    with serve_app(SglangStyleEngine(engine_url)) as url:
        yield url


@pytest.fixture(scope="module")
def split(engine_url, tokenizer, raw_bytes):
    """(first half id, second half id, a seed whose sample is exactly [first, second])."""
    a, b = tokenizer.encode(EMOJI, add_special_tokens=False)
    assert raw_bytes(a) + raw_bytes(b) == EMOJI.encode()
    assert "\ufffd" in tokenizer.decode([a]) and "\ufffd" in tokenizer.decode([b])  # both halves partial
    for seed in range(64):
        out = httpx.post(engine_url + "/v1/chat/completions", json=_body((a, b, seed)) | {"return_token_ids": True},
                         timeout=30).json()
        if out["choices"][0]["token_ids"] == [a, b]:
            return a, b, seed
    pytest.fail("no seed in 0..63 samples the two halves in order")


def _body(split, **extra) -> dict:
    a, b, seed = split
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 1.0,
            "seed": seed, "logit_bias": {str(a): 100, str(b): 100}, "logprobs": True, "top_logprobs": 2, **extra}


def _ask(url: str, body: dict, headers: dict) -> tuple[str, list[dict]]:
    """(content, logprobs.content items) of a chat completion, streamed or not."""
    if not body.get("stream"):
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["message"]["content"], c["logprobs"]["content"]
    content, items = "", []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in orjson.loads(line[6:]).get("choices") or []:
                content += c["delta"].get("content") or ""
                items += (c.get("logprobs") or {}).get("content") or []
    return content, items


def _check(content: str, items: list[dict], split, raw_bytes) -> None:
    a, b, _ = split
    assert content == EMOJI
    assert [bytes(i["bytes"]) for i in items] == [raw_bytes(a), raw_bytes(b)]
    assert b"".join(bytes(i["bytes"]) for i in items).decode("utf-8") == content
    for i in items:  # the two biased halves are the top-2 alternatives at both steps
        assert sorted(bytes(t["bytes"]) for t in i["top_logprobs"]) == sorted([raw_bytes(a), raw_bytes(b)])


@pytest.mark.parametrize("stream", [False, True])
def test_engine_bytes_of_split_character(engine_url, split, raw_bytes, stream):
    _check(*_ask(engine_url, _body(split, stream=stream), {}), split, raw_bytes)


@pytest.mark.parametrize("engine", ["cpu", "sglang-style"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("recorded", [True, False])
def test_proxy_bytes_of_split_character(engine_url, sglang_url, kafka_config, split, raw_bytes, engine, stream,
                                        recorded):
    """Recorded turns (the proxy adds token ids) and unrecorded ones (``anonymous=skip``) alike."""
    url = engine_url if engine == "cpu" else sglang_url
    headers = {"X-Session-Id": f"bytes-{engine}-{stream}"} if recorded else {}
    with running_proxy(kafka_config, url, anonymous="record" if recorded else "skip", tokenizer="tiny-random") as (
            purl, _app):
        _check(*_ask(purl, _body(split, stream=stream), headers), split, raw_bytes)


def test_sglang_style_stand_in_sends_replacement_bytes(sglang_url, split):
    """The stand-in really answers like SGLang, so the proxy tests above test the repair."""
    _content, items = _ask(sglang_url, _body(split), {})
    assert [i["bytes"] for i in items] == [list(" \ufffd".encode()), list("\ufffd".encode())]
