"""Engines never fall back to the base model for good: a (re)starting syncer, and a syncer whose
engine restarted, reconcile the engine with the trainer's last published version (real broker,
real engines serving the tiny model, real weight folders)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from pipeline import events
from pipeline.bus import EventProducer
from pipeline.config import load_config
from pipeline.testing.engine import running_engine
from pipeline.testing.trainer import shifted_export
from pipeline.testing.waiting import wait_for

TOKENS = list(range(200, 230))


def _config(kafka_config, tmp_path, **syncer):
    base = kafka_config.model_dump(mode="python")
    s = dict(engine_id="engine-0", retries=1, retry_backoff_s=0.1, check_interval_s=0.3,
             group_id=f"syncer-{kafka_config.topics.prefix}")  # one group per test: no stale members
    s.update(syncer)
    t = dict(export_dir=str(tmp_path / "weights"), run_id="reconcile", engines=["engine-0"], sync_timeout_s=60.0)
    return load_config(None, kafka=base["kafka"], topics=base["topics"], trainer=t, syncer=s)


def _start(cfg):
    from pipeline.syncer import Syncer

    syncer = Syncer(cfg)
    t = threading.Thread(target=syncer.run, daemon=True)
    t.start()
    return syncer, t


def _stop(syncer, t):
    syncer.stop.set()
    t.join(30)
    assert not t.is_alive()


async def _info(url):
    from pipeline.engine_api.client import EngineClient

    async with EngineClient(url, timeout_s=60) as eng:
        return await eng.weight_version(), await eng.score(TOKENS, 10)


def _version(url) -> str | None:
    return asyncio.run(_info(url))[0]


def _control(cfg, want: int, timeout_s: float = 15.0) -> list[events.Control]:
    from pipeline.testing.topics import read_events

    return read_events(cfg, "control", want, timeout_s, settle_s=0.2)


def _publish(cfg, version: int, folder, sha: str, wait: bool = True):
    """What the trainer does: pause, weights, (wait for applied), resume."""
    from pipeline.trainer.sync import WeightPublisher

    if not wait:
        cfg = cfg.replace(trainer={"engines": []})
    pub = WeightPublisher(cfg)
    try:
        return pub.sync(version, str(folder), sha)
    finally:
        pub.close()


def _gauge(name: str) -> float | None:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, {"engine_id": "engine-0"})


# ---- case 2: engine and syncer restart --------------------------------------------------------

def test_restarted_engine_and_syncer_serve_the_published_version_before_traffic(kafka_config, tmp_path):
    cfg = _config(kafka_config, tmp_path)
    v1, sha1 = shifted_export(tmp_path / "weights", 1)
    with running_engine("tiny-random", threads=1) as url:
        cfg = cfg.replace(syncer={"engine_url": url})
        syncer, t = _start(cfg)
        try:
            assert syncer.ready.wait(30)
            report = _publish(cfg, 1, v1, sha1)
        finally:
            _stop(syncer, t)  # its group has now committed past the weights event
        assert report.applied == ["engine-0"]
        served_v1, trained_scores = asyncio.run(_info(url))
    assert served_v1 == "1"
    # both restart: the engine comes back with its base model as version 0 (as the deploy files start it)
    with running_engine("tiny-random", threads=1) as url:
        base_version, base_scores = asyncio.run(_info(url))
        assert base_version == "0" and base_scores != trained_scores
        cfg = cfg.replace(syncer={"engine_url": url})
        syncer, t = _start(cfg)
        try:
            assert syncer.ready.wait(30), "the syncer never joined its group"
            # the reconcile happens before the syncer even reads its group: v1 is served already
            version, scores = asyncio.run(_info(url))
            assert version == "1", f"restarted engine serves v{version}, the trainer published v1"
            assert scores == trained_scores  # the published weights, not only the label
        finally:
            _stop(syncer, t)
    applied = [c for c in _control(cfg, want=6) if c.action == "applied" and c.engine_id == "engine-0"]
    assert {c.policy_version for c in applied} == {1}
    # a real reload on each engine (a re-read weights event may add an idempotent "already serving")
    assert sum(c.message.startswith("Succeeded") for c in applied) == 2, [c.message for c in applied]


def test_engine_restarted_without_its_syncer_is_reconciled(kafka_config, tmp_path):
    from pipeline.engine_api.client import EngineClient
    from pipeline.models import resolve_model

    cfg = _config(kafka_config, tmp_path)
    v1, sha1 = shifted_export(tmp_path / "weights", 1)
    with running_engine("tiny-random", threads=1) as url:
        cfg = cfg.replace(syncer={"engine_url": url})
        syncer, t = _start(cfg)
        try:
            assert syncer.ready.wait(30)
            assert _publish(cfg, 1, v1, sha1).applied == ["engine-0"]
            _, trained = asyncio.run(_info(url))
            assert syncer.reconciles == 0

            async def back_to_base():  # what a restart leaves: the base model, reported as v0
                async with EngineClient(url, timeout_s=60) as eng:
                    await eng.update_weights_from_disk(str(resolve_model("tiny-random")), weight_version="0")

            asyncio.run(back_to_base())
            wait_for(lambda: _version(url) == "1", what="the syncer to re-apply v1")
            assert asyncio.run(_info(url))[1] == trained
            assert syncer.reconciles == 1 and syncer.in_sync.is_set()
            assert _gauge("pipeline_syncer_engine_weight_version") == 1.0
            assert _gauge("pipeline_syncer_published_version") == 1.0
            assert _gauge("pipeline_syncer_engine_versions_behind") == 0.0
            assert _gauge("pipeline_syncer_reconciles_total") >= 1.0
        finally:
            _stop(syncer, t)


# ---- variants ----------------------------------------------------------------------------------

def test_engine_serving_an_unpublished_version_is_reconciled_and_readyz_says_so(kafka_config, tmp_path):
    cfg = _config(kafka_config, tmp_path)
    v1, sha1 = shifted_export(tmp_path / "weights", 1)
    _publish(cfg, 1, v1, sha1, wait=False)
    with running_engine("tiny-random", threads=1, weight_version="7") as url:  # v7 was never published
        cfg = cfg.replace(syncer={"engine_url": url})
        from pipeline.syncer import Syncer

        syncer = Syncer(cfg)
        port = syncer.serve_ready(0, host="127.0.0.1")
        assert _readyz(port)[0] == 503  # nothing reconciled yet: no traffic
        t = threading.Thread(target=syncer.run, daemon=True)
        t.start()
        try:
            wait_for(lambda: _version(url) == "1", what="v7 -> v1")
            wait_for(lambda: _readyz(port)[0] == 200, what="/readyz 200")
            assert _readyz(port)[1] == {"engine_id": "engine-0", "served": "1", "published": 1, "in_sync": True}
            # a newer version that cannot be applied: loud (failed, behind 1), but the replica keeps
            # serving the published v1 it was confirmed on instead of dropping out of the service
            _publish(cfg, 2, tmp_path / "weights" / "v000002", "0" * 64, wait=False)
            wait_for(lambda: 2 in syncer.failed and not syncer.in_sync.is_set(), what="v2 failed")
            code, body = _readyz(port)
            assert code == 200 and body == {"engine_id": "engine-0", "served": "1", "published": 2, "in_sync": False}
            assert _gauge("pipeline_syncer_engine_versions_behind") == 1.0
        finally:
            _stop(syncer, t)


def test_published_weights_that_cannot_be_served_are_never_silent(kafka_config, tmp_path):
    import shutil

    cfg = _config(kafka_config, tmp_path)
    v1, sha1 = shifted_export(tmp_path / "weights", 1)
    _publish(cfg, 1, v1, sha1, wait=False)
    shutil.rmtree(v1)  # the published folder is gone (pruned, volume lost)
    with running_engine("tiny-random", threads=1) as url:
        cfg = cfg.replace(syncer={"engine_url": url})
        from pipeline.syncer import Syncer

        syncer = Syncer(cfg)
        port = syncer.serve_ready(0, host="127.0.0.1")
        t = threading.Thread(target=syncer.run, daemon=True)
        t.start()
        try:
            assert syncer.ready.wait(30)
            failed = [c for c in _control(cfg, want=4) if c.action == "failed"]
            assert failed and failed[0].engine_id == "engine-0" and failed[0].policy_version == 1
            assert "serves '0'" in failed[0].message and "not found" in failed[0].message, failed[0].message
            assert _version(url) == "0" and not syncer.in_sync.is_set()
            code, body = _readyz(port)
            assert code == 503 and body["served"] == "0" and body["published"] == 1
            assert _gauge("pipeline_syncer_engine_versions_behind") == 1.0
        finally:
            _stop(syncer, t)


def test_syncer_restarted_during_a_sync_completes_it(kafka_config, tmp_path):
    cfg = _config(kafka_config, tmp_path)
    v2, sha2 = shifted_export(tmp_path / "weights", 2)
    with running_engine("tiny-random", threads=1) as url:
        cfg = cfg.replace(syncer={"engine_url": url})
        box: dict = {}
        trainer = threading.Thread(target=lambda: box.update(report=_publish(cfg, 2, v2, sha2)), daemon=True)
        trainer.start()  # pause + weights v2 published; no syncer is running
        wait_for(lambda: any(c.action == "weights" for c in _control(cfg, want=2, timeout_s=1)), what="weights v2")
        syncer, t = _start(cfg)
        try:
            trainer.join(60)
            assert box["report"].applied == ["engine-0"] and _version(url) == "2"
        finally:
            _stop(syncer, t)


def test_control_aged_out_falls_back_to_the_trainers_record(kafka_config, tmp_path):
    from pipeline.syncer import last_published
    from pipeline.weightsync import Published, write_published

    cfg = _config(kafka_config, tmp_path)
    v3, sha3 = shifted_export(tmp_path / "weights", 3)
    assert last_published(cfg, "reconcile") is None
    # control holds no weights event of the run (retention), the trainer's record does
    write_published(tmp_path / "weights", Published("reconcile", 3, str(v3), sha3, events.now_ms()))
    write_published(tmp_path / "other", Published("another-run", 9, str(v3), sha3))
    got = last_published(cfg, "reconcile")
    assert (got.policy_version, got.location, got.sha256) == (3, str(v3), sha3)
    with running_engine("tiny-random", threads=1) as url:
        cfg = cfg.replace(syncer={"engine_url": url})
        syncer, t = _start(cfg)
        try:
            wait_for(lambda: _version(url) == "3", what="v3 from published.json")
        finally:
            _stop(syncer, t)


def test_an_older_weights_event_is_never_applied_after_a_newer_one(kafka_config, tmp_path):
    cfg = _config(kafka_config, tmp_path)
    v1, sha1 = shifted_export(tmp_path / "weights", 1)
    v2, sha2 = shifted_export(tmp_path / "weights", 2, shift=0.02)
    p = EventProducer(cfg, name="test")
    for v, folder, sha in ((2, v2, sha2), (1, v1, sha1)):  # out of order, e.g. a stray replay
        p.send(cfg.topics.name("control"), events.Control(action="weights", epoch=v, policy_version=v,
                                                          run_id="reconcile", location=str(folder), sha256=sha),
               key="reconcile")
    p.flush(10)
    p.close()
    assert last_published(cfg).policy_version == 2
    with running_engine("tiny-random", threads=1) as url:
        cfg = cfg.replace(syncer={"engine_url": url})
        syncer, t = _start(cfg)
        try:
            assert syncer.ready.wait(30)
            wait_for(lambda: _version(url) == "2", what="v2")
            time.sleep(1.0)  # several check intervals and polls: it must stay on v2
            assert _version(url) == "2" and 1 not in syncer.applied
        finally:
            _stop(syncer, t)


def last_published(cfg):
    from pipeline.syncer import last_published as lp

    return lp(cfg, "reconcile")


def _readyz(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(autouse=True)
def _quiet_kafka(caplog):
    caplog.set_level("WARNING", logger="kafka")


def test_unknown_versions_read_nan_not_a_version():
    """Before the engine answered and before anything was published, the version gauges read
    NaN (was -1, and versions-behind then read published + 1, a value a dashboard plots as data)."""
    import math

    from prometheus_client import REGISTRY

    from pipeline.syncer import Syncer

    def gauge(name):
        return REGISTRY.get_sample_value(name, {"engine_id": "gauge-probe"})

    syncer = Syncer(load_config(None, syncer={"engine_id": "gauge-probe"}))
    syncer._observe()
    for name in ("pipeline_syncer_engine_weight_version", "pipeline_syncer_published_version",
                 "pipeline_syncer_engine_versions_behind"):
        assert math.isnan(gauge(name)), name
    syncer.served = "3"
    syncer._observe()
    assert gauge("pipeline_syncer_engine_weight_version") == 3.0
    assert math.isnan(gauge("pipeline_syncer_engine_versions_behind"))  # nothing published yet
