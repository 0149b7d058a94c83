"""Stages check their topics' shape at start (issue 25 item 4), on the session broker.

Real broker, real admin client, and the real ``pipeline`` command line: a stage started against
a topic of the wrong shape refuses with a message naming the topic and the fix; missing topics
are created as topics.yaml declares them (never by the broker's auto-creation).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.bus.admin import admin_client, create_topics, describe_topics, ensure_topics
from pipeline.topics import STAGE_TOPICS, TopicsError, load_topics
from tests.conftest import make_config

ROOT = Path(__file__).resolve().parents[2]


def _create(config, name: str, partitions: int, **configs: str) -> None:
    admin = admin_client(config)
    try:
        create_topics(admin, [(config.topics.name(name), partitions, 1, configs)])
    finally:
        admin.close()


def _pipeline(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_stage_refuses_a_control_topic_with_four_partitions(broker_bootstrap, topic_prefix):
    config = make_config(broker_bootstrap, topic_prefix)
    _create(config, "control", 4)
    r = _pipeline("syncer", "--engine", "http://127.0.0.1:9", "--bootstrap", broker_bootstrap,
                  "--set", f"topics.prefix={topic_prefix}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"topic '{topic_prefix}control' has 4 partitions on the broker, topics.yaml declares 1" in r.stderr
    assert "Refusing to start" in r.stderr and "pipeline topics apply" in r.stderr
    # it created nothing of its own while refusing
    assert set(describe_topics(config, [config.topics.name("control.dlq")])) == set()


def test_missing_topics_are_created_with_the_declared_shape(broker_bootstrap, topic_prefix):
    config = make_config(broker_bootstrap, topic_prefix)
    created = ensure_topics(config, STAGE_TOPICS["trainer"])
    assert sorted(created) == sorted(config.topics.name(n) for n in STAGE_TOPICS["trainer"])
    declared = {s.name: s.partitions for s in load_topics(config.topics.file)}
    states = describe_topics(config, created)
    assert {n: states[config.topics.name(n)].partitions for n in STAGE_TOPICS["trainer"]} == \
        {n: declared[n] for n in STAGE_TOPICS["trainer"]}
    assert states[config.topics.name("control")].partitions == 1
    assert ensure_topics(config, STAGE_TOPICS["trainer"]) == []  # idempotent


def test_missing_topics_without_permission_to_create_name_the_apply_command(broker_bootstrap, topic_prefix):
    config = make_config(broker_bootstrap, topic_prefix, topics={"prefix": topic_prefix, "create_missing": False})
    with pytest.raises(TopicsError) as e:
        ensure_topics(config, ("turns", "control"))
    msg = str(e.value)
    assert f"missing topics {topic_prefix}turns, {topic_prefix}control" in msg
    assert f"pipeline topics apply --set topics.prefix={topic_prefix} --bootstrap {broker_bootstrap}" in msg
    assert describe_topics(config, [config.topics.name("turns")]) == {}


def test_wrong_cleanup_policy_is_refused_where_the_broker_reports_configs(broker_bootstrap, topic_prefix):
    config = make_config(broker_bootstrap, topic_prefix)
    _create(config, "turns", 4, **{"cleanup.policy": "compact"})
    state = describe_topics(config, [config.topics.name("turns")])[config.topics.name("turns")]
    if state.cleanup_policy is None:
        pytest.skip("this broker answers no DescribeConfigs (Tansu 0.6.0)")
    with pytest.raises(TopicsError, match=r"cleanup.policy=compact on the broker, topics.yaml declares delete"):
        ensure_topics(config, ("turns",))


def test_a_topics_file_declaring_several_control_partitions_is_refused(broker_bootstrap, topic_prefix, tmp_path):
    data = yaml.safe_load((ROOT / "topics.yaml").read_text())
    data["topics"]["control"]["partitions"] = 4
    path = tmp_path / "topics.yaml"
    path.write_text(yaml.safe_dump(data))
    config = make_config(broker_bootstrap, topic_prefix, topics={"prefix": topic_prefix, "file": str(path)})
    with pytest.raises(TopicsError, match="declares 4 partitions for 'control'; it needs exactly one"):
        ensure_topics(config, ("control",))
    assert describe_topics(config, [config.topics.name("control")]) == {}
