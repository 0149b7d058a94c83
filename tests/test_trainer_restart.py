"""Kill the trainer process and restart it: every produced sample is trained exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

from pipeline import events
from pipeline.bus import EventProducer


def _produce(cfg, ids):
    p = EventProducer(cfg, name="test")
    for i in ids:
        toks = [(i * 7 + j) % 5000 + 1 for j in range(10)]
        s = events.Sample(sample_id=f"sess{i}:0:rl", session_id=f"sess{i}", turn_index=0, tokens=toks,
                          response_length=4, rollout_log_probs=[-2.0] * 4, reward=(-1.0) ** i)
        p.send(cfg.topics.name("samples"), s, key=s.session_id)
    p.flush(10)
    p.close()


def _records(path):
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def _trainer(cfg, tmp_path, max_steps):
    cmd = [sys.executable, "-m", "pipeline", "trainer", "--model", "tiny-random", "--batch-size", "3",
           "--max-steps", str(max_steps), "--checkpoint-dir", str(tmp_path / "ckpt"),
           "--export-dir", str(tmp_path / "weights"), "--engines", "", "--threads", "1", "--no-progress",
           "--bootstrap", cfg.kafka.bootstrap_servers, "--set", f"topics.prefix={cfg.topics.prefix}",
           "--set", "trainer.lr=0.001", "--set", "trainer.poll_timeout_s=0.2", "--log-level", "WARNING"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_killed_trainer_restarts_without_training_a_sample_twice(kafka_config, tmp_path):
    metrics = tmp_path / "ckpt" / "metrics.jsonl"
    _produce(kafka_config, range(6))  # two batches of 3
    proc = _trainer(kafka_config, tmp_path, max_steps=4)
    try:
        deadline = time.monotonic() + 120
        while len(_records(metrics)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_records(metrics)) == 2, proc.stdout.read() if proc.poll() is not None else "no progress"
        time.sleep(0.5)  # it is now waiting for a third batch: between steps
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    _produce(kafka_config, range(6, 12))
    proc = _trainer(kafka_config, tmp_path, max_steps=4)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    recs = _records(metrics)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert [r["policy_version"] for r in recs] == [1, 2, 3, 4]
    trained = Counter(i for r in recs for i in r["sample_ids"])
    assert set(trained) == {f"sess{i}:0:rl" for i in range(12)}
    assert max(trained.values()) == 1
    meta = json.loads((tmp_path / "ckpt" / "step_00000004" / "meta.json").read_text())
    assert sum(meta["offsets"][kafka_config.topics.name("samples")].values()) == 12
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["published.json", "v000002", "v000003",
                                                                          "v000004"]
    assert json.loads((tmp_path / "weights" / "published.json").read_text())["policy_version"] == 4
