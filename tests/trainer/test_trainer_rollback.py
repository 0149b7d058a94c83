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
