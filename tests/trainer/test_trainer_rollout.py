"""Issue 39 (rollout): the trainer with ``rollout.enabled`` and ``trainer.lora`` on the real broker.

A tenant's update is synced once and opens a canary; while it is open the tenant's next batches
are trained but not synced (``held``), also across a restart; a ``promote`` releases the newest
state as the next candidate; a ``rollback`` restores the incumbent adapter's exported weights
(fresh optimizer state) and the next update is synced under a new, higher ``n``. Another tenant's
canary is its own. The decisions are written here as the evaluator would write them; the engines
are the stand-in syncer of ``test_tenants_trainer_stage``."""

from __future__ import annotations

import pytest

from pipeline import events
from pipeline.config import load_config
from pipeline.testing.topics import publish
from tests.trainer.test_tenants_trainer_stage import RUN, StandInSyncer, _ctl, _publish, _run_stage, _steps, _wait


def _config(kafka_config, tmp_path, rollout=None, **trainer):
    base = kafka_config.model_dump(mode="python")
    t = dict(model="tiny-random", rollout_batch_size=2, micro_batch_size=2, lr=1e-2,
             checkpoint_dir=str(tmp_path / "ckpt"), export_dir=str(tmp_path / "weights"), engines=["engine-a"],
             sync_timeout_s=10.0, progress=False, threads=1, run_id=RUN, per_tenant=True, tenant_max_wait_records=1000,
             max_staleness=None, poll_timeout_s=0.2, lora={"rank": 4, "alpha": 8}, keep_exports=1, poison_steps=[2])
    t.update(trainer)
    return load_config(None, kafka=base["kafka"], topics=base["topics"], trainer=t,
                       rollout={"enabled": True, **(rollout or {})})


def _decide(cfg, action: str, tenant: str | None, adapter: dict | None, incumbent: dict | None,
            version: int = 1) -> None:
    """A decision as the evaluator publishes it: about ``tenant``'s ``adapter``, or with ``tenant``
    None about the full weights' ``version``."""
    evidence = {"rule": "newcombe-noninferiority-v1",
                "reason": "non_inferior" if action == "promote" else "reward_fell",
                "config": {"min_n": 400}, "incumbent": incumbent["version"] if incumbent else None,
                "arms": {"candidate": {"reward": [30, 60]}, "incumbent": {"reward": [30, 60]}},
                "bounds": {"reward": [-0.1, 0.1]}}
    v = 0 if tenant is not None else version
    publish(cfg, [events.Control(action=action, epoch=v, policy_version=v, run_id=RUN, tenant=tenant,
                                 adapter=adapter, evidence=evidence)], "control", key=RUN)


def _weights(cfg, tenant: str) -> list[tuple[int, str]]:
    return [(c.policy_version, c.adapter["version"]) for c in _ctl(cfg, tenant) if c.action == "weights"]


def _adapter_tensors(stage, tenant: str) -> dict:
    return {k: v.float() for k, v in stage.policy.lora.hf_tensors(tenant).items()}


@pytest.mark.slow(seconds=180)
def test_a_canary_holds_the_tenants_sync_promote_releases_it_rollback_restores_the_incumbent(kafka_config, tmp_path):
    import torch

    from pipeline.trainer.adapters import adapter_folder
    from pipeline.trainer.lora import read_adapter_folder

    cfg = _config(kafka_config, tmp_path, max_steps=3)
    syncer = StandInSyncer(cfg, lambda ev: [] if (ev.tenant, ev.policy_version) == ("alice", 4) else ["engine-a"])
    try:
        stage, t, errors = _run_stage(cfg)
        _publish(cfg, ["alice", "alice"], 0)
        _steps(stage, 1, errors)
        _publish(cfg, ["alice", "alice", "bob", "bob"], 10)
        t.join(300)
        assert not t.is_alive() and not errors, errors
        recs = stage.log.records()
        a1 = recs[0]["adapter"]
        assert [(r["tenant"], r["policy_version"], r.get("held"), r.get("poisoned"), "adapter" in r) for r in recs] == [
            ("alice", 1, None, None, True),   # synced: alice's canary (A1 against the base) opens
            ("alice", 2, True, True, False),  # trained (poisoned: n=2 is listed), not exported or synced
            ("bob", 1, None, None, True)]     # bob's canary is his own
        assert _weights(cfg, "alice") == [(1, a1["version"])]
        assert stage.adapters.table["alice"].synced == 1 and stage.adapters.table["alice"].updates == 2

        # a restart mid-canary: the held update is restored, still held
        cfg2 = _config(kafka_config, tmp_path, max_steps=6)
        stage, t, errors = _run_stage(cfg2)
        _publish(cfg, ["bob", "bob"], 20)
        recs = _steps(stage, 4, errors)
        assert (recs[3]["tenant"], recs[3].get("held")) == ("bob", True)
        assert _weights(cfg, "alice") == [(1, a1["version"])]  # no sync of alice's n=2 at the restart

        _decide(cfg, "promote", "alice", a1, None)  # the idle trainer releases n=2 as the next candidate
        _wait(lambda: stage.adapters.table["alice"].synced == 2, "alice's n=2 synced after the promote")
        a2 = stage.adapters.table["alice"].published
        assert _weights(cfg, "alice") == [(1, a1["version"]), (2, a2["version"])]
        _publish(cfg, ["alice", "alice"], 30)
        recs = _steps(stage, 5, errors)
        assert (recs[4]["tenant"], recs[4]["policy_version"], recs[4].get("held")) == ("alice", 3, True)

        _decide(cfg, "rollback", "alice", a2, a1)  # alice continues from the incumbent A1
        _wait(lambda: stage.adapters.table["alice"].published == a1, "alice restored to A1")
        _, exported, _ = read_adapter_folder(adapter_folder(tmp_path / "weights", "alice", a1["version"]))
        restored = _adapter_tensors(stage, "alice")
        assert restored.keys() == exported.keys()
        assert all(torch.equal(restored[k], exported[k].float()) for k in exported)
        assert stage.policy.adapter_steps("alice") == 0  # a fresh optimizer state
        assert len(_weights(cfg, "alice")) == 2  # the restored incumbent is not synced again

        _publish(cfg, ["alice", "alice"], 40)  # engine-a stays silent for n=4: resume names the incumbent
        t.join(300)
        assert not t.is_alive() and not errors, errors
    finally:
        syncer.close()
    recs = stage.log.records()
    assert (recs[5]["tenant"], recs[5]["policy_version"], recs[5].get("held")) == ("alice", 4, None)
    a4 = recs[5]["adapter"]
    trained = [i for r in recs for i in r["sample_ids"]]
    assert len(trained) == len(set(trained)) == 12  # every sample once, across the restart mid-canary
    assert _weights(cfg, "alice") == [(1, a1["version"]), (2, a2["version"]), (4, a4["version"])]
    assert a4["version"] not in (a1["version"], a2["version"])
    resume = [c for c in _ctl(cfg, "alice") if c.action == "resume"][-1]
    assert resume.policy_version == 4 and resume.adapter == a1  # previous = the incumbent
    assert [c.policy_version for c in _ctl(cfg, "bob") if c.action == "weights"] == [1]  # bob's canary: still open
    assert (tmp_path / "weights" / "adapters" / "alice" / a1["version"][:16]).is_dir()  # the incumbent's folder kept


@pytest.mark.slow(seconds=120)
def test_full_weights_canary_holds_the_sync_a_promote_releases_it_a_rollback_restores_the_incumbent(kafka_config,
                                                                                                    tmp_path):
    """Without LoRA the scope is the full weights (gated by the eval set): a new run publishes v0,
    the first incumbent; a version's canary holds the next versions' syncs; the next batch after a
    promote first syncs the newest version; a rollback restores the incumbent's export (the held
    v3 is dropped; exactly: tests/trainer/test_trainer_rollback.py) and the next update is v4, a
    new candidate."""
    from pipeline.trainer import checkpoint as C

    gate = {"eval_set": str(tmp_path / "team.jsonl"), "guards": ["accuracy"]}
    cfg = _config(kafka_config, tmp_path, gate, max_steps=4, per_tenant=False, lora=None, engines=[],
                  poison_steps=[])
    full = lambda: [c.policy_version for c in _ctl(cfg) if c.action == "weights" and c.full_weights]  # noqa: E731
    stage, t, errors = _run_stage(cfg)
    _publish(cfg, [None, None], 0)
    _steps(stage, 1, errors)
    _publish(cfg, [None, None], 10)
    recs = _steps(stage, 2, errors)
    assert [(r["policy_version"], r.get("held")) for r in recs] == [(1, None), (2, True)] and full() == [0, 1]
    _decide(cfg, "promote", None, None, None)
    _publish(cfg, [None, None], 20)  # its payload carries the promote: v2 is synced, then v3 trained (held)
    recs = _steps(stage, 3, errors)
    assert recs[2]["policy_version"] == 3 and recs[2].get("held") and full() == [0, 1, 2]
    _decide(cfg, "rollback", None, None, None, version=2)
    _publish(cfg, [None, None], 30)  # its payload carries the rollback: v1 restored, v3 dropped, then v4 trained
    t.join(300)
    assert not t.is_alive() and not errors, errors
    recs = stage.log.records()
    assert recs[3]["policy_version"] == 4 and not recs[3].get("held") and full() == [0, 1, 2, 4]
    assert C.read_synced(tmp_path / "ckpt") == 4
    assert (tmp_path / "weights" / "v000001").is_dir()  # the incumbent's folder: kept (keep_exports=1)


class Killed(BaseException):
    """The trainer process dies here (raised by :func:`_killed_before_resume`)."""


def _killed_before_resume(monkeypatch, version: int) -> None:
    """The trainer is killed when it is about to send the ``resume`` of ``version`` (after its
    ``pause`` and ``weights``): no ``resume``, no ``synced.json`` of it."""
    from pipeline.trainer.sync import WeightPublisher

    send = WeightPublisher._send

    def _send(self, ev):
        if ev.action == "resume" and ev.policy_version == version:
            raise Killed(f"killed before the resume of {version}")
        return send(self, ev)

    monkeypatch.setattr(WeightPublisher, "_send", _send)


def _died(t, errors) -> None:
    t.join(300)
    assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], Killed), errors


def _run_killed(monkeypatch, version: int, cfg, before_death) -> None:
    """Run the trainer until it is killed before the ``resume`` of ``version``; ``before_death(stage,
    errors)`` feeds it meanwhile."""
    with monkeypatch.context() as m:
        _killed_before_resume(m, version)
        stage, t, errors = _run_stage(cfg)
        before_death(stage, errors)
        _died(t, errors)


def _full_config(kafka_config, tmp_path, **trainer):
    gate = {"eval_set": str(tmp_path / "team.jsonl"), "guards": ["accuracy"]}
    return _config(kafka_config, tmp_path, gate, **{"per_tenant": False, "lora": None, "engines": [],
                                                     "poison_steps": [], **trainer})


def _full_ctl(cfg) -> list[tuple[str, int]]:
    return [(c.action, c.policy_version) for c in _ctl(cfg) if c.full_weights and c.tenant is None]


@pytest.mark.slow(seconds=60)
def test_full_weights_killed_between_weights_and_resume_the_restart_resumes_the_candidate(kafka_config, tmp_path,
                                                                                          monkeypatch):
    """The canary of v1 opened (``weights``) but its ``resume`` never came: the serving view holds v1
    as a candidate that is not live. The restarted trainer syncs v1 again (the same order twice is
    no new canary) and ends with v1's ``resume``; v0 is declared once."""
    cfg = _full_config(kafka_config, tmp_path, max_steps=1)
    _run_killed(monkeypatch, 1, cfg, lambda stage, errors: _publish(cfg, [None, None], 0))
    assert _full_ctl(cfg) == [("weights", 0), ("pause", 1), ("weights", 1)]
    stage, t, errors = _run_stage(cfg)  # max_steps reached: it restores and re-syncs only
    t.join(300)
    assert not t.is_alive() and not errors, errors
    assert _full_ctl(cfg) == [("weights", 0), ("pause", 1), ("weights", 1), ("pause", 1), ("weights", 1),
                              ("resume", 1)]
    assert stage.view.scope(None).live and stage.view.scope(None).opened == 1


@pytest.mark.slow(seconds=60)
def test_an_adapter_killed_between_weights_and_resume_the_restart_resumes_the_candidate(kafka_config, tmp_path,
                                                                                        monkeypatch):
    """As for the full weights: alice's candidate A1 was ordered, never resumed; the restart
    syncs A1 again and ends with its ``resume``."""
    cfg = _config(kafka_config, tmp_path, max_steps=1, engines=[], poison_steps=[])
    _run_killed(monkeypatch, 1, cfg, lambda stage, errors: _publish(cfg, ["alice", "alice"], 0))
    a1 = [c.adapter for c in _ctl(cfg, "alice") if c.action == "weights"][0]
    stage, t, errors = _run_stage(cfg)
    t.join(300)
    assert not t.is_alive() and not errors, errors
    assert [(c.action, c.adapter) for c in _ctl(cfg, "alice")] == [("pause", a1), ("weights", a1)] * 2 + [
        ("resume", a1)]
    assert stage.view.scope("alice").live and stage.adapters.table["alice"].published == a1


@pytest.mark.slow(seconds=90)
def test_a_restart_after_a_full_weight_rollback_continues_from_the_restored_incumbent(kafka_config, tmp_path,
                                                                                      monkeypatch):
    """``checkpoint_every: 2``: the checkpoint of step 2 predates the rollback of v1. The step after
    the rollback checkpoints before it exports v3, so a trainer killed in v3's sync restarts from
    v3 (the incumbent v0 plus one update), not from the held v2 of the rolled-back lineage (which
    it would publish as v4), and resumes v3."""
    from pipeline.trainer.stage import export_versions

    cfg = _full_config(kafka_config, tmp_path, max_steps=4, checkpoint_every=2, keep_exports=5)  # 3: not the last

    def feed(stage, errors) -> None:
        _publish(cfg, [None, None], 0)
        _publish(cfg, [None, None], 10)
        assert [r.get("held") for r in _steps(stage, 2, errors)] == [None, True]
        _decide(cfg, "rollback", None, None, None, version=1)
        _publish(cfg, [None, None], 20)  # its payload carries the rollback: v0 restored, v2 dropped, v3 trained

    _run_killed(monkeypatch, 3, cfg, feed)
    assert export_versions(tmp_path / "weights") == [0, 1, 3]
    _publish(cfg, [None, None], 30)  # trained only by a restart from step 2's checkpoint
    stage, t, errors = _run_stage(_full_config(kafka_config, tmp_path, max_steps=3, checkpoint_every=2,
                                               keep_exports=5))
    t.join(300)
    assert not t.is_alive() and not errors, errors
    assert (stage.step, stage.version) == (3, 3)  # not v4: the rolled-back lineage re-published
    assert _full_ctl(cfg)[-3:] == [("pause", 3), ("weights", 3), ("resume", 3)]


@pytest.mark.slow(seconds=90)
def test_killed_between_weights_and_resume_with_an_older_checkpoint_the_restart_supersedes_the_candidate(
        kafka_config, tmp_path, monkeypatch):
    """``checkpoint_every: 2``: v3's sync is killed before its ``resume``, the newest checkpoint is
    step 2's (v2). The restart re-publishes its restored weights as v4 (engines may hold v3): v4's
    order supersedes the never-live candidate v3 and its ``resume`` makes v4 live, instead of
    holding the full weights behind v3 forever; the next update (v5) is held by v4's canary."""
    cfg = _full_config(kafka_config, tmp_path, max_steps=4, checkpoint_every=2, keep_exports=5)

    def feed(stage, errors) -> None:
        for i, version in enumerate((1, 2)):
            _publish(cfg, [None, None], 10 * i)
            _steps(stage, i + 1, errors)
            _decide(cfg, "promote", None, None, None, version=version)
        _publish(cfg, [None, None], 20)  # its payload carries the promote of v2: v3 trained and synced

    _run_killed(monkeypatch, 3, cfg, feed)
    assert _full_ctl(cfg)[-2:] == [("pause", 3), ("weights", 3)]
    _publish(cfg, [None, None], 30)
    stage, t, errors = _run_stage(_full_config(kafka_config, tmp_path, max_steps=3, checkpoint_every=2))
    t.join(300)
    assert not t.is_alive() and not errors, errors
    assert _full_ctl(cfg)[-3:] == [("pause", 4), ("weights", 4), ("resume", 4)]
    assert stage.version == 5 and stage.log.records()[-1].get("held")
    scope = stage.view.scope(None)
    assert (scope.incumbent, scope.candidate, scope.live) == (2, 4, True)
