"""``python -m pipeline evaluator`` as its own process: it refuses to start with rollout off,
and with rollout on it follows the topics live (the records arrive after it started) and
publishes alice's rollback on ``control`` exactly once, then stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from pipeline.testing.waiting import wait_for
from tests.evaluator.scenario import adapter, decisions, publish_all, sync, traffic
from tests.processes import PipelineProcess

A1 = adapter("alice", "a")


def _args(config, *extra: str) -> list[str]:
    return ["evaluator", "--bootstrap", config.kafka.bootstrap_servers, "--set",
            f"topics.prefix={config.topics.prefix}", *extra]


def test_the_evaluator_refuses_to_start_with_rollout_off(kafka_config):
    r = subprocess.run([sys.executable, "-m", "pipeline", *_args(kafka_config)], capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "set rollout.enabled=true" in r.stderr


@pytest.mark.slow(seconds=15)
def test_the_evaluator_process_publishes_a_rollback_once(kafka_config):
    rule = ["--set", "rollout.enabled=true", "--set", "trainer.lora.rank=4", "--set", "rollout.min_n=20", "--set", "rollout.rollback_min_n=10",
            "--set", "rollout.max_n=100"]
    p = PipelineProcess(*_args(kafka_config, *rule))
    try:
        p.wait_line(r".*decider caught up", "the evaluator never read the (empty) topics", 90)
        publish_all(kafka_config, sync("alice", 1, A1, 1) + traffic("alice", A1, {"candidate": 1, "incumbent": 9},
                                                                         0, 40, 100))
        p.wait_line(r".*published rollback of alice's adapter", "the evaluator published no rollback", 60)
        got = wait_for(lambda: decisions(kafka_config, 1), "the rollback on control", timeout_s=30)
        assert [(d.action, d.tenant, d.adapter) for d in got] == [("rollback", "alice", A1)]
    finally:
        p.proc.send_signal(signal.SIGTERM)
        rc = p.proc.wait(30)
    assert rc == 0, "".join(p.output)
    assert len(decisions(kafka_config)) == 1, "".join(p.output)
