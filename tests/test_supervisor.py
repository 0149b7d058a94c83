"""``pipeline up``'s supervisor: a stage that dies is restarted with back-off, restarts are counted
and shown; only repeated fast failures stop the stack (with the log tail).

Real child processes (``python -m pipeline front``: a small server that starts in about a second),
real ``kill -9``; the clock of the back-off schedule is injected so no test waits on it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from pipeline.procutil import free_port
from pipeline.orchestrate.supervisor import RestartPolicy, StageFailed, Supervisor, http_ok
from pipeline.orchestrate.up import Stack, parse_replicas, replica_names, status_line
from tests.support.waiting import wait_for


def _front_args(port: int) -> list[str]:
    return ["front", "--port", str(port), "--backend", "http://127.0.0.1:9"]


def test_a_killed_stage_is_restarted_with_the_same_arguments_and_counted(tmp_path):
    port = free_port()
    sup = Supervisor(tmp_path / "logs", policy=RestartPolicy(backoff_s=0.1, stable_s=0.5))
    ready = http_ok(f"http://127.0.0.1:{port}/_front/status")
    try:
        st = sup.start("front", _front_args(port), ready=ready, timeout_s=120)
        first_pid, argv = st.pid, list(st.argv)
        time.sleep(0.6)  # a run longer than stable_s: not a fast failure
        os.kill(first_pid, signal.SIGKILL)
        lines = wait_for(lambda: sup.check())
        assert "exited with -9" in lines[0] and "restart #1 in 0.0 s" in lines[0], lines
        wait_for(lambda: sup.check() is not None and st.alive and st.pid != first_pid)
        assert st.argv == argv and st.restarts == 1 and st.exits == [-9]
        assert "restarts 1" in status_line(Stack(config=None, run_dir=tmp_path, supervisor=sup))
        wait_for(lambda: (sup.check(), st.state == "up")[1], timeout_s=120)
        assert httpx.get(f"http://127.0.0.1:{port}/_front/status", timeout=5).status_code == 200, "serves again"
    finally:
        sup.stop_all(timeout_s=5)
    assert not st.alive


def test_fast_failures_back_off_exponentially_then_stop_with_the_log_tail(tmp_path):
    pol = RestartPolicy(backoff_s=1.0, max_backoff_s=3.0, stable_s=1000.0, max_fast_failures=4)
    sup = Supervisor(tmp_path / "logs", policy=pol)
    # exits at once with a usage error (missing --backend): a stage that cannot start
    st = sup.start("broken", ["front", "--port", str(free_port())])
    wait_for(lambda: not st.alive)
    delays, now = [], 10_000.0
    st.started_at = now
    try:
        for _ in range(3):
            sup.check(now=now)  # sees the exit, schedules the restart
            delays.append(st.restart_at - now)
            assert st.state.startswith("restarting in")
            now = st.restart_at
            sup.check(now=now)  # restarts it
            assert st.proc is not None
            wait_for(lambda: not st.alive)
            st.started_at = now
        assert delays == [1.0, 2.0, 3.0], "doubling from backoff_s, capped at max_backoff_s"
        assert st.restarts == 3
        with pytest.raises(StageFailed) as e:
            sup.check(now=now)
        assert "failed 4 times in a row" in str(e.value) and "--backend" in str(e.value), "the log tail is shown"
    finally:
        sup.stop_all(timeout_s=5)


def test_a_stable_run_resets_the_back_off(tmp_path):
    pol = RestartPolicy(backoff_s=1.0, stable_s=5.0, max_fast_failures=2)
    sup = Supervisor(tmp_path / "logs", policy=pol)
    st = sup.start("broken", ["front", "--port", str(free_port())])
    wait_for(lambda: not st.alive)
    try:
        st.started_at = 0.0
        sup.check(now=1.0)  # ran 1 s: fast failure 1 -> back-off 1 s
        assert st.fast_failures == 1 and st.restart_at == 2.0
        sup.check(now=2.0)
        wait_for(lambda: not st.alive)
        st.started_at = 2.0
        sup.check(now=100.0)  # ran 98 s: stable, restarted at once; no stop although max_fast_failures is 2
        assert st.fast_failures == 0 and st.restarts == 2 and st.restart_at is None, "restarted without delay"
    finally:
        sup.stop_all(timeout_s=5)


def test_no_restart_after_stop_all(tmp_path):
    port = free_port()
    sup = Supervisor(tmp_path / "logs", policy=RestartPolicy(backoff_s=0.0))
    st = sup.start("front", _front_args(port), ready=http_ok(f"http://127.0.0.1:{port}/_front/status"),
                   timeout_s=120)
    sup.stop_all(timeout_s=5)
    assert sup.check() == [] and not st.alive and st.restarts == 0


def test_replicas_flag():
    assert parse_replicas("proxy=2,judge=3") == {"proxy": 2, "judge": 3, "engine": 1}
    assert replica_names("proxy", 1) == ["proxy"] and replica_names("judge", 2) == ["judge-0", "judge-1"]
    import argparse

    for bad in ("trainer=2", "proxy=0", "proxy=x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_replicas(bad)


def test_stage_logs_are_appended_across_restarts(tmp_path):
    sup = Supervisor(tmp_path / "logs", policy=RestartPolicy(backoff_s=0.0, stable_s=1000.0, max_fast_failures=3))
    st = sup.start("broken", ["front", "--port", str(free_port())])
    try:
        wait_for(lambda: not st.alive)
        sup.check()  # back-off 0: restarted within this pass
        assert st.restarts == 1
        wait_for(lambda: not st.alive)
    finally:
        sup.stop_all(timeout_s=5)
    assert Path(st.log_path).read_text().count("--backend") >= 2, "both runs' output kept"
