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

CHATTER = ("Params for bucket", "OptimizerConfig(", "DistributedDataParallelConfig(", "Transformer Engine",
           "Apex", "full scope is deprecated", "Megatron-FSDP")


def _produce(cfg, n):
    p = EventProducer(cfg, name="test")
    for i in range(n):
        toks = [(i * 7 + j) % 5000 + 1 for j in range(10)]
        s = events.Sample(sample_id=f"s{i}:0:rl", session_id=f"s{i}", turn_index=0, tokens=toks,
                          response_length=4, rollout_log_probs=[-2.0] * 4, reward=(-1.0) ** i)
        p.send(cfg.topics.name("samples"), s, key=s.session_id)
    p.flush(10)
    p.close()


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
    _produce(kafka_config, 4)
    info = _trainer_log(kafka_config, tmp_path, "INFO", steps=1)
    assert "step 1 v1" in info, info[-2000:]
    assert [c for c in CHATTER if c in info] == [], info[:3000]
    debug = _trainer_log(kafka_config, tmp_path, "DEBUG", steps=2)  # restarts from step 1's checkpoint
    assert "step 2 v2" in debug, debug[-2000:]
    assert "Params for bucket" in debug and "Transformer Engine" in debug
