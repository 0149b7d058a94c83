"""The proxy in front of a real vLLM server (issue 38): what it records is what vLLM returned, a
client that leaves mid-stream is never trained as complete, and a full-weight sync by the real
syncer under load fails no request while every recorded turn names the weights that served it.

One vLLM server for the file (``tiny-random-64``, float32). The reference for every recorded
log-prob is an HF forward of the weights folder of the turn's recorded version
(:func:`tests.engine_api.test_vllm.hf_logprobs`): vLLM's log-probs are raw, so recorded as
temperature 1 whatever the request's temperature.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from pipeline import events
from pipeline.testing.proxy import running_proxy
from pipeline.testing.topics import read_events
from pipeline.testing.vllm import require_vllm, running_vllm
from pipeline.weightsync import sha256_file
from tests.engine_api.test_vllm import MODEL, hf_logprobs, perturbed_copy
from tests.syncer.syncing import new_syncer, publish, running, syncer_config

CHAT = "/v1/chat/completions"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_url():
    require_vllm()
    with running_vllm(MODEL, enable_lora=False) as url:  # the teacher scores here too: no LoRA (docs/vllm.md)
        yield url


def _config(kafka_config):
    return kafka_config.replace(engine={"kind": "vllm", "model": MODEL})


def _turns(c, n: int) -> list[events.Turn]:
    return [e for e in read_events(c, "turns", lambda out: sum(isinstance(e, events.Turn) for e in out) >= n,
                                   timeout_s=60) if isinstance(e, events.Turn)]


def _ask(url: str, body: dict, sid: str) -> str:
    """One request (streamed or not); the answer's text. Raises AssertionError on any error."""
    h = {"X-Session-Id": sid}
    if not body.get("stream"):
        r = httpx.post(url + CHAT, json=body, headers=h, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    text = []
    with httpx.stream("POST", url + CHAT, json=body, headers=h, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                assert '"error"' not in line, line
                chunk = httpx.Response(200, content=line[6:]).json()
                text += [(c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or []]
    return "".join(text)


def test_recorded_turns_are_what_vllm_returned(vllm_url, kafka_config):
    """Streamed and not, at temperature 0.7: the turn has vLLM's ids, and log-probs equal to an
    independent forward at temperature 1 (vLLM's are raw), recorded as such; version 0."""
    from pipeline.models import resolve_model

    c = _config(kafka_config)
    msgs = [{"role": "user", "content": "Tell me about rivers."}]
    with running_proxy(c, vllm_url) as (url, app):
        for i, stream in enumerate((False, True)):
            _ask(url, {"model": MODEL, "messages": msgs, "max_tokens": 10, "temperature": 0.7, "stream": stream},
                 f"rec-{i}")
        assert app.publisher.wait_idle(10)
    turns = _turns(c, 2)
    base = resolve_model(MODEL)
    for t in turns:
        assert len(t.response_token_ids) == len(t.response_logprobs) > 0
        assert t.logprob_temperature == 1.0 and t.logprob_processors == []
        assert t.policy_version == 0 and t.finish_reason in ("stop", "length")
        want = hf_logprobs(base, list(t.prompt_token_ids) + list(t.response_token_ids), len(t.prompt_token_ids))
        assert list(t.response_logprobs) == pytest.approx(want, abs=2e-4)


def test_fields_vllm_would_ignore_are_refused(vllm_url, kafka_config):
    """SGLang's ``regex`` / ``ebnf`` reach vLLM as fields it ignores with a 200: refused with a 400
    naming the field, so no turn claims a constraint that never applied."""
    with running_proxy(_config(kafka_config), vllm_url) as (url, _app):
        for field, value in (("regex", "[0-9]{8}"), ("ebnf", 'root ::= "a"')):
            r = httpx.post(url + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                             field: value, "max_tokens": 4}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_client_leaving_the_stream_is_an_abort(vllm_url, kafka_config):
    c = _config(kafka_config)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with running_proxy(c, vllm_url) as (url, app):
        with httpx.stream("POST", url + CHAT, json=body, headers={"X-Session-Id": "leaver"}, timeout=60) as s:
            seen = 0
            for line in s.iter_lines():
                seen += line.startswith("data: {")
                if seen == 3:
                    break  # the user closes the tab
        turn = _turns(c, 1)[0]
    assert turn.finish_reason == "abort"
    assert len(turn.response_token_ids) < 400


def test_full_weight_sync_under_load(vllm_url, kafka_config, tmp_path):
    """Clients keep asking (streamed and not) while the trainer's side publishes two versions
    that the real syncer applies to vLLM: no request fails, the engine ends on v2, and every turn
    recorded with ids has the log-probs of the weights of the version it names."""
    from pipeline.models import resolve_model

    base = resolve_model(MODEL)
    folders = {0: base, 1: perturbed_copy(base, tmp_path / "v1", 2.0), 2: perturbed_copy(base, tmp_path / "v2", 3.0)}
    cfg = syncer_config(kafka_config, tmp_path).replace(engine={"kind": "vllm", "model": MODEL},
                                                        syncer={"engine_url": vllm_url})
    stop, errors, served = threading.Event(), [], []

    def client(k: int, url: str) -> None:
        i = 0
        while not stop.is_set():
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Question {k}-{i}?"}],
                    "max_tokens": 12, "temperature": 1.0, "stream": bool(i % 2)}
            try:
                _ask(url, body, f"load-{k}-{i}")
                served.append(1)
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                errors.append(repr(e))
            i += 1

    with running(new_syncer(cfg)), running_proxy(cfg, vllm_url, follow_control=True) as (url, app):
        threads = [threading.Thread(target=client, args=(k, url)) for k in range(3)]
        for t in threads:
            t.start()
        try:
            for v in (1, 2):
                assert publish(cfg, v, folders[v], sha256_file(folders[v] / "model.safetensors")).applied == \
                    ["engine-0"]
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        assert app.publisher.wait_idle(10)
    assert errors == [] and len(served) >= 3
    turns = [t for t in _turns(cfg, len(served)) if t.session_id.startswith("load-")]
    assert len(turns) == len(served)
    with_ids = [t for t in turns if t.response_token_ids]
    assert {t.policy_version for t in with_ids} >= {2}
    for t in with_ids:
        want = hf_logprobs(folders[t.policy_version], list(t.prompt_token_ids) + list(t.response_token_ids),
                           len(t.prompt_token_ids))
        assert list(t.response_logprobs) == pytest.approx(want, abs=2e-4), t.policy_version


def test_thumbs_down_with_a_correction_trains_on_vllm(vllm_url, kafka_config):
    """Issue 40 on the vLLM path: a client's thumbs-down with a correction on a turn vLLM served
    gives a sample with reward -1 from the feedback and the correction as the OPD hint, its
    teacher log-probs vLLM's own scoring of the hinted prompt (built here from the recorded ids)."""
    from transformers import AutoTokenizer

    from pipeline.models import resolve_model
    from pipeline.testing.judge import JudgeThread
    from tests.e2e.test_signal_reference_e2e import hinted_prompt_ids, score

    c = _config(kafka_config)
    comment = "Answer with the name of one river only."
    msgs = [{"role": "user", "content": "Which river flows through Paris?"}]
    with running_proxy(c, vllm_url) as (url, app):
        r = httpx.post(url + CHAT, json={"model": MODEL, "messages": msgs, "max_tokens": 8, "temperature": 1.0},
                       headers={"X-Session-Id": "fb-vllm"}, timeout=60)
        assert r.status_code == 200, r.text
        fb = httpx.post(url + "/v1/feedback", json={"response_id": r.json()["id"], "score": -1, "comment": comment},
                        timeout=30)
        assert fb.status_code == 200, fb.text
        msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": "No."}]
        httpx.post(url + CHAT, json={"model": MODEL, "messages": msgs, "max_tokens": 4},
                   headers={"X-Session-Id": "fb-vllm", "X-Session-Done": "true"}, timeout=60).raise_for_status()
        assert app.publisher.wait_idle(10)
    turn = next(t for t in _turns(c, 2) if t.turn_index == 0)
    cj = c.replace(judge={"backend": "llm", "url": vllm_url, "mode": "combine", "group_id": f"{c.topics.prefix}judge",
                          "retries": 0}, engine={"teacher_url": vllm_url})
    with JudgeThread(cj):
        samples = read_events(cj, "samples", lambda out: any(s.turn_index == 0 for s in out), timeout_s=120)
    s = next(x for x in samples if x.turn_index == 0)
    assert (s.reward, s.reward_source, s.hint, s.hint_source) == (-1.0, "feedback", comment, "feedback")
    tok = AutoTokenizer.from_pretrained(str(resolve_model(MODEL)))
    want = score(vllm_url, hinted_prompt_ids(tok, list(turn.prompt_token_ids), comment),
                 list(turn.response_token_ids), 1.0, "vllm")
    assert list(s.teacher_log_probs) == pytest.approx(want, abs=1e-4)
    assert list(s.rollout_log_probs) == list(turn.response_logprobs)
