"""Issue 40 at the proxy: ``POST /v1/feedback`` and session outcomes, over HTTP with the real clients.

The real proxy app in front of ``StandInEngine`` (a scripted stand-in, NOT a model: feedback does
not depend on the model); events read back from the broker. Rules restated from docs/feedback.md:
every recorded main turn records the id its client received (``chatcmpl-<request id>`` from chat,
``resp_<request id>`` from /v1/responses, ``msg_<request id>`` from /v1/messages); a feedback
names the turn by that id or by session + turn index; an unknown id and another tenant's turn are
both 404 ``turn_not_found``; a bad body is 400 in OpenAI's error shape; the event is keyed like
the turn.
"""

from __future__ import annotations

import hashlib
import itertools
import math

import anthropic
import httpx
import openai
import pytest

from pipeline import events
from pipeline.proxy.errors import ProxyError
from pipeline.proxy.feedback import IndexedTurn, TurnIndex, parse_feedback
from pipeline.testing.proxy import running_proxy, stack
from pipeline.testing.servers import Reply, StandInEngine, serve_app
from pipeline.testing.topics import read_records

KEY_A, KEY_B = "key-of-alice", "key-of-bob"
TENANTS = {hashlib.sha256(KEY_A.encode()).hexdigest(): "alice", hashlib.sha256(KEY_B.encode()).hexdigest(): "bob"}


def _numbered():
    n = itertools.count(1)
    return lambda req: Reply(content=f"answer {next(n)}")


def _events(config, app, want) -> list:
    assert app.publisher.wait_idle(10)
    recs = read_records(config, config.topics.name("turns"), want, timeout_s=15)
    return recs


def _post(client: openai.OpenAI, body: dict) -> dict:
    """What the README shows: the openai SDK's own ``client.post``."""
    return client.post("/feedback", body=body, cast_to=object)


# ---- the body's rules, without HTTP --------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"response_id": "chatcmpl-x", "score": 2}, "score"),
    ({"response_id": "chatcmpl-x", "score": -1.5}, "score"),
    ({"response_id": "chatcmpl-x", "score": True}, "score"),
    ({"response_id": "chatcmpl-x", "score": "1"}, "score"),
    ({"response_id": "chatcmpl-x", "score": math.nan}, "score"),
    ({"response_id": "chatcmpl-x"}, "score"),
    ({"response_id": "chatcmpl-x", "score": 1, "comment": "   "}, "comment"),
    ({"response_id": "chatcmpl-x", "score": 1, "comment": "x" * (events.MAX_COMMENT_CHARS + 1)}, "comment"),
    ({"response_id": "chatcmpl-x", "score": 1, "source": "boss"}, "source"),
    ({"response_id": "chatcmpl-x", "score": 1, "rating": 5}, "rating"),
    ({"response_id": "chatcmpl-x", "session_id": "s", "turn_index": 0, "score": 1}, "response_id"),
    ({"session_id": "s", "score": 1}, "response_id"),
    ({"session_id": "s", "turn_index": -1, "score": 1}, "turn_index"),
    ({"session_id": "s", "turn_index": 1.5, "score": 1}, "turn_index"),
    ({"response_id": "", "score": 1}, "response_id"),
])
def test_bad_bodies_are_400_naming_the_field(body, param):
    with pytest.raises(ProxyError) as e:
        parse_feedback(body)
    assert e.value.status == 400 and e.value.param == param


def test_a_good_body():
    ref = parse_feedback({"session_id": "s", "turn_index": 3, "score": -1, "comment": "use config.yaml",
                          "source": "reviewer"})
    assert ref == {"score": -1.0, "comment": "use config.yaml", "source": "reviewer", "response_id": None,
                   "session_id": "s", "turn_index": 3}
    assert parse_feedback({"response_id": "msg_1", "score": 0.25})["source"] == "user"


def test_turn_index_is_bounded_and_survives_a_restart(tmp_path):
    idx = TurnIndex(3, str(tmp_path))
    for k in range(5):
        idx.add(IndexedTurn("t", "s", k, f"r{k}", f"chatcmpl-r{k}"))
    assert idx.find("t", {"response_id": "chatcmpl-r0"}) is None  # least recent dropped
    assert idx.find("t", {"response_id": "chatcmpl-r4"}).turn_index == 4
    assert idx.find(None, {"response_id": "chatcmpl-r4"}) is None  # another tenant's (here: none) is not found
    idx.close()
    with open(tmp_path / "turn-index.jsonl", "ab") as f:
        f.write(b'["t", "s", 9, "r9"')  # a line cut by a crash
    again = TurnIndex(3, str(tmp_path))
    assert again.find("t", {"session_id": "s", "turn_index": 3}).request_id == "r3"
    assert again.find("t", {"response_id": "chatcmpl-r9"}) is None
    assert again.find("t", {"session_id": "s", "turn_index": 1}) is None



def test_a_deferred_turn_index_writes_its_lines_at_flush(tmp_path):
    """``deferred``: ``add`` indexes at once but writes the file only at ``flush`` (one write for
    every queued line; the proxy flushes after each group commit of its event buffer) or ``close``."""
    idx = TurnIndex(10, str(tmp_path), deferred=True)
    for k in range(3):
        idx.add(IndexedTurn(None, "s", k, f"r{k}", f"chatcmpl-r{k}"))
    assert idx.find(None, {"response_id": "chatcmpl-r2"}).turn_index == 2
    assert not (tmp_path / "turn-index.jsonl").exists()
    idx.flush()
    assert TurnIndex(10, str(tmp_path)).find(None, {"session_id": "s", "turn_index": 2}).request_id == "r2"
    idx.add(IndexedTurn(None, "s", 3, "r3", "chatcmpl-r3"))
    idx.close()  # writes what is still queued
    assert TurnIndex(10, str(tmp_path)).find(None, {"response_id": "chatcmpl-r3"}).request_id == "r3"
    assert (tmp_path / "turn-index.jsonl").read_bytes().count(b"\n") == 4


def test_a_deferred_turn_index_rewrites_its_file_in_maintain_only(tmp_path):
    """The flush of a deferred index may run on the proxy's event loop: it only appends. The
    rewrite (the kept turns, once the file holds twice ``max_turns`` lines) is ``maintain``'s,
    which the publisher's writer thread runs; a restart reads the rewritten file."""
    idx = TurnIndex(3, str(tmp_path), deferred=True)
    path = tmp_path / "turn-index.jsonl"
    for k in range(10):
        idx.add(IndexedTurn(None, "s", k, f"r{k}", f"chatcmpl-r{k}"))
        idx.flush()
    assert path.read_bytes().count(b"\n") == 10  # over 2 x 3: never rewritten by a flush
    idx.maintain()
    assert path.read_bytes().count(b"\n") == 3
    idx.maintain()  # nothing due: unchanged
    assert path.read_bytes().count(b"\n") == 3
    idx.add(IndexedTurn(None, "s", 10, "r10", "chatcmpl-r10"))
    idx.close()
    again = TurnIndex(3, str(tmp_path))
    assert [again.find(None, {"session_id": "s", "turn_index": k}) is not None for k in (7, 8, 9, 10)] == [
        False, True, True, True]

# ---- over HTTP with the real clients ---------------------------------------------------------------
def test_each_sdks_response_id_names_its_turn(kafka_config):
    """Chat (unary and streamed), Responses and Messages answers: the id each SDK returns is
    recorded on the turn, and a feedback naming it is published keyed like the turn, naming the
    turn's request id."""
    with stack(kafka_config, _numbered()) as (url, app, up):
        oc = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                           default_headers={"X-Session-Id": "fb-sdk"})
        ac = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0,
                                 default_headers={"X-Session-Id": "fb-sdk-a"})
        msgs = [{"role": "user", "content": "hi"}]
        ids = [oc.chat.completions.create(model="m", messages=msgs).id]
        stream = oc.chat.completions.create(model="m", messages=msgs + [{"role": "assistant", "content": "answer 1"},
                                                                         {"role": "user", "content": "more"}],
                                            stream=True)
        ids.append({chunk.id for chunk in stream}.pop())
        ids.append(oc.responses.create(model="m", input="hello", extra_headers={"X-Session-Id": "fb-sdk-r"}).id)
        ids.append(ac.messages.create(model="m", max_tokens=8, messages=msgs).id)
        assert [i.split("-")[0].split("_")[0] for i in ids] == ["chatcmpl", "chatcmpl", "resp", "msg"]
        answers = [_post(oc, {"response_id": i, "score": s, "comment": f"fix {k}"})
                   for k, (i, s) in enumerate(zip(ids, (1, -1, 0.5, -0.25)))]
        recs = _events(kafka_config, app, lambda evs: sum(e.TYPE == "feedback" for e in evs) >= 4)
    turns = {r.event.response_id: r for r in recs if r.event.TYPE == "turn"}
    fbs = [r for r in recs if r.event.TYPE == "feedback"]
    assert sorted(turns) == sorted(ids) and len(fbs) == 4
    for i, a, s in zip(ids, answers, (1, -1, 0.5, -0.25)):
        (fb,) = [f for f in fbs if f.event.response_id == i]
        turn = turns[i]
        assert fb.key == turn.key and fb.partition == turn.partition and fb.offset > turn.offset
        assert (fb.event.session_id, fb.event.turn_index, fb.event.turn_request_id) == (
            turn.event.session_id, turn.event.turn_index, turn.event.request_id)
        assert fb.event.score == s and a["score"] == s and a["object"] == "feedback"
        assert a["id"] == "fb_" + fb.event.feedback_id and fb.event.source == "user"


def test_session_and_index_reference_and_errors_in_openai_shape(kafka_config):
    with stack(kafka_config, _numbered(), tenants=TENANTS) as (url, app, up):
        alice = openai.OpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0,
                              default_headers={"X-Session-Id": "fb-s"})
        bob = openai.OpenAI(base_url=url + "/v1", api_key=KEY_B, max_retries=0)
        first = alice.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        ok = _post(alice, {"session_id": "fb-s", "turn_index": 0, "score": -1, "comment": "say hello back",
                           "source": "reviewer"})
        assert ok["response_id"] == first.id and ok["turn_index"] == 0
        errors = {}
        for name, client, body in (
                ("unknown", alice, {"response_id": "chatcmpl-nope", "score": 1}),
                ("bob_by_id", bob, {"response_id": first.id, "score": 1}),
                ("bob_by_index", bob, {"session_id": "fb-s", "turn_index": 0, "score": 1}),
                ("index_past", alice, {"session_id": "fb-s", "turn_index": 1, "score": 1})):
            with pytest.raises(openai.NotFoundError) as e:
                _post(client, body)
            errors[name] = e.value.body
        with pytest.raises(openai.BadRequestError) as bad:
            _post(alice, {"response_id": first.id, "score": 3})
        raw = httpx.post(url + "/v1/feedback", content=b"{not json", headers={"Authorization": f"Bearer {KEY_A}"})
        nokey = httpx.post(url + "/v1/feedback", json={"response_id": first.id, "score": 1})
        recs = _events(kafka_config, app, lambda evs: any(e.TYPE == "feedback" for e in evs))
    assert {b["code"] for b in errors.values()} == {"turn_not_found"}
    assert {b["type"] for b in errors.values()} == {"invalid_request_error"}
    assert errors["bob_by_id"]["message"].replace(first.id, "X") == errors["unknown"]["message"].replace(
        "chatcmpl-nope", "X")  # another tenant's turn reads exactly as an unknown one
    assert bad.value.body == {"message": bad.value.body["message"], "type": "invalid_request_error",
                              "param": "score", "code": "invalid_score"}
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    assert nokey.status_code == 401
    (fb,) = [r.event for r in recs if r.event.TYPE == "feedback"]
    assert (fb.tenant, fb.session_id, fb.score, fb.comment, fb.source) == ("alice", "fb-s", -1.0, "say hello back",
                                                                          "reviewer")


def test_a_restarted_proxy_still_resolves_its_turns(kafka_config, tmp_path):
    """The index is kept beside the durable buffer: a new proxy process on the same folder
    resolves a response id answered by the one before."""
    up = StandInEngine(_numbered())
    with serve_app(up) as up_url:
        with running_proxy(kafka_config, up_url, buffer_dir=str(tmp_path)) as (url, app):
            oc = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            rid = oc.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]).id
        with running_proxy(kafka_config, up_url, buffer_dir=str(tmp_path)) as (url, app):
            oc = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            assert _post(oc, {"response_id": rid, "score": 1})["response_id"] == rid
        with running_proxy(kafka_config, up_url) as (url, app):  # another folder: another proxy's turns
            oc = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.NotFoundError):
                _post(oc, {"response_id": rid, "score": 1})


def test_session_outcome_on_end_and_on_the_done_header(kafka_config):
    with stack(kafka_config, _numbered()) as (url, app, up):
        r = httpx.post(url + "/v1/sessions/fb-o1/end", json={"outcome": 0.5})
        assert r.status_code == 200 and r.json() == {"session_id": "fb-o1", "ended": True, "outcome": 0.5}
        assert httpx.post(url + "/v1/sessions/fb-o2/end").json() == {"session_id": "fb-o2", "ended": True}  # no outcome
        for body in ({"outcome": 1.5}, {"outcome": "good"}, {"result": 1}):
            bad = httpx.post(url + "/v1/sessions/fb-o3/end", json=body)
            assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
        oc = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        oc.chat.completions.create(model="m", messages=msgs, extra_headers={
            "X-Session-Id": "fb-o4", "X-Session-Done": "true", "X-Session-Outcome": "-1"})
        with pytest.raises(openai.BadRequestError) as e:  # an outcome without the end it belongs to
            oc.chat.completions.create(model="m", messages=msgs, extra_headers={
                "X-Session-Id": "fb-o5", "X-Session-Outcome": "1"})
        assert e.value.body["code"] == "invalid_outcome"
        recs = _events(kafka_config, app, lambda evs: sum(e.TYPE == "session_end" for e in evs) >= 3)
    ends = {r.event.session_id: r.event for r in recs if r.event.TYPE == "session_end"}
    assert ends["fb-o1"].outcome == 0.5 and ends["fb-o2"].outcome is None and ends["fb-o4"].outcome == -1.0
    assert ends["fb-o4"].reason == "header" and "fb-o3" not in ends and "fb-o5" not in ends
