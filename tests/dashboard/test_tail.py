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


def _publish_canary_log(config) -> None:
    from tests.rollout.live_records import canary_log

    for topic, records in canary_log().items():
        publish(config, records, topic)


def test_tail_versions_prints_a_table_per_scope(kafka_config, tmp_path, capsys):
    """``pipeline tail versions`` over records published in-process: alice's rolled-back candidate
    beside her incumbent with each rate's interval and n, the decision's evidence, bob's live
    candidate, the full weights' eval-set result; ``--json`` is the same view as data."""
    import contextlib
    import io

    from pipeline.cli import main
    from pipeline.rollout.stats import wilson_interval
    from tests.rollout.live_records import A1, A2, B1

    _publish_canary_log(kafka_config)
    cfg = _cfg_file(kafka_config, tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["tail", "versions", "--config", cfg, "--set", "rollout.enabled=true",
                     "--set", "trainer.lora.rank=4"]) == 0
    text = out.getvalue()
    lines = text.splitlines()
    assert f"tenant alice: incumbent {A1['name']}" in lines
    assert f"tenant bob: incumbent base, candidate {B1['name']} (live)" in lines
    a2 = next(x for x in lines if x.startswith(A2["name"]))
    lo, hi = wilson_interval(2, 10)
    assert "rolled back" in a2 and f"0.20 [{lo:.2f}, {hi:.2f}] n=10" in a2  # judged reward with its interval
    assert "0.30 [" in a2 and "rollback reward_fell: reward d in [-0.85, -0.25]" in a2  # refusals, evidence
    a1 = next(x for x in lines if x.startswith(A1["name"]))
    assert "incumbent" in a1 and "0.80 [" in a1 and "n=30" in a1 and "promote non_inferior" in a1
    assert "gsm8k-eval: accuracy 0.60 [0.53, 0.66] n=200" in text
    header = next(x for x in lines if x.startswith("version"))
    assert header.split()[:5] == ["version", "role", "turns", "judged", "reward"]

    (view,) = _tail(cfg, "versions", "--json")  # rollout.enabled unset: the records show the rollout
    scopes = {s["scope"]: s for s in view}
    rows = {r["label"]: r for r in scopes["alice"]["versions"]}
    assert (rows[A2["name"]]["role"], rows[A2["name"]]["reward"]["n"], rows[A1["name"]]["turns"]) == (
        "rolled back", 10, 30)
    assert main(["tail", "versions", "--session", "x", "--config", cfg]) == 2
    assert "reads every record" in capsys.readouterr().err


def test_tail_versions_follows_new_records(kafka_config, tmp_path):
    """``--follow`` prints the view again once new records change it, until interrupted."""
    import queue
    import threading

    from tests.rollout.live_records import B1, turn_and_sample

    _publish_canary_log(kafka_config)
    cfg = _cfg_file(kafka_config, tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "tail", "versions", "--follow", "--json",
                             "--config", cfg], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()

    def bob_turns(view) -> int:
        (bob,) = [s for s in view if s["scope"] == "bob"]
        return bob["versions"][0]["turns"]

    try:
        assert bob_turns(json.loads(lines.get(timeout=60))) == 5
        publish(kafka_config, [turn_and_sample("b9", 0, "bob", B1, 1.0, 300)[0]], "turns")
        assert bob_turns(json.loads(lines.get(timeout=30))) == 6
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err[-2000:]
