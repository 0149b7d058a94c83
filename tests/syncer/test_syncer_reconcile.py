"""Engines never fall back to the base model for good: a (re)starting syncer, and a syncer whose
engine restarted, reconcile the engine with the trainer's last published version (real broker,
real engines serving the tiny model, real weight folders)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pipeline import events
from pipeline.bus import EventProducer
from pipeline.config import load_config
from pipeline.testing.trainer import shifted_export
from pipeline.testing.waiting import wait_for
from tests.syncer.syncing import (control, engine_for, info, new_syncer, publish, readyz, running, syncer_config,
                                  version)


def _gauge(name: str) -> float | None:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, {"engine_id": "engine-0"})


# ---- case 2: engine and syncer restart --------------------------------------------------------

def test_restarted_engine_and_syncer_serve_the_published_version_before_traffic(kafka_config, tmp_path):
    cfg = syncer_config(kafka_config, tmp_path)
    v1, sha1 = shifted_export(tmp_path / "weights", 1)
    with engine_for(cfg) as (cfg, url):
        with running(new_syncer(cfg)):  # on exit its group has committed past the weights event
            report = publish(cfg, 1, v1, sha1)
        assert report.applied == ["engine-0"]
        served_v1, trained_scores = info(url)
    assert served_v1 == "1"
    # both restart: the engine comes back with its base model as version 0 (as the deploy files start it)
    with engine_for(cfg) as (cfg, url):
        base_version, base_scores = info(url)
        assert base_version == "0" and base_scores != trained_scores
        with running(new_syncer(cfg)):
            # the reconcile happens before the syncer even reads its group: v1 is served already
            served_version, scores = info(url)
            assert served_version == "1", f"restarted engine serves v{served_version}, the trainer published v1"
            assert scores == trained_scores  # the published weights, not only the label
    applied = [c for c in control(cfg, want=6) if c.action == "applied" and c.engine_id == "engine-0"]
    assert {c.policy_version for c in applied} == {1}
    # a real reload on each engine (a re-read weights event may add an idempotent "already serving")
    assert sum(c.message.startswith("Succeeded") for c in applied) == 2, [c.message for c in applied]


def test_engine_restarted_without_its_syncer_is_reconciled(kafka_config, tmp_path):
    from pipeline.engine_api.client import EngineClient
    from pipeline.models import resolve_model

    cfg = syncer_config(kafka_config, tmp_path)
    v1, sha1 = shifted_export(tmp_path / "weights", 1)
    with engine_for(cfg) as (cfg, url), running(new_syncer(cfg)) as syncer:
        assert publish(cfg, 1, v1, sha1).applied == ["engine-0"]
        _, trained = info(url)
        assert syncer.reconciles == 0

        async def back_to_base():  # what a restart leaves: the base model, reported as v0
            async with EngineClient(url, timeout_s=60) as eng:
                await eng.update_weights_from_disk(str(resolve_model("tiny-random")), weight_version="0")

        asyncio.run(back_to_base())
        wait_for(lambda: version(url) == "1", what="the syncer to re-apply v1")
        assert info(url)[1] == trained
        assert syncer.reconciles == 1 and syncer.in_sync.is_set()
        assert _gauge("pipeline_syncer_engine_weight_version") == 1.0
        assert _gauge("pipeline_syncer_published_version") == 1.0
        assert _gauge("pipeline_syncer_engine_versions_behind") == 0.0
        assert _gauge("pipeline_syncer_reconciles_total") >= 1.0


# ---- variants ----------------------------------------------------------------------------------

def test_engine_serving_an_unpublished_version_is_reconciled_and_readyz_says_so(kafka_config, tmp_path):
    cfg = syncer_config(kafka_config, tmp_path)
    v1, sha1 = shifted_export(tmp_path / "weights", 1)
    publish(cfg, 1, v1, sha1, wait=False)
    with engine_for(cfg, weight_version="7") as (cfg, url):  # v7 was never published
        syncer = new_syncer(cfg)
        port = syncer.serve_ready(0, host="127.0.0.1")
        assert readyz(port)[0] == 503  # nothing reconciled yet: no traffic
        with running(syncer, ready=False):
            wait_for(lambda: version(url) == "1", what="v7 -> v1")
            wait_for(lambda: readyz(port)[0] == 200, what="/readyz 200")
            assert readyz(port)[1] == {"engine_id": "engine-0", "served": "1", "published": 1, "in_sync": True,
                                          "adapters_missing": {}}
            # a newer version that cannot be applied: loud (failed, behind 1), but the replica keeps
            # serving the published v1 it was confirmed on instead of dropping out of the service
            publish(cfg, 2, tmp_path / "weights" / "v000002", "0" * 64, wait=False)
            wait_for(lambda: 2 in syncer.failed and not syncer.in_sync.is_set(), what="v2 failed")
            code, body = readyz(port)
            assert code == 200 and body == {"engine_id": "engine-0", "served": "1", "published": 2, "in_sync": False,
                                          "adapters_missing": {}}
            assert _gauge("pipeline_syncer_engine_versions_behind") == 1.0


def test_published_weights_that_cannot_be_served_are_never_silent(kafka_config, tmp_path):
    import shutil

    cfg = syncer_config(kafka_config, tmp_path)
    v1, sha1 = shifted_export(tmp_path / "weights", 1)
    publish(cfg, 1, v1, sha1, wait=False)
    shutil.rmtree(v1)  # the published folder is gone (pruned, volume lost)
    with engine_for(cfg) as (cfg, url):
        syncer = new_syncer(cfg)
        port = syncer.serve_ready(0, host="127.0.0.1")
        with running(syncer):
            failed = [c for c in control(cfg, want=4) if c.action == "failed"]
            assert failed and failed[0].engine_id == "engine-0" and failed[0].policy_version == 1
            assert "serves '0'" in failed[0].message and "not found" in failed[0].message, failed[0].message
            assert version(url) == "0" and not syncer.in_sync.is_set()
            code, body = readyz(port)
            assert code == 503 and body["served"] == "0" and body["published"] == 1
            assert _gauge("pipeline_syncer_engine_versions_behind") == 1.0


def test_syncer_restarted_during_a_sync_completes_it(kafka_config, tmp_path):
    cfg = syncer_config(kafka_config, tmp_path)
    v2, sha2 = shifted_export(tmp_path / "weights", 2)
    with engine_for(cfg) as (cfg, url):
        box: dict = {}
        trainer = threading.Thread(target=lambda: box.update(report=publish(cfg, 2, v2, sha2)), daemon=True)
        trainer.start()  # pause + weights v2 published; no syncer is running
        wait_for(lambda: any(c.action == "weights" for c in control(cfg, want=2, timeout_s=1)), what="weights v2")
        with running(new_syncer(cfg), ready=False):
            trainer.join(60)
            assert box["report"].applied == ["engine-0"] and version(url) == "2"


def test_control_aged_out_falls_back_to_the_trainers_record(kafka_config, tmp_path):
    from pipeline.syncer import last_published
    from pipeline.weightsync import Published, write_published

    cfg = syncer_config(kafka_config, tmp_path)
    v3, sha3 = shifted_export(tmp_path / "weights", 3)
    assert last_published(cfg, "reconcile") is None
    # control holds no weights event of the run (retention), the trainer's record does
    write_published(tmp_path / "weights", Published("reconcile", 3, str(v3), sha3, events.now_ms()))
    write_published(tmp_path / "other", Published("another-run", 9, str(v3), sha3))
    got = last_published(cfg, "reconcile")
    assert (got.policy_version, got.location, got.sha256) == (3, str(v3), sha3)
    with engine_for(cfg) as (cfg, url), running(new_syncer(cfg), ready=False):
        wait_for(lambda: version(url) == "3", what="v3 from published.json")


def test_an_older_weights_event_is_never_applied_after_a_newer_one(kafka_config, tmp_path):
    cfg = syncer_config(kafka_config, tmp_path)
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
    with engine_for(cfg) as (cfg, url), running(new_syncer(cfg)) as syncer:
        wait_for(lambda: version(url) == "2", what="v2")
        time.sleep(1.0)  # several check intervals and polls: it must stay on v2
        assert version(url) == "2" and 1 not in syncer.applied


def last_published(cfg):
    from pipeline.syncer import last_published as lp

    return lp(cfg, "reconcile")


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
