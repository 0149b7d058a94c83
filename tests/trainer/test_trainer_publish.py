"""The trainer mirrors each step to the ``metrics`` topic: the step's numbers, the batch's sample
ids and, for each trained sample, its mean advantage, checked against a reference computed
from the advantage's definition (GRPO reward broadcast + teacher minus rollout log-prob)."""

from __future__ import annotations

import pytest

from pipeline import events
from pipeline.bus import EventProducer, Record, TopicReader
from pipeline.config import load_config


def _sample(i, reward, kind="rl", mask=1, teacher=None):
    toks = [100 + i, 101 + i, 102 + i, 7, 8, 9]
    rollout = [-1.0, -0.5, -2.0]
    return events.Sample(sample_id=f"p:{i}", session_id=f"p{i}", turn_index=0, kind=kind, tokens=toks,
                         response_length=3, rollout_log_probs=rollout, reward=reward, loss_mask=mask,
                         teacher_log_probs=teacher)


def test_trainer_publishes_steps_with_trained_samples_and_their_advantages(kafka_config, tmp_path):
    from pipeline.trainer.stage import TrainerStage
    from pipeline.testing.trainer import megatron_runtime

    base = kafka_config.model_dump(mode="python")
    cfg = load_config(None, kafka=base["kafka"], topics=base["topics"], trainer=dict(
        model="tiny-random", rollout_batch_size=4, micro_batch_size=2, lr=1e-3, max_steps=1, engines=[],
        checkpoint_dir=str(tmp_path / "ckpt"), export_dir=str(tmp_path / "weights"), progress=False, threads=1,
        run_id="pub-run", count_masked_samples=True, normalize_advantages=False, w_rl=1.0, w_opd=0.5))
    teacher = [-0.5, -0.5, -1.0]
    samples = [_sample(0, 1.0), _sample(1, -1.0), _sample(2, 1.0, kind="opd+rl", teacher=teacher),
               _sample(3, None, mask=0)]
    p = EventProducer(cfg, name="test")
    for s in samples:
        p.send(cfg.topics.name("samples"), s, key=s.session_id)
    p.flush(10)
    p.close()
    with megatron_runtime(tp=1, threads=1):
        stage = TrainerStage(cfg)
        assert stage.run(install_signals=False) == 0
    with TopicReader(cfg, [cfg.topics.name("metrics")]) as r:
        got = [rec for rec in r.read() if isinstance(rec, Record)]
    assert len(got) == 1 and got[0].key == "pub-run"
    step = got[0].event
    assert isinstance(step, events.TrainStep) and (step.step, step.policy_version, step.run_id) == (1, 1, "pub-run")
    assert sorted(step.sample_ids) == ["p:0", "p:1", "p:2", "p:3"]
    # reference from the definition: w_rl * reward (no normalisation) + w_opd * mean(teacher - rollout)
    rollout = samples[0].rollout_log_probs
    opd = sum(t - o for t, o in zip(teacher, rollout)) / 3
    want = {"p:0": 1.0, "p:1": -1.0, "p:2": 1.0 + 0.5 * opd}  # p:3 is masked: in the batch, not trained
    assert step.trained.keys() == want.keys()
    for sid, adv in want.items():
        assert step.trained[sid] == pytest.approx(adv, abs=1e-6), sid
    logged = stage.log.records()[-1]
    assert step.metrics["loss"] == pytest.approx(logged["loss"]) and step.metrics["step_s"] == logged["step_s"]
    assert "sample_ids" not in step.metrics
