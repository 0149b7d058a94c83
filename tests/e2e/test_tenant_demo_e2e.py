"""``pipeline demo --tenants`` end to end on tiny-random (plumbing only: a random model learns
nothing): both tenants get an adapter through adapter sync, each adapter version is evaluated
through the engine under its own name, the base beside, and report.json/png hold both curves."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow(seconds=180)
def test_tenant_demo_reports_both_tenants_adapters_and_the_base(tmp_path):
    out = tmp_path / "report"
    r = subprocess.run(
        [sys.executable, "-m", "pipeline", "demo", "--tenants", "--model", "tiny-random", "--steps", "1",
         "--batch-size", "4", "--eval-prompts", "4", "--eval-samples", "1", "--max-tokens", "16",
         "--concurrency", "4", "--repeat", "1", "--max-minutes", "4", "--report-dir", str(out)],
        capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "tenants" and not report["notes"], report["notes"]
    evs = report["evaluations"]
    assert evs[0]["target"] == "base" and evs[0]["adapter"] is None
    for tenant in ("alice", "bob"):
        mine = [e for e in evs if e["target"] == tenant]
        assert mine and all(e["adapter"].startswith(f"{tenant}@") for e in mine), evs
        pts = report["curves"]["users"][tenant]["points"]
        assert [p["version"] for p in pts] == [e["version"] for e in mine]
        assert all(p["own"]["n"] == 4 and p["other"]["n"] == 4 for p in pts)
        assert report["verdicts"][tenant] is not None
    assert (out / "report.png").stat().st_size > 0
    assert "verdict alice" in r.stdout and "verdict bob" in r.stdout
