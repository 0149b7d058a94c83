"""The model-name rule (:mod:`pipeline.proxy.names`): served ids and aliases pass (as the served id),
anything else is 404 ``model_not_found`` unless ``unknown_model: serve``; an engine without
``/v1/models`` is taken on trust; the served ids are re-read when a name is missing."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from pipeline.proxy.errors import ProxyError
from pipeline.proxy.names import REFRESH_S, ServedModels


class FakeModels:  # stand-in for the engine's GET /v1/models (no LLM involved)
    def __init__(self, ids, status=200):
        self.ids, self.status, self.calls = list(ids), status, 0

    async def __call__(self):
        self.calls += 1
        return self.status, orjson.dumps({"object": "list", "data": [{"id": i, "object": "model"} for i in self.ids]})


def _resolve(models, name):
    return asyncio.run(models.resolve(name))


def test_served_names_and_aliases_resolve_to_the_served_id():
    m = ServedModels(FakeModels(["smollm2-135m"]), {"gpt-4o-mini": "smollm2-135m"})
    assert _resolve(m, "smollm2-135m") == "smollm2-135m"
    assert _resolve(m, "gpt-4o-mini") == "smollm2-135m"
    assert _resolve(m, None) == "smollm2-135m"


@pytest.mark.parametrize("name", ["gpt-9", "SmolLM2-135M", "smollm2-135m ", ""])
def test_unknown_names_are_404_model_not_found_naming_what_is_served(name):
    m = ServedModels(FakeModels(["smollm2-135m"]), unknown="reject")
    with pytest.raises(ProxyError) as e:
        _resolve(m, name)
    err = orjson.loads(e.value.body())["error"]
    assert e.value.status == 404 and err["code"] == "model_not_found" and err["param"] == "model"
    assert "'smollm2-135m'" in err["message"] and "proxy.model_aliases" in err["message"]


def test_unknown_names_are_served_as_the_served_model_by_default():
    assert _resolve(ServedModels(FakeModels(["m"])), "gpt-9") == "m"


def test_a_non_string_model_is_a_400():
    with pytest.raises(ProxyError) as e:
        _resolve(ServedModels(FakeModels(["m"])), 5)
    assert e.value.status == 400 and e.value.param == "model"


def test_an_engine_without_model_ids_is_taken_on_trust_and_not_asked_on_every_request():
    fetch = FakeModels([], status=404)
    m = ServedModels(fetch)
    assert _resolve(m, "anything") is None and _resolve(m, "other") is None
    assert fetch.calls == 1  # re-asked at most every REFRESH_S seconds


def test_the_ids_are_read_again_when_a_name_is_missing(monkeypatch):
    fetch = FakeModels(["old"])
    m = ServedModels(fetch, unknown="reject")
    assert _resolve(m, "old") == "old" and fetch.calls == 1
    fetch.ids = ["new"]  # the engine was restarted with another model
    now = [1000.0]
    monkeypatch.setattr("pipeline.proxy.names.time.monotonic", lambda: now[0])
    m._read_at = now[0]
    with pytest.raises(ProxyError):
        _resolve(m, "new")  # within REFRESH_S of the last read: not asked again
    now[0] += REFRESH_S
    assert _resolve(m, "new") == "new" and fetch.calls == 2


def test_every_front_door_answers_an_unknown_model_404_in_its_own_shape_and_records_the_served_id(kafka_config):
    # proxy.unknown_model=reject, through the real proxy app and a stand-in engine serving "scripted"
    import anthropic
    import httpx
    import openai

    from pipeline.testing.proxy import running_proxy
    from pipeline.testing.servers import Reply, StandInEngine, serve_app
    from pipeline.testing.topics import read_records

    config = kafka_config.replace(proxy={"unknown_model": "reject", "model_aliases": {"gpt-4o-mini": "scripted"}})
    up = StandInEngine(lambda req: Reply(content="hello"))
    with serve_app(up) as up_url, running_proxy(config, up_url) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["code"] == "model_not_found" and "'scripted'" in e.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="gpt-9", input="hi")
        r = httpx.post(url + "/v1/messages", json={"model": "claude-x", "max_tokens": 8,
                                                   "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        body = r.json()
        assert r.status_code == 404 and body["type"] == "error" and "claude-x" in body["error"]["message"]
        with pytest.raises(anthropic.NotFoundError):
            anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages.create(
                model="claude-x", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert up.requests == [] or all(q.get("model") == "scripted" for q in up.requests)  # no 404 reached it
        for name in ("scripted", "gpt-4o-mini", "default"):
            out = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                 extra_headers={"X-Session-Id": f"names-{name}"})
            assert out.model == "scripted" and out.choices[0].message.content == "hello"
        assert app.publisher.wait_idle(10)
    recs = read_records(config, config.topics.name("turns"), 3, 15, 0.5)
    assert sorted(r.event.session_id for r in recs) == ["names-default", "names-gpt-4o-mini", "names-scripted"]
    assert {r.event.model for r in recs} == {"scripted"}  # what the engine served, never the name sent


class FakeModelsWithAdapters(FakeModels):  # stand-in engine listing LoRA adapter cards as SGLang does
    async def __call__(self):
        self.calls += 1
        cards = [{"id": i, "object": "model"} for i in self.ids]
        cards += [{"id": f"{self.ids[0]}:{a}", "object": "model", "parent": self.ids[0], "root": f"/adapters/{a}"}
                  for a in ("alice", "bob")]
        return self.status, orjson.dumps({"object": "list", "data": cards})


@pytest.mark.parametrize("unknown", ["serve", "reject"])
def test_a_client_never_names_an_adapter_card(unknown):
    """Adapters are per tenant and chosen by the proxy: ``base:adapter``, an adapter card's id
    or a name of the trainer's adapter form is refused (400), never served nor forwarded."""
    m = ServedModels(FakeModelsWithAdapters(["smollm2-135m"]), unknown=unknown)
    assert _resolve(m, "smollm2-135m") == "smollm2-135m"
    assert m.served == ["smollm2-135m"]
    for name in ("smollm2-135m:bob", "x:y", "bob@0123456789abcdef"):
        with pytest.raises(ProxyError) as e:
            _resolve(m, name)
        assert (e.value.status, e.value.code) == (400, "model_not_allowed"), name
    if unknown == "serve":  # an '@' alone is no adapter's name: an unknown name, served by the base
        assert _resolve(m, "bob@not-hex") == "smollm2-135m"


def test_without_the_engines_list_an_adapter_name_is_refused_not_taken_on_trust():
    m = ServedModels(FakeModels([], status=404))
    assert _resolve(m, "any-model") is None  # taken on trust, as before
    with pytest.raises(ProxyError) as e:
        _resolve(m, "smollm2-135m:bob")
    assert e.value.status == 400


def test_base_cards_leave_out_adapters():
    from pipeline.proxy.names import base_cards

    body = {"data": [{"id": "m"}, {"id": "m:a", "parent": "m"}, "junk"]}
    assert base_cards(body) == [{"id": "m"}]
    assert base_cards(None) == [] and base_cards({"data": None}) == []


def test_requests_that_arrive_during_the_first_read_wait_for_it():
    """Two requests at once before the served ids are known: both get the served id (the second
    used to go on with none, and vLLM refuses the ``default`` it was then sent with); one read."""
    class SlowModels(FakeModels):
        async def __call__(self):
            await asyncio.sleep(0.05)  # the read is still in flight when the second request asks
            return await super().__call__()

    fetch = SlowModels(["tiny-random-64"])
    m = ServedModels(fetch)

    async def both():
        return await asyncio.gather(m.resolve("default"), m.resolve(None))

    assert asyncio.run(both()) == ["tiny-random-64", "tiny-random-64"]
    assert fetch.calls == 1
