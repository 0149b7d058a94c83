"""``pipeline retrain`` end to end on a real broker: a 2-session archive -> replay into the run's own
topics -> the embedding judge -> a tiny-random Megatron trainer step. Checks the summary against
the records, that the live topics and groups are untouched (no offsets spent: a second run with
another name does the same work again), and that a session the range leaves open is ended."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from pipeline import events
from pipeline.history.store import to_line
from pipeline.testing.topics import read_records

pytestmark = pytest.mark.slow(seconds=45)

REPLIES = {"a": ["Thanks, that's exactly what I needed, short and right.", "Perfect, thank you!"],
           "b": ["No, that's wrong: the answer is 12, not 14. Please fix it."]}


def _turn(sid: str, k: int, rng: random.Random, msgs: list) -> events.Turn:
    resp = [rng.randrange(1000, 40000) for _ in range(rng.randint(4, 9))]
    return events.Turn(session_id=sid, turn_index=k, request_id=f"req-{sid}-{k}", created_at=1_764_000_000_000 + k,
                       policy_version=0, model="tiny-random", messages=list(msgs), sampling={"temperature": 1.0},
                       prompt_token_ids=[rng.randrange(1000, 40000) for _ in range(12)], response_token_ids=resp,
                       response_logprobs=[-rng.random() * 3 - 0.01 for _ in resp],
                       response={"content": f"answer {k}", "reasoning_content": None, "tool_calls": None},
                       finish_reason="stop", logprob_temperature=1.0)


def write_archive(directory, topic: str) -> dict:
    """Session a: two turns, each answered, then ended. Session b: an answered turn, then one the
    range leaves open (no reply, no end). Returns what is in it."""
    rng, offset, lines = random.Random(7), 0, []
    for sid, replies in REPLIES.items():
        msgs = [{"role": "user", "content": f"What is 6 + 6? ({sid})"}]
        for k, reply in enumerate(replies + ([None] if sid == "b" else [])):
            lines.append((sid, _turn(sid, k, rng, msgs)))
            if reply is None:
                break
            lines.append((sid, events.NextState(session_id=sid, messages=[{"role": "user", "content": reply}],
                                                after_turn_index=k, created_at=1_764_000_000_500 + k)))
            msgs += [{"role": "assistant", "content": f"answer {k}"}, {"role": "user", "content": reply}]
        if sid == "a":
            lines.append((sid, events.SessionEnd(session_id=sid, reason="header", created_at=1_764_000_001_000)))
    day = directory / "2025-11-24"
    day.mkdir(parents=True)
    with open(day / "partition-0.jsonl", "wb") as f:
        for sid, ev in lines:
            f.write(to_line(topic, 0, offset, 1_764_000_000_000 + offset, sid, ev))
            offset += 1
    return {"records": offset, "main_turns": sum(isinstance(e, events.Turn) for _, e in lines)}


def _retrain(config, archive, run_dir, name):
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "retrain", "--archive", str(archive), "--name", name, "--run-dir",
         str(run_dir), "--model", "tiny-random", "--batch-size", "2", "--steps", "1", "--no-progress",
         "--bootstrap", config.kafka.bootstrap_servers, "--set", f"topics.prefix={config.topics.prefix}",
         "--set", "trainer.threads=1"],
        capture_output=True, text=True, timeout=900)


def test_retrain_turns_a_two_session_archive_into_a_trainer_step(kafka_config, tmp_path):
    archive = tmp_path / "archive"
    want = write_archive(archive, kafka_config.topics.name("turns"))
    name = f"{kafka_config.topics.prefix}rt"
    out = _retrain(kafka_config, archive, tmp_path / "run", name)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "retrain.json").read_text())
    assert result["replayed"]["sent"] == want["records"] and result["replayed"]["main_turns"] == want["main_turns"]
    assert result["replayed"]["closed"] == 1, "session b was left open by the range"
    assert result["trainer_steps"] == 1 and "1 steps" in out.stdout
    # what the summary says is what the run's topics hold
    rconf = kafka_config.replace(topics={"prefix": f"{name}-"})
    samples = [r.event for r in read_records(rconf, rconf.topics.name("samples"), result["samples"], 30, 0.5)]
    assert len(samples) == result["samples"] >= 3
    assert sum(1 for s in samples if s.loss_mask) == result["samples_with_loss"] >= 2
    turns = [r.event for r in read_records(rconf, rconf.topics.name("turns"), want["records"] + 1, 30, 0.5)]
    ends = [e for e in turns if isinstance(e, events.SessionEnd)]
    assert sorted((e.session_id, e.reason) for e in ends) == [("a", "header"), ("b", "end_of_range")]
    steps = [json.loads(line) for line in (tmp_path / "run" / "trainer_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "step" in r] == [1] and steps[-1]["batch_samples"] == 2
    # the live topics were not written, and another run does the same work again
    assert read_records(kafka_config, kafka_config.topics.name("samples"), 0, 5, 0.5) == []
    same = _retrain(kafka_config, archive, tmp_path / "run3", name)  # the same name: its topics hold records
    assert same.returncode == 2 and "already hold records" in same.stderr
    again = _retrain(kafka_config, archive, tmp_path / "run2", f"{name}2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "run2" / "retrain.json").read_text())["samples"] == result["samples"]


def test_retrain_refuses_an_empty_range(kafka_config, tmp_path):
    archive = tmp_path / "archive"
    write_archive(archive, kafka_config.topics.name("turns"))
    out = subprocess.run([sys.executable, "-m", "pipeline", "retrain", "--archive", str(archive), "--from", "2030-01-01",
                          "--name", f"{kafka_config.topics.prefix}e", "--run-dir", str(tmp_path / "r"), "--no-progress",
                          "--bootstrap", kafka_config.kafka.bootstrap_servers], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and "no main turn" in out.stderr
