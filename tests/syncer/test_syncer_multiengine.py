"""Syncers of a full-weight canary over several engines (``rollout.canary_engines``, docs/rollout.md
"Full-weight canaries over several engines"): the canary engine applies the candidate at its
``weights`` order and re-applies the incumbent at its ``rollback``; an engine outside the canary
never applies a candidate while its canary is open, applies the promoted version's own order at
its ``promote`` (verified, ``applied`` published), and a restarted syncer reconciles each engine
to what it must serve (the incumbent; the live candidate on a canary engine).

The real :class:`pipeline.syncer.Syncer` driven with the records (no broker), as in
``test_syncer_fullweights_rollout.py`` (whose stand-in engine and helpers this reuses)."""

from __future__ import annotations

import pytest

from pipeline.config import Config
from tests.syncer.test_syncer_fullweights_rollout import _decision, _Engine, _export, _feed, _resume
from tests.syncer.syncing import RecordingProducer, syncer_maker


def _config(engine_id: str) -> Config:
    return Config().replace(trainer={"engines": ["engine-0", "engine-1"]},
                            rollout={"enabled": True, "canary_engines": ["engine-1"]},
                            proxy={"canary_engine_url": "http://127.0.0.1:30001"},
                            syncer={"engine_id": engine_id, "retries": 0})


@pytest.fixture
def syncer():
    """``make(engine_id, engine)``: the syncer of ``engine_id`` calling the stand-in ``engine``."""
    with syncer_maker() as make:
        yield lambda engine_id, engine: make(_config(engine_id), engine)


def test_outside_the_canary_a_candidate_waits_for_its_promote_and_a_rollback_loads_nothing(syncer, tmp_path):
    v0, v1, v2 = (_export(tmp_path / "weights", v) for v in (0, 1, 2))
    eng = _Engine()
    s = syncer("engine-0", eng)
    assert not s.takes_candidate
    _feed(s, v0, _resume(0))  # the first incumbent's own order: every engine applies it
    assert eng.loads == [(v0.location, "0")]
    assert _feed(s, v1, _resume(1)).sent == [] and eng.loads == [(v0.location, "0")]  # v1's canary: not here
    assert _feed(s, _decision("rollback", 1)).sent == [] and eng.version == "0"  # still the incumbent
    assert _feed(s, v2, _resume(2)).sent == [] and eng.version == "0"
    out = _feed(s, _decision("promote", 2))  # now this engine serves v2: its own order, verified
    assert eng.loads[-1] == (v2.location, "2") and s.target == v2 and s.in_sync.is_set()
    assert [(c.action, c.policy_version, c.engine_id, c.sha256) for c in out.sent] == [
        ("applied", 2, "engine-0", v2.sha256)]


def test_the_canary_engine_takes_the_candidate_and_re_applies_the_incumbent_on_rollback(syncer, tmp_path):
    v0, v1, v2 = (_export(tmp_path / "weights", v) for v in (0, 1, 2))
    eng = _Engine()
    s = syncer("engine-1", eng)
    assert s.takes_candidate
    _feed(s, v0, _resume(0))
    out = _feed(s, v1)
    assert eng.loads[-1] == (v1.location, "1") and [(c.action, c.policy_version) for c in out.sent] == [("applied", 1)]
    out = _feed(s, _resume(1), _decision("rollback", 1))
    assert eng.loads[-1] == (v0.location, "0") and [(c.action, c.policy_version) for c in out.sent] == [("applied", 0)]
    _feed(s, v2, _resume(2))
    loads = len(eng.loads)
    assert _feed(s, _decision("promote", 2)).sent == [] and len(eng.loads) == loads  # it serves v2 already


@pytest.mark.parametrize("engine_id, want", [("engine-0", 0), ("engine-1", 1)])
def test_a_restarted_syncer_reconciles_to_what_its_engine_must_serve(syncer, tmp_path, engine_id, want):
    """Mid-canary (v1 live on the canary engine): the canary engine's syncer reconciles to v1, the
    other's to the incumbent v0, whatever ``published.json`` (v1, the newest export) says."""
    v0, v1 = (_export(tmp_path / "weights", v) for v in (0, 1))
    eng = _Engine()
    eng.version = "7"  # the engine restarted on something else
    s = syncer(engine_id, eng)
    for ev in (v0, _resume(0), v1, _resume(1)):  # what scan_control folds at start
        s.tenants.see_full(ev)
    s.target = s.tenants.full_target(v1, s.takes_candidate)
    assert s.target == (v0, v1)[want]
    p = RecordingProducer()
    assert s.reconcile(p)
    assert eng.loads == [(s.target.location, str(want))]
    assert [(c.action, c.policy_version) for c in p.sent] == [("applied", want)]
