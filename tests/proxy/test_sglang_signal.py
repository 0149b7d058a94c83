"""Issue 24, cases 2 and 5: what a turn records on the SGLang paths is what the engine did.

Real parts: the CPU engine (tiny-random copied into a folder whose ``generation_config.json``
sets a default temperature, and in one copy a repetition penalty), the real proxy, the broker.
SGLang is :class:`pipeline.testing.sglang_style.SglangStyleEngine`, a stand-in (our CPU engine
answering as SGLang does: no token ids on streamed chat, no ``metadata.sampling_params``).

- Case 2: a request without ``temperature`` is sampled by the engine at the generation-config
  default, on every path (our engine and SGLang, stream and unary); the turn must say so
  (``logprob_temperature`` 0.6, ``repetition_penalty`` in ``logprob_processors``), and its
  rollout log-probs must be those of a T = 0.6 pass.
- Case 5: a client that closes the SGLang-path stream after 3 chunks: the turn is recorded as
  ``abort`` with what was sent so far, the engine's generation is aborted (``/abort_request``)
  and ``client_disconnect`` is counted, as on the native path.
"""

from __future__ import annotations

import json
import shutil
import uuid

import httpx
import numpy as np
import pytest

from tests.conftest import make_config
from pipeline import events
from pipeline.models import resolve_model
from pipeline.testing.engine import running_engine
from pipeline.testing.proxy import running_proxy
from pipeline.testing.servers import serve_app
from pipeline.testing.sglang_style import SglangStyleEngine
from pipeline.testing.topics import read_events
from pipeline.testing.waiting import wait_for

CHAT = "/v1/chat/completions"
T_DEFAULT = 0.6


def _model_folder(root, **generation) -> str:
    """tiny-random copied to ``root`` with ``generation`` added to its generation_config.json."""
    src = resolve_model("tiny-random")
    shutil.copytree(src, root)
    cfg = json.loads((root / "generation_config.json").read_text())
    (root / "generation_config.json").write_text(json.dumps({**cfg, **generation}))
    return str(root)


@pytest.fixture(scope="module", params=["penalty", "plain"])
def served(request, tmp_path_factory):
    """(kind, model folder, CPU engine URL, SGLang stand-in URL): generation_config temperature
    0.6, with (``penalty``) or without (``plain``) a repetition penalty of 1.3."""
    extra = {"repetition_penalty": 1.3} if request.param == "penalty" else {}
    folder = _model_folder(tmp_path_factory.mktemp("gen") / "model", temperature=T_DEFAULT, **extra)
    with running_engine(folder, threads=1, context_length=1024) as eng, \
            serve_app(SglangStyleEngine(eng)) as sglang:
        yield request.param, folder, eng, sglang


def _config(broker_bootstrap, folder: str):
    from pipeline.bus.admin import apply_topics
    from pipeline.topics import load_topics

    c = make_config(broker_bootstrap, f"t-sglang-signal-{uuid.uuid4().hex[:6]}-", engine={"model": folder})
    apply_topics(c, load_topics(c.topics.file))
    return c


def _ask(url: str, body: dict, sid: str) -> None:
    if body.get("stream"):
        with httpx.stream("POST", url + CHAT, json=body, headers={"X-Session-Id": sid}, timeout=60) as r:
            assert r.status_code == 200, r.read()
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and not any('"error"' in x for x in lines), lines[-3:]
        return
    r = httpx.post(url + CHAT, json=body, headers={"X-Session-Id": sid}, timeout=60)
    assert r.status_code == 200, r.text


def _prefill(engine_url: str, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    body = {"input_ids": prompt + response, "return_logprob": True, "logprob_start_len": len(prompt) - 1,
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature}}
    entries = httpx.post(engine_url + "/generate", json=body, timeout=60).json()["meta_info"][
        "input_token_logprobs"][-len(response):]
    assert [e[1] for e in entries] == response
    return [float(e[0]) for e in entries]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("path", ["native", "sglang"])
def test_turn_records_the_generation_config_distribution(broker_bootstrap, served, path, stream):
    """No ``temperature`` in the request: the engine samples at generation_config's 0.6 (and
    its repetition penalty); the turn records exactly that on every path."""
    kind, folder, eng, sglang = served
    c = _config(broker_bootstrap, folder)
    with running_proxy(c, eng if path == "native" else sglang) as (url, app):
        body = {"messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 12, "stream": stream,
                "seed": 3}
        _ask(url, body, "gen-defaults")
        assert app.publisher.wait_idle(10)
        turn = next(e for e in read_events(c, "turns", 1) if isinstance(e, events.Turn))
    assert turn.logprob_temperature == pytest.approx(T_DEFAULT)
    assert turn.logprob_processors == (["repetition_penalty"] if kind == "penalty" else [])
    if kind == "plain":  # the rollout log-probs are those of a T = 0.6 pass (a PPO ratio of 1 at step 1)
        want = _prefill(eng, list(turn.prompt_token_ids), list(turn.response_token_ids), T_DEFAULT)
        np.testing.assert_allclose(turn.response_logprobs, want, atol=1e-4, rtol=0)
        at_one = _prefill(eng, list(turn.prompt_token_ids), list(turn.response_token_ids), 1.0)
        assert float(np.max(np.abs(np.asarray(at_one) - want))) > 1e-3  # the check can tell 0.6 from 1


def test_client_leaving_the_sglang_stream_is_an_abort(broker_bootstrap, tmp_path):
    """The client closes after 3 chunks: the turn is ``abort`` with fewer tokens than asked,
    the stand-in SGLang gets ``/abort_request`` for the generation's rid, and it is counted."""
    from pipeline.proxy import metrics as M

    folder = _model_folder(tmp_path / "model")
    c = _config(broker_bootstrap, folder)
    counter = M.UNFINISHED.labels("client_disconnect")
    with running_engine(folder, threads=1, context_length=1024) as eng:
        stand_in = SglangStyleEngine(eng, generate_chunk_delay_s=0.05)
        with serve_app(stand_in) as sglang_url, running_proxy(c, sglang_url) as (url, app):
            before = counter._value.get()
            body = {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 200,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + CHAT, json=body, headers={"X-Session-Id": "leaver"}, timeout=60) as s:
                seen = 0
                for line in s.iter_lines():
                    seen += line.startswith("data: {")
                    if seen == 3:
                        break  # the user closes the tab
            turn = next(e for e in read_events(c, "turns", 1) if isinstance(e, events.Turn))
            wait_for(lambda: counter._value.get() > before, "the disconnect to be counted", timeout_s=15)
            rid = next(b["rid"] for p, b in stand_in.requests if p == "/generate")
            wait_for(lambda: any(p == "/abort_request" and b.get("rid") == rid for p, b in stand_in.requests),
                     "the proxy to abort the generation", timeout_s=15)
    assert turn.finish_reason == "abort"
    assert 1 <= len(turn.response_token_ids) < 200
