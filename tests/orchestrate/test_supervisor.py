"""``pipeline up``'s supervisor: a stage that dies is restarted with back-off, restarts are counted
and shown; only repeated fast failures stop the stack (with the log tail).

Real child processes (``python -m pipeline front``: a small server that starts in about a second),
real ``kill -9``; the clock of the back-off schedule is injected so no test waits on it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pipeline.orchestrate.supervisor import RestartPolicy, Stage, StageFailed, StopOutcome, Supervisor, http_ok
from pipeline.orchestrate.up import Stack, parse_replicas, replica_names, status_line, stop_summary
from pipeline.procutil import free_port
from pipeline.testing.waiting import wait_for


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


def test_stop_all_can_keep_a_stage_running_until_a_later_call(tmp_path):
    # the demo stops every writer, reads the topics from the still-running broker, then stops it
    ports = [free_port(), free_port()]
    sup = Supervisor(tmp_path / "logs", policy=RestartPolicy(backoff_s=0.0))
    a, b = (sup.start(name, _front_args(p), ready=http_ok(f"http://127.0.0.1:{p}/_front/status"), timeout_s=120)
            for name, p in zip(("broker", "proxy"), ports))
    try:
        first = sup.stop_all(timeout_s=5, keep=("broker",))
        assert list(first) == ["proxy"] and first["proxy"].how == "stopped"
        assert a.alive and not b.alive and sup.check() == []  # kept, and nothing restarted
        assert httpx.get(f"http://127.0.0.1:{ports[0]}/_front/status", timeout=5).status_code == 200
        second = sup.stop_all(timeout_s=5)
        assert list(second) == ["proxy", "broker"] and second["proxy"] is first["proxy"]
        assert not a.alive
    finally:
        sup.stop_all(timeout_s=5)


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


def _child(tmp_path, name: str, on_term: str) -> Stage:
    """A stage process whose SIGTERM handler is ``on_term`` (Python source), started and ready."""
    code = ("import signal, sys, time\n"
            f"signal.signal(signal.SIGTERM, lambda *a: ({on_term}))\n"
            "print('ready', flush=True)\n"
            "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    return Stage(name, proc.args, tmp_path / f"{name}.log", proc=proc)


def test_a_clean_stop_reads_as_stopped_and_only_real_failures_as_exit_codes(tmp_path):
    port = free_port()
    sup = Supervisor(tmp_path / "logs")
    # a real stage (uvicorn re-raises the SIGTERM it handled: the process ends by the signal, -15)
    front = sup.start("front", _front_args(port), ready=http_ok(f"http://127.0.0.1:{port}/_front/status"),
                      timeout_s=120)
    outcome = sup.stop(front, timeout_s=30)
    assert outcome.clean and str(outcome) == "stopped" and outcome.code in (0, -signal.SIGTERM), outcome
    assert str(sup.stop(_child(tmp_path, "exits0", "sys.exit(0)"), timeout_s=30)) == "stopped"
    failed = sup.stop(_child(tmp_path, "exits3", "sys.exit(3)"), timeout_s=30)
    assert not failed.clean and str(failed) == "failed (exit 3)"
    killed = sup.stop(_child(tmp_path, "deaf", "None"), timeout_s=0.5)  # ignores SIGTERM
    assert not killed.clean and str(killed) == f"killed (exit {-signal.SIGKILL})"
    gone = _child(tmp_path, "gone", "sys.exit(0)")
    gone.proc.kill()
    gone.proc.wait()
    assert str(sup.stop(gone)) == f"exited (exit {-signal.SIGKILL})"  # it had died before the stop


def test_stop_summary_names_only_what_did_not_stop_cleanly():
    line = stop_summary({"dashboard": StopOutcome(-15, "stopped"), "proxy": StopOutcome(-15, "stopped"),
                         "engine": StopOutcome(0, "stopped"), "trainer": StopOutcome(-9, "killed"),
                         "teacher": StopOutcome(None, "not started")})
    assert line == "stopped cleanly: dashboard, proxy, engine, teacher | did not stop cleanly: trainer: killed (exit -9)"
    assert "-15" not in stop_summary({"proxy": StopOutcome(-15, "stopped"), "engine": StopOutcome(-15, "stopped")})


def test_broker_probe_answers_a_closed_port_at_once_and_quietly(caplog, monkeypatch):
    """A broker still starting: the readiness probe says no without a Kafka client (one would
    retry its bootstrap for ~30 s, logging each refused connection as an error)."""
    import kafka

    from pipeline.broker import kafka_answers

    built, real = [], kafka.KafkaAdminClient
    monkeypatch.setattr(kafka, "KafkaAdminClient", lambda *a, **k: built.append(a) or real(*a, **k))
    with caplog.at_level(logging.WARNING):
        assert kafka_answers(f"127.0.0.1:{free_port()}") is False
    assert built == [] and not [r for r in caplog.records if r.name.startswith("kafka")]


def test_status_line_reads_n_a_for_a_stage_that_serves_no_figure(tmp_path):
    """A stage whose /metrics cannot be read gives no figure: ``n/a``, never 0 (was "requests 0",
    "policy version 0")."""
    port = free_port()  # nothing listens there
    sup = Supervisor(tmp_path / "logs", policy=RestartPolicy(backoff_s=0.1, stable_s=0.5))
    url = f"http://127.0.0.1:{port}/metrics"
    line = status_line(Stack(config=None, run_dir=tmp_path, supervisor=sup,
                             metrics={"proxy": url, "judge": url, "trainer": url}))
    for figure in ("requests", "samples", "trainer steps", "policy version"):
        assert f"| {figure} n/a" in line, line


def test_status_line_counts_failed_syncs_only_when_there_are_some(tmp_path):
    """``| syncs failed N``: full-weight applies and tenant adapter loads the syncers answered
    ``failed`` for, summed over syncers; absent while none failed (issue 28)."""
    from prometheus_client import CollectorRegistry, Counter, start_http_server

    regs, urls, servers = [], {}, []
    for i in range(2):
        reg = CollectorRegistry()
        regs.append((Counter("pipeline_syncer_failed_total", "x", registry=reg),
                     Counter("pipeline_syncer_adapter_loads_total", "x", ["engine_id", "result"], registry=reg)))
        port = free_port()
        servers.append(start_http_server(port, addr="127.0.0.1", registry=reg))
        urls[f"syncer-{i}"] = f"http://127.0.0.1:{port}/metrics"
    sup = Supervisor(tmp_path / "logs", policy=RestartPolicy(backoff_s=0.1, stable_s=0.5))
    stack = Stack(config=None, run_dir=tmp_path, supervisor=sup, metrics=urls)
    try:
        regs[0][1].labels("engine-0", "applied").inc(5)
        assert "syncs failed" not in status_line(stack)
        regs[0][0].inc(3)
        regs[1][1].labels("engine-1", "failed").inc()
        regs[1][1].labels("engine-1", "applied").inc(2)
        assert "| syncs failed 4 |" in status_line(stack)
    finally:
        for server, thread in servers:
            server.shutdown()
            thread.join(timeout=5)


def test_status_line_says_how_many_samples_the_next_step_still_needs(tmp_path):
    """From the trainer's ``pipeline_trainer_batch_size`` and ``_batch_counted`` (issue 41);
    nothing when the trainer serves neither."""
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    reg = CollectorRegistry()
    size = Gauge("pipeline_trainer_batch_size", "x", registry=reg)
    counted = Gauge("pipeline_trainer_batch_counted", "x", registry=reg)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=reg)
    sup = Supervisor(tmp_path / "logs", policy=RestartPolicy(backoff_s=0.1, stable_s=0.5))
    stack = Stack(config=None, run_dir=tmp_path, supervisor=sup, metrics={"trainer": f"http://127.0.0.1:{port}/metrics"})
    try:
        assert "next step" not in status_line(stack)  # batch size 0: not reading a batch yet
        size.set(4)
        counted.set(3)
        assert "(next step: 1 more samples)" in status_line(stack)
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_status_line_says_which_version_the_engines_serve_when_it_is_not_the_trainers(tmp_path):
    """After a rollback (or while a canary holds) the engine serves another version than the
    trainer's counter: ``(engines serve v0)``; nothing while they agree or no engine reports one."""
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    gauges, urls, servers = {}, {}, []
    for name, metric in (("trainer", "pipeline_trainer_policy_version"), ("engine", "pipeline_engine_weight_version")):
        reg = CollectorRegistry()
        gauges[name] = Gauge(metric, "x", registry=reg)
        port = free_port()
        servers.append(start_http_server(port, addr="127.0.0.1", registry=reg))
        urls[name] = f"http://127.0.0.1:{port}/metrics"
    sup = Supervisor(tmp_path / "logs", policy=RestartPolicy(backoff_s=0.1, stable_s=0.5))
    try:
        gauges["trainer"].set(3)
        gauges["engine"].set(3)
        assert "engines serve" not in status_line(Stack(config=None, run_dir=tmp_path, supervisor=sup, metrics=urls))
        gauges["engine"].set(0)
        line = status_line(Stack(config=None, run_dir=tmp_path, supervisor=sup, metrics=urls))
        assert "| policy version 3 (engines serve v0) |" in line, line
        no_engine = {"trainer": urls["trainer"]}
        assert "engines serve" not in status_line(Stack(config=None, run_dir=tmp_path, supervisor=sup,
                                                        metrics=no_engine))
    finally:
        for server, thread in servers:
            server.shutdown()
            thread.join(timeout=5)
