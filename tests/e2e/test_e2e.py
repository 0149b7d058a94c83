"""CI-sized end to end: every stage as its own process (tiny model), simulated GSM8K users,
trainer steps and a weight sync; counts of events, samples and versions; metrics the dashboard
uses; no conversation text in default-level logs; no process left behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline import events
from pipeline.orchestrate.demo import read_topic
from pipeline.orchestrate.up import start_stack
from tests.conftest import tiny_stack_config

ROOT = Path(__file__).resolve().parents[2]
SESSIONS = 6


def _family_names(url: str) -> set[str]:
    text = httpx.get(url, timeout=5).text
    return {f.name for f in text_string_to_metric_families(text)}


def _dashboard_metrics() -> set[str]:
    dash = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    names = set()
    for p in dash["panels"]:
        for t in p["targets"]:
            names |= set(re.findall(r"pipeline_[a-z_]+", t["expr"]))
    return {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in names}


STAGE_OF_PREFIX = {"pipeline_proxy_": ["proxy"], "pipeline_judge_": ["judge"], "pipeline_trainer_": ["trainer"],
                   "pipeline_syncer_": ["syncer"], "pipeline_engine_": ["engine"],
                   "pipeline_events_": ["judge", "trainer"], "pipeline_consumer_": ["judge"],
                   "pipeline_dead_letters": ["judge", "trainer"], "pipeline_producer_": ["judge", "trainer"]}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not running
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.slow(seconds=80)
def test_whole_loop_tiny_model(tmp_path):
    run_dir = tmp_path / "run"
    config = tiny_stack_config(run_dir, judge={"mode": "rl", "backend": "embedding", "idle_timeout_s": 5})
    stack = start_stack(config, run_dir, ready_timeout_s=300)
    config = stack.config  # with the broker, ports and URLs the stages run with
    pids = stack.supervisor.pids()
    try:
        sim = subprocess.run(
            [sys.executable, "-m", "pipeline", "simulate", "--dataset", "gsm8k", "--sessions", str(SESSIONS),
             "--proxy-url", stack.proxy_url, "--concurrency", "3", "--max-tokens", "24", "--max-turns", "2",
             "--log", str(tmp_path / "sim.jsonl"), "--no-progress", "--config", str(run_dir / "config.yaml")],
            capture_output=True, text=True, timeout=300)
        assert sim.returncode == 0, sim.stderr[-2000:]
        summary = json.loads(sim.stdout.strip().splitlines()[-1])
        assert summary["sessions"] == SESSIONS and summary["sessions_failed"] == 0

        # the trainer takes >= 1 step and the engine applies the new version
        deadline = time.monotonic() + 240
        version = "0"
        while time.monotonic() < deadline:
            version = httpx.get(f"{config.engine.url}/model_info", timeout=5).json()["weight_version"]
            if version != "0":
                break
            time.sleep(1)
        assert version != "0", "no weight sync reached the engine"

        # every stage serves the metric names the Grafana dashboard uses
        exposed = {name: _family_names(url) for name, url in stack.metrics.items()}
        missing = []
        for metric in _dashboard_metrics():
            stages = next(v for k, v in STAGE_OF_PREFIX.items() if metric.startswith(k))
            for s in stages:
                if metric not in exposed[s]:
                    missing.append(f"{s}: {metric}")
        assert not missing, f"dashboard metrics not served: {missing}"

        # wait for what the assertions below read: every turn judged, the v1 sync resumed
        deadline = time.monotonic() + 120
        while True:
            turns = read_topic(config, "turns")
            samples = read_topic(config, "samples")
            control = read_topic(config, "control")
            judged = len({s.sample_id for s in samples}) >= sum(isinstance(e, events.Turn) for e in turns)
            resumed = any(c.action == "resume" and c.policy_version == 1 for c in control)
            if (judged and resumed) or time.monotonic() > deadline:
                break
    finally:
        codes = stack.stop()
    # clean shutdown, nothing left behind
    assert all(not _alive(p) for p in pids), "a stage process survived the shutdown"
    # every stage stopped as asked (uvicorn re-raises the SIGTERM it handled: -15 is a clean stop)
    assert all(o.clean and o.code in (0, -15) for o in codes.values()), codes

    sim_rows = [json.loads(line) for line in (tmp_path / "sim.jsonl").read_text().splitlines()]
    kinds = Counter(type(e).__name__ for e in turns)
    assert kinds["Turn"] == len(sim_rows), "one turn event per reply"
    assert kinds["SessionEnd"] == SESSIONS
    assert len({e.session_id for e in turns}) == SESSIONS
    # every non-closing reply got feedback, i.e. a next state
    assert kinds["NextState"] == sum(1 for r in sim_rows if not r.get("closing"))
    for t in (e for e in turns if isinstance(e, events.Turn)):
        assert t.prompt_token_ids and len(t.response_token_ids) == len(t.response_logprobs) > 0
    # Binary RL: one sample per main turn (the closing turn is flushed by session_end with mask 0)
    ids = [s.sample_id for s in samples]
    assert len(set(ids)) == kinds["Turn"], (len(set(ids)), kinds["Turn"])
    assert {s.kind for s in samples} == {"rl"}
    # a vote in {-1, 0, 1}; the closing turn (no next state) carries no reward at all
    assert all(s.reward in (-1.0, 0.0, 1.0) or (s.reward is None and not s.loss_mask) for s in samples)
    # the weight-sync protocol ran: pause -> weights -> applied -> resume for version 1
    v1 = [c.action for c in control if c.policy_version == 1]
    assert v1[:2] == ["pause", "weights"] and "applied" in v1 and v1[-1] == "resume", v1
    steps = [json.loads(line) for line in Path(config.trainer.metrics_file).read_text().splitlines()]
    assert steps and steps[0]["step"] == 1

    # no conversation text in logs at the default level (INFO)
    texts = [r["reply"] for r in sim_rows if len(r.get("reply") or "") > 20]
    from pipeline.simulate.datasets import load_gsm8k
    questions = {p.question for p in load_gsm8k("train")}
    logs = "\n".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log"))
    assert texts
    for t in texts:
        assert t not in logs, "a model reply appears in a log"
    for q in questions:
        assert q[:60] not in logs, "a user message appears in a log"
