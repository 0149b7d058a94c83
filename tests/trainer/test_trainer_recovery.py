"""The trainer stage over a real broker: bad values refused at the samples boundary, and a trainer
that lost its checkpoint never pushes the base model over trained weights."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from pipeline import events
from pipeline.config import load_config
from pipeline.models import resolve_model
from pipeline.testing.topics import publish


def _config(kafka_config, tmp_path, **trainer):
    base = kafka_config.model_dump(mode="python")
    t = dict(model="tiny-random", rollout_batch_size=3, micro_batch_size=4, lr=1e-3, max_steps=1,
             checkpoint_dir=str(tmp_path / "ckpt"), export_dir=str(tmp_path / "weights"), engines=[],
             progress=False, threads=1, run_id="recovery", poll_timeout_s=0.2)
    t.update(trainer)
    return load_config(None, kafka=base["kafka"], topics=base["topics"], trainer=t)


def _sample(i, reward=1.0, **kw):
    toks = [(i * 31 + j * 7) % 4000 + 5 for j in range(10)]
    kw.setdefault("rollout_log_probs", [-2.0] * 4)
    return events.Sample(sample_id=f"r:{i}", session_id=f"r{i}", turn_index=0, tokens=toks, response_length=4,
                         reward=reward, **kw)


def _produce_unchecked(config, samples):
    """Produce samples as a faulty producer would: encoded without the schema's checks (the
    schema itself refuses non-finite values at encode time)."""
    from unittest import mock

    from kafka import KafkaProducer

    raw = KafkaProducer(bootstrap_servers=config.kafka.bootstrap_servers)
    with mock.patch.object(events.Sample, "validate", lambda self: None):
        for s in samples:
            raw.send(config.topics.name("samples"), value=events.encode(s), key=s.session_id.encode()).get(10)
    raw.close()


def _read(config, topic: str, want: int, timeout_s: float = 20.0) -> list[events.Event]:
    from pipeline.testing.topics import read_records

    return [r.event for r in read_records(config, topic, want, timeout_s, settle_s=0.2)]


def _trained_export(export_dir, version: int, shift: float = 0.01):
    """Export ``v<version>`` = base weights + ``shift``; returns its tensors."""
    from pipeline.testing.trainer import shifted_export

    folder, _ = shifted_export(export_dir, version, shift)
    return _weights(folder)


#: the conftest ``runtime`` fixture's settings
RUNTIME_SETTINGS = {"threads": 1}


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


# ---- case 1 (samples side): non-finite values never reach a batch ----------------------------

def test_nonfinite_samples_go_to_the_dlq_with_their_reason(kafka_config, tmp_path, runtime):
    from pipeline.trainer.stage import TrainerStage

    cfg = _config(kafka_config, tmp_path)
    nan, inf = float("nan"), float("inf")
    bad = [
        _sample(1, reward=nan),
        _sample(2, rollout_log_probs=[-2.0, nan, -2.0, -2.0]),
        _sample(3, kind="opd+rl", teacher_log_probs=[-1.0, -1.0, -inf, -1.0]),
        _sample(4, None, kind="opd", teacher_log_probs=[-1.0] * 4, teacher_top_k=1, teacher_topk_ids=[7] * 4,
                teacher_topk_log_probs=[-0.5, -0.5, -0.5, nan]),
        _sample(5, reward=-inf),
    ]
    good = [_sample(0, 1.0), _sample(6, -1.0), _sample(7, 1.0)]
    _produce_unchecked(cfg, bad[:2] + good[:1] + bad[2:] + good[1:])
    stage = TrainerStage(cfg)
    assert stage.run(install_signals=False) == 0
    rec = stage.log.records()[-1]
    assert sorted(rec["sample_ids"]) == ["r:0", "r:6", "r:7"] and rec["dead_letters"] == 5
    assert rec["policy_version"] == 1 and not rec["skipped"] and math.isfinite(rec["loss"])
    dlq = _read(cfg, cfg.topics.dlq("samples"), want=5)
    # refused where they are first read: by the schema (reward, log-probs) or the trainer's guard
    # (top-k log-probs, where -inf is a legal "missing entry" but NaN is not)
    reasons = sorted(d.error for d in dlq)
    wanted = [("reward", "got nan"), ("reward", "got -inf"), ("rollout_log_probs", "non-finite"),
              ("teacher_log_probs", "non-finite"), ("teacher_topk_log_probs", "nan")]
    for f, v in wanted:  # each bad sample refused with its field named
        assert sum(1 for r in reasons if f"{f}" in r and v in r) == 1, (f, v, reasons)
    assert all(d.stage == "trainer" and d.raw for d in dlq)
    w = _weights(tmp_path / "weights" / "v000001")
    assert all(bool(torch.isfinite(t).all()) for t in w.values())


def test_restored_checkpoint_with_nonfinite_weights_is_refused(kafka_config, tmp_path, runtime):
    from pipeline.trainer import checkpoint as C
    from pipeline.trainer.guards import NonFiniteWeights
    from pipeline.trainer.policy import PolicyTrainer
    from pipeline.trainer.stage import TrainerStage

    cfg = _config(kafka_config, tmp_path)
    pt = PolicyTrainer(cfg.trainer, resolve_model("tiny-random"), runtime)
    state = pt.state_dict()
    key = next(k for k in state["model"] if "linear_qkv.weight" in k)
    state["model"][key][0, 0] = float("nan")
    C.save(cfg.trainer.checkpoint_dir, 4, runtime, state, {"policy_version": 4})
    stage = TrainerStage(cfg)
    with pytest.raises(NonFiniteWeights, match="step_00000004.*1 parameter"):
        stage._setup()
    assert not (tmp_path / "weights").exists()  # nothing exported or synced


# ---- case 3: no checkpoint, but exports ------------------------------------------------------

def test_trainer_without_checkpoint_but_with_exports_refuses(kafka_config, tmp_path, runtime):
    from pipeline.errors import PipelineError
    from pipeline.trainer.stage import TrainerStage

    cfg = _config(kafka_config, tmp_path)
    (tmp_path / "ckpt").mkdir()
    _trained_export(tmp_path / "weights", 5)
    stage = TrainerStage(cfg)
    with pytest.raises(PipelineError) as err:  # today: starts at v6 from the base model and exports it
        stage._setup()
    assert type(err.value).__name__ == "CheckpointMissing"
    msg = str(err.value)
    assert str(tmp_path / "ckpt") in msg and str(tmp_path / "weights") in msg and "v000005" in msg
    assert "--from-newest-export" in msg and "--start-fresh" in msg
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000005"]  # nothing new exported


def test_synced_record_without_checkpoint_refuses(kafka_config, tmp_path, runtime):
    from pipeline.errors import PipelineError
    from pipeline.trainer import checkpoint as C
    from pipeline.trainer.stage import TrainerStage

    cfg = _config(kafka_config, tmp_path)
    C.write_synced(tmp_path / "ckpt", 3)  # the checkpoints were deleted, the record of v3 was not
    with pytest.raises(PipelineError, match="v3 was synced to the engines"):
        TrainerStage(cfg)._setup()


def test_latest_pointer_to_a_missing_folder_without_checkpoint_refuses(kafka_config, tmp_path, runtime):
    from pipeline.errors import PipelineError
    from pipeline.trainer.stage import TrainerStage

    cfg = _config(kafka_config, tmp_path)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("step_00000004\n")
    with pytest.raises(PipelineError, match="names step_00000004, which is missing"):
        TrainerStage(cfg)._setup()


def test_from_newest_export_continues_from_its_weights(kafka_config, tmp_path, runtime):
    from pipeline.trainer import prom
    from pipeline.trainer.stage import TrainerStage
    from pipeline.weightsync import read_published

    cfg = _config(kafka_config, tmp_path, missing_checkpoint="newest_export")
    _trained_export(tmp_path / "weights", 3, shift=0.02)
    v5 = _trained_export(tmp_path / "weights", 5)
    publish(cfg, [_sample(i, (-1.0) ** i, policy_version=5) for i in range(3)], "samples")  # served by v5
    stage = TrainerStage(cfg)
    assert stage.run(install_signals=False) == 0
    assert stage.version == 6
    # v5 was re-published (the engines may not have it), then the step trained on top of it
    ctl = [(c.action, c.policy_version) for c in _read(cfg, cfg.topics.name("control"), want=6)
           if c.action in ("weights",)]
    assert ctl == [("weights", 5), ("weights", 6)]
    v6 = _weights(tmp_path / "weights" / "v000006")
    base = _weights(resolve_model("tiny-random"))
    near_v5 = max((v6[k] - v5[k]).abs().max().item() for k in v6)
    assert near_v5 < 5e-3 < max((v6[k] - base[k]).abs().max().item() for k in v6), near_v5
    pub = read_published(tmp_path / "weights")
    assert pub.policy_version == 6 and pub.location == str((tmp_path / "weights" / "v000006").resolve())
    assert prom.PUBLISHED_VERSION._value.get() == 6


def test_start_fresh_publishes_the_base_model_as_a_new_version(kafka_config, tmp_path, runtime):
    from pipeline.trainer.stage import TrainerStage

    cfg = _config(kafka_config, tmp_path, missing_checkpoint="fresh", max_steps=0)
    _trained_export(tmp_path / "weights", 5)
    stage = TrainerStage(cfg)
    assert stage.run(install_signals=False) == 0
    assert stage.version == 6  # versions never go backwards
    v6, base = _weights(tmp_path / "weights" / "v000006"), _weights(resolve_model("tiny-random"))
    assert all(torch.equal(v6[k], base[k]) for k in base)


def test_cli_refusal_is_one_clear_line(kafka_config, tmp_path):
    (tmp_path / "ckpt").mkdir()
    _trained_export(tmp_path / "weights", 5)
    cmd = [sys.executable, "-m", "pipeline", "trainer", "--model", "tiny-random", "--max-steps", "1",
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--export-dir", str(tmp_path / "weights"), "--engines", "",
           "--threads", "1", "--no-progress", "--bootstrap", kafka_config.kafka.bootstrap_servers,
           "--set", f"topics.prefix={kafka_config.topics.prefix}", "--log-level", "WARNING"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("pipeline trainer: checkpoint directory") and str(tmp_path / "weights") in line
    assert "Traceback" not in r.stderr
