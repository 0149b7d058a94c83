"""Configuration precedence, topics.yaml validation, and the broker/topics commands end to end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from pipeline.procutil import free_port
from pipeline.config import ConfigError, load_config
from pipeline.topics import TopicsError, load_topics, render

PY = [sys.executable, "-m", "pipeline"]


def test_precedence_yaml_env_flags(tmp_path, monkeypatch):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"judge": {"votes": 5, "mode": "opd"}, "kafka": {"client_id": "from-yaml"}}))
    monkeypatch.setenv("PIPELINE_JUDGE__VOTES", "7")
    c = load_config(str(f), overrides=["kafka.client_id=from-flag"])
    assert (c.judge.votes, c.judge.mode, c.kafka.client_id) == (7, "opd", "from-flag")
    c = load_config(str(f), overrides=["judge.votes=9"], bootstrap="h:1")
    assert c.judge.votes == 9 and c.kafka.bootstrap_servers == "h:1"


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="judge.votes"):
        load_config(None, overrides=["judge.votes=many"])
    with pytest.raises(ConfigError, match="judge.no_such_key"):
        load_config(None, overrides=["judge.no_such_key=1"])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, overrides=["judge.votes"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(str(bad))


def test_secrets_masked_and_passed(monkeypatch):
    monkeypatch.setenv("PIPELINE_KAFKA__SASL_PLAIN_PASSWORD", "hunter2")
    c = load_config(None, overrides=["kafka.security_protocol=SASL_SSL", "kafka.sasl_mechanism=PLAIN",
                                     "kafka.sasl_plain_username=u"])
    assert c.kafka.client_kwargs()["sasl_plain_password"] == "hunter2"
    out = subprocess.run(PY + ["config", "show", "--format", "json"], capture_output=True, text=True,
                         env={**os.environ, "PIPELINE_KAFKA__SASL_PLAIN_PASSWORD": "hunter2"})
    assert out.returncode == 0 and "hunter2" not in out.stdout and "sasl_plain_password" in out.stdout


def test_topics_yaml_is_valid_and_complete():
    specs = {s.name: s for s in load_topics(load_config(None).topics.file)}
    assert {"turns", "samples", "control", "turns.dlq", "samples.dlq", "control.dlq"} <= set(specs)
    assert specs["control"].partitions == 1  # total order
    assert set(specs["turns"].values) == {"turn", "next_state", "session_end", "feedback"}


def test_topics_yaml_errors(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("topics:\n  x:\n    partitions: 0\n    replication_factor: 1\n")
    with pytest.raises(TopicsError, match="partitions"):
        load_topics(f)
    f.write_text("topics:\n  x:\n    partitions: 1\n    replication_factor: 1\n    values: [bogus]\n")
    with pytest.raises(TopicsError, match="bogus"):
        load_topics(f)
    f.write_text("topics:\n  x: {}\n")
    with pytest.raises(TopicsError, match="'x'"):
        load_topics(f)


def test_render_strimzi_matches_topics_yaml():
    specs = load_topics(load_config(None).topics.file)
    docs = list(yaml.safe_load_all(render(specs, "strimzi")))
    assert [d["spec"]["topicName"] for d in docs] == [s.name for s in specs]
    for d, s in zip(docs, specs):
        assert d["kind"] == "KafkaTopic" and d["spec"]["partitions"] == s.partitions
        assert d["spec"]["config"] == s.config and d["spec"]["replicas"] == s.replication_factor


@pytest.mark.slow(seconds=13)
def test_broker_command_and_idempotent_apply():
    port = free_port()
    broker = subprocess.Popen(PY + ["broker", "--port", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        line = broker.stdout.readline()
        while line and "broker ready" not in line:
            line = broker.stdout.readline()
        assert f"bootstrap=127.0.0.1:{port}" in line
        first = subprocess.run(PY + ["topics", "apply", "--bootstrap", f"127.0.0.1:{port}"], capture_output=True,
                               text=True, timeout=60)
        assert first.returncode == 0, first.stderr
        created = [ln.split()[1] for ln in first.stdout.splitlines() if ln.startswith("created")]
        assert sorted(created) == sorted(s.name for s in load_topics(load_config(None).topics.file))
        second = subprocess.run(PY + ["topics", "apply", "--bootstrap", f"127.0.0.1:{port}"], capture_output=True,
                                text=True, timeout=60)
        assert second.returncode == 0 and "created" not in second.stdout
        assert "nothing to create" in second.stdout
        listed = subprocess.run(PY + ["topics", "list", "--bootstrap", f"127.0.0.1:{port}"], capture_output=True,
                                text=True, timeout=60)
        assert "MISSING" not in listed.stdout and "turns" in listed.stdout
    finally:
        broker.send_signal(signal.SIGTERM)
        assert broker.wait(20) == 0
    t0 = time.monotonic()
    down = subprocess.run(PY + ["topics", "apply", "--bootstrap", f"127.0.0.1:{port}"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PIPELINE_KAFKA__REQUEST_TIMEOUT_MS": "3000"})
    assert down.returncode != 0 and "Traceback" not in down.stderr and "cannot reach" in down.stderr
    # it gave up after about the configured 3 s (not kafka-python's fixed 30 s bootstrap wait)
    assert time.monotonic() - t0 < 20, f"{time.monotonic() - t0:.0f} s to report an unreachable broker"


@pytest.mark.parametrize("override", ["judge.votes=0", "trainer.rollout_batch_size=0", "trainer.lr=-1",
                                      "proxy.port=99999", "kafka.session_timeout_ms=-5"])
def test_out_of_range_values_are_rejected(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(None, overrides=[override])


def test_secrets_only_from_the_environment(tmp_path):
    with pytest.raises(ConfigError, match="PIPELINE_KAFKA__SASL_PLAIN_PASSWORD"):
        load_config(None, overrides=["kafka.sasl_plain_password=hunter2"])
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"proxy": {"api_keys": ["k"]}}))
    with pytest.raises(ConfigError, match="proxy.api_keys is a secret"):
        load_config(str(f))


@pytest.mark.parametrize("raised, want", [("timeout", "KafkaTimeoutError"), ("connection", "KafkaConnectionError"),
                                          ("refused", "TopicsError")])
def test_a_creation_the_broker_refuses_is_a_topics_error_and_an_unreachable_broker_stays_so(monkeypatch, raised, want):
    """``create_topic_if_missing``: a refusal reads "broker refused to create ..."; a time-out or a
    lost connection stays kafka-python's, so the CLI prints its "cannot reach the Kafka broker"
    line instead of a traceback (stand-in admin client: the broker's answers are the cases)."""
    from kafka.errors import InvalidReplicationFactorError, KafkaConnectionError, KafkaTimeoutError

    from pipeline.bus import admin

    errors = {"timeout": KafkaTimeoutError("no answer"), "connection": KafkaConnectionError("lost"),
              "refused": InvalidReplicationFactorError("rf 3 > 1 broker")}

    class StandInAdmin:
        def list_topics(self):
            return ["other"]

        def create_topics(self, *a, **kw):
            raise errors[raised]

        def close(self):
            pass

    monkeypatch.setattr(admin, "admin_client", lambda config: StandInAdmin())
    with pytest.raises(Exception) as got:
        admin.create_topic_if_missing(load_config(None), "t", 1, 3, {}, what="topic")
    assert type(got.value).__name__ == want
    assert admin.is_unreachable(got.value) == (raised != "refused")
    if raised == "refused":
        assert str(got.value).startswith("broker refused to create topic t: ")


def test_applying_topics_to_a_broker_that_stops_answering_is_no_refusal(monkeypatch):
    """``apply_topics`` (``pipeline topics apply``): a time-out while creating stays kafka-python's
    (the CLI's "cannot reach" line); a refusal is a TopicsError (stand-in admin client)."""
    from kafka.errors import InvalidReplicationFactorError, KafkaTimeoutError

    from pipeline.bus import admin

    raised = {}

    class StandInAdmin:
        def list_topics(self):
            return []

        def create_topics(self, *a, **kw):
            raise raised["e"]

        def close(self):
            pass

    monkeypatch.setattr(admin, "admin_client", lambda config: StandInAdmin())
    config = load_config(None)
    raised["e"] = KafkaTimeoutError("no answer")
    with pytest.raises(KafkaTimeoutError):
        admin.apply_topics(config, load_topics(config.topics.file))
    raised["e"] = InvalidReplicationFactorError("rf 3 > 1 broker")
    with pytest.raises(TopicsError, match="^broker refused to create topics: "):
        admin.apply_topics(config, load_topics(config.topics.file))
