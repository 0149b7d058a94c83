"""A syncer of the one full-weight engine during a canary (rollout on, docs/rollout.md "Serving";
pipeline/syncer/core.py, published.py :meth:`TenantServing.full_target`): the candidate's order is
applied as without rollout; its ``rollback`` re-applies the incumbent's own order (folder and
sha256) and answers ``applied`` for it; a ``promote`` reloads nothing; a restarted syncer
reconciles to the incumbent, never to the rolled-back version that ``published.json`` names.

The real :class:`pipeline.syncer.Syncer`'s drain, apply and reconcile, driven with the records (no
broker), in front of a stand-in engine that records each load; the folders' content is checked by
the real :func:`pipeline.weightsync.verify_folder` (each folder is a real, tiny export)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline import events, weightsync
from pipeline.config import Config
from tests.syncer.syncing import RecordingProducer, syncer_maker

RUN = "default"
EVIDENCE = {"rule": "newcombe-evalset-v1", "reason": "test", "config": {}, "incumbent": 0,
            "arms": {"candidate": {}, "incumbent": {}}, "bounds": {}}


class _Engine:
    """Stand-in full-weight engine client: ``/model_info``'s version and each load (folder, version)."""

    def __init__(self) -> None:
        self.version, self.loads = "0", []

    async def weight_version(self) -> str:
        return self.version

    async def update_weights_from_disk(self, location: str, weight_version=None, **_) -> dict:
        self.version = str(weight_version)
        self.loads.append((location, self.version))
        return {"success": True, "message": "Succeeded"}

    async def aclose(self) -> None:
        pass


class _Consumer:
    """What :meth:`Syncer._drain` calls: ``decode`` and ``poll_raw`` (nothing more to read)."""

    def decode(self, rec):
        return rec

    def poll_raw(self, timeout_ms=0):
        return []


def _export(root: Path, version: int) -> events.Control:
    """A real export folder of ``version`` (its checksum file written) and its ``weights`` order."""
    folder = root / f"v{version:06d}"
    folder.mkdir(parents=True)
    (folder / weightsync.WEIGHTS_FILE).write_bytes(f"weights of v{version}".encode())
    sha = weightsync.sha256_file(folder / weightsync.WEIGHTS_FILE)
    (folder / weightsync.CHECKSUM_FILE).write_text(f"{sha}  {weightsync.WEIGHTS_FILE}\n")
    weightsync.verify_folder(folder, sha)
    return events.Control(action="weights", epoch=version, policy_version=version, run_id=RUN,
                          location=str(folder), sha256=sha)


def _decision(action: str, version: int) -> events.Control:
    return events.Control(action=action, epoch=version, policy_version=version, run_id=RUN, evidence=EVIDENCE)


def _resume(version: int) -> events.Control:
    return events.Control(action="resume", epoch=version, policy_version=version, run_id=RUN)


@pytest.fixture
def syncer(tmp_path):
    """``make(engine)``: a full-weight rollout :class:`pipeline.syncer.Syncer` calling ``engine``."""
    cfg = Config().replace(rollout={"enabled": True, "eval_set": str(tmp_path / "team.jsonl"), "guards": ["accuracy"]},
                           syncer={"engine_id": "engine-0", "retries": 0})
    with syncer_maker() as make:
        yield lambda engine: make(cfg, engine)


def _feed(s, *recs: events.Control) -> RecordingProducer:
    """One drained poll of ``recs``, as :meth:`Syncer.run` handles it (full weights only)."""
    p = RecordingProducer()
    polled = [SimpleNamespace(partition=0, offset=i, event=ev) for i, ev in enumerate(recs)]
    latest, tenant_recs, _ = s._drain(_Consumer(), polled)
    assert tenant_recs == []
    if latest is not None:
        s._apply_full(p, latest)
    return p


def test_a_rollback_re_applies_the_incumbents_order_and_a_promote_reloads_nothing(syncer, tmp_path):
    v0, v1, v2 = (_export(tmp_path / "weights", v) for v in (0, 1, 2))
    eng = _Engine()
    s = syncer(eng)
    _feed(s, v0, _resume(0))  # the trainer's order of its incumbent v0 (a new run)
    _feed(s, v1)  # the candidate: one engine takes it
    assert eng.loads == [(v0.location, "0"), (v1.location, "1")]
    assert _feed(s, _resume(1)).sent == []  # live: nothing to load
    out = _feed(s, _decision("rollback", 1))
    assert eng.loads[-1] == (v0.location, "0") and eng.version == "0"
    assert [(c.action, c.policy_version, c.location, c.sha256) for c in out.sent] == [
        ("applied", 0, v0.location, v0.sha256)]
    assert s.target == v0 and s.in_sync.is_set()
    assert _feed(s, v1).sent == [] and eng.version == "0"  # a re-published order of v1: never served again
    _feed(s, v2)
    assert eng.loads[-1] == (v2.location, "2")
    loads = len(eng.loads)
    assert _feed(s, _resume(2), _decision("promote", 2)).sent == [] and len(eng.loads) == loads
    assert s.target == v2 and s.tenants.view.scope(None).incumbent == 2


def test_a_restarted_syncer_reconciles_to_the_incumbent_not_the_rolled_back_version(syncer, tmp_path):
    v0, v1 = (_export(tmp_path / "weights", v) for v in (0, 1))
    log = [v0, _resume(0), v1, _resume(1), _decision("rollback", 1)]
    eng = _Engine()  # the engine restarted: its base model as v0, content unknown to the new syncer
    s = syncer(eng)
    for ev in log:  # what scan_control folds at start
        s.tenants.see_full(ev)
    s.target = s.tenants.full_target(v1)  # published.json names v1, the newest export
    assert s.target == v0
    p = RecordingProducer()
    assert s.reconcile(p)
    assert eng.loads == [(v0.location, "0")]  # its own folder, verified: never v1's
    assert [(c.action, c.policy_version) for c in p.sent] == [("applied", 0)]
    loads = len(eng.loads)
    assert s.reconcile(RecordingProducer()) and len(eng.loads) == loads  # in sync now: nothing reloaded


def test_a_tampered_incumbent_folder_is_refused_and_retried_by_reconcile(syncer, tmp_path):
    """The incumbent's folder must verify like any apply: a tampered one is refused (``failed``);
    the target stays the incumbent, so reconciliation keeps trying it (never the rolled-back v1)."""
    v0, v1 = (_export(tmp_path / "weights", v) for v in (0, 1))
    eng = _Engine()
    s = syncer(eng)
    _feed(s, v0, v1, _resume(1))
    (Path(v0.location) / weightsync.WEIGHTS_FILE).write_bytes(b"tampered")
    out = _feed(s, _decision("rollback", 1))
    assert [(c.action, c.policy_version) for c in out.sent] == [("failed", 0)]
    assert eng.loads == [(v1.location, "1")] and s.target == v0  # one poll: only the candidate was applied
    s._retry_at = 0.0  # the back-off after the failure is not under test
    assert not s.reconcile(RecordingProducer()) and s.target == v0 and eng.loads == [(v1.location, "1")]
