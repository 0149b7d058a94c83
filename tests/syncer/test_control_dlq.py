"""Bad records on ``control`` land in ``control.dlq`` and every follower goes on.

Three readers follow ``control``: the proxy's :class:`ControlFollower`, each engine's
:class:`Syncer` and the trainer's sync wait (:class:`WeightPublisher`). In the middle of a real
weight sync (after the trainer's ``pause`` and ``weights``, before any answer) the test writes
bad records to ``control``: bytes that are not msgpack, a valid event of another topic's type, a
control event of an unknown schema version and a tombstone. Each follower must dead-letter
every one of them (with its stage name, the error and the source offset) and finish the sync:
the syncer answers ``applied``, the trainer's wait sees it, the proxy sees ``resume``.
The engine is a stand-in (:class:`StandInEngine` already serving version 1, so the syncer
answers without loading weights).
"""

from __future__ import annotations

import threading

import msgpack
from kafka import KafkaProducer

from pipeline import events
from pipeline.config import load_config
from pipeline.proxy.control import ControlFollower
from pipeline.weightsync import CHECKSUM_FILE, WEIGHTS_FILE, sha256_file
from tests.conftest import read_all
from pipeline.testing.servers import StandInEngine, serve_app
from pipeline.testing.waiting import until


def _bad_control_values() -> list[tuple[bytes | None, str]]:
    v3 = msgpack.unpackb(events.encode(events.Control(action="resume", epoch=1, run_id="r")), raw=False)
    v3["v"] = 3
    sample = events.Sample(sample_id="x:0:rl", session_id="x", turn_index=0, tokens=[1, 2], response_length=1,
                           rollout_log_probs=[-1.0], reward=1.0)
    return [(b"\x93\x01corrupt", "MalformedEvent"), (events.encode(sample), "WrongTopic"),
            (msgpack.packb(v3, use_bin_type=True), "UnsupportedVersion"), (None, "MalformedEvent")]


def test_corrupt_records_on_control_go_to_control_dlq_and_every_follower_goes_on(kafka_config, tmp_path):
    from pipeline.syncer import Syncer
    from pipeline.trainer.sync import WeightPublisher

    base = kafka_config.model_dump(mode="python")
    cfg = load_config(None, kafka=base["kafka"], topics=base["topics"],
                      trainer={"run_id": "r", "engines": ["engine-0"], "sync_timeout_s": 60.0,
                               "export_dir": str(tmp_path / "weights")},  # published.json: not in the checkout
                      syncer={"engine_id": "engine-0", "retries": 0, "group_id": f"{kafka_config.topics.prefix}sync"})
    folder = tmp_path / "v000001"
    folder.mkdir()
    (folder / WEIGHTS_FILE).write_bytes(b"weights of version 1")
    sha = sha256_file(folder / WEIGHTS_FILE)
    (folder / CHECKSUM_FILE).write_text(f"{sha}  {WEIGHTS_FILE}\n")
    control = cfg.topics.name("control")

    states = []
    follower = ControlFollower(cfg, states.append).start()
    syncer = None
    try:
        with serve_app(StandInEngine(weight_version="1")) as engine_url:
            cfg = cfg.replace(syncer={"engine_url": engine_url})
            pub = WeightPublisher(cfg)
            result = {}
            trainer = threading.Thread(target=lambda: result.setdefault("report", pub.sync(1, str(folder), sha)))
            trainer.start()
            # the sync is under way: the proxy saw the pause (pause and weights are on control)
            assert until(lambda: any(s.paused for s in states)), states
            bad = _bad_control_values()
            raw = KafkaProducer(bootstrap_servers=cfg.kafka.bootstrap_servers)
            bad_offsets = [raw.send(control, value=v, key=b"r", partition=0).get(10).offset for v, _ in bad]
            raw.close()
            syncer = Syncer(cfg)
            threading.Thread(target=syncer.run, daemon=True).start()
            trainer.join(60)
            pub.close()
            assert not trainer.is_alive(), "the trainer's sync wait never finished"
            report = result["report"]
            assert report.ok and report.applied == ["engine-0"], report  # the trainer's wait went on
            assert syncer.applied == [1]                                  # the syncer went on
            assert until(lambda: states and not states[-1].paused)       # the proxy went on: resume seen
            assert states[-1].applied_version == 1 and states[-1].epoch == 1
            assert follower.records >= len(bad) + 4  # pause, weights, the bad ones, applied, resume
            # read while every stage still runs: the syncer may apply v1 before it reads past it
            # (a drain that finds the next fetch not there yet), and reaches the bad ones later
            stages = {"proxy", "syncer-engine-0", "trainer"}
            want = len(bad) * len(stages)
            letters = [e for *_, e in read_all(cfg, cfg.topics.dlq("control"), want=want, timeout_s=120)]
    finally:
        follower.stop()
        if syncer is not None:
            syncer.stop.set()
    got = sorted((d.stage, d.offset) for d in letters)
    assert got == sorted((s, o) for s in stages for o in bad_offsets), got
    errors = {(d.stage, d.offset): d.error for d in letters}
    raws = {(d.stage, d.offset): d.raw for d in letters}
    for s in stages:
        for o, (value, error) in zip(bad_offsets, bad):
            assert errors[(s, o)].startswith(error), errors[(s, o)]
            assert raws[(s, o)] == (value or b"")
    assert all(d.source_topic == control and d.partition == 0 for d in letters)
