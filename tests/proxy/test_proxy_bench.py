"""bench/proxy.py's goal checks and bench/proxy_stages.py's stage table (logic only: no timing
is asserted; the numbers themselves live in the bench's output)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(p50: float, rps: float, ttft: float) -> dict:
    return {"p50": p50, "p99": 2 * p50, "rps": rps, "ttft50": ttft, "ttft99": ttft, "errors": 0}


def _results(proxy_p50: float, proxy_ttft1: float, proxy_rps16: float, proxy_ttft16: float = 7.0) -> dict:
    return {(False, 1): {"direct": _run(0.2, 5000, 0), "naive": _run(1.0, 1000, 0), "proxy": _run(proxy_p50, 900, 0)},
            (False, 16): {"direct": _run(1.0, 9000, 0), "naive": _run(10, 800, 0), "proxy": _run(5, proxy_rps16, 0)},
            (True, 1): {"direct": _run(0, 3, 5.0), "naive": _run(0, 3, 6.0), "proxy": _run(0, 3, proxy_ttft1)},
            (True, 16): {"direct": _run(0, 40, 5.0), "naive": _run(0, 40, 8.0), "proxy": _run(0, 40, proxy_ttft16)}}


METRICS = """pipeline_proxy_requests_total{status="200",stream="false"} 90.0
pipeline_proxy_requests_total{status="200",stream="true"} 10.0
pipeline_proxy_turns_total{turn_type="main"} 100.0
pipeline_proxy_events_delivered_total 199.0
pipeline_proxy_events_buffered 0.0
pipeline_proxy_events_dropped_total{reason="buffer_full"} %s
"""


def test_the_goals_pass_and_miss_on_their_bounds():
    bench = _load("proxy")
    ok = {name: passed for name, passed, _ in bench._checks(_results(1.1, 5.9, 2100), METRICS % "0.0")}
    assert list(ok.values()) == [True, True, True, True, True], ok
    bad = {name: passed for name, passed, _ in bench._checks(_results(1.3, 6.1, 1900, 8.1), METRICS % "1.0")}
    assert not any(bad.values()), bad  # 1.1 ms added, TTFT behind naive's, 2.375x, a dropped event
    lost = {name: passed for name, passed, _ in
            bench._checks(_results(1.1, 5.9, 2100), METRICS.replace("turns_total{turn_type=\"main\"} 100.0",
                                                                    "turns_total{turn_type=\"main\"} 99.0") % "0.0")}
    assert [name for name, passed in lost.items() if not passed] == [
        "nothing lost: every request a turn, every event delivered, none dropped or not durable"]


def test_the_stage_table_times_every_stage_on_the_bench_workload():
    stages = _load("proxy_stages")
    us = stages.measure(requests=12, warmup=2)
    assert list(us) == list(stages.STAGES) and all(v > 0 for v in us.values())
