"""What a user reads in the trainer's log: at the default level (INFO) the trainer's own lines,
not megatron-core's config dumps, gradient-bucket parameter lists or "Transformer Engine / Apex
is not installed" warnings (expected on a CPU install); at DEBUG those are still there.

A real ``pipeline trainer`` process (tiny model, one step) on the test broker."""

from __future__ import annotations

import os
import subprocess
import sys

from pipeline import events
from pipeline.bus import EventProducer
from pipeline.testing.topics import publish
from tests.trainer.samples import rl_sample

CHATTER = ("Params for bucket", "OptimizerConfig(", "DistributedDataParallelConfig(", "Transformer Engine",
           "Apex", "full scope is deprecated", "Megatron-FSDP")


def _trainer_log(cfg, tmp_path, level: str, steps: int) -> str:
    cmd = [sys.executable, "-m", "pipeline", "trainer", "--model", "tiny-random", "--batch-size", "2",
           "--max-steps", str(steps), "--checkpoint-dir", str(tmp_path / "ckpt"), "--export-dir",
           str(tmp_path / "weights"), "--engines", "", "--threads", "1", "--no-progress",
           "--bootstrap", cfg.kafka.bootstrap_servers, "--set", f"topics.prefix={cfg.topics.prefix}",
           "--set", "trainer.poll_timeout_s=0.2", "--log-level", level]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    out = subprocess.run(cmd, env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


def test_trainer_info_log_holds_no_library_chatter_and_debug_keeps_it(kafka_config, tmp_path):
    publish(kafka_config, [rl_sample(i) for i in range(4)], "samples")
    info = _trainer_log(kafka_config, tmp_path, "INFO", steps=1)
    assert "step 1 v1" in info, info[-2000:]
    assert [c for c in CHATTER if c in info] == [], info[:3000]
    debug = _trainer_log(kafka_config, tmp_path, "DEBUG", steps=2)  # restarts from step 1's checkpoint
    assert "step 2 v2" in debug, debug[-2000:]
    assert "Params for bucket" in debug and "Transformer Engine" in debug


def test_absent_figures_read_n_a_in_the_log_and_nan_in_prometheus(kafka_config, tmp_path):
    """A batch whose samples carry no reward (OPD only) has no reward mean: the trainer's log line
    says ``reward n/a`` (was ``reward 0.000``)."""
    p = EventProducer(kafka_config, name="test")
    for i in range(2):
        toks = [(i * 7 + j) % 5000 + 1 for j in range(10)]
        s = events.Sample(sample_id=f"o{i}:0:opd", session_id=f"o{i}", turn_index=0, kind="opd", tokens=toks,
                          response_length=4, rollout_log_probs=[-2.0] * 4, teacher_log_probs=[-1.0] * 4, reward=None)
        p.send(kafka_config.topics.name("samples"), s, key=s.session_id)
    p.flush(10)
    p.close()
    info = _trainer_log(kafka_config, tmp_path, "INFO", steps=1)
    line = next((x for x in info.splitlines() if "step 1 v1" in x), None)
    assert line is not None and "reward n/a" in line and "reward 0" not in line, info[-2000:]


def test_prometheus_gauges_of_absent_figures_read_nan():
    """Every per-step gauge reads NaN when the step record lacks its figure (no reward, no sample
    sampled by a policy, no trainable sample), never 0 and never the previous step's value (was:
    staleness kept its last value, and a skipped step left every gauge at the previous one)."""
    import math

    from pipeline.trainer import prom

    gauges = {"reward_mean": prom.REWARD, "staleness_mean": prom.STALENESS, "loss": prom.LOSS,
              "logprob_abs_diff": prom.LOGPROB_DIFF}
    full = {"step": 1, "policy_version": 1, "loss": 0.5, "reward_mean": 0.25, "staleness_mean": 1.0,
            "logprob_abs_diff": 0.01}
    prom.observe_step(full)
    assert {k: g._value.get() for k, g in gauges.items()} == {k: full[k] for k in gauges}
    for skipped in (False, True):
        prom.observe_step(full)
        prom.observe_step({"step": 2, "policy_version": 1, "skipped": skipped, "loss": 0.5, "reward_mean": None})
        assert prom.LOSS._value.get() == 0.5
        for k in ("reward_mean", "staleness_mean", "logprob_abs_diff"):
            assert math.isnan(gauges[k]._value.get()), (skipped, k)
    from pipeline.trainer.metrics import fmt, step_line

    assert (fmt(None), fmt(float("nan")), fmt(0.0), fmt(0.12345, ".2f")) == ("n/a", "n/a", "0.0000", "0.12")
    assert step_line({"step": 3, "policy_version": 2, "batch_samples": 0}) == \
        "step 3 v2 loss n/a reward n/a samples 0 (n/a s)"
