"""Choosing and configuring the local broker (pipeline/kafka_broker.py, pipeline/broker.py).

No broker is started here except by the real ``pipeline broker`` command refusing to start;
the Kafka broker's life cycle (format, restart on the same data, kill -9) is tested in
tests/core/test_broker_durable.py, and every topic-level test runs on it when it is installed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from pipeline.broker import resolve_kind
from pipeline.kafka_broker import kafka_installed, new_cluster_id, server_properties

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_ids_look_like_kafkas_and_never_start_with_a_dash():
    ids = {new_cluster_id() for _ in range(2000)}
    assert len(ids) == 2000
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{22}", i) and not i.startswith("-") for i in ids)


def test_our_broker_never_auto_creates_topics_and_accepts_the_stages_group_timeouts():
    props = dict(line.split("=", 1) for line in server_properties(9, 10, Path("/x")).splitlines())
    assert props["auto.create.topics.enable"] == "false"
    assert props["group.initial.rebalance.delay.ms"] == "0"
    assert int(props["group.min.session.timeout.ms"]) <= 2000  # KafkaConfig.session_timeout_ms default
    assert props["controller.quorum.voters"] == "1@127.0.0.1:10"
    assert "log.flush.interval.messages" not in props
    assert "log.flush.interval.messages=1" in server_properties(9, 10, Path("/x"), flush_every_message=True)


def test_a_data_dir_keeps_the_kind_that_wrote_it(tmp_path):
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "broker.json").write_text(json.dumps({"kind": "kafka", "port": 1}))
    (tmp_path / "t" / "objects").mkdir(parents=True)  # a Tansu data dir from before broker.json had a kind
    assert resolve_kind("auto", tmp_path / "k") == "kafka"
    assert resolve_kind("auto", tmp_path / "t") == "tansu"
    assert resolve_kind("tansu", tmp_path / "k") == "tansu"  # asked for explicitly
    assert resolve_kind("auto", tmp_path / "new") == ("kafka" if kafka_installed() else "tansu")


def test_kafka_without_its_jars_is_a_clear_error_and_auto_falls_back_to_tansu(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PIPELINE_KAFKA_HOME": str(tmp_path / "empty"), "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "pipeline", "broker", "--kind", "kafka", "--port", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1
    assert "Apache Kafka's jars are not installed" in r.stderr and "deploy/install-kafka.sh" in r.stderr
    probe = subprocess.run([sys.executable, "-c", "from pipeline.broker import resolve_kind; print(resolve_kind())"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60, env={**env, "PYTHONPATH": str(ROOT)})
    assert probe.stdout.strip() == "tansu", probe.stderr
