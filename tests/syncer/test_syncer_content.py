"""Issue 24, case 7: a weight version is its content (sha256), not its number.

Real broker, a real CPU engine serving the tiny model, real weight folders, the real syncer. The
engine's log-probs of a fixed sequence tell which weights it serves (each export shifts every
weight by a different amount).

- a ``weights`` event with the number the engine serves but a new sha256 (a same-path folder
  with new content) is applied, not answered "already serving";
- after a syncer restart the engine's content is unknown: an engine that reports the published
  number while holding other weights is reloaded with the published ones;
- a folder whose content no longer matches the event's sha256 is refused (``failed``).
"""

from __future__ import annotations

import shutil

from pipeline import events
from pipeline.testing.trainer import shifted_export
from tests.syncer.syncing import control, engine_for, info, new_syncer, publish, running, syncer_config


def _applied(cfg, n):
    return [c for c in control(cfg, want=n) if c.action in ("applied", "failed") and c.engine_id == "engine-0"]


def test_same_number_new_content_at_the_same_path_is_applied(kafka_config, tmp_path):
    cfg = syncer_config(kafka_config, tmp_path)
    folder, sha_a = shifted_export(tmp_path / "weights", 1, shift=0.01)
    with engine_for(cfg) as (cfg, url), running(new_syncer(cfg)):
        assert publish(cfg, 1, folder, sha_a).applied == ["engine-0"]
        _, scores_a = info(url)
        shutil.rmtree(folder)  # the trainer re-exports v1 to the same path with other weights
        folder_b, sha_b = shifted_export(tmp_path / "weights", 1, shift=0.03)
        assert folder_b == folder and sha_b != sha_a
        assert publish(cfg, 1, folder, sha_b).applied == ["engine-0"]
        version, scores_b = info(url)
    assert version == "1" and scores_b != scores_a  # the new content is served
    last = _applied(cfg, 8)[-1]
    assert last.sha256 == sha_b and not last.message.startswith("already serving"), last.message


def test_restarted_syncer_reloads_an_engine_of_unknown_content(kafka_config, tmp_path):
    import asyncio

    cfg = syncer_config(kafka_config, tmp_path)
    v1, sha1 = shifted_export(tmp_path / "weights", 1, shift=0.01)
    other, _ = shifted_export(tmp_path / "elsewhere", 1, shift=0.05)
    with engine_for(cfg) as (cfg, url):
        with running(new_syncer(cfg)):
            assert publish(cfg, 1, v1, sha1).applied == ["engine-0"]
            _, published_scores = info(url)

        async def swap():  # someone loads other weights and labels them v1 while no syncer runs
            from pipeline.engine_api.client import EngineClient

            async with EngineClient(url, timeout_s=60) as eng:
                await eng.update_weights_from_disk(str(other), weight_version="1")

        asyncio.run(swap())
        assert info(url) != ("1", published_scores)
        with running(new_syncer(cfg)):  # reconciled before it joins its group
            version, scores = info(url)
    assert version == "1" and scores == published_scores  # the published content, not only the label


def test_folder_that_no_longer_matches_its_sha256_is_refused(kafka_config, tmp_path):
    cfg = syncer_config(kafka_config, tmp_path)
    folder, sha_a = shifted_export(tmp_path / "weights", 1, shift=0.01)
    with engine_for(cfg) as (cfg, _url):
        syncer = new_syncer(cfg)
        try:
            ev = events.Control(action="weights", epoch=1, policy_version=1, run_id="reconcile",
                                location=str(folder), sha256=sha_a)
            assert syncer.apply(ev)[0]
            shutil.rmtree(folder)
            shifted_export(tmp_path / "weights", 1, shift=0.03)  # new content, the event's old sha256
            ok, msg = syncer.apply(ev)
        finally:
            syncer.close()
    assert not ok and "sha256" in msg.lower() or "checksum" in msg.lower(), msg
