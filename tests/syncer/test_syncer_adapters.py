"""Adapter sync at the syncer (docs/tenants.md "Adapter sync"): a tenant's ``weights`` loads its
adapter into a real CPU engine (LoRA on, tiny-random) and is answered on ``control``; a
``resume`` unloads the tenant's other adapters; a torn folder is refused; a restarted syncer or
engine gets every tenant's current adapter back. Real broker, real engine, real syncer; the
trainer's records are published by the test (the contract)."""

from __future__ import annotations

import asyncio

from pipeline import events
from pipeline.engine.lora import LoraSettings
from pipeline.engine_api.client import EngineClient
from pipeline.testing.lora import adapter_order, export_tenant_adapter
from pipeline.testing.topics import publish, read_events
from pipeline.testing.waiting import wait_for
from tests.syncer.syncing import TOKENS, engine_for, new_syncer, readyz, running, syncer_config

LORA = LoraSettings(enabled=True, max_rank=16)
RUN = "reconcile"  # syncer_config's run


def _order(action: str, tenant: str, adapter: dict | None, folder=None) -> events.Control:
    return adapter_order(action, tenant, adapter, folder, run_id=RUN)


def _loaded(url: str) -> set[str]:
    async def go():
        async with EngineClient(url, timeout_s=60) as eng:
            return {m["id"] for m in (await eng.models())["data"] if m.get("parent")}
    return asyncio.run(go())


def _scores(url: str, adapter: str | None) -> list[float]:
    async def go():
        async with EngineClient(url, timeout_s=60) as eng:
            return await eng.score(TOKENS, 10, lora_path=adapter)
    return asyncio.run(go())


def _answers(cfg, pred, want) -> list[events.Control]:
    """The syncers' answers on control matching ``pred`` (waits for ``want`` of them)."""
    got = read_events(cfg, "control", lambda evs: sum(pred(e) for e in evs) >= want, timeout_s=60, settle_s=0.3)
    return [e for e in got if pred(e)]


def _exports(tmp_path, *tenants: str) -> list[tuple]:
    """``(folder, adapter)`` of one fresh adapter per entry of ``tenants`` (seeds 1, 2, ...)."""
    return [export_tenant_adapter(tmp_path / "weights", t, seed=i) for i, t in enumerate(tenants, 1)]


def _answer_of(action: str, adapter: dict):
    return lambda e: e.action == action and e.adapter == adapter and e.engine_id == "engine-0"


def test_weights_load_the_adapter_resume_unloads_the_one_before_the_old_and_a_torn_folder_is_refused(kafka_config, tmp_path):
    cfg = syncer_config(kafka_config, tmp_path)
    (a1_dir, a1), (a2_dir, a2), (a3_dir, a3), (bad_dir, bad) = _exports(tmp_path, "alice", "alice", "alice", "bob")
    (bad_dir / "adapter_model.safetensors").write_bytes(b"torn")  # not what its checksum file says
    with engine_for(cfg, lora=LORA) as (cfg, url), running(new_syncer(cfg)) as syncer:
        base = _scores(url, None)
        publish(cfg, [_order("pause", "alice", a1), _order("weights", "alice", a1, a1_dir)], "control")
        (ans,) = _answers(cfg, _answer_of("applied", a1), 1)
        assert ans.tenant == "alice" and ans.sha256 == a1["sha256"]
        assert a1["name"] in _loaded(url) and _scores(url, a1["name"]) != base  # the engine serves A1
        publish(cfg, [_order("resume", "alice", a1), _order("pause", "alice", a2),
                      _order("weights", "alice", a2, a2_dir)], "control")
        _answers(cfg, _answer_of("applied", a2), 1)
        assert {a1["name"], a2["name"]} <= _loaded(url)  # A1 still serves alice until resume names A2
        publish(cfg, [_order("resume", "alice", a2), _order("pause", "alice", a3),
                      _order("weights", "alice", a3, a3_dir)], "control")
        _answers(cfg, _answer_of("applied", a3), 1)
        assert {a1["name"], a2["name"], a3["name"]} <= _loaded(url)  # A1: served alice until this resume
        publish(cfg, [_order("resume", "alice", a3)], "control")
        wait_for(lambda: _loaded(url) == {a2["name"], a3["name"]}, what="alice's adapter before the last one unloaded")
        publish(cfg, [_order("resume", "alice", None)], "control")  # reset: nothing of alice stays loaded
        wait_for(lambda: _loaded(url) == set(), what="alice's adapters unloaded on a resume to the base")
        publish(cfg, [_order("pause", "bob", bad), _order("weights", "bob", bad, bad_dir)], "control")
        (failed,) = _answers(cfg, _answer_of("failed", bad), 1)
        assert failed.tenant == "bob" and "sha256" in failed.message
        assert bad["name"] not in _loaded(url)
        assert syncer.adapters_loaded == {}


def test_every_tenants_newest_weights_of_one_drained_poll_is_applied(kafka_config, tmp_path):
    cfg = syncer_config(kafka_config, tmp_path)
    (old_dir, old), (new_dir, new), (bob_dir, bob) = _exports(tmp_path, "alice", "alice", "bob")
    # all waiting before the syncer reads its group: one drain
    publish(cfg, [_order("weights", "alice", old, old_dir), _order("weights", "alice", new, new_dir),
                  _order("weights", "bob", bob, bob_dir)], "control")
    with engine_for(cfg, lora=LORA) as (cfg, url), running(new_syncer(cfg)) as syncer:
        applied = _answers(cfg, lambda e: e.action == "applied" and e.engine_id == "engine-0", 2)
        assert {(e.tenant, e.adapter["name"]) for e in applied} >= {("alice", new["name"]), ("bob", bob["name"])}
        assert {new["name"], bob["name"]} <= _loaded(url)
        assert set(syncer.adapters_loaded) >= {new["name"], bob["name"]}


def test_restarted_syncer_and_engine_get_every_tenants_current_adapter_back(kafka_config, tmp_path):
    cfg = syncer_config(kafka_config, tmp_path)
    export = tmp_path / "weights"
    a_dir, a = export_tenant_adapter(export, "alice", seed=1)
    b_dir, b = export_tenant_adapter(export, "bob", seed=2)
    publish(cfg, [_order("weights", "alice", a, a_dir), _order("resume", "alice", a),
                  _order("weights", "bob", b, b_dir), _order("resume", "bob", b)], "control")
    with engine_for(cfg, lora=LORA) as (cfg, url):
        with running(new_syncer(cfg)):
            wait_for(lambda: {a["name"], b["name"]} <= _loaded(url), what="both tenants' adapters")
            served = _scores(url, a["name"])
    # both restart: the engine comes back without adapters; the syncer loads them before its group
    with engine_for(cfg, lora=LORA) as (cfg, url):
        assert _loaded(url) == set()
        syncer = new_syncer(cfg)
        port = syncer.serve_ready(0, "127.0.0.1")
        with running(syncer):
            assert {a["name"], b["name"]} <= _loaded(url)
            assert _scores(url, a["name"]) == served
            wait_for(lambda: readyz(port)[0] == 200, what="/readyz 200")
            # the engine loses an adapter under a running syncer (an engine restart): reloaded at the next check
            asyncio.run(_unload(url, b["name"]))
            wait_for(lambda: b["name"] in _loaded(url), what="bob's adapter to be reloaded")
            # a tenant whose current adapter's folder is gone cannot be served: /readyz says so
            c_dir, c = export_tenant_adapter(export, "carol", seed=4)
            publish(cfg, [_order("resume", "carol", c)], "control")  # its weights record never came
            wait_for(lambda: readyz(port)[0] == 503, what="/readyz 503")
            assert "carol" in readyz(port)[1]["adapters_missing"]
            publish(cfg, [_order("resume", "carol", None)], "control")  # reset: carol goes back to the base
            wait_for(lambda: readyz(port)[0] == 200, what="/readyz 200 again")


async def _unload(url: str, name: str) -> None:
    async with EngineClient(url, timeout_s=60) as eng:
        await eng.unload_lora_adapter(name)


def test_a_record_whose_folder_holds_other_content_is_refused_before_or_after_the_engine_trusts(
        kafka_config, tmp_path):
    """The folder is hashed once: by the syncer until the engine reports content ids, then by the
    engine alone; a record naming other content than its folder holds is refused either way, and
    the name is not left loaded."""
    cfg = syncer_config(kafka_config, tmp_path)
    (a_dir, a), (b_dir, b) = _exports(tmp_path, "alice", "alice")
    lie = {**a, "name": events.adapter_name("alice", "f" * 64), "version": "f" * 64}  # A's folder, another id
    with engine_for(cfg, lora=LORA) as (cfg, url), running(new_syncer(cfg)) as syncer:
        assert not syncer._engine_reports_versions
        publish(cfg, [_order("weights", "alice", lie, a_dir)], "control")  # refused by the syncer's own hash
        (first,) = _answers(cfg, _answer_of("failed", lie), 1)
        assert "adapter version" in first.message and lie["name"] not in _loaded(url)
        publish(cfg, [_order("weights", "alice", b, b_dir)], "control")
        _answers(cfg, _answer_of("applied", b), 1)
        assert syncer._engine_reports_versions  # the CPU engine answered with content ids
        lie_b = {**lie, "sha256": b["sha256"]}  # B's folder under an id that is not B's
        publish(cfg, [_order("weights", "alice", lie_b, b_dir)], "control")
        (second,) = _answers(cfg, _answer_of("failed", lie_b), 1)  # refused on the engine's id, then unloaded
        assert "the engine loaded content" in second.message and b["version"] in second.message
        assert lie["name"] not in _loaded(url) and b["name"] in _loaded(url)
        # a weights record read after the resume that names it: the name is live, verified first
        lie_c = {**lie, "sha256": "c" * 64}
        publish(cfg, [_order("resume", "alice", lie_c), _order("weights", "alice", lie_c, b_dir)], "control")
        # (reconciliation, which now finds alice resumed on it, refuses it too: those answers aside)
        (third,) = _answers(cfg, lambda e: _answer_of("failed", lie_c)(e) and not e.message.startswith("reconcile"), 1)
        assert "adapter version" in third.message and lie["name"] not in _loaded(url)


class _EngineWithoutIds:
    """A stand-in engine client answering loads as SGLang does (no ``adapter_versions``)."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.unloaded: list[str] = []

    async def load_lora_adapter(self, name: str, path: str) -> dict:
        self.loaded.append(name)
        return {"success": True, "error_message": None, "loaded_adapters": {name: path}}

    async def unload_lora_adapter(self, name: str) -> dict:
        self.unloaded.append(name)
        return {"success": True, "error_message": None, "loaded_adapters": {}}

    async def aclose(self) -> None:
        pass


def test_an_engine_that_reports_no_content_ids_gets_the_folder_verified_even_after_trusting(
        kafka_config, tmp_path, monkeypatch):
    cfg = syncer_config(kafka_config, tmp_path)
    (a_dir, a), (b_dir, _) = _exports(tmp_path, "alice", "bob")
    syncer = new_syncer(cfg)
    syncer._engine = fake = _EngineWithoutIds()
    syncer._engine_reports_versions = True  # as if the engine behind the URL had reported ids before
    try:
        ok, msg = syncer.apply_adapter(_order("weights", "alice", a, b_dir))  # A's record, B's folder
        assert not ok and "adapter version" in msg
        assert fake.loaded == fake.unloaded == [a["name"]] and not syncer._engine_reports_versions
        ok, _ = syncer.apply_adapter(_order("weights", "alice", a, a_dir))  # verified before the load now
        assert ok and syncer.adapters_loaded == {a["name"]: "alice"} and fake.unloaded == [a["name"]]
    finally:
        syncer.close()


def test_reconciliation_never_loads_other_content_under_a_live_adapter_name(kafka_config, tmp_path):
    """A tenant's current adapter is routed already: when its folder changed (the config edited,
    the tensors and their checksum intact), a syncer that trusts the engine's content ids still
    verifies before reloading it, so the name is never loaded with other content."""
    cfg = syncer_config(kafka_config, tmp_path)
    (a_dir, a), (b_dir, b) = _exports(tmp_path, "alice", "bob")
    with engine_for(cfg, lora=LORA) as (cfg, url), running(new_syncer(cfg)) as syncer:
        publish(cfg, [_order("weights", "alice", a, a_dir), _order("resume", "alice", a)], "control")
        _answers(cfg, _answer_of("applied", a), 1)
        publish(cfg, [_order("weights", "bob", b, b_dir)], "control")
        _answers(cfg, _answer_of("applied", b), 1)
        assert syncer._engine_reports_versions
        conf = a_dir / "adapter_config.json"
        conf.write_text(conf.read_text().replace('"lora_alpha": 8.0', '"lora_alpha": 4.0'))
        asyncio.run(_unload(url, a["name"]))  # the engine lost it (a restart): reconciliation reloads it
        failed = _answers(cfg, _answer_of("failed", a), 1)  # retried with back-off: one answer or more
        assert all(e.message.startswith("reconcile: ") and "adapter version" in e.message for e in failed)
        assert a["name"] not in _loaded(url) and "alice" in syncer.adapters_missing
