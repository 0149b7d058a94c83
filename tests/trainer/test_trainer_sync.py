"""Trainer stage + syncer + engine over a real broker: a real step, its weights served after the sync."""

from __future__ import annotations

import asyncio
import threading


from pipeline import events
from pipeline.bus import EventProducer
from pipeline.config import load_config
from pipeline.testing.topics import publish


def _config(kafka_config, tmp_path, **trainer):
    base = kafka_config.model_dump(mode="python")
    t = dict(model="tiny-random", rollout_batch_size=2, micro_batch_size=2, lr=1e-3, max_steps=1,
             checkpoint_dir=str(tmp_path / "ckpt"), export_dir=str(tmp_path / "weights"), engines=["engine-0"],
             sync_timeout_s=60.0, progress=False, threads=1, run_id="test-run")
    t.update(trainer)
    return load_config(None, kafka=base["kafka"], topics=base["topics"], trainer=t)


def _control_log(config, timeout_s: float = 10.0, want: int = 1) -> list[events.Control]:
    from pipeline.testing.topics import read_events

    return read_events(config, "control", want, timeout_s, settle_s=0.2)


async def _sample_from_engine(url, prompt, seed, temperature=1.0, n=12):
    from pipeline.engine_api.client import EngineClient

    async with EngineClient(url, timeout_s=60) as eng:
        out = await eng.generate(prompt, sampling_params={"max_new_tokens": n, "temperature": temperature,
                                                          "sampling_seed": seed}, return_logprob=True)
        mi = out["meta_info"]
        ids = [e[1] for e in mi["output_token_logprobs"]]
        lps = [e[0] for e in mi["output_token_logprobs"]]
        return ids, lps


async def _score(url, tokens, start):
    from pipeline.engine_api.client import EngineClient

    async with EngineClient(url, timeout_s=60) as eng:
        return await eng.score(tokens, start), await eng.weight_version()


def test_training_step_raises_positive_response_logprob_on_the_engine(kafka_config, tmp_path):
    from pipeline.testing.engine import running_engine
    from pipeline.syncer import Syncer
    from pipeline.trainer.stage import TrainerStage
    from pipeline.testing.trainer import megatron_runtime

    cfg = _config(kafka_config, tmp_path)
    cfg = cfg.replace(syncer={"engine_id": "engine-0"})
    cfg = cfg.replace(syncer={"retry_backoff_s": 0.2})
    with running_engine("tiny-random", threads=1) as url:
        cfg = cfg.replace(syncer={"engine_url": url})
        prompt = list(range(100, 130))
        good, good_lp = asyncio.run(_sample_from_engine(url, prompt, seed=1))
        bad, bad_lp = asyncio.run(_sample_from_engine(url, prompt, seed=2))
        samples = [
            events.Sample(sample_id=f"s:{i}:rl", session_id=f"s{i}", turn_index=0, tokens=prompt + resp,
                          response_length=len(resp), rollout_log_probs=lp, reward=r, policy_version=0)
            for i, (resp, lp, r) in enumerate([(good, good_lp, 1.0), (bad, bad_lp, -1.0)])]
        publish(cfg, samples, "samples")
        syncer = Syncer(cfg)
        t = threading.Thread(target=syncer.run, daemon=True)
        t.start()
        try:
            with megatron_runtime(tp=1, threads=1):
                stage = TrainerStage(cfg)
                assert stage.run(install_signals=False) == 0
        finally:
            syncer.stop.set()
            t.join(20)
        assert syncer.applied == [1]
        after_good, version = asyncio.run(_score(url, prompt + good, len(prompt)))
        after_bad, _ = asyncio.run(_score(url, prompt + bad, len(prompt)))
    assert version == "1"
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean(after_good) > mean(good_lp) + 1e-3, (mean(after_good), mean(good_lp))
    assert mean(after_bad) < mean(bad_lp) - 1e-3, (mean(after_bad), mean(bad_lp))
    rec = stage.log.records()[-1]
    assert rec["step"] == 1 and rec["policy_version"] == 1 and rec["sync_applied"] == ["engine-0"]
    assert sorted(rec["sample_ids"]) == ["s:0:rl", "s:1:rl"]
    assert rec["logprob_abs_diff"] < 1e-4  # trainer vs engine log-probs on identical weights
    ctl = [(c.action, c.engine_id) for c in _control_log(cfg, want=4) if c.run_id == "test-run"]
    assert ctl == [("pause", None), ("weights", None), ("applied", "engine-0"), ("resume", None)]
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "step_00000001"
    assert (tmp_path / "weights" / "v000001" / "model.safetensors").exists()


def test_sync_times_out_reports_failed_and_resumes(kafka_config, tmp_path):
    from pipeline.trainer.sync import WeightPublisher

    cfg = _config(kafka_config, tmp_path, engines=["ghost-engine"], sync_timeout_s=1.0)
    pub = WeightPublisher(cfg)
    try:
        report = pub.sync(7, str(tmp_path), "0" * 64)
    finally:
        pub.close()
    assert not report.ok and "ghost-engine" in report.failed
    ctl = [(c.action, c.policy_version, c.engine_id) for c in _control_log(cfg, want=4)]
    assert ctl == [("pause", 7, None), ("weights", 7, None), ("failed", 7, "ghost-engine"), ("resume", 7, None)]


def test_syncer_verifies_checksum_retries_and_reports_failed(kafka_config, tmp_path):
    from pipeline.syncer import Syncer
    from pipeline.procutil import free_port
    from pipeline.weightsync import CHECKSUM_FILE, WEIGHTS_FILE, sha256_file

    folder = tmp_path / "v000003"
    folder.mkdir()
    (folder / WEIGHTS_FILE).write_bytes(b"not really weights")
    good_sha = sha256_file(folder / WEIGHTS_FILE)
    (folder / CHECKSUM_FILE).write_text(f"{good_sha}  {WEIGHTS_FILE}\n")
    cfg = _config(kafka_config, tmp_path)
    cfg = cfg.replace(syncer={"engine_id": "engine-9"})
    cfg = cfg.replace(syncer={"engine_url": f"http://127.0.0.1:{free_port()}"})  # nothing listens there
    cfg = cfg.replace(syncer={"retries": 2})
    cfg = cfg.replace(syncer={"retry_backoff_s": 0.05})
    syncer = Syncer(cfg)
    p = EventProducer(cfg, name="test")
    base = dict(epoch=3, policy_version=3, run_id="test-run", location=str(folder))
    p.send(cfg.topics.name("control"), events.Control(action="weights", sha256="f" * 64, **base), key="test-run")
    p.flush(10)
    t = threading.Thread(target=syncer.run, daemon=True)
    t.start()
    try:
        ans = [c for c in _control_log(cfg, timeout_s=30, want=2) if c.action in ("applied", "failed")]
        assert [(c.action, c.engine_id, c.policy_version) for c in ans] == [("failed", "engine-9", 3)]
        assert "sha256" in ans[0].message
        # right checksum, but the engine is down: retried, then reported
        base.update(epoch=4, policy_version=4)
        p.send(cfg.topics.name("control"), events.Control(action="weights", sha256=good_sha, **base), key="test-run")
        p.flush(10)
        ans = [c for c in _control_log(cfg, timeout_s=30, want=4) if c.action in ("applied", "failed")]
        assert [(c.action, c.policy_version) for c in ans] == [("failed", 3), ("failed", 4)]
        assert "Engine" in ans[1].message or "onnect" in ans[1].message, ans[1].message
    finally:
        syncer.stop.set()
        t.join(20)
        p.close()
    assert syncer.failed == [3, 4] and syncer.applied == []


def test_a_full_weight_candidate_waits_for_the_canary_engines_only(kafka_config, tmp_path):
    """``rollout.canary_engines`` (docs/rollout.md): a candidate's sync counts the canary engines'
    answers alone (the other engines apply it at its ``promote``), so it resumes ok while
    ``engine-0`` is silent; the incumbent's own order (``candidate`` False) waits for every engine."""
    from pipeline.trainer.sync import WeightPublisher

    cfg = _config(kafka_config, tmp_path, engines=["engine-0", "engine-1"], sync_timeout_s=1.5).replace(
        rollout={"enabled": True, "canary_engines": ["engine-1"]}, proxy={"canary_engine_url": "http://x:1"})
    pub = WeightPublisher(cfg)
    assert pub.engines_for(True) == ["engine-1"] and pub.engines_for(False) == ["engine-0", "engine-1"]
    answer = threading.Thread(target=lambda: (_control_log(cfg, want=2), publish(
        cfg, [events.Control(action="applied", epoch=3, policy_version=3, run_id="test-run",
                             engine_id="engine-1", sha256="0" * 64)], "control")), daemon=True)
    try:
        answer.start()
        report = pub.sync(3, str(tmp_path), "0" * 64, engines=pub.engines_for(True))
        answer.join(10)
        assert report.ok and report.applied == ["engine-1"] and report.seconds < 1.5
        report = pub.sync(4, str(tmp_path), "0" * 64, engines=pub.engines_for(False))
    finally:
        pub.close()
    assert sorted(report.failed) == ["engine-0", "engine-1"]  # the incumbent's order: every engine counts


def test_the_promoted_incumbent_is_awaited_on_the_engines_outside_the_canary(kafka_config, tmp_path):
    """:meth:`WeightPublisher.await_applied`: an ``applied`` of the incumbent after its order counts
    (one before it, or of another version, does not); a silent engine times out as a sync's does,
    and nothing is published."""
    from pipeline.trainer.sync import WeightPublisher

    cfg = _config(kafka_config, tmp_path, engines=["engine-0", "engine-1", "engine-2"], sync_timeout_s=1.5).replace(
        rollout={"enabled": True, "canary_engines": ["engine-2"]}, proxy={"canary_engine_url": "http://x:1"})
    pub = WeightPublisher(cfg)
    applied = lambda engine, v: events.Control(action="applied", epoch=v, policy_version=v,  # noqa: E731
                                               run_id="test-run", engine_id=engine, sha256="0" * 64)
    try:
        publish(cfg, [applied("engine-1", 2)], "control")  # before the order: an earlier apply
        order = pub._send(pub._control("weights", 2, location=str(tmp_path), sha256="0" * 64))
        publish(cfg, [applied("engine-1", 1), applied("engine-0", 2)], "control")
        report = pub.await_applied(2, order.offset, ["engine-0", "engine-1"])
    finally:
        pub.close()
    assert report.applied == ["engine-0"] and list(report.failed) == ["engine-1"] and report.seconds >= 1.5
    assert [c.action for c in _control_log(cfg, want=4)] == ["applied", "weights", "applied", "applied"]
