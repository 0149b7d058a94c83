"""Issue 28 (tenants): the trainer's per-tenant adapter table and each tenant's current adapter on ``control``
(pure: no broker, no model)."""

from __future__ import annotations

import json

import pytest

from pipeline import events
from pipeline.weightsync import current_adapters
from pipeline.trainer.tenants import TenantTable


def _ad(tenant: str, c: str) -> dict:
    return {"name": f"{tenant}@{c * 16}", "version": c * 64, "sha256": "f" * 64}


def test_versions_map_to_the_update_that_produced_them_and_survive_json():
    t = TenantTable(keep=3)
    assert t.produced_by("alice", None) == 0 and t.updates("alice") == 0  # the base: n = 0
    for c in "abcd":
        t.bump("alice")
        t.record("alice", c * 64)
    assert t.updates("alice") == 4 and t.updates("bob") == 0 and t.updates(None) == 0
    assert [t.produced_by("alice", _ad("alice", c)) for c in "bcd"] == [2, 3, 4]
    assert t.produced_by("alice", _ad("alice", "a")) is None  # evicted (oldest): unknown, never fresh
    assert t.produced_by("bob", _ad("alice", "d")) is None  # another tenant's version is not bob's
    back = TenantTable(keep=3, meta=json.loads(json.dumps(t.to_meta())))
    assert back.to_meta() == t.to_meta()


def test_reset_forgets_versions_keeps_the_count_and_the_base_is_the_fresh_adapter():
    t = TenantTable()
    t.bump("alice")
    t.record("alice", "a" * 64)
    t.synced_to("alice", 1, _ad("alice", "a"))
    t["alice"].frozen = True
    s = t.reset("alice")
    assert s.updates == 1 and s.published is None and s.frozen and s.versions == {}
    assert t.produced_by("alice", _ad("alice", "a")) is None  # served by the dropped adapter: unknown
    assert t.produced_by("alice", None) == 1  # the base == the fresh adapter (B = 0) at n = 1
    assert t.unsynced() == []


def test_a_tenant_is_unsynced_until_its_update_is_synced():
    t = TenantTable()
    t.bump("bob")
    t.record("bob", "b" * 64)
    assert t.unsynced() == ["bob"]
    t.synced_to("bob", 1, _ad("bob", "b"))
    assert t.unsynced() == []


def _ctl(action, tenant, adapter=None, **kw):
    return events.Control(action=action, epoch=1, policy_version=1, run_id=kw.pop("run_id", "r"), tenant=tenant,
                          adapter=adapter, sha256=adapter["sha256"] if action == "weights" else None,
                          location=kw.pop("location", None), **kw)


def test_current_adapter_is_the_last_resume_and_its_weights_location():
    a1, a2 = _ad("alice", "a"), _ad("alice", "b")
    log = [_ctl("weights", "alice", a1, location="/x/a"), _ctl("resume", "alice", a1),
           _ctl("weights", "alice", a2, location="/x/b"), _ctl("resume", "alice", a1),  # b failed somewhere
           _ctl("weights", "bob", _ad("bob", "c"), location="/x/c"), _ctl("resume", "bob", _ad("bob", "c")),
           _ctl("resume", "alice", a2, run_id="other-run")]
    assert current_adapters(log, "r") == {"alice": (a1, "/x/a"), "bob": (_ad("bob", "c"), "/x/c")}
    assert current_adapters(log, "other-run") == {"alice": None}  # its weights record is of run r
    later = current_adapters(log + [_ctl("reset", "alice"), _ctl("resume", "alice")], "r")
    assert later["alice"] is None and later["bob"] == (_ad("bob", "c"), "/x/c")


@pytest.mark.parametrize("action", events.ADAPTER_COMMANDS)
def test_commands_name_a_tenant_and_no_adapter(action):
    ev = _ctl(action, "alice")
    assert events.decode(events.encode(ev)).action == action
    with pytest.raises(events.EventError):
        events.decode(events.encode(_ctl(action, None)))
