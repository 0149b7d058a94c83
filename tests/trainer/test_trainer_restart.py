"""Kill the trainer process (``kill -9``) in the middle of a step, restart it: every produced
sample is trained exactly once and policy versions keep counting.

The kill is proven to land in the middle of the work, from the outside, before it is sent: two
steps are done (checkpointed, committed to the group), the third batch is consumed, and the
trainer's /metrics shows some but not all of step 3's ``steps_per_batch`` optimizer steps
(half-trained). After the kill, step 3 has no checkpoint and no log line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

from pipeline.jsonl import read_jsonl
from pipeline.procutil import free_port
from pipeline.testing.topics import publish
from tests.conftest import scrape
from tests.trainer.samples import rl_sample

BATCH, OPT_STEPS = 3, 12  # samples per trainer step, optimizer steps per trainer step


def _records(path):
    return read_jsonl(path, strict=False, missing_ok=True)


def _trainer(cfg, tmp_path, max_steps, port):
    cmd = [sys.executable, "-m", "pipeline", "trainer", "--model", "tiny-random", "--batch-size", str(BATCH),
           "--max-steps", str(max_steps), "--checkpoint-dir", str(tmp_path / "ckpt"),
           "--export-dir", str(tmp_path / "weights"), "--engines", "", "--threads", "1", "--no-progress",
           "--bootstrap", cfg.kafka.bootstrap_servers, "--set", f"topics.prefix={cfg.topics.prefix}",
           "--set", "trainer.lr=0.001", "--set", "trainer.poll_timeout_s=0.2",
           "--set", f"trainer.steps_per_batch={OPT_STEPS}", "--set", f"metrics_port={port}", "--log-level", "WARNING"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(proc, cond, what: str, timeout_s: float = 180.0):
    """Poll ``cond()`` (returns a truthy observation or None) until it holds; fail if the trainer exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        assert proc.poll() is None, f"trainer exited before {what}: {proc.stdout.read()[-3000:]}"
        time.sleep(0.01)
    raise AssertionError(f"trainer never reached: {what}")


def _kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def _committed(cfg) -> int:
    from pipeline.bus import TopicReader

    with TopicReader(cfg, cfg.topics.name("samples"), name="test", group_id=cfg.trainer.group_id) as r:
        return sum(o or 0 for o in r.committed().values())


def test_trainer_killed_half_trained_restarts_without_training_a_sample_twice(kafka_config, tmp_path):
    metrics, ckpt = tmp_path / "ckpt" / "metrics.jsonl", tmp_path / "ckpt"
    samples_topic = kafka_config.topics.name("samples")
    publish(kafka_config, [rl_sample(i, "sess") for i in range(12)], "samples")  # four batches of 3

    port = free_port()
    proc = _trainer(kafka_config, tmp_path, max_steps=4, port=port)
    try:
        def mid_step_3():
            m = scrape(port)
            n = m.get("pipeline_trainer_optimizer_steps_total", 0)
            return m if 2 * OPT_STEPS < n <= 2 * OPT_STEPS + OPT_STEPS // 2 else None

        seen = _wait_for(proc, mid_step_3, "the middle of step 3")
        _kill(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    # what the killed trainer had done: consumed batch 3, trained part of it, committed steps 1-2
    opt_steps = seen["pipeline_trainer_optimizer_steps_total"]
    assert 2 * OPT_STEPS < opt_steps < 3 * OPT_STEPS, "killed inside step 3, between its optimizer steps"
    assert seen.get("pipeline_records_consumed_total", 0) >= 3 * BATCH
    assert [r["step"] for r in _records(metrics)] == [1, 2], "step 3 was never finished"
    assert not (ckpt / "step_00000003").exists() and (ckpt / "latest").read_text().strip() == "step_00000002"
    assert _committed(kafka_config) == 2 * BATCH

    # the survivor redoes step 3 from the checkpoint of step 2 and finishes
    proc = _trainer(kafka_config, tmp_path, max_steps=4, port=free_port())
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    recs = _records(metrics)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert [r["policy_version"] for r in recs] == [1, 2, 3, 4]
    assert all(r["optimizer_steps"] == OPT_STEPS * r["step"] for r in recs), "no half step survived in the state"
    trained = Counter(i for r in recs for i in r["sample_ids"])
    assert set(trained) == {f"sess{i}:0:rl" for i in range(12)}
    assert max(trained.values()) == 1
    meta = json.loads((ckpt / "step_00000004" / "meta.json").read_text())
    assert sum(meta["offsets"][samples_topic].values()) == 12
    assert _committed(kafka_config) == 12
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["published.json", "v000002", "v000003",
                                                                          "v000004"]
    assert json.loads((tmp_path / "weights" / "published.json").read_text())["policy_version"] == 4
