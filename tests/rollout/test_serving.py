"""The serving view folded from ``control`` (pipeline/rollout/serving.py): candidate, live,
promote, rollback, supersede, failed sync, reset; records of another run change nothing."""

from __future__ import annotations

from pipeline import events
from pipeline.rollout.serving import ServingView, version_of

A1 = {"name": "alice-1", "version": "a" * 64, "sha256": "1" * 64}
A2 = {"name": "alice-2", "version": "b" * 64, "sha256": "2" * 64}
B1 = {"name": "bob-1", "version": "c" * 64, "sha256": "3" * 64}
EVIDENCE = {"rule": "r", "reason": "x", "config": {}, "incumbent": None, "arms": {}, "bounds": {}}


def ctl(action, n=1, tenant=None, adapter=None, run_id="default", **kw):
    if action == "weights":
        kw.update(location="/x", sha256=adapter["sha256"] if adapter else "f" * 64)
    if action in ("promote", "rollback"):
        kw["evidence"] = EVIDENCE
    return events.Control(action=action, epoch=n, policy_version=n, run_id=run_id, tenant=tenant, adapter=adapter, **kw)


def test_a_tenants_candidate_goes_live_at_its_resume_and_is_promoted():
    v = ServingView()
    assert v.scope("alice").incumbent is None and not v.canary_open("alice")
    assert v.apply(ctl("weights", 1, "alice", A1))
    s = v.scope("alice")
    assert s.candidate == A1 and not s.live and v.canary_open("alice")
    assert v.apply(ctl("resume", 1, "alice", A1)) and v.scope("alice").live
    assert v.apply(ctl("promote", 1, "alice", A1))
    s = v.scope("alice")
    assert s.incumbent == A1 and s.candidate is None and not v.canary_open("alice")
    assert not v.apply(ctl("weights", 1, "alice", A1))  # the incumbent re-published: no canary
    assert v.scope("alice").opened == 1 and v.scope("bob").opened == 0


def test_a_rolled_back_version_never_goes_live_whatever_the_order():
    v = ServingView()
    for ev in (ctl("weights", 1, "alice", A1), ctl("resume", 1, "alice", A1), ctl("promote", 1, "alice", A1),
               ctl("weights", 2, "alice", A2), ctl("rollback", 2, "alice", A2), ctl("resume", 2, "alice", A2)):
        v.apply(ev)
    s = v.scope("alice")
    assert s.incumbent == A1 and s.candidate is None and s.rolled_back == {A2["version"]}
    assert not v.apply(ctl("weights", 3, "alice", A2))  # never a candidate again
    assert v.scope("bob").incumbent is None  # alice's rollback leaves bob alone
    v.apply(ctl("weights", 1, "bob", B1))
    assert v.scope("bob").candidate == B1 and v.scope("alice").candidate is None


def test_a_newer_candidate_supersedes_and_a_failed_sync_ends_the_canary():
    v = ServingView()
    v.apply(ctl("weights", 1, "alice", A1))
    v.apply(ctl("weights", 2, "alice", A2))
    assert v.scope("alice").candidate == A2
    v.apply(ctl("resume", 2, "alice", None))  # every engine did not apply it: back on the base
    assert v.scope("alice").candidate is None and v.scope("alice").incumbent is None
    v.apply(ctl("weights", 3, "alice", A1))
    v.apply(ctl("promote", 3, "alice", A1))
    v.apply(ctl("weights", 4, "alice", A2))
    v.apply(ctl("resume", 4, "alice", A1))  # failed: resumed on the previous one
    assert v.scope("alice").candidate is None and v.scope("alice").incumbent == A1
    v.apply(ctl("reset", 5, "alice"))
    assert v.scope("alice").incumbent is None


def test_full_weights_and_other_runs():
    v = ServingView()
    assert not v.apply(ctl("weights", 1, run_id="other"))
    assert v.apply(ctl("weights", 1)) and version_of(v.scope(None).candidate) == 1
    v.apply(ctl("resume", 1))
    assert v.scope(None).live
    v.apply(ctl("rollback", 1))
    assert v.scope(None).incumbent == 0 and v.scope(None).rolled_back == {1}
    assert not v.apply(ctl("promote", 1))  # no candidate to promote


def test_a_sync_cut_short_and_run_again_opens_one_canary_that_its_resume_makes_live():
    """A trainer killed between ``weights`` and ``resume`` syncs the same candidate again at its
    restart: the second ``weights`` changes nothing (the decider's fold likewise:
    ``test_fold.py::test_a_republished_order_neither_restarts_a_canary_nor_revives_a_rolled_back_version``),
    the ``resume`` makes it live; for the full weights and for a tenant's adapter."""
    for tenant, adapter in ((None, None), ("alice", A1)):
        v = ServingView()
        assert v.apply(ctl("weights", 1, tenant, adapter))
        assert not v.apply(ctl("pause", 1, tenant, adapter)) and not v.apply(ctl("weights", 1, tenant, adapter))
        s = v.scope(tenant)
        assert version_of(s.candidate) == version_of(1 if tenant is None else A1) and not s.live and s.opened == 1
        assert v.apply(ctl("resume", 1, tenant, adapter)) and v.scope(tenant).live and v.scope(tenant).opened == 1
