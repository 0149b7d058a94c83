"""Issue 28 (tenants): the trainer stage with ``trainer.lora`` on the real broker: two tenants'
samples train two adapters, each update is synced on ``control`` (docs/tenants.md, "Adapter
sync"), commands act between steps, and a restart resumes every tenant's state.

The engines' side is a stand-in syncer written here (``StandInSyncer``: test code, not the
project's syncer): it verifies each adapter folder the trainer names and answers ``applied`` for
the engines it plays; an engine it does not play stays silent."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from pipeline import events, weightsync
from pipeline.bus import EventProducer, TopicReader
from pipeline.config import load_config
from pipeline.testing.topics import publish, read_events

RUN = "t28-run"


def _config(kafka_config, tmp_path, **trainer):
    base = kafka_config.model_dump(mode="python")
    t = dict(model="tiny-random", rollout_batch_size=2, micro_batch_size=2, lr=1e-2, checkpoint_dir=str(tmp_path / "ckpt"),
             export_dir=str(tmp_path / "weights"), engines=["engine-a"], sync_timeout_s=60.0, progress=False,
             threads=1, run_id=RUN, per_tenant=True, tenant_max_wait_records=1000, max_staleness=None,
             poll_timeout_s=0.2, lora={"rank": 4, "alpha": 8})
    t.update(trainer)
    return load_config(None, kafka=base["kafka"], topics=base["topics"], trainer=t)


def _sample(i: int, tenant: str | None) -> events.Sample:
    toks = [(i * 7 + j) % 500 + 1 for j in range(10)]
    sid = f"s{i}:0:rl"
    return events.Sample(sample_id=f"{tenant}/{sid}" if tenant else sid, session_id=f"s{i}", turn_index=0, tokens=toks,
                         response_length=4, rollout_log_probs=[-2.0] * 4, reward=(-1.0) ** i, tenant=tenant)


def _publish(cfg, tenants: list[str | None], start: int) -> list[events.Sample]:
    out = [_sample(start + i, t) for i, t in enumerate(tenants)]
    publish(cfg, out, "samples", key="one")  # one partition: batches are released in this order
    return out


class StandInSyncer:
    """Test code standing in for the engines' syncers: for each adapter ``weights`` record of the
    run it verifies the folder against the adapter's version and answers ``applied`` as each
    engine of ``plays(record)`` (an engine left out stays silent); a folder that does not verify
    is an error of the test. ``seen``: (tenant, version) it verified. ``start``: where it starts
    reading ``control`` (a restarted stack's syncers already answered the earlier records)."""

    def __init__(self, cfg, plays, start: str = "beginning") -> None:
        self.cfg, self.plays, self.start = cfg, plays, start
        self.errors: list = []
        self.stop = threading.Event()
        self.seen: list[tuple[str, str]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        producer = EventProducer(self.cfg, name="stand-in-syncer")
        with TopicReader(self.cfg, self.cfg.topics.name("control"), self.start, name="stand-in") as reader:
            while not self.stop.is_set():
                for rec in reader.poll(200):
                    ev = getattr(rec, "event", None)
                    if not isinstance(ev, events.Control) or ev.action != "weights" or ev.adapter is None:
                        continue
                    try:
                        weightsync.verify_adapter(ev.location, ev.adapter["version"])
                    except (OSError, ValueError) as e:
                        self.errors.append(e)
                        continue
                    self.seen.append((ev.tenant, ev.adapter["version"]))
                    for engine in self.plays(ev):
                        producer.send(self.cfg.topics.name("control"), events.Control(
                            action="applied", epoch=ev.epoch, policy_version=ev.policy_version, run_id=ev.run_id,
                            engine_id=engine, tenant=ev.tenant, adapter=ev.adapter, sha256=ev.sha256), key=RUN)
                producer.flush(10)
        producer.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(20)
        assert not self.errors, self.errors


def _wait(cond, what: str, timeout_s: float = 240.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"never reached: {what}")


def _run_stage(cfg):
    """``TrainerStage(cfg).run()`` in a thread (inside a Megatron runtime); returns (stage, thread, errors)."""
    from pipeline.testing.trainer import megatron_runtime
    from pipeline.trainer.stage import TrainerStage

    stage = TrainerStage(cfg)
    errors: list = []

    def body():
        try:
            with megatron_runtime(tp=1, threads=1):
                stage.run(install_signals=False)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return stage, t, errors


def _steps(stage, n: int, errors: list):
    def done():
        assert not errors, errors
        recs = stage.log.records() if stage.log.path else []
        return recs if len(recs) >= n else None

    return _wait(lambda: done(), f"{n} step records")


def _ctl(cfg, tenant=None):
    return [c for c in read_events(cfg, "control", settle_s=0.3) if c.run_id == RUN and (tenant is None or
                                                                                        c.tenant == tenant)]


@pytest.mark.slow(seconds=120)
def test_two_tenants_train_two_adapters_each_synced_and_a_silent_engine_keeps_the_previous(kafka_config, tmp_path):
    cfg = _config(kafka_config, tmp_path, engines=["engine-a", "engine-b"], sync_timeout_s=4.0, max_steps=4,
                  keep_exports=1)
    # engine-b answers only a tenant's first update: alice's second meets a silent engine-b
    syncer = StandInSyncer(cfg, lambda ev: ["engine-a", "engine-b"] if ev.policy_version == 1 else ["engine-a"])
    sent = _publish(cfg, ["alice", "alice", "bob", "bob", None, None, "alice", "alice"], 0)
    try:
        stage, t, errors = _run_stage(cfg)
        t.join(300)
        assert not t.is_alive() and not errors, errors
    finally:
        syncer.close()
    recs = stage.log.records()
    assert [(r["tenant"], r["skipped"], r["policy_version"]) for r in recs] == [
        ("alice", False, 1), ("bob", False, 1), (None, True, 0), ("alice", False, 2)]
    assert recs[2]["no_tenant_samples"] == 2 and recs[2]["train_samples"] == 0 and "adapter" not in recs[2]
    by_tenant: dict = {}
    for r in recs:
        assert all(i.startswith(f"{r['tenant']}/") if r["tenant"] else "/" not in i for i in r["sample_ids"])
        by_tenant.setdefault(r["tenant"], []).extend(r["sample_ids"])
    assert not set(by_tenant["alice"]) & set(by_tenant["bob"])
    assert sorted(i for ids in by_tenant.values() for i in ids) == sorted(s.sample_id for s in sent)  # each once
    a1, b1, a2 = recs[0]["adapter"], recs[1]["adapter"], recs[3]["adapter"]
    assert len({a1["version"], b1["version"], a2["version"]}) == 3
    for tenant, ad in (("alice", a1), ("bob", b1), ("alice", a2)):
        folder = tmp_path / "weights" / "adapters" / tenant / ad["version"][:16]
        assert weightsync.verify_adapter(folder, ad["version"]) == ad["version"]
        assert ad["name"] == events.adapter_name(tenant, ad["version"])
        assert ad["sha256"] == weightsync.sha256_file(folder / weightsync.ADAPTER_FILE)
    assert sorted(stage.policy.adapters()) == ["alice", "bob"]
    # keep_exports=1, but alice's resume still names v1: both of her folders stay
    assert {p.name for p in (tmp_path / "weights" / "adapters" / "alice").iterdir()} == {
        a1["version"][:16], a2["version"][:16]}
    # control: one sync per update, every record naming its tenant; no full-weights sync at all
    ctl = _ctl(cfg)
    assert all(c.tenant in ("alice", "bob") for c in ctl)
    alice = [(c.action, c.policy_version, c.engine_id, (c.adapter or {}).get("version")) for c in _ctl(cfg, "alice")]
    v1, v2 = a1["version"], a2["version"]
    assert alice[:2] == [("pause", 1, None, v1), ("weights", 1, None, v1)]
    assert sorted(alice[2:4]) == [("applied", 1, "engine-a", v1), ("applied", 1, "engine-b", v1)]
    assert alice[4] == ("resume", 1, None, v1)  # every engine applied: the new adapter
    assert alice[5:7] == [("pause", 2, None, v2), ("weights", 2, None, v2)]
    assert sorted(alice[7:9]) == [("applied", 2, "engine-a", v2), ("failed", 2, "engine-b", v2)]
    assert alice[9] == ("resume", 2, None, v1)  # engine-b is silent: alice stays on her previous adapter
    assert len(alice) == 10 and recs[3]["sync_failed"].keys() == {"engine-b"}
    bob = [(c.action, (c.adapter or {}).get("version")) for c in _ctl(cfg, "bob")]
    assert bob[0] == ("pause", b1["version"]) and bob[-1] == ("resume", b1["version"]) and len(bob) == 5
    weights = [c for c in ctl if c.action == "weights"]
    assert all(c.sha256 == c.adapter["sha256"] and c.location.endswith(c.adapter["version"][:16]) for c in weights)
    assert Counter(tv for tv in syncer.seen) == Counter((c.tenant, c.adapter["version"]) for c in weights)
    steps = [e for e in read_events(cfg, "metrics", want=4, settle_s=0.3) if isinstance(e, events.TrainStep)]
    assert [(e.tenant, (e.adapter or {}).get("version")) for e in steps] == [
        ("alice", v1), ("bob", b1["version"]), (None, None), ("alice", v2)]


def _cli(cfg, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "adapters", *args, "--bootstrap",
                           cfg.kafka.bootstrap_servers, "--set", f"topics.prefix={cfg.topics.prefix}",
                           "--set", f"trainer.run_id={RUN}"], capture_output=True, text=True, timeout=120)


def _command(cfg, action: str, tenant: str) -> None:
    publish(cfg, [events.Control(action=action, epoch=0, policy_version=0, run_id=RUN, tenant=tenant)], "control",
            key=RUN)


@pytest.mark.slow(seconds=150)
def test_commands_freeze_reset_delete_export_and_a_restart(kafka_config, tmp_path):
    from pipeline.trainer.adapters import tenant_dir
    from pipeline.trainer.adapters_cli import export

    cfg = _config(kafka_config, tmp_path, max_steps=6, keep_exports=1)
    syncer = StandInSyncer(cfg, lambda ev: ["engine-a"])
    try:
        stage, t, errors = _run_stage(cfg)
        _publish(cfg, ["alice", "alice", "bob", "bob"], 0)
        _steps(stage, 2, errors)
        r = _cli(cfg, "freeze", "--tenant", "alice")  # the real CLI publishes the command
        assert r.returncode == 0, r.stderr
        _publish(cfg, ["alice", "alice", "bob", "bob"], 10)
        recs = _steps(stage, 4, errors)
        assert [(r["tenant"], r["skipped"], r.get("frozen_samples")) for r in recs[2:4]] == [
            ("alice", True, 2.0), ("bob", False, None)]
        assert stage.policy.adapter_steps("alice") == 1  # frozen: not trained
        out = tmp_path / "alice-export"
        exported = export(read_events(cfg, "control", settle_s=0.3), "alice", RUN, out)
        assert exported == recs[0]["adapter"] and weightsync.verify_adapter(out) == exported["version"]
        _command(cfg, "unfreeze", "alice")
        _command(cfg, "reset", "alice")
        _command(cfg, "delete", "bob")
        _publish(cfg, ["alice", "alice", "bob", "bob"], 20)
        recs = _steps(stage, 6, errors)
        t.join(120)
        assert not t.is_alive() and not errors, errors
    finally:
        syncer.close()
    assert [(r["tenant"], r["skipped"], r["policy_version"]) for r in recs[4:]] == [("alice", False, 2),
                                                                                     ("bob", False, 3)]
    assert stage.policy.adapter_steps("alice") == 1  # reset: a fresh adapter and optimizer state, one step on it
    resets = [(c.tenant, c.adapter) for c in _ctl(cfg) if c.action == "resume" and c.adapter is None]
    assert resets == [("alice", None), ("bob", None)]
    bob_folders = sorted(p.name for p in tenant_dir(tmp_path / "weights", "bob").iterdir())
    assert bob_folders == [recs[5]["adapter"]["version"][:16]]  # delete removed bob's older ones
    r = _cli(cfg, "export", "--tenant", "carol", "--out", str(tmp_path / "none"))
    assert r.returncode == 1 and "has no adapter" in r.stderr and not (tmp_path / "none").exists()

    # restart: every tenant's state comes back, and nothing is trained twice
    trained_before = [i for r in recs for i in r["sample_ids"] if not r["skipped"]]
    cfg2 = _config(kafka_config, tmp_path, max_steps=8, keep_exports=1)
    syncer = StandInSyncer(cfg2, lambda ev: ["engine-a"], start="end")
    try:
        stage2, t, errors = _run_stage(cfg2)
        _command(cfg2, "reset", "carol")  # no sample is coming: applied while the trainer waits for one
        _wait(lambda: [c for c in _ctl(cfg2, "carol") if c.action == "resume" and c.adapter is None], "carol's resume")
        assert len(stage2.log.records()) == 6  # no step was taken for it
        _command(cfg2, "freeze", "bob")
        _publish(cfg2, ["alice", "alice", "bob", "bob"], 30)
        recs2 = _steps(stage2, 8, errors)
        t.join(120)
        assert not errors, errors
    finally:
        syncer.close()
    table = stage2.adapters.table
    assert (table.updates("alice"), table.updates("bob")) == (3, 3) and table["bob"].frozen
    assert table["alice"].published == recs2[6]["adapter"] and table["bob"].published == recs[5]["adapter"]
    assert [(r["tenant"], r["skipped"]) for r in recs2[6:]] == [("alice", False), ("bob", True)]
    trained = Counter(trained_before + [i for r in recs2[6:] for i in r["sample_ids"] if not r["skipped"]])
    assert max(trained.values()) == 1 and len(trained) == 12  # 16 sent: alice 2 and bob 2 frozen
    alice_folders = [p.name for p in (tmp_path / "weights" / "adapters" / "alice").iterdir()]
    assert alice_folders == [recs2[6]["adapter"]["version"][:16]]  # keep_exports=1: older ones pruned


@pytest.mark.slow(seconds=90)
def test_killed_during_an_adapter_sync_the_restart_syncs_it_again(kafka_config, tmp_path):
    import os
    import signal

    cfg = _config(kafka_config, tmp_path, max_steps=1, sync_timeout_s=600.0)
    _publish(cfg, ["alice", "alice"], 0)
    cmd = [sys.executable, "-m", "pipeline", "trainer", "--model", "tiny-random", "--batch-size", "2", "--max-steps",
           "1", "--checkpoint-dir", str(tmp_path / "ckpt"), "--export-dir", str(tmp_path / "weights"), "--engines",
           "engine-a", "--threads", "1", "--no-progress", "--bootstrap", cfg.kafka.bootstrap_servers,
           "--log-level", "WARNING"]
    for k, v in (("topics.prefix", cfg.topics.prefix), ("trainer.run_id", RUN), ("trainer.per_tenant", "true"),
                 ("trainer.lora.rank", "4"), ("trainer.lora.alpha", "8"), ("trainer.lr", "0.01"),
                 ("trainer.max_staleness", "null"), ("trainer.poll_timeout_s", "0.2"), ("trainer.sync_timeout_s", "600")):
        cmd += ["--set", f"{k}={v}"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:  # no engine answers: the trainer waits in the sync; killed once its weights record is out
        weights = _wait(lambda: [c for c in _ctl(cfg, "alice") if c.action == "weights"] or
                        (proc.poll() is not None and pytest.fail(proc.stdout.read()[-3000:])), "alice's weights")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    adapter = weights[0].adapter
    assert [c.action for c in _ctl(cfg, "alice")] == ["pause", "weights"]  # never resumed
    syncer = StandInSyncer(cfg, lambda ev: ["engine-a"])
    try:
        stage, t, errors = _run_stage(cfg)  # max_steps reached: it only restores and re-syncs
        t.join(120)
        assert not t.is_alive() and not errors, errors
    finally:
        syncer.close()
    alice = [(c.action, c.engine_id, (c.adapter or {}).get("version")) for c in _ctl(cfg, "alice")]
    v = adapter["version"]
    ours = [a for a in alice if a[0] != "applied"]  # the stand-in answers both weights records
    assert ours == [("pause", None, v), ("weights", None, v), ("pause", None, v), ("weights", None, v),
                    ("resume", None, v)]  # the same content, synced again, and now resumed
    assert ("applied", "engine-a", v) in alice
    assert stage.adapters.table["alice"].published == adapter and stage.adapters.table["alice"].synced == 1
    assert [p.name for p in (tmp_path / "weights" / "adapters" / "alice").iterdir()] == [v[:16]]  # reused


@pytest.mark.slow(seconds=150)
def test_adapters_through_the_stage_under_torchrun_tp2(kafka_config, tmp_path):
    """``torchrun -m pipeline trainer --tp 2`` with ``trainer.lora``: rank 0's tenant and commands
    reach both ranks (a ``reset`` removes the adapter on each: both shards of the checkpoint hold a
    fresh adapter with one optimizer step), the export gathers both halves of each adapter."""
    import json

    from tests.trainer.torchrun import torchrun_two

    cfg = _config(kafka_config, tmp_path)
    _publish(cfg, ["alice", "alice", "bob", "bob", None, None], 0)
    args = ["-m", "pipeline", "trainer", "--tp", "2", "--model", "tiny-random", "--batch-size", "2", "--max-steps", "3",
            "--engines", "", "--threads", "1", "--no-progress", "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--export-dir", str(tmp_path / "weights"), "--bootstrap", cfg.kafka.bootstrap_servers, "--log-level",
            "WARNING"]
    for k, v in (("topics.prefix", cfg.topics.prefix), ("trainer.run_id", RUN), ("trainer.per_tenant", "true"),
                 ("trainer.lora.rank", "4"), ("trainer.lora.alpha", "8"), ("trainer.lr", "0.01"),
                 ("trainer.max_staleness", "null"), ("trainer.poll_timeout_s", "0.2")):
        args += ["--set", f"{k}={v}"]
    torchrun_two(args, timeout_s=300)
    _command(cfg, "reset", "alice")
    _publish(cfg, ["alice", "alice"], 10)
    torchrun_two([*args[:args.index("--max-steps") + 1], "4", *args[args.index("--max-steps") + 2:]], timeout_s=300)
    recs = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["tenant"], r["skipped"], r["policy_version"]) for r in recs] == [
        ("alice", False, 1), ("bob", False, 1), (None, True, 0), ("alice", False, 2)]
    for r in (recs[0], recs[1], recs[3]):
        folder = tmp_path / "weights" / "adapters" / r["tenant"] / r["adapter"]["version"][:16]
        assert weightsync.verify_adapter(folder, r["adapter"]["version"]) == r["adapter"]["version"]
    meta = json.loads((tmp_path / "ckpt" / "step_00000004" / "meta.json").read_text())
    assert meta["tenants"]["alice"]["updates"] == 2 and meta["tenants"]["alice"]["base"] == 1
    assert list(meta["tenants"]["alice"]["versions"].values()) == [2]  # reset forgot the first version
    import torch

    for shard in ("tp00.pt", "tp01.pt"):
        state = torch.load(tmp_path / "ckpt" / "step_00000004" / shard, weights_only=False)
        assert {n: a["steps"] for n, a in state["adapters"].items()} == {"alice": 1, "bob": 1}, shard
