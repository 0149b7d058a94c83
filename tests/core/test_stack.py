"""A running stack is found, not configured (:mod:`pipeline.stack`): commands that talk to the
broker use the running stack's ``stack.json`` when no address is given (via ``PIPELINE_STACK`` or
the pointer ``pipeline up`` writes), say so in one line, and fail fast in one line when there is
none. The real ``pipeline up`` (tiny model) writes the file and the pointer and removes the pointer
at its stop."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.config import load_config
from pipeline.procutil import free_port, port_free
from pipeline.stack import NoStack, find_stack, pointer_path, resolve, write_pointer, write_stack

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_stack(tmp_path, monkeypatch) -> Path:
    """A private state folder (no pointer) and no PIPELINE_STACK."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("PIPELINE_STACK", raising=False)
    return tmp_path / "state"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_no_stack_fails_fast_in_one_line(no_stack, tmp_path):
    if not port_free(9092):
        pytest.skip("something listens at the default broker address 127.0.0.1:9092")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE_")}
    env.update(XDG_STATE_HOME=str(no_stack), PYTHONPATH=str(ROOT))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pipeline", "tail", "turns", "--session", "s"], env=env,
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no running stack" in lines[0] and "pipeline up" in lines[0], out.stderr
    assert time.monotonic() - t0 < 15  # no 30 s of Kafka client retries


def test_commands_use_the_running_stack(kafka_config, no_stack, tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    stack_file = write_stack(run_dir, {"bootstrap": kafka_config.kafka.bootstrap_servers,
                                       "topics_prefix": kafka_config.topics.prefix,
                                       "proxy_url": "http://127.0.0.1:1", "model": {"id": "m"}})
    write_pointer(stack_file)  # this process is the stack's "pipeline up": it is alive
    assert main(["topics", "list"]) == 0
    out, err = capsys.readouterr()
    assert f"using the stack of {run_dir.resolve()}" in err and kafka_config.kafka.bootstrap_servers in err
    assert f"{kafka_config.topics.prefix}turns" in out and "MISSING" not in out
    # PIPELINE_STACK picks one explicitly, and an explicit --bootstrap is used as given (no lookup)
    monkeypatch.setenv("PIPELINE_STACK", str(run_dir))
    info, _ = find_stack()
    assert info is not None and info.path == stack_file
    config = load_config(None, bootstrap="10.0.0.1:1")
    assert resolve("tail", argparse.Namespace(), config) is config
    assert capsys.readouterr().err == ""


def test_a_stopped_stack_is_not_used(no_stack, tmp_path):
    stack_file = write_stack(tmp_path / "run", {"bootstrap": "127.0.0.1:1", "proxy_url": "http://127.0.0.1:1"})
    data = json.loads(stack_file.read_text())
    stack_file.write_text(json.dumps({**data, "pid": _dead_pid()}))
    write_pointer(stack_file)
    info, why = find_stack()
    assert info is None and "has stopped" in why
    if port_free(9092):
        with pytest.raises(NoStack, match="has stopped"):
            resolve("archive", argparse.Namespace(), load_config(None))


def test_every_command_the_readme_names_finds_the_stack(no_stack, tmp_path, capsys):
    # README: `tail`, `archive`, `replay`, `retrain`, `judge` and `trainer` find the stack without flags
    stack_file = write_stack(tmp_path / "run", {"bootstrap": "127.0.0.1:1", "proxy_url": "http://127.0.0.1:2"})
    write_pointer(stack_file)  # this process is the stack's "pipeline up": it is alive
    for command in ("tail", "archive", "replay", "retrain", "judge", "trainer", "dashboard"):
        config = resolve(command, argparse.Namespace(), load_config(None))
        assert config.kafka.bootstrap_servers == "127.0.0.1:1", command
    # `pipeline dashboard --run-dir DIR` shows DIR's run (its saved config), not the running stack
    config = load_config(None)
    assert resolve("dashboard", argparse.Namespace(run_dir=str(tmp_path / "old")), config) is config


def test_offline_modes_need_no_stack(no_stack):
    config = load_config(None)
    assert resolve("judge", argparse.Namespace(fit=True, eval=None), config) is config
    assert resolve("topics", argparse.Namespace(action="render"), config) is config
    assert resolve("engine", argparse.Namespace(), config) is config


@pytest.mark.slow
def test_pipeline_up_is_found_by_tail_and_forgotten_at_stop(no_stack, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE_")}
    env.update(XDG_STATE_HOME=str(no_stack), PYTHONPATH=str(ROOT))
    port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "pipeline", "up", "--model", "tiny-random", "--no-trainer",
                           "--no-dashboard", "--memory-broker", "--judge-mode", "rl", "--proxy-port", str(port),
                           "--run-dir", str(tmp_path / "run"), "--set", "engine.threads=1",
                           "--set", "judge.backend=constant"],
                          env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in up.stdout:  # until it says it is ready (or exits)
            lines.append(line)
            if line.startswith("stack: "):
                break
        assert pointer_path().exists(), "".join(lines)
        record = json.loads((tmp_path / "run" / "stack.json").read_text())
        assert record["proxy_url"] == f"http://127.0.0.1:{port}" and record["pid"] == up.pid
        assert record["model"]["id"] == "tiny-random" and record["model"]["context_window"] == 2048
        tail = subprocess.run([sys.executable, "-m", "pipeline", "tail", "turns", "--session", "nobody"], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert tail.returncode == 0 and "using the stack of" in tail.stderr, tail.stderr
        assert record["bootstrap"] in tail.stderr
    finally:
        up.send_signal(signal.SIGINT)
        rest = up.communicate(timeout=120)[0]
    assert up.returncode == 0, rest[-2000:]
    assert not pointer_path().exists()
    assert find_stack()[0] is None


@pytest.mark.slow
def test_a_signal_during_start_up_stops_what_started(no_stack, tmp_path):
    # SIGTERM (or Ctrl-C) while `pipeline up` waits for a stage to become ready stops it there:
    # every stage already started is stopped and it exits 130, instead of waiting for the stack
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE_")}
    env.update(XDG_STATE_HOME=str(no_stack), PYTHONPATH=str(ROOT))
    up = subprocess.Popen([sys.executable, "-m", "pipeline", "up", "--model", "tiny-random", "--memory-broker",
                           "--no-dashboard", "--run-dir", str(tmp_path / "run")],
                          env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in up.stdout:  # the broker is spawned; `up` now waits for it to answer
            lines.append(line)
            if "started broker (pid " in line:
                break
        assert lines and "started broker" in lines[-1], "".join(lines)
        broker_pid = int(lines[-1].split("(pid ")[1].split(")")[0])
        up.send_signal(signal.SIGTERM)
        rest = up.communicate(timeout=120)[0]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 130, rest[-2000:]
    assert "stopped during start-up" in rest and "ready: proxy" not in rest
    with pytest.raises(ProcessLookupError):
        os.kill(broker_pid, 0)
    assert find_stack()[0] is None
