"""Offline retraining from history against real brokers: archive -> stop broker -> new broker ->
replay gives the same events and the same judge samples; restart de-duplication; replay from the
topic by time and offsets; reset of a consumer group; import of OpenAI-format conversations."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
from kafka import KafkaConsumer
from kafka.structs import TopicPartition

from pipeline import events
from pipeline.broker import EmbeddedBroker
from pipeline.bus import consumer_kwargs
from pipeline.bus.admin import apply_topics
from pipeline.history.archive import Archiver, archive_topic
from pipeline.history.store import ArchiveError, partition_files, read_archive
from pipeline.simulate.feedback import THANKS_BRIEF, TOO_LONG
from pipeline.topics import load_topics

from tests.conftest import make_config
from pipeline.testing.topics import publish, read_records

EXAMPLES = Path(__file__).resolve().parents[2] / "pipeline" / "data" / "examples" / "conversations.jsonl"


def conversation_stream(n_sessions: int, seed: int = 0, prefix: str = "h") -> list[events.Event]:
    """A proxy-like turns stream: sessions of 1-3 turns with feedback next states, interleaved
    (each session in order), ending with session_end; random token ids and float32 log-probs."""
    rng = random.Random(seed)
    sessions = []
    for i in range(n_sessions):
        sid, evs = f"{prefix}{i}", []
        msgs = [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]
        for k in range(rng.randint(1, 3)):
            n = rng.randint(3, 12)
            resp = [rng.randrange(49152) for _ in range(n)]
            evs.append(events.Turn(
                session_id=sid, turn_index=k, request_id=f"{sid}-{k}", created_at=1_700_000_000_000 + i * 100 + k,
                policy_version=rng.randint(0, 2), model="smollm2-135m", messages=list(msgs),
                sampling={"temperature": 1.0, "max_tokens": 96},
                prompt_token_ids=[rng.randrange(49152) for _ in range(rng.randint(5, 20))],
                response_token_ids=resp, response_logprobs=[-rng.random() * 5 for _ in resp],
                response={"content": f"answer {k}", "reasoning_content": None, "tool_calls": None},
                finish_reason="stop"))
            fb = rng.choice([rng.choice(THANKS_BRIEF), TOO_LONG.format(n=40)])
            evs.append(events.NextState(session_id=sid, messages=[{"role": "user", "content": fb}],
                                        after_turn_index=k, created_at=1_700_000_000_000 + i * 100 + k))
            msgs += [{"role": "assistant", "content": f"answer {k}"}, {"role": "user", "content": fb}]
        evs.append(events.SessionEnd(session_id=sid, reason="header"))
        sessions.append(evs)
    out = []
    while sessions:
        j = rng.randrange(len(sessions))
        out.append(sessions[j].pop(0))
        if not sessions[j]:
            sessions.pop(j)
    return [events.decode(events.encode(e)) for e in out]  # float32 log-probs, as consumers see them


def read_topic(config, name: str, expect: int, timeout_s: float = 30.0) -> list[tuple[int, int, str, events.Event]]:
    """(partition, offset, key, event) of a physical topic, from the beginning, waiting for ``expect``."""
    recs = read_records(config, name, expect, timeout_s, settle_s=0.3)
    return sorted(((r.partition, r.offset, r.key, r.event) for r in recs), key=lambda x: (x[0], x[1]))


def by_session(evs) -> dict[str, list[events.Event]]:
    out = defaultdict(list)
    for ev in evs:
        out[ev.session_id].append(ev)
    return dict(out)


def archive_until(config, directory, n: int, group="archive", timeout_s=60.0, **kw):
    """Run the archive consumer in a thread until ``n`` records were archived or skipped."""
    box = {}

    def ready(a):
        box["a"] = a

    t = threading.Thread(target=lambda: box.setdefault("res", archive_topic(
        config, directory, group=group, install_signals=False, flush_interval_s=0.1, on_ready=ready, **kw)),
        daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        a = box.get("a")
        if a is not None and (a.archived + a.skipped >= n or a.error):
            break
        time.sleep(0.05)
    box["a"].app.stop()
    t.join(30)
    assert not t.is_alive()
    return box["res"]


def run_cli(*args, timeout=180):
    extra = [] if args[0] == "archive" else ["--no-progress"]
    p = subprocess.run([sys.executable, "-m", "pipeline", *args, *extra], capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def judge_samples(config, backend, n_turns: int) -> dict[str, events.Sample]:
    from pipeline.testing.judge import JudgeThread
    from pipeline.testing.topics import read_events

    with JudgeThread(config, mode="rl", backend=backend, group_id="judge-test"):
        got = read_events(config, "samples", n_turns, timeout_s=90)
    return {s.sample_id: s for s in got}


@pytest.mark.slow(seconds=12)
def test_archive_stop_broker_new_broker_replay_same_events_and_samples(tmp_path):
    from pipeline.judge.backends import make_backend

    stream = conversation_stream(14, seed=3)
    n_turns = sum(isinstance(e, events.Turn) for e in stream)
    archive = tmp_path / "archive"
    with EmbeddedBroker() as a:
        cfg_a = make_config(a.bootstrap, "a-")
        apply_topics(cfg_a, load_topics(cfg_a.topics.file))
        publish(cfg_a, stream)
        original = read_topic(cfg_a, "a-turns", len(stream))
        # the archive CLI, in batch mode: stops once nothing arrived for 2 s
        rc, out, err = run_cli("archive", "--dir", str(archive), "--until-idle", "2", "--bootstrap", a.bootstrap,
                               "--set", "topics.prefix=a-")
        assert rc == 0, err
        assert json.loads(out.strip().splitlines()[-1])["archived"] == len(stream)
        backend = make_backend("embedding", cfg_a)
        samples_a = judge_samples(cfg_a, backend, n_turns)
    # broker A is gone (memory storage): only the archive remains
    assert sum(1 for _ in read_archive(archive)) == len(stream)
    with EmbeddedBroker() as b:
        cfg_b = make_config(b.bootstrap, "b-")
        apply_topics(cfg_b, load_topics(cfg_b.topics.file))
        rc, out, err = run_cli("replay", "--archive", str(archive), "--bootstrap", b.bootstrap,
                               "--set", "topics.prefix=b-")
        assert rc == 0, err
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["sent"] == len(stream) and summary["turns"] == n_turns and summary["failed"] == 0
        replayed = read_topic(cfg_b, "b-turns", len(stream))
        assert len(replayed) == len(stream)
        # same payloads in the same order per session; keys kept; live turns marked as replayed
        want = by_session([e for _p, _o, _k, e in original])
        got = by_session([e for _p, _o, _k, e in replayed])
        assert set(got) == set(want)
        for sid, evs in want.items():
            expect = [dataclasses.replace(e, source="replay") if isinstance(e, events.Turn) else e for e in evs]
            assert got[sid] == expect, sid
        assert all(k == e.session_id for _p, _o, k, e in replayed)
        # the same samples from the judge (sample ids, rewards, masks, tokens, log-probs)
        samples_b = judge_samples(cfg_b, backend, n_turns)
    assert len(samples_a) == n_turns and set(samples_b) == set(samples_a)
    ignore = {"created_at", "source"}
    for sid, s in samples_a.items():
        da = {k: v for k, v in s.to_dict().items() if k not in ignore}
        db = {k: v for k, v in samples_b[sid].to_dict().items() if k not in ignore}
        assert da == db, sid
        assert s.source == "proxy" and samples_b[sid].source == "replay"
    assert {s.reward for s in samples_a.values()} & {1.0, -1.0}  # the judge did score something


def test_archive_restart_dedupes_repairs_and_detects_a_foreign_log(kafka_config, tmp_path):
    stream = conversation_stream(6, seed=1)
    publish(kafka_config, stream)
    d = tmp_path / "arch"
    first = archive_until(kafka_config, d, len(stream), fsync=False)
    assert first.archived == len(stream) and first.error is None
    files = [f for fs in partition_files(d).values() for f in fs]
    with files[0].open("ab") as fh:  # a crash in the middle of a write
        fh.write(b'{"topic": "x", "partition"')
    # a new group re-reads everything: nothing is written twice, the half line is cut off
    again = archive_until(kafka_config, d, len(stream), group="archive-2", fsync=False)
    assert again.archived == 0 and again.skipped == len(stream) and again.error is None
    assert all(f.read_bytes().endswith(b"\n") for f in files)
    more = conversation_stream(2, seed=9, prefix="m")
    publish(kafka_config, more)
    third = archive_until(kafka_config, d, len(more))
    assert third.archived == len(more)
    recs = list(read_archive(d))
    assert len(recs) == len(stream) + len(more)
    assert len({(r.partition, r.offset) for r in recs}) == len(recs)
    # another topic into the same directory is refused
    with pytest.raises(ArchiveError, match="archives topic"):
        Archiver(d, "other-turns")
    # same topic name on a different broker (offsets from 0 again, other records): stop, not skip
    with EmbeddedBroker() as c:
        cfg_c = make_config(c.bootstrap, kafka_config.topics.prefix)
        apply_topics(cfg_c, load_topics(cfg_c.topics.file))
        publish(cfg_c, conversation_stream(3, seed=5, prefix="z"))
        foreign = archive_until(cfg_c, d, 1)
    assert foreign.error and "another log" in foreign.error and foreign.archived == 0
    assert len(list(read_archive(d))) == len(recs)


def test_replay_from_topic_by_time_and_offsets_and_reset_group(kafka_config):
    first = conversation_stream(4, seed=2, prefix="early")
    later = conversation_stream(3, seed=4, prefix="late")
    publish(kafka_config, first)
    time.sleep(0.05)
    t_mid = events.now_ms()
    time.sleep(0.05)
    publish(kafka_config, later)
    src = kafka_config.topics.name("turns")
    all_recs = read_topic(kafka_config, src, len(first) + len(later))
    common = ["--bootstrap", kafka_config.kafka.bootstrap_servers, "--set", f"topics.prefix={kafka_config.topics.prefix}"]

    rc, out, err = run_cli("replay", "--from", f"ms:{t_mid}", "--to-topic", src + ".late", *common)
    assert rc == 0, err
    got = read_topic(kafka_config, src + ".late", len(later))
    assert by_session([e for *_x, e in got]).keys() == by_session(later).keys()
    assert all(e.source == "replay" for *_x, e in got if isinstance(e, events.Turn))

    # offsets: skip the first record of partition 0, stop before offset 3 of every partition
    rc, out, err = run_cli("replay", "--from", "0:1", "--to", "3", "--to-topic", src + ".cut", "--keep-source",
                           *common)
    assert rc == 0, err
    want = [(p, o) for p, o, _k, _e in all_recs if o < 3 and not (p == 0 and o == 0)]
    got = read_topic(kafka_config, src + ".cut", len(want))
    assert sorted((e.session_id, e.TYPE) for *_x, e in got) == sorted(
        (e.session_id, e.TYPE) for p, o, _k, e in all_recs if (p, o) in want)
    assert all(e.source == "proxy" for *_x, e in got if isinstance(e, events.Turn))

    rc, _out, err = run_cli("replay", *common)  # the topic onto itself
    assert rc == 2 and "same broker" in err
    rc, _out, err = run_cli("replay", "--from", "last tuesday", *common)
    assert rc == 2 and "not a time" in err

    rc, out, err = run_cli("replay", "--reset-group", "judge-v2", "--from", f"ms:{t_mid}", *common)
    assert rc == 0, err
    committed = {int(k): v for k, v in json.loads(out.strip().splitlines()[-1])["committed"].items()}
    c = KafkaConsumer(**consumer_kwargs(kafka_config, "judge-v2"))
    try:
        for p, off in committed.items():
            assert c.committed(TopicPartition(src, p)) == off
    finally:
        c.close()
    # the committed positions skip exactly the early records (Tansu may answer per batch: <=)
    early_ids = {e.session_id for e in first}
    for p, off in committed.items():
        part = [(o, e) for pp, o, _k, e in all_recs if pp == p]
        assert all(e.session_id in early_ids for o, e in part if o < off) or not part
        late_offsets = [o for o, e in part if e.session_id not in early_ids]
        assert not late_offsets or off <= min(late_offsets)


def run_inprocess(capsys, *args):
    """``python -m pipeline ARGS --no-progress`` in this process (saves the interpreter start)."""
    from pipeline.cli import main

    capsys.readouterr()
    rc = main([*args, "--no-progress"])
    out, err = capsys.readouterr()
    return rc, out, err


def test_import_examples_as_turn_events(kafka_config, tmp_path, capsys):
    from transformers import AutoTokenizer

    from pipeline.engine_api.render import ChatRenderer
    from pipeline.models import resolve_model

    bad = tmp_path / "bad.jsonl"
    lines = EXAMPLES.read_text().splitlines()
    bad.write_text("\n".join([lines[0], "{not json", json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                              "", lines[-1]]) + "\n")
    common = ["--bootstrap", kafka_config.kafka.bootstrap_servers, "--set", f"topics.prefix={kafka_config.topics.prefix}",
              "--set", "engine.model=tiny-random"]
    rc, out, err = run_inprocess(capsys, "import", str(EXAMPLES), *common)
    assert rc == 0, err
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["conversations"] == 5 and stats["turns"] == 8 and stats["bad_lines"] == 0
    got = [e for *_x, e in read_topic(kafka_config, kafka_config.topics.name("turns"), stats["events"])]
    assert len(got) == stats["events"]
    sessions = by_session(got)
    assert len(sessions) == 5
    tok = AutoTokenizer.from_pretrained(str(resolve_model("tiny-random")))
    renderer = ChatRenderer(tok)
    convs = [json.loads(x) for x in lines]
    for conv in convs:
        sid = conv.get("session_id") or next(s for s in sessions if s.startswith("import-"))
        evs = sessions[sid]
        assert isinstance(evs[-1], events.SessionEnd) and evs[-1].reason == "import"
        turns = [e for e in evs if isinstance(e, events.Turn)]
        msgs = conv["messages"]
        assistant_at = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        assert [t.turn_index for t in turns] == list(range(len(assistant_at)))
        for t, i in zip(turns, assistant_at):
            assert t.source == "import" and t.response_logprobs == [] and t.messages == msgs[:i]
            assert t.response_token_ids[-1] == tok.eos_token_id
            # prompt + response are exactly the engine's rendering of the conversation through this reply
            upto = renderer.render_text(msgs[: i + 1], conv.get("tools"), add_generation_prompt=False,
                                        continue_final_message=True)
            assert tok.decode(t.prompt_token_ids + t.response_token_ids[:-1]) == upto
            assert t.prompt_token_ids == renderer.render_ids(msgs[:i], conv.get("tools"))
        states = [e for e in evs if isinstance(e, events.NextState)]
        assert [s.after_turn_index for s in states] == [
            k for k, i in enumerate(assistant_at) if i + 1 < len(msgs) and msgs[i + 1]["role"] != "assistant"]
    tool_turn = next(t for t in sessions["example-tools-1"] if isinstance(t, events.Turn))
    assert "<tool_call>" in tok.decode(tool_turn.response_token_ids) and tool_turn.finish_reason == "tool_calls"

    rc, out, err = run_inprocess(capsys, "import", str(bad), *common, "--to-topic", kafka_config.topics.name("turns") + ".bad")
    assert rc == 0, err
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["conversations"] == 2 and stats["bad_lines"] == 2
    assert any("invalid JSON" in e for e in stats["errors"]) and any("no assistant" in e for e in stats["errors"])
    rc, out, err = run_inprocess(capsys, "import", str(bad), *common, "--strict", "--to-topic", kafka_config.topics.name("turns") + ".x")
    assert rc == 1
    rc, out, err = run_inprocess(capsys, "import", str(tmp_path / "missing.jsonl"), *common)
    assert rc == 2 and "no such file" in err


def test_replay_dead_letters_bad_source_records_and_stops_on_request(kafka_config):
    """A bad record in the source topic is not copied: it goes to the source's DLQ (stage
    ``replay``, with its offset) and is counted. A stop request (SIGTERM in the CLI) ends the
    copy cleanly with ``stopped`` in the stats."""
    import threading

    from kafka import KafkaProducer

    from pipeline.history.replay import topic_records

    src = kafka_config.topics.name("turns")
    raw = KafkaProducer(bootstrap_servers=kafka_config.kafka.bootstrap_servers)
    good = [events.SessionEnd(session_id=f"r{i}", created_at=i) for i in range(4)]
    values = [events.encode(good[0]), b"\x93junk", events.encode(good[1]),
              events.encode(events.Control(action="pause", epoch=1)), events.encode(good[2]), events.encode(good[3])]
    offsets = [raw.send(src, value=v, key=b"r", partition=0).get(10).offset for v in values]
    raw.close()
    stats: dict = {}
    got = [r.event for r in topic_records(kafka_config, src, None, None, stats, idle_timeout_s=5)]
    assert got == good and stats["bad"] == 2
    letters = [e for *_x, e in read_topic(kafka_config, kafka_config.topics.dlq("turns"), 2)]
    assert sorted((d.stage, d.offset) for d in letters) == [("replay", offsets[1]), ("replay", offsets[3])]
    # stop after the first record: the reading ends there
    stop, stats, out = threading.Event(), {}, []
    for rec in topic_records(kafka_config, src, None, None, stats, idle_timeout_s=5, stop=stop):
        out.append(rec.event)
        stop.set()
    assert out == good[:1]
    assert stats.get("stopped") is True


def test_imported_turn_ids_follow_the_conversation_not_only_the_session_id():
    """Importing the same conversation twice gives the same request ids (and sample ids); another
    conversation under the same session_id never shares them."""
    from pipeline.history.importer import Tokenizer, conversation_events
    from pipeline.judge.samples import sample_id

    tok = Tokenizer.load("tiny-random")
    a = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    b = {"messages": [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "see you"}]}

    def ids(conv):
        return [sample_id(e, "rl") for e in conversation_events(conv, tok, "same") if isinstance(e, events.Turn)]

    assert ids(a) == ids(a) and set(ids(a)).isdisjoint(ids(b))
