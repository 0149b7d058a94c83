"""The trainer's sample source on a real broker: batch counting, dedup, staleness, DLQ, offsets."""

from __future__ import annotations

from pipeline import events
from pipeline.bus import EventProducer
from pipeline.config import load_config
from pipeline.trainer.source import DedupWindow, SampleSource
from pipeline.testing.topics import read_records


def _cfg(kafka_config, **trainer):
    base = kafka_config.model_dump(mode="python")
    return load_config(None, kafka=base["kafka"], topics=base["topics"],
                       trainer={"poll_timeout_s": 0.2, "max_staleness": 2, **trainer})


def _s(i, version=5, mask=1, sid=None):
    return events.Sample(sample_id=sid or f"id{i}", session_id="one", turn_index=i, tokens=[1, 2, 3, 4],
                         response_length=2, rollout_log_probs=[-1.0, -1.0], reward=1.0, loss_mask=mask,
                         policy_version=version)


def _produce(cfg, values):
    p = EventProducer(cfg, name="test")
    for v in values:
        p.send(cfg.topics.name("samples"), v, key="one")  # one key: one partition, this order
    p.flush(10)
    p.close()


def _dlq(cfg, want):
    return [r.event for r in read_records(cfg, cfg.topics.dlq("samples"), want, timeout_s=10, settle_s=0.2)]


def test_batches_count_trainable_samples_and_offsets_are_exact(kafka_config):
    cfg = _cfg(kafka_config, rollout_batch_size=3)
    bad_vocab = _s(90)
    bad_vocab.tokens = [1, 2, 3, 10**6]
    values = [_s(0), _s(1, sid="id0"),            # a duplicate of id0
              b"\x93not an event",                  # undecodable -> DLQ
              _s(2, mask=0),                        # fully masked: consumed, not counted
              _s(3, version=1),                     # staleness 4 > 2: dropped
              events.SessionEnd(session_id="one"),  # wrong type -> DLQ
              bad_vocab,                            # rejected by validate -> DLQ
              _s(4, version=3), _s(5),              # staleness 2 (ok) and 0
              _s(6), _s(7), _s(8)]
    _produce(cfg, values)
    validate = lambda s: "token id out of range" if max(s.tokens) >= 49152 else None  # noqa: E731
    src = SampleSource(cfg, validate=validate)
    b1 = src.next_batch(trainer_version=5)
    seen1 = src.dedup.to_list()  # what a checkpoint after b1 holds
    assert [s.sample_id for s in b1.samples] == ["id0", "id4", "id5"]
    st = b1.stats
    assert (st["duplicates"], st["masked"], st["stale_dropped"], st["dead_letters"]) == (1, 1, 1, 3)
    assert st["records"] == 9 and st["staleness_max"] == 2.0
    part = max(b1.offsets, key=b1.offsets.get)  # the partition of key "one"
    assert sum(b1.offsets.values()) == 9
    assert b1.offsets[part] == 9  # exactly past id5, though the poll read further
    dl = _dlq(cfg, 3)
    assert sorted(d.offset for d in dl) == [2, 5, 6] and all(d.stage == "trainer" for d in dl)
    b2 = src.next_batch(trainer_version=5)
    assert [s.sample_id for s in b2.samples] == ["id6", "id7", "id8"] and b2.offsets[part] == 12
    src.commit(b1.offsets)
    src.close()
    # a restarted source seeks to the checkpointed offsets: it continues after b1, not at the commit
    again = SampleSource(cfg, offsets=b1.offsets, seen=seen1)
    b = again.next_batch(trainer_version=5)
    assert [s.sample_id for s in b.samples] == ["id6", "id7", "id8"]
    again.close()
    # without a checkpoint it starts at the group's committed offset
    fresh = SampleSource(cfg)
    assert fresh.positions[part] == 9
    fresh.close()


def test_masked_samples_can_count_and_stale_ones_be_downweighted(kafka_config):
    cfg = _cfg(kafka_config, rollout_batch_size=3, count_masked_samples=True, stale_policy="downweight",
               stale_decay=0.5)
    _produce(cfg, [_s(0, mask=0), _s(1, version=1), _s(2)])
    src = SampleSource(cfg)
    b = src.next_batch(trainer_version=5)
    assert [s.sample_id for s in b.samples] == ["id0", "id1", "id2"]
    assert b.weights == [1.0, 0.25, 1.0]  # staleness 4 = bound 2 + 2 -> 0.5 ** 2
    assert b.stats["stale_downweighted"] == 1 and b.stats["masked"] == 1
    src.close()


def test_stop_returns_none_and_keeps_records_for_later(kafka_config):
    import threading

    cfg = _cfg(kafka_config, rollout_batch_size=3)
    _produce(cfg, [_s(0), _s(1)])
    src = SampleSource(cfg)
    stop = threading.Event()
    t = threading.Timer(1.5, stop.set)
    t.start()
    assert src.next_batch(5, stop) is None
    _produce(cfg, [_s(2)])
    b = src.next_batch(5)
    assert [s.sample_id for s in b.samples] == ["id0", "id1", "id2"]
    src.close()


def test_dedup_window_forgets_the_oldest():
    w = DedupWindow(2, ["a", "b"])
    w.add("c")
    assert "a" not in w and "b" in w and "c" in w and w.to_list() == ["b", "c"]


def test_v1_records_on_the_topic_are_read_with_their_meaning_or_dead_lettered(kafka_config):
    """Records the v1 judge left on ``samples`` before an upgrade: the trainer reads them with the
    stand-ins undone (no teacher on a vote-only combine sample, no reward on a hint-only one, no
    rollout log-probs on an import), and sends one that is still inconsistent to the DLQ."""
    from tests.legacy_records import sample_v1

    cfg = _cfg(kafka_config, rollout_batch_size=3, max_staleness=None)
    values = [sample_v1(sample_id="vote-only"),
              sample_v1(sample_id="hint-only", hint="a long enough hint", reward=0.0, teacher_log_probs=[-0.25, -2.0]),
              sample_v1(sample_id="broken", rollout_log_probs=[-1.0]),  # 1 log-prob for 2 tokens
              sample_v1(sample_id="imported", source="import", reward=-1.0, rollout_log_probs=[0.0, 0.0],
                        teacher_log_probs=[0.0, 0.0])]
    _produce(cfg, values)
    src = SampleSource(cfg)
    b = src.next_batch(trainer_version=3)
    src.close()
    got = {s.sample_id: s for s in b.samples}
    assert list(got) == ["vote-only", "hint-only", "imported"] and b.stats["dead_letters"] == 1
    assert (got["vote-only"].kind, got["vote-only"].reward, got["vote-only"].teacher_log_probs) == ("rl", 1.0, None)
    assert (got["hint-only"].kind, got["hint-only"].reward) == ("opd", None)
    assert got["imported"].rollout_log_probs is None and got["imported"].teacher_log_probs is None
    dl = _dlq(cfg, 1)
    assert len(dl) == 1 and "rollout_log_probs has 1 entries, want 2" in dl[0].error


def test_samples_without_rollout_log_probs_are_never_stale(kafka_config):
    """An imported conversation carries policy_version 0 but was never sampled by any policy: it
    is trained on-policy (recomputed log-probs), so no staleness bound drops or down-weights it."""
    cfg = _cfg(kafka_config, rollout_batch_size=2)  # max_staleness 2
    imported = _s(0, version=0)
    imported.rollout_log_probs, imported.source = None, "import"
    _produce(cfg, [imported, _s(1, version=0), _s(2, version=10)])
    src = SampleSource(cfg)
    b = src.next_batch(trainer_version=10)
    src.close()
    assert [s.sample_id for s in b.samples] == ["id0", "id2"] and b.weights == [1.0, 1.0]
    assert b.stats["stale_dropped"] == 1 and b.stats["staleness_max"] == 0.0  # id1 (sampled at v0) is stale


def test_a_batch_without_sampled_samples_has_no_staleness_figure(kafka_config):
    """Only imported samples (never sampled by a policy): no staleness to measure, so no
    ``staleness_mean`` / ``staleness_max`` (was 0.0: a figure that reads as "fresh")."""
    cfg = _cfg(kafka_config, rollout_batch_size=2)
    imported = [_s(i, version=0) for i in range(2)]
    for s in imported:
        s.rollout_log_probs, s.source = None, "import"
    _produce(cfg, imported)
    src = SampleSource(cfg)
    b = src.next_batch(trainer_version=10)
    src.close()
    assert len(b.samples) == 2
    assert "staleness_mean" not in b.stats and "staleness_max" not in b.stats, b.stats
