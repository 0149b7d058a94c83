"""Issue 39 (rollout): :meth:`pipeline.trainer.adapters.TenantAdapters.rollback` on its own, with a
stand-in policy (no broker, no model): which rollbacks restore, to what, and the table after.
The restore of a real adapter from its folder: ``test_trainer_rollout``."""

from __future__ import annotations

from pipeline.config import load_config
from pipeline.trainer.adapters import TenantAdapters, adapter_folder

V1, V2, V3 = "1" * 64, "2" * 64, "3" * 64


class AdapterPolicy:
    """Stands in for the policy's adapter calls; records loads and removals."""

    def __init__(self, names) -> None:
        self.names = set(names)
        self.calls: list = []

    def adapters(self) -> list[str]:
        return sorted(self.names)

    def remove_adapter(self, name: str) -> None:
        self.names.discard(name)
        self.calls.append(("remove", name))

    def load_adapter(self, name: str, folder, sha256=None) -> str:
        self.names.add(name)
        self.calls.append(("load", name, str(folder), sha256))
        return sha256


def _adapters(tmp_path, policy) -> TenantAdapters:
    cfg = load_config(None, trainer=dict(model="tiny-random", per_tenant=True, lora={"rank": 4, "alpha": 8},
                                         export_dir=str(tmp_path / "w"), checkpoint_dir=str(tmp_path / "c")))
    ad = TenantAdapters(cfg, policy, is_main=False)
    s = ad.table["alice"]
    s.updates = 3
    for n, v in ((1, V1), (2, V2)):
        s.versions[v] = n
    s.synced, s.published = 2, {"name": "alice-2", "version": V2, "sha256": V2}
    return ad


def test_a_rollback_to_the_base_gives_a_fresh_adapter_and_nothing_pending(tmp_path):
    policy = AdapterPolicy(["alice", "bob"])
    ad = _adapters(tmp_path, policy)
    assert ad.rollback("alice", V2, None)
    s = ad.table["alice"]
    assert policy.calls == [("remove", "alice")] and policy.adapters() == ["bob"]
    assert (s.updates, s.synced, s.base, s.published) == (3, 3, 3, None)  # n stays; base samples on-policy
    assert ad.table.produced_by("alice", None) == 3


def test_a_rollback_to_an_adapter_loads_its_folder_and_counts_it_as_the_current_update(tmp_path, monkeypatch):
    from pipeline import weightsync

    policy = AdapterPolicy(["alice"])
    ad = _adapters(tmp_path, policy)
    folder = adapter_folder(tmp_path / "w", "alice", V1)
    inc = {"name": "alice-1", "version": V1, "sha256": V1}
    assert not ad.rollback("alice", V2, inc)  # the incumbent's folder is gone: nothing changes
    assert policy.calls == [] and ad.table["alice"].synced == 2
    folder.mkdir(parents=True)
    monkeypatch.setattr(weightsync, "verify_adapter", lambda path, sha=None: sha)
    assert ad.rollback("alice", V2, inc)
    assert policy.calls == [("remove", "alice"), ("load", "alice", str(folder), V1)]
    s = ad.table["alice"]
    assert (s.updates, s.synced, s.published, s.versions[V1]) == (3, 3, inc, 3)


def test_a_rollback_of_an_older_or_unknown_version_changes_nothing(tmp_path):
    policy = AdapterPolicy(["alice"])
    ad = _adapters(tmp_path, policy)
    assert not ad.rollback("alice", V1, None)  # superseded: alice trains on from V2
    assert not ad.rollback("alice", V3, None)
    assert not ad.rollback("carol", V3, None) and "carol" not in ad.table.tenants
    assert policy.calls == [] and ad.table["alice"].synced == 2


def test_the_other_tp_ranks_follow_rank_0s_verdict(tmp_path):
    """A TP rank other than 0 does not record exported versions: it restores when rank 0 did."""
    policy = AdapterPolicy(["alice"])
    ad = _adapters(tmp_path, policy)
    ad.table["alice"].versions.clear()  # as on a rank other than 0
    assert not ad.rollback("alice", V2, None, decided=False) and policy.calls == []
    assert ad.rollback("alice", V2, None, decided=True)
    assert policy.calls == [("remove", "alice")] and ad.table["alice"].synced == 3


# ---- the full weights: TrainerStage._rollback_full with a real policy (tiny-random, Megatron) ----

RUNTIME_SETTINGS = {"threads": 1}


def _full_stage(tmp_path, runtime, engines=(), **rollout):
    """A :class:`TrainerStage` of full weights with rollout on (eval-set gated; ``rollout``: more
    settings), its policy built on ``runtime`` (no broker: the decision is handed to
    ``_apply_actions`` as the reader would)."""
    from pathlib import Path

    from pipeline.testing.trainer import policy_trainer
    from pipeline.trainer.stage import TrainerStage

    cfg = load_config(None, trainer=dict(model="tiny-random", export_dir=str(tmp_path / "w"),
                                         checkpoint_dir=str(tmp_path / "c"), engines=list(engines)),
                      rollout={"enabled": True, "eval_set": str(tmp_path / "team.jsonl"), "guards": ["accuracy"],
                               **rollout},
                      proxy={"canary_engine_url": "http://x:1"} if rollout.get("canary_engines") else {})
    stage = TrainerStage(cfg)
    stage.par, stage.policy = runtime, policy_trainer(runtime)
    stage.export_dir, stage.ckpt_dir = Path(cfg.trainer.export_dir), Path(cfg.trainer.checkpoint_dir)
    return stage


def _train(stage, seed: int) -> None:
    import random

    from pipeline import events

    rng = random.Random(seed)
    batch = [events.Sample(sample_id=f"r{seed}:{i}", session_id=f"r{seed}{i}", turn_index=0,
                           tokens=[rng.randrange(1, 49152) for _ in range(10)], response_length=4,
                           reward=1.0 if i % 2 else -1.0, rollout_log_probs=[-1.0] * 4) for i in range(4)]
    assert not stage.policy.train_batch(batch).skipped
    stage.version += 1


def test_a_full_weight_rollback_restores_the_incumbents_export_exactly(tmp_path, runtime):
    import torch

    from pipeline import weightsync
    from pipeline.testing.trainer import param_copies
    from pipeline.trainer import checkpoint as C

    stage = _full_stage(tmp_path, runtime)
    incumbent = stage.policy.export(stage.export_dir / "v000000")  # the first incumbent, as a new run publishes it
    v0 = param_copies(stage.policy)
    _train(stage, 1)
    stage.policy.export(stage.export_dir / "v000001")  # the candidate
    _train(stage, 2)  # v2: held during the canary
    trained = param_copies(stage.policy)
    assert any(not torch.equal(v0[k], trained[k]) for k in v0)
    opt = stage.policy.trainables[None].optimizer
    assert stage.policy.optimizer_steps == 2 and getattr(opt, "optimizer", opt).state  # Adam moments to drop
    actions = [("rollback", None, 0, 0)]  # not the newest export: nothing to restore
    stage._apply_actions(actions)
    assert actions[0][4] is False and all(torch.equal(trained[k], v) for k, v in param_copies(stage.policy).items())
    assert not stage._checkpoint_due
    actions = [("rollback", None, 1, 0)]
    stage._apply_actions(actions)
    assert actions[0][4] is True  # rank 0's verdict, which the other TP ranks follow
    assert stage._checkpoint_due  # the next step checkpoints the restored state before it exports
    after = param_copies(stage.policy)
    assert all(torch.equal(v0[k], after[k]) for k in v0)  # the incumbent's tensors, exactly
    again = stage.policy.export(tmp_path / "again")
    assert again.sha256 == incumbent.sha256 == weightsync.verify_folder(stage.export_dir / "v000000")
    assert not getattr(opt, "optimizer", opt).state  # fresh Adam moments
    assert stage.version == 2 and C.read_synced(stage.ckpt_dir) == 2  # counts on: the next update is v3
    stage._release()  # the restored incumbent is served already: nothing to export or sync
    assert sorted(p.name for p in stage.export_dir.iterdir()) == ["v000000", "v000001"]


def test_a_full_weight_rollback_without_a_good_incumbent_folder_changes_nothing(tmp_path, runtime):
    import torch

    from pipeline import weightsync
    from pipeline.testing.trainer import param_copies

    stage = _full_stage(tmp_path, runtime)
    stage.policy.export(stage.export_dir / "v000000")
    _train(stage, 3)
    stage.policy.export(stage.export_dir / "v000001")
    (stage.export_dir / "v000000" / weightsync.WEIGHTS_FILE).write_bytes(b"torn")
    before = param_copies(stage.policy)
    assert not stage._rollback_full(1, 0)
    assert not stage._rollback_full(1, 0, decided=False)  # another rank follows rank 0's "no"
    assert all(torch.equal(before[k], v) for k, v in param_copies(stage.policy).items())


class DeclareRecorder:
    """Stands in for the stage's publisher: records ``declare`` calls."""

    def __init__(self) -> None:
        self.declared: list = []

    def declare(self, version: int, location: str, sha256: str) -> None:
        self.declared.append((version, location, sha256))


def test_v0_is_declared_unless_control_holds_its_order_even_when_its_folder_exists(tmp_path, runtime):
    """A trainer killed between exporting ``v000000`` and declaring it: the restart declares v0
    (reusing the folder); one whose ``control`` holds a ``weights`` order of v0 declares nothing."""
    from types import SimpleNamespace

    from pipeline import weightsync

    stage = _full_stage(tmp_path, runtime)
    stage.publisher, stage.commands = DeclareRecorder(), SimpleNamespace(full_orders={})
    stage._export({})  # the killed run's export: v000000 exists, no order on control
    sha = weightsync.verify_folder(stage.export_dir / "v000000")
    stage._publish_incumbent()
    assert stage.publisher.declared == [(0, str((stage.export_dir / "v000000").resolve()), sha)]
    stage.publisher, stage.commands = DeclareRecorder(), SimpleNamespace(full_orders={0: 0})
    stage._publish_incumbent()
    assert stage.publisher.declared == []


class SyncRecorder:
    """Stands in for the stage's publisher with ``rollout.canary_engines``: records the waits for
    the incumbent and the syncs, in order."""

    def __init__(self, config) -> None:
        from pipeline.trainer.sync import WeightPublisher

        self.config, self.cfg, self.calls = config, config.trainer, []
        self.engines_for = WeightPublisher.engines_for.__get__(self)

    def await_applied(self, version, offset, engines, stop=None):
        self.calls.append(("await_applied", version, offset, engines))

    def sync(self, version, location, sha256, stop=None, engines=None):
        from pipeline.trainer.sync import SyncReport

        self.calls.append(("sync", version, engines))
        return SyncReport(version)


def test_a_candidate_sync_waits_first_for_the_promoted_incumbent_on_the_engines_outside_the_canary(tmp_path,
                                                                                                   runtime):
    """``rollout.canary_engines``: after a ``promote`` of v2 the engines outside the canary apply v2
    on their own; the next candidate's sync first waits for their ``applied`` of v2 (read from v2's
    order on; its timeout: ``test_trainer_sync.py``). While v0, declared, is the incumbent there is
    nothing to wait for."""
    from types import SimpleNamespace

    from pipeline.rollout.serving import ServingView

    stage = _full_stage(tmp_path, runtime, engines=["engine-0", "engine-1"], canary_engines=["engine-1"])
    stage.publisher, stage.view = SyncRecorder(stage.config), ServingView()
    stage.commands = SimpleNamespace(full_orders={0: 0, 2: 7})  # v2's order at offset 7
    stage.version = 1
    stage._export_and_sync({})
    assert stage.publisher.calls == [("sync", 1, ["engine-1"])]
    stage.view.scopes[None].incumbent, stage.version = 2, 3
    stage.publisher.calls.clear()
    stage._export_and_sync({})
    assert stage.publisher.calls == [("await_applied", 2, 7, ["engine-0"]), ("sync", 3, ["engine-1"])]
