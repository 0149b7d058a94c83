"""``pipeline tail``: a topic's events decoded, filtered by session, from an offset or a time, or
followed; no consumer group joined, no offset committed (a stage's committed position stays)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline import events
from tests.dashboard.dashboard_helpers import MARK, marked_conversation
from pipeline.testing.topics import publish

ROOT = Path(__file__).resolve().parents[2]


def _cfg_file(config, tmp_path) -> str:
    import yaml

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"kafka": {"bootstrap_servers": config.kafka.bootstrap_servers},
                                    "topics": {"prefix": config.topics.prefix}}))
    return str(path)


def _tail(cfg: str, *args) -> list[dict]:
    """``pipeline tail ARGS`` through the CLI's entry point in this process; its JSON lines."""
    import contextlib
    import io

    from pipeline.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["tail", *args, "--config", cfg]) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()]


def _committed(config, group: str) -> dict:
    from pipeline.bus.admin import admin_client

    admin = admin_client(config)
    try:
        return {(tp.topic, tp.partition): om.offset for tp, om in admin.list_group_offsets({group: None})[group].items()}
    finally:
        admin.close()


def test_tail_decodes_filters_and_leaves_groups_alone(kafka_config, tmp_path):
    from kafka import KafkaConsumer
    from kafka.structs import OffsetAndMetadata, TopicPartition

    from pipeline.bus import consumer_kwargs
    from pipeline.bus.admin import admin_client

    cfg = _cfg_file(kafka_config, tmp_path)
    a, _ = marked_conversation("s-a", turns=2)
    b, _ = marked_conversation("s-b", turns=1)
    publish(kafka_config, a + b, "turns")
    publish(kafka_config, [b"\xc1garbage"], "turns", key="s-a")
    # a stage's group with a committed position in the middle of the topic
    topic = kafka_config.topics.name("turns")
    group = f"{kafka_config.topics.prefix}judge"
    c = KafkaConsumer(**consumer_kwargs(kafka_config, group))
    parts = sorted(c.partitions_for_topic(topic))
    c.assign([TopicPartition(topic, p) for p in parts])
    c.commit({TopicPartition(topic, p): OffsetAndMetadata(1, "", -1) for p in parts})
    c.close()
    before = _committed(kafka_config, group)
    admin = admin_client(kafka_config)
    groups_before = set(map(str, admin.list_groups()))

    rows = _tail(cfg, "turns", "--session", "s-a")
    types = [r["event"]["type"] if "event" in r else "undecodable" for r in rows]
    assert types == ["turn", "next_state", "turn", "next_state", "session_end", "undecodable"]
    assert all(r["key"] == "s-a" and r["topic"] == topic for r in rows)
    assert "not a msgpack value" in rows[-1]["error"] or "msgpack" in rows[-1]["error"]
    turn = rows[0]["event"]
    assert turn["session_id"] == "s-a" and turn["turn_index"] == 0 and turn["finish_reason"] == "stop"
    assert "session_source" in turn  # the proxy's rule that chose the session (None: not recorded by a proxy)
    assert turn["response"]["chars"] == len(f"{MARK} reply 0") and turn["response_tokens"] == 2
    assert MARK not in json.dumps(rows), "conversation text printed without --text"
    shown = _tail(cfg, "turns", "--session", "s-b", "--text", "--arrays", "--type", "turn")
    assert len(shown) == 1 and shown[0]["event"]["response"]["content"] == f"{MARK} reply 0"
    assert shown[0]["event"]["response_token_ids"] == [4, 5]

    # from an offset (each session is on one partition) and from a time
    p_a = rows[0]["partition"]
    from_offset = _tail(cfg, "turns", "--session", "s-a", "--from", f"{p_a}:{rows[2]['offset']}")
    assert [r["offset"] for r in from_offset] == [r["offset"] for r in rows[2:]]
    later = events.now_ms()
    time.sleep(0.05)
    publish(kafka_config, [events.SessionEnd(session_id="s-a", reason="late")], "turns")
    since = _tail(cfg, "turns", "--from", f"ms:{later}")
    assert [r["event"]["reason"] for r in since] == ["late"]
    assert _tail(cfg, "turns", "--session", "s-a", "-n", "2")[1]["event"]["type"] == "next_state"

    # nothing joined, nothing committed
    assert _committed(kafka_config, group) == before
    assert set(map(str, admin.list_groups())) == groups_before
    admin.close()


def test_tail_follows_until_interrupted(kafka_config, tmp_path):
    import queue
    import threading

    cfg = _cfg_file(kafka_config, tmp_path)
    publish(kafka_config, [events.Control(action="pause", epoch=1, policy_version=1)], "control")  # before: not shown
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "tail", "control", "--from", "now", "--follow",
                             "--config", cfg], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        assert "following" in proc.stderr.readline()  # assigned and positioned: what comes now is shown
        publish(kafka_config, [events.Control(action="resume", epoch=1, policy_version=1)], "control")
        first = json.loads(lines.get(timeout=30))
        assert first["event"]["action"] == "resume"
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err[-2000:]
    assert lines.empty()


def test_tail_unknown_topic_or_start_is_a_clear_error(kafka_config, tmp_path, capsys):
    from pipeline.cli import main

    cfg = _cfg_file(kafka_config, tmp_path)
    assert main(["tail", "nope", "--config", cfg]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["tail", "turns", "--from", "yesterday-ish", "--config", cfg]) == 2
    assert "--from" in capsys.readouterr().err


def test_session_filter_takes_the_sub_sessions_of_a_reused_id():
    # a reused X-Session-Id's new conversation is recorded as `S~<16 hex>` (docs/sessions.md):
    # `--session S` shows it too, and nothing of another session that merely shares a prefix
    from types import SimpleNamespace

    from pipeline.dashboard.tail import matches

    def rec(key):
        return SimpleNamespace(key=key, event=SimpleNamespace(session_id=key, TYPE="turn"))

    assert matches(rec("conv-42"), "conv-42", None) and matches(rec("conv-42~c08ab2123b57884a"), "conv-42", None)
    assert not matches(rec("conv-420"), "conv-42", None) and not matches(rec("conv-4"), "conv-42", None)
    assert not matches(rec("conv-42~c08ab2123b57884a"), "conv-42~0000000000000000", None)
