"""The whole loop on a real vLLM (issue 38): ``pipeline up --engine vllm`` (here: its
:func:`start_stack` with ``engine.kind: vllm``) starts vLLM servers for the policy as a supervised
stage; simulated users talk through the proxy; the judge scores, the Megatron trainer steps, the
syncer reloads vLLM, and the proxy records the new version from vLLM's own answers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from pipeline import events
from pipeline.orchestrate.demo import read_topic
from pipeline.orchestrate.up import start_stack
from pipeline.testing.vllm import require_vllm
from tests.conftest import tiny_stack_config

MODEL = "tiny-random-64"


def _simulate(stack, run_dir, tmp_path, sessions: int, tag: str) -> dict:
    sim = subprocess.run(
        [sys.executable, "-m", "pipeline", "simulate", "--dataset", "gsm8k", "--sessions", str(sessions),
         "--proxy-url", stack.proxy_url, "--concurrency", "2", "--max-tokens", "16", "--max-turns", "2",
         "--log", str(tmp_path / f"sim-{tag}.jsonl"), "--no-progress", "--config", str(run_dir / "config.yaml")],
        capture_output=True, text=True, timeout=300)
    assert sim.returncode == 0, sim.stderr[-2000:]
    return json.loads(sim.stdout.strip().splitlines()[-1])


@pytest.mark.slow(seconds=150)
def test_loop_on_vllm_serves_the_trainers_weights(tmp_path):
    require_vllm()
    run_dir = tmp_path / "run"
    config = tiny_stack_config(run_dir, judge={"mode": "rl", "backend": "embedding", "idle_timeout_s": 5})
    config = config.replace(engine={"kind": "vllm", "model": MODEL, "context_length": 1024},
                            trainer={"model": MODEL})
    stack = start_stack(config, run_dir, ready_timeout_s=400)
    config = stack.config
    try:
        assert _simulate(stack, run_dir, tmp_path, 4, "a")["sessions_failed"] == 0
        deadline, version = time.monotonic() + 300, "0"
        while time.monotonic() < deadline and version in ("0", "default"):  # the engine's own word
            version = httpx.get(f"{config.engine.url}/weight_info", timeout=5).json()["weight_version"]
            time.sleep(1)
        assert version not in ("0", "default"), "no trainer step reached vLLM"
        assert _simulate(stack, run_dir, tmp_path, 2, "b")["sessions_failed"] == 0
        turns = [e for e in read_topic(config, "turns") if isinstance(e, events.Turn)]
        control = read_topic(config, "control")
    finally:
        codes = stack.stop()
    assert all(o.clean for o in codes.values()), codes
    applied = [c for c in control if c.action == "applied"]
    assert applied and applied[0].policy_version == 1
    assert all(t.response_token_ids and len(t.response_token_ids) == len(t.response_logprobs) for t in turns)
    assert all(t.logprob_temperature == 1.0 for t in turns)  # vLLM's raw log-probs
    versions = {t.policy_version for t in turns}
    assert 0 in versions and max(versions) >= 1, versions  # recorded from vLLM's answers, before and after
