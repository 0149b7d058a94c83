"""Two tenants' traffic through the whole stack (every stage its own process, tiny-random):
each tenant's samples train its own LoRA adapter, the adapter is synced to the engine through
``control``, and the proxy serves each tenant with its own adapter version (read from the turn
records, checked against the engine's own report), never the other tenant's; no batch mixes
tenants and no sample of one tenant reaches the other's batches (docs/tenants.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pipeline import events
from pipeline.config import load_config
from pipeline.orchestrate.demo import read_topic
from pipeline.orchestrate.up import start_stack

TENANTS = ("alice", "bob")


def _config(run_dir: Path):
    return load_config(
        None,
        engine={"model": "tiny-random", "threads": 1, "max_batch_size": 8, "enable_lora": True},
        trainer={"model": "tiny-random", "rollout_batch_size": 4, "lr": 1e-3, "threads": 1,
                 "checkpoint_dir": str(run_dir / "ckpt"), "export_dir": str(run_dir / "weights"),
                 "metrics_file": str(run_dir / "trainer.jsonl"), "progress": False, "max_staleness": None,
                 "per_tenant": True, "tenant_max_wait_records": 64, "log_sample_ids": True,
                 "lora": {"rank": 4, "alpha": 8}},
        judge={"mode": "rl", "backend": "embedding", "idle_timeout_s": 5})


def _simulate(stack, run_dir: Path, tenant: str, sessions: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", "simulate", "--dataset", "gsm8k", "--sessions", str(sessions),
         "--proxy-url", stack.proxy_url, "--concurrency", "2", "--max-tokens", "16", "--max-turns", "2",
         "--tenant", tenant, "--session-prefix", f"{tenant}-{log.stem}", "--log", str(log), "--no-progress",
         "--config", str(run_dir / "config.yaml")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run_round(stack, run_dir: Path, tmp_path: Path, name: str, sessions: int) -> None:
    procs = [_simulate(stack, run_dir, t, sessions, tmp_path / f"{name}-{t}.jsonl") for t in TENANTS]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["sessions_failed"] == 0, summary


def _served_adapters(control: list) -> dict[str, dict]:
    """Each tenant's adapter of its last ``resume`` that names one (what the proxy routes it to)."""
    out: dict[str, dict] = {}
    for c in control:
        if isinstance(c, events.Control) and c.action == "resume" and c.tenant is not None:
            if c.adapter is not None:
                out[c.tenant] = c.adapter
            else:
                out.pop(c.tenant, None)
    return out


@pytest.mark.slow(seconds=240)
def test_two_tenants_train_two_adapters_and_are_served_by_their_own(tmp_path):
    run_dir = tmp_path / "run"
    stack = start_stack(_config(run_dir), run_dir, ready_timeout_s=300)
    config = stack.config
    try:
        _run_round(stack, run_dir, tmp_path, "first", sessions=3)
        deadline = time.monotonic() + 240  # both tenants' first adapter synced and routed
        while set(_served_adapters(read_topic(config, "control"))) != set(TENANTS):
            assert time.monotonic() < deadline, [
                (c.action, c.tenant, c.adapter and c.adapter["name"]) for c in read_topic(config, "control")]
            time.sleep(1)
        served = _served_adapters(read_topic(config, "control"))
        loaded = {m["id"] for m in httpx.get(f"{config.engine.url}/v1/models", timeout=5).json()["data"]}
        assert all(any(a["name"] in m for m in loaded) for a in served.values()), (served, loaded)
        _run_round(stack, run_dir, tmp_path, "second", sessions=1)
        deadline = time.monotonic() + 120  # every turn judged
        while True:
            turns = [e for e in read_topic(config, "turns") if isinstance(e, events.Turn)]
            samples = read_topic(config, "samples")
            if len({s.sample_id for s in samples}) >= len(turns) or time.monotonic() > deadline:
                break
            time.sleep(1)
        control = read_topic(config, "control")
    finally:
        stack.stop()
    published: dict[str, set[str]] = {t: set() for t in TENANTS}  # every adapter version each tenant got
    for c in control:
        if c.action == "weights" and c.tenant is not None:
            assert c.adapter["name"].startswith(f"{c.tenant}@") and c.sha256 == c.adapter["sha256"]
            published[c.tenant].add(c.adapter["version"])
    assert all(published[t] for t in TENANTS) and not published["alice"] & published["bob"]
    # served by its own adapter: every turn's adapter is one published for its own tenant; the
    # second round (after both resumes) is served by an adapter, never the base, never the other's
    assert {t.tenant for t in turns} == set(TENANTS)
    for t in turns:
        assert t.adapter is None or t.adapter["version"] in published[t.tenant], (t.tenant, t.adapter)
    second = [t for t in turns if "-second" in t.session_id]
    assert second and all(t.adapter is not None for t in second)
    # the judge copies tenant and adapter; no batch mixes tenants, no sample crosses
    by_id = {s.sample_id: s for s in samples}
    for s in samples:
        assert s.sample_id.startswith(f"{s.tenant}/")
    steps = [json.loads(line) for line in Path(config.trainer.metrics_file).read_text().splitlines()]
    trained = [r for r in steps if r.get("sample_ids")]
    assert {r["tenant"] for r in trained} == set(TENANTS)
    for r in trained:
        assert {by_id[i].tenant for i in r["sample_ids"] if i in by_id} == {r["tenant"]}
        assert all(i.startswith(f"{r['tenant']}/") for i in r["sample_ids"])
