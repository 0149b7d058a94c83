"""A syncer during a tenant's canary (rollout on, docs/rollout.md "Serving";
pipeline/syncer/adapters.py): the candidate's ``resume`` keeps the incumbent loaded beside it, a
restarted engine gets both back, a ``rollback`` unloads the candidate (and a later order never
brings it back), a ``promote`` keeps the old incumbent until the tenant's next ``resume``, and
another tenant is untouched. Rollout off: a ``resume`` names the one adapter that serves.

The real :class:`pipeline.syncer.Syncer`'s record handling and reconciliation, driven directly
with the records (no broker), in front of a stand-in engine that keeps the loaded names; the
folders are not read (the content checks have their own tests)."""

from __future__ import annotations

import pytest

from pipeline import events
from pipeline.config import Config
from pipeline.engine_api.errors import EngineError
from pipeline.testing.lora import adapter_order
from tests.syncer.syncing import RecordingProducer, syncer_maker

RUN = "default"
EVIDENCE = {"rule": "test", "reason": "test", "config": {}, "incumbent": None,
            "arms": {"candidate": {}, "incumbent": {}}, "bounds": {}}


def _adapter(tenant: str, c: str) -> dict:
    version = c * 64
    return {"name": events.adapter_name(tenant, version), "version": version, "sha256": c * 64}


A1, A2, A3, A4 = (_adapter("alice", c) for c in "1234")
B1 = _adapter("bob", "b")


def _order(action: str, adapter: dict | None, tenant: str = "alice") -> events.Control:
    if action in ("promote", "rollback"):
        return events.Control(action=action, epoch=1, run_id=RUN, tenant=tenant, adapter=adapter, evidence=EVIDENCE)
    folder = f"/adapters/{adapter['name']}" if action == "weights" else None
    return adapter_order(action, tenant, adapter, folder, run_id=RUN)


class _Engine:
    """Stand-in engine client: loads and unloads names, lists them on ``/v1/models``."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}

    async def load_lora_adapter(self, name: str, location: str, **_) -> dict:
        self.loaded[name] = location
        return {"success": True, "loaded_adapters": dict(self.loaded)}

    async def unload_lora_adapter(self, name: str) -> dict:
        if self.loaded.pop(name, None) is None:
            raise EngineError(f"{name} is not loaded", 400)
        return {"success": True}

    async def models(self) -> dict:
        return {"data": [{"id": "base", "parent": None}] + [{"id": n, "parent": "base"} for n in self.loaded]}

    async def aclose(self) -> None:
        pass


@pytest.fixture
def verified(monkeypatch):
    """Every folder passes the content check (not under test here)."""
    from pipeline import weightsync

    monkeypatch.setattr(weightsync, "verify_adapter", lambda path, sha256=None: sha256)


@pytest.fixture
def syncers():
    """``make(engine, rollout)``: a :class:`pipeline.syncer.Syncer` calling ``engine`` (closed after)."""
    with syncer_maker() as make:
        yield lambda engine, rollout: make(Config().replace(rollout={"enabled": rollout}, trainer={"lora": {"rank": 4}},
                                                            syncer={"engine_id": "engine-0", "retries": 0}), engine)


def _feed(syncer, *recs: events.Control) -> RecordingProducer:
    p = RecordingProducer()
    syncer.handle_tenant_records(p, list(recs))
    return p


def _names(*adapters: dict) -> set[str]:
    return {a["name"] for a in adapters}


def test_both_serve_during_a_canary_and_a_rollback_unloads_the_candidate(verified, syncers):
    eng = _Engine()
    s = syncers(eng, rollout=True)
    _feed(s, _order("weights", B1, "bob"), _order("resume", B1, "bob"))
    _feed(s, _order("weights", A1), _order("resume", A1), _order("promote", A1))
    _feed(s, _order("pause", A2), _order("weights", A2))
    assert set(eng.loaded) == _names(A1, A2, B1)
    _feed(s, _order("resume", A2))  # the candidate goes live: the incumbent still serves
    assert set(eng.loaded) == _names(A1, A2, B1)
    eng.loaded.clear()  # the engine restarted
    assert s.reconcile_adapters(RecordingProducer())
    assert set(eng.loaded) == _names(A1, A2, B1)  # both of alice's are back
    _feed(s, _order("rollback", A2))
    assert set(eng.loaded) == _names(A1, B1)  # bob untouched
    _feed(s, _order("resume", A2))  # a late order naming the rolled-back version: never served again
    eng.loaded.clear()
    assert s.reconcile_adapters(RecordingProducer())
    assert set(eng.loaded) == _names(A1, B1)


def test_a_promotion_keeps_the_old_incumbent_until_the_next_resume(verified, syncers):
    eng = _Engine()
    s = syncers(eng, rollout=True)
    _feed(s, _order("weights", A1), _order("resume", A1), _order("promote", A1))
    _feed(s, _order("weights", A2), _order("resume", A2))
    _feed(s, _order("promote", A2))
    assert set(eng.loaded) == _names(A1, A2)  # requests the proxy routed to A1 just before still served
    _feed(s, _order("weights", A3))
    assert set(eng.loaded) == _names(A1, A2, A3)
    _feed(s, _order("resume", A3))
    assert set(eng.loaded) == _names(A2, A3)  # the new canary: incumbent A2 beside candidate A3
    eng.loaded.clear()
    assert s.reconcile_adapters(RecordingProducer()) and set(eng.loaded) == _names(A2, A3)


def test_a_restarted_syncer_unloads_a_rolled_back_adapter_the_engine_still_holds(verified, syncers):
    eng = _Engine()
    recs = [_order("weights", A1), _order("resume", A1), _order("promote", A1), _order("weights", A2),
            _order("resume", A2), _order("rollback", A2)]
    eng.loaded = {A1["name"]: "x", A2["name"]: "x"}  # the old syncer died before its unload
    s = syncers(eng, rollout=True)
    for ev in recs:  # what scan_control folds at start
        s.tenants.see(ev)
    assert s.reconcile_adapters(RecordingProducer())
    assert set(eng.loaded) == _names(A1)


def test_rollout_off_a_resume_names_the_one_adapter_that_serves(verified, syncers):
    eng = _Engine()
    s = syncers(eng, rollout=False)
    _feed(s, _order("weights", A1), _order("resume", A1))
    _feed(s, _order("weights", A2), _order("resume", A2), _order("rollback", A2))  # decisions: ignored
    assert set(eng.loaded) == _names(A1, A2)  # A1: served alice until this resume (kept until the next)
    eng.loaded.clear()
    assert s.reconcile_adapters(RecordingProducer()) and set(eng.loaded) == _names(A2)  # the last resume only
    _feed(s, _order("weights", A3), _order("resume", A3))
    assert set(eng.loaded) == _names(A2, A3)
