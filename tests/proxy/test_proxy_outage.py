"""Serving never depends on Kafka: the broker stops mid-conversation and comes back.

Each test runs its own embedded broker (memory storage) so it can stop it. A restarted Tansu
broker has lost its topics (memory only), so the test re-creates them on the same port, as an
operator would, and then checks that every event published during the outage arrives — in
session order — or that the loss is counted exactly. A proxy killed during an outage is in
tests/proxy/test_proxy_crash.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx
import pytest
from pipeline import events
from pipeline.broker import EmbeddedBroker
from pipeline.procutil import free_port
from pipeline.config import load_config
from pipeline.proxy.buffer import EventBufferError, EventBufferFull
from pipeline.proxy.publisher import EventPublisher
from pipeline.bus.admin import apply_topics
from pipeline.topics import load_topics
from pipeline.testing.proxy import running_proxy
from pipeline.testing.servers import StandInEngine, serve_app
from pipeline.testing.topics import read_events, read_records
from pipeline.testing.waiting import until

CHAT = "/v1/chat/completions"


@contextlib.contextmanager
def own_broker():
    port = free_port()
    broker = EmbeddedBroker(port=port).start()
    config = load_config(None, kafka={"bootstrap_servers": broker.bootstrap}, topics={"prefix": "o-"})
    apply_topics(config, load_topics(config.topics.file))
    try:
        yield broker, config
    finally:
        crash(broker)


def crash(broker: EmbeddedBroker) -> None:
    """Kill the broker (no graceful shutdown: Tansu's waits seconds for connected clients)."""
    broker.proc.kill()
    broker.proc.wait(10)


def restart(broker: EmbeddedBroker, config) -> None:
    broker.start()
    apply_topics(config, load_topics(config.topics.file))


def converse(url: str, session: str, turns: int, history: list | None = None, done: bool = False) -> list:
    """``turns`` sequential requests of one session; every one must succeed. Returns the history."""
    msgs = history or [{"role": "user", "content": f"hello from {session}"}]
    with httpx.Client(base_url=url, timeout=30) as c:
        for i in range(turns):
            h = {"X-Session-Id": session}
            if done and i == turns - 1:
                h["X-Session-Done"] = "1"
            r = c.post(CHAT, json={"model": "m", "messages": msgs, "stream": i % 2 == 1}, headers=h)
            assert r.status_code == 200, r.text
            if i % 2 == 1:  # streamed: the client assembles the message from the deltas
                assert r.text.rstrip().endswith("data: [DONE]")
                msgs = msgs + [{"role": "assistant", "content": "ok"}]  # StandInEngine's default reply
            else:
                msgs = msgs + [r.json()["choices"][0]["message"]]
            msgs = msgs + [{"role": "user", "content": f"more {i}"}]
    return msgs


def _first_occurrences(evs: list) -> list:
    """Drop re-deliveries (same event seen again), keeping the order of first arrival."""
    seen, out = set(), []
    for e in evs:
        key = (e.TYPE, getattr(e, "request_id", ""), getattr(e, "turn_index", None), getattr(e, "reason", None))
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def _by_session(recs) -> dict:
    out: dict = {}
    for r in recs:
        out.setdefault(r.key, []).append(r.event)
    return out


@pytest.mark.parametrize("client", ["librdkafka", "kafka-python"])
def test_broker_outage_mid_conversation_serves_everyone_and_delivers_everything_after(client):
    with own_broker() as (broker, config), serve_app(StandInEngine()) as up_url, \
            running_proxy(config, up_url, publish_delivery_timeout_ms=3000, kafka_client=client) as (url, app):
        hist_a = converse(url, "A", 2)
        assert app.publisher.wait_idle(15)
        before = read_events(config, want=3)
        assert [e.TYPE for e in before] == ["turn", "next_state", "turn"]
        published_before = app.publisher.stats()["delivered"]

        crash(broker)
        hist_a = converse(url, "A", 3, hist_a)  # mid-conversation: next_state + turn each
        converse(url, "B", 3, done=True)  # a new session during the outage
        deadline = time.monotonic() + 30  # until a delivery attempt during the outage has failed
        while app.publisher.stats()["broker_connected"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not app.publisher.stats()["broker_connected"], "the publisher never noticed the outage"
        assert app.publisher.buffered == 2 * 3 + (1 + 2 * 2 + 1)  # still waiting, none lost
        assert app.publisher.stats()["dropped_total"] == 0

        restart(broker, config)
        assert app.publisher.wait_idle(60), app.publisher.stats()
        stats = app.publisher.stats()
        after = read_records(config, config.topics.name("turns"), timeout_s=30, settle_s=2.0)
    assert stats["dropped_total"] == 0
    assert stats["delivered"] - published_before >= 12
    # delivery is at-least-once: a window whose acknowledgement was lost in the crash may arrive twice
    sessions = {k: _first_occurrences(v) for k, v in _by_session(after).items()}
    a, b = sessions["A"], sessions["B"]
    assert [e.TYPE for e in a] == ["next_state", "turn"] * 3
    assert [e.turn_index for e in a if e.TYPE == "turn"] == [2, 3, 4]
    assert [e.after_turn_index for e in a if e.TYPE == "next_state"] == [1, 2, 3]
    assert [e.TYPE for e in b] == ["turn", "next_state", "turn", "next_state", "turn", "session_end"]
    assert [e.turn_index for e in b if e.TYPE == "turn"] == [0, 1, 2]


def test_durable_buffer_keeps_everything_a_memory_only_proxy_counts_every_drop(tmp_path):
    # two proxies, each with its own buffer: a durable one (default) and a memory-only one (buffer_dir=None)
    with own_broker() as (broker, config), serve_app(StandInEngine()) as up_url, \
            running_proxy(config, up_url, buffer_max_events=3, buffer_dir=str(tmp_path / "buf"),
                          publish_delivery_timeout_ms=3000) as (url_disk, app_disk), \
            running_proxy(config, up_url, buffer_max_events=3, buffer_dir=None,
                          publish_delivery_timeout_ms=3000) as (url_drop, app_drop):
        converse(url_disk, "warm", 1)
        converse(url_drop, "warm2", 1)
        assert app_disk.publisher.wait_idle(15) and app_drop.publisher.wait_idle(15)
        crash(broker)
        converse(url_disk, "S", 5)  # 1 + 2*4 = 9 events; memory would hold 3
        converse(url_drop, "D", 5)
        disk_stats = app_disk.publisher.stats()
        # every answered event of the durable proxy is on disk before its response completed
        assert disk_stats["on_disk"] == 9 and disk_stats["dropped_total"] == 0 and disk_stats["not_durable"] == {}
        # the memory-only proxy counts its drops when its publisher thread hands events on, which
        # may come just after the response: await that state
        drop_stats = until(lambda: (st := app_drop.publisher.stats())["dropped_total"] > 0 and st, timeout_s=30)
        assert drop_stats and drop_stats["on_disk"] == 0, app_drop.publisher.stats()
        restart(broker, config)
        assert app_disk.publisher.wait_idle(60) and app_drop.publisher.wait_idle(60)
        drop_stats = app_drop.publisher.stats()
        evs = read_records(config, config.topics.name("turns"), timeout_s=30, settle_s=2.0)
    sessions = {k: _first_occurrences(v) for k, v in _by_session(evs).items()}
    s = sessions["S"]
    assert [e.TYPE for e in s] == ["turn"] + ["next_state", "turn"] * 4  # all of them, in order
    assert [e.turn_index for e in s if e.TYPE == "turn"] == [0, 1, 2, 3, 4]
    d = sessions.get("D", [])
    assert len(d) + drop_stats["dropped"]["buffer_full"] == 9  # the loss is counted exactly
    assert drop_stats["dropped"] == {"buffer_full": drop_stats["dropped_total"]}


def test_a_full_disk_buffer_falls_back_to_memory_and_counts_exactly(tmp_path):
    # the disk buffer's bound (or a full disk) refuses a group: those events are held in memory
    # (counted as not durable), then dropped beyond buffer_max_events (counted); none vanish
    with own_broker() as (broker, config):
        topic = config.topics.name("turns")
        crash(broker)
        pub = EventPublisher(config, max_buffer=20, buffer_dir=str(tmp_path / "buf"), buffer_max_bytes=64 * 4096,
                             delivery_timeout_ms=3000).start()
        big = [{"role": "user", "content": "x" * 4000}]
        for i in range(120):
            pub.publish(topic, events.NextState(session_id="F", messages=big, after_turn_index=i, created_at=i), "F")
        assert pub.wait_idle(0.01) is False
        deadline = time.monotonic() + 10
        while pub.stats()["in_memory"] + pub.stats()["on_disk"] + pub.stats()["dropped_total"] < 120:
            assert time.monotonic() < deadline, pub.stats()
            time.sleep(0.01)
        st = pub.stats()
        assert st["on_disk"] > 0 and st["not_durable"] == {"buffer_full": 20} and st["in_memory"] == 20
        assert st["on_disk"] + 20 + st["dropped"]["buffer_full"] == 120
        restart(broker, config)
        assert pub.wait_idle(60), pub.stats()
        pub.close()
        evs = read_events(config, timeout_s=30, settle_s=2.0)
    got = list(dict.fromkeys(e.after_turn_index for e in evs))  # first occurrences (at-least-once)
    assert got == list(range(st["on_disk"] + 20))  # the disk prefix then the memory part, in order


def test_undelivered_events_survive_a_restart_in_the_disk_buffer(tmp_path):
    buf = str(tmp_path / "buf")
    with own_broker() as (broker, config):
        topic = config.topics.name("turns")
        crash(broker)
        pub = EventPublisher(config, max_buffer=100, buffer_dir=buf, delivery_timeout_ms=3000).start()
        for i in range(5):
            pub.publish(topic, events.SessionEnd(session_id=f"x{i}", reason="header", created_at=i), f"x{i}")
        pub.close(timeout_s=1.0)  # broker still down: everything stays in the buffer
        assert pub.stats()["dropped_total"] == 0
        restart(broker, config)
        pub2 = EventPublisher(config, buffer_dir=buf).start()
        pub2.publish(topic, events.SessionEnd(session_id="x5", reason="header", created_at=5), "x5")
        assert pub2.wait_idle(30)
        pub2.close()
        evs = read_events(config, timeout_s=30, settle_s=2.0)
    assert [e.session_id for e in evs if e.session_id == "x0"] == ["x0"]
    got = {e.session_id: e.created_at for e in evs}
    assert got == {f"x{i}": i for i in range(6)}


def test_unreachable_broker_overflow_and_shutdown_are_counted_exactly():
    # a bootstrap address where nothing listens: publish() accepts, the backlog keeps 10, the rest is counted
    config = load_config(None, kafka={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    pub = EventPublisher(config, max_buffer=10).start()
    accepted = [pub.publish("t", events.SessionEnd(session_id="s", created_at=0), "s") for _ in range(20)]
    deadline = time.monotonic() + 10  # until the writer has refused the overflow
    while time.monotonic() < deadline and pub.stats()["dropped_total"] < 10:
        time.sleep(0.01)
    stats = pub.stats()
    pub.close(timeout_s=0.5)
    assert all(accepted)
    assert stats["buffered"] + stats["dropped_total"] == 20 and stats["dropped"].get("buffer_full", 0) == 10
    assert pub.stats()["dropped"]["shutdown"] == 10


# ---- one hand-over per event-loop iteration, commit hooks ------------------------------------------
def test_events_of_one_loop_iteration_reach_the_writer_as_one_group():
    """Events published in one slice of the event loop are handed to the writer once, after the
    slice (one wake-up, one group commit); outside a loop each event goes to the writer at once."""
    config = load_config(None, kafka={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    pub = EventPublisher(config)  # threads not started: the inbox shows what the writer would get
    pub.publish("t", events.SessionEnd(session_id="a", created_at=0), "a")
    assert pub._inbox.qsize() == 1

    async def one_slice() -> tuple[int, list]:
        for s in ("b", "c", "d"):
            assert pub.publish("t", events.SessionEnd(session_id=s, created_at=0), s)
        before = pub._inbox.qsize()
        await asyncio.sleep(0)  # the loop runs the hand-over
        return before, [pub._inbox.get_nowait() for _ in range(pub._inbox.qsize())]

    before, handed = asyncio.run(one_slice())
    assert before == 1 and len(handed) == 2  # "a" alone, then b, c, d together, in order
    assert [[e.session_id for _, _, e in group] for group in handed] == [["a"], ["b", "c", "d"]]
    assert pub.buffered == 4


def test_a_commit_hook_runs_before_the_waiting_response_is_released(tmp_path):
    """What a commit hook writes (the proxy's turn index) is done before ``durable()`` returns
    for the events of that commit; a hook that raises does not stop the publisher."""
    config = load_config(None, kafka={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    pub = EventPublisher(config, buffer_dir=str(tmp_path / "buf"))
    seen: list[int] = []
    pub.add_commit_hook(lambda: seen.append(pub._buf.count))
    pub.add_commit_hook(lambda: 1 / 0)
    pub.start()

    async def answer() -> int:
        pub.publish("t", events.SessionEnd(session_id="s", created_at=0), "s")
        pub.publish("t", events.SessionEnd(session_id="u", created_at=0), "u")
        await pub.durable()
        return len(seen)

    try:
        assert asyncio.run(answer()) >= 1 and seen[-1] >= 2  # ran after the two events were committed
        assert asyncio.run(answer()) >= 2 and seen[-1] >= 4  # the publisher survived the failing hook
    finally:
        pub.close(timeout_s=0.5)


@pytest.mark.parametrize("fsync,inline", [(False, True), (True, True), (False, False)])
def test_a_group_is_committed_on_the_event_loop_only_with_inline_commit_and_no_fsync(tmp_path, fsync, inline):
    """With ``inline_commit`` (the default) and no fsync the events of one loop iteration are
    committed by the loop itself (no hand-off to the writer thread and back), once the writer
    made the new WAL's first commit; with ``buffer_fsync`` (a commit waits for the disk) or
    without ``inline_commit`` by the writer thread. Either way in publish order, and durable()
    returns once they are on disk."""
    config = load_config(None, kafka={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    pub = EventPublisher(config, buffer_dir=str(tmp_path / "buf"), buffer_fsync=fsync, inline_commit=inline)
    committers: list[str] = []
    pub.add_commit_hook(lambda: committers.append(threading.current_thread().name))
    pub.start()

    async def answer(k: int) -> None:
        for i in range(3):
            pub.publish("t", events.SessionEnd(session_id=f"s{k}-{i}", created_at=i), "s")
        await pub.durable()

    try:
        for k in range(3):
            asyncio.run(answer(k))
        assert pub._buf.count == 9  # nothing delivered (no broker): all on disk
        assert [events.decode(r[3]).session_id for r in pub._buf.read(0, 9)] == [
            f"s{k}-{i}" for k in range(3) for i in range(3)]
        if inline and not fsync:  # the first commit of the new WAL is the writer's (it syncs), then the loop's
            assert committers[0] == "proxy-publish-writer"
            assert set(committers[1:]) == {threading.current_thread().name}
        else:
            assert set(committers) == {"proxy-publish-writer"}
    finally:
        pub.close(timeout_s=0.5)


# ---- the sender's memory mirror of committed rows, deletion and compaction ----------------------------
class FakeBrokerTransport:
    """Stand-in for the Kafka transport (a unit test of the sender's logic, no broker): records
    every window it acknowledges; while ``down`` it fails every window."""

    def __init__(self) -> None:
        self.down = True
        self.sent: list = []

    def send_window(self, items: list, give_up) -> list[bool]:
        if self.down:
            return [False] * len(items)
        self.sent.extend(items)
        return [True] * len(items)

    def close(self) -> None:
        pass


def _publish_all(pub: EventPublisher, names: list[str], in_loop: bool) -> None:
    """Publish one SessionEnd per name: from an event loop (inline commits, a response waiting
    for each group) or from a plain thread (each event straight to the writer thread)."""
    def publish(name: str) -> None:
        assert pub.publish("t", events.SessionEnd(session_id=name, created_at=0), name)

    async def answers() -> None:
        for i in range(0, len(names), 4):
            for name in names[i:i + 4]:
                publish(name)
            await pub.durable()

    if in_loop:
        asyncio.run(answers())
    else:
        for name in names:
            publish(name)


@pytest.mark.parametrize("in_loop", [False, True])
@pytest.mark.parametrize("mirror_events", [1000, 10, 0])
def test_the_sender_takes_committed_rows_from_memory_and_reads_the_buffer_only_past_its_bound(
        tmp_path, monkeypatch, mirror_events, in_loop):
    """Committed rows are kept in memory for the sender, up to ``mirror_max_bytes``: within it
    the buffer is never read back; past it the sender reads the buffer until it has caught up
    and then takes the memory again. Either way every event is sent once, in order, delivered
    rows are deleted, and the memory is given back."""
    fake = FakeBrokerTransport()
    monkeypatch.setattr("pipeline.proxy.publisher.make_transport", lambda *a, **k: fake)
    size = len(events.encode(events.SessionEnd(session_id="s00", created_at=0)))
    config = load_config(None, kafka={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    pub = EventPublisher(config, buffer_dir=str(tmp_path / "buf"), mirror_max_bytes=mirror_events * size,
                         linger_s=0)
    reads: list[int] = []
    real_read = pub._buf.read
    monkeypatch.setattr(pub._buf, "read", lambda after, n: reads.append(after) or real_read(after, n))
    pub.start()
    try:
        first = [f"s{i:02d}" for i in range(40)]
        _publish_all(pub, first, in_loop)
        assert until(lambda: pub._buf.count == 40, timeout_s=10)  # all committed while the broker is away
        fake.down = False
        assert pub.wait_idle(30), pub.stats()
        assert [events.decode(v).session_id for _, _, v in fake.sent] == first  # once each, in order
        assert bool(reads) == (mirror_events < 40)
        assert until(lambda: pub._buf.count == 0 and not pub._mirror and pub._mirror_bytes == 0, timeout_s=10)
        before = len(reads)
        _publish_all(pub, ["a0", "a1"], in_loop)  # the mirror has drained: it takes new rows again
        assert pub.wait_idle(30), pub.stats()
        assert [events.decode(v).session_id for _, _, v in fake.sent[40:]] == ["a0", "a1"]
        assert (len(reads) == before) == (mirror_events >= 2)
    finally:
        pub.close(timeout_s=1.0)
    assert pub.stats()["dropped_total"] == 0


def test_a_drained_buffer_is_compacted_beside_the_event_loops_commits(tmp_path, monkeypatch):
    """The writer thread compacts the buffer once everything was delivered and its files grew
    past ``compact_bytes`` (here 0: every time it drains), outside the commit lock the event
    loop's inline commits take; nothing published meanwhile is lost."""
    fake = FakeBrokerTransport()
    fake.down = False
    monkeypatch.setattr("pipeline.proxy.publisher.make_transport", lambda *a, **k: fake)
    config = load_config(None, kafka={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    pub = EventPublisher(config, buffer_dir=str(tmp_path / "buf"), compact_bytes=0, linger_s=0).start()
    wal = tmp_path / "buf" / "events.sqlite-wal"
    try:
        for round_ in range(3):
            names = [f"r{round_}-{i}" for i in range(30)]
            _publish_all(pub, names, in_loop=True)
            assert pub.wait_idle(30), pub.stats()
            assert until(lambda: not wal.exists() or wal.stat().st_size == 0, timeout_s=10)  # compacted
    finally:
        pub.close(timeout_s=1.0)
    assert [events.decode(v).session_id for _, _, v in fake.sent] == [
        f"r{r}-{i}" for r in range(3) for i in range(30)]


def test_the_mirror_holds_contiguous_rows_only(tmp_path):
    """The rows kept in memory are always the next ones to send, without a hole: rows that found
    the memory full are read from the buffer, and no later row is kept until the memory is empty
    (else the sender would skip the hole)."""
    config = load_config(None, kafka={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    pub = EventPublisher(config, buffer_dir=str(tmp_path / "buf"), mirror_max_bytes=10)  # threads not started
    item = ("t", None, b"x")
    try:
        pub._committed(1, [item] * 10)  # rows 1-10 kept (10 bytes)
        pub._committed(11, [item] * 5)  # 11-15: the memory is full
        pub._sent_id = 5
        assert [r[0] for r in pub._take_rows()] == [6, 7, 8, 9, 10]
        pub._committed(16, [item])  # room again, but 11-15 are missing: not kept
        assert [r[0] for r in pub._mirror] == [6, 7, 8, 9, 10] and pub._mirror_bytes == 5
        pub._sent_id = 10
        assert pub._take_rows() is None and not pub._mirror  # 11 on: read from the buffer
        pub._committed(17, [item, item])  # empty memory: a new run starts
        assert pub._take_rows() is None  # 11-16 still come from the buffer
        pub._sent_id = 16
        assert [r[0] for r in pub._take_rows()] == [17, 18] and pub._disk_pending()
    finally:
        pub._buf.close()


def _traced(pub: EventPublisher, monkeypatch) -> list:
    """Record ``(thread name, what)`` for each append (``append`` or ``append+delete``),
    deletion and checkpoint the publisher makes on its buffer."""
    trace: list = []
    buf = pub._buf
    real_append, real_delete, real_cp = buf.append, buf.delete_through, buf.maybe_checkpoint

    def append(items, delete_through=None):
        out = real_append(items, delete_through)
        trace.append((threading.current_thread().name, "append+delete" if delete_through else "append"))
        return out

    def delete_through(last_id):
        trace.append((threading.current_thread().name, "delete"))
        return real_delete(last_id)

    def maybe_checkpoint(*args):
        ran = real_cp(*args)
        if ran:
            trace.append((threading.current_thread().name, "checkpoint"))
        return ran

    monkeypatch.setattr(buf, "append", append)
    monkeypatch.setattr(buf, "delete_through", delete_through)
    monkeypatch.setattr(buf, "maybe_checkpoint", maybe_checkpoint)
    return trace


@pytest.mark.parametrize("broker_up", [False, True])
def test_the_event_loop_only_appends_and_the_writer_commits_first_after_a_checkpoint(
        tmp_path, monkeypatch, broker_up):
    """On the event loop a commit is an append and nothing else: deleting what was delivered
    (long for a big window) and checkpoints are the writer thread's, and so is the first commit
    after a checkpoint (it starts the WAL over and syncs its header). Checkpoints run while the
    broker is away too (no acknowledgement wakes the writer then), so the WAL stays bounded."""
    fake = FakeBrokerTransport()
    fake.down = not broker_up
    monkeypatch.setattr("pipeline.proxy.publisher.make_transport", lambda *a, **k: fake)
    config = load_config(None, kafka={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    pub = EventPublisher(config, buffer_dir=str(tmp_path / "buf"), linger_s=0, checkpoint_every=16)
    trace = _traced(pub, monkeypatch)
    pub.start()
    loop_thread = threading.current_thread().name
    big = [{"role": "user", "content": "x" * 2000}]
    wal = tmp_path / "buf" / "events.sqlite-wal"
    wal_sizes = []

    async def answers() -> None:
        for i in range(800):
            pub.publish("t", events.NextState(session_id="S", messages=big, after_turn_index=i, created_at=i), "S")
            await pub.durable()
            await asyncio.sleep(0.0002)  # the next request arrives over the network: other threads run
            if i % 50 == 49:
                wal_sizes.append(wal.stat().st_size)

    try:
        asyncio.run(answers())
        if broker_up:
            assert pub.wait_idle(30), pub.stats()
    finally:
        pub.close(timeout_s=1.0)
    on_loop = {what for who, what in trace if who == loop_thread}
    assert on_loop == {"append"}  # never a deletion or a checkpoint on the loop
    assert sum(1 for who, what in trace if who == loop_thread) > 400  # the loop did most commits
    checkpoints = [i for i, (_, what) in enumerate(trace) if what == "checkpoint"]
    assert len(checkpoints) >= 5, trace[-20:]  # one per 16 commits or so (the writer wakes when it gets the GIL)
    for i in checkpoints:  # the commit right after a checkpoint is the writer thread's
        nxt = next((t for t in trace[i + 1:] if t[1] != "checkpoint"), None)
        assert nxt is None or nxt[0] == "proxy-publish-writer", trace[i - 2:i + 3]
    assert max(wal_sizes) < 2 << 20, wal_sizes  # 800 commits of ~2 KB (~9 MB of WAL): it starts over
    if broker_up:
        assert any(what in ("append+delete", "delete") for _, what in trace)  # on the writer (above)
        assert len(fake.sent) == 800


def test_a_group_refused_on_the_event_loop_goes_to_the_writer_once(tmp_path, monkeypatch):
    """A full buffer refuses the event loop's commit (nothing of it applied): the group goes to
    the writer thread already encoded, which keeps what fits and holds the rest in memory. An
    event that cannot be encoded is counted once, not again by the writer."""
    fake = FakeBrokerTransport()
    monkeypatch.setattr("pipeline.proxy.publisher.make_transport", lambda *a, **k: fake)
    config = load_config(None, kafka={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    pub = EventPublisher(config, max_buffer=1000, buffer_dir=str(tmp_path / "buf"), buffer_max_bytes=64 * 4096,
                         linger_s=0).start()
    big = [{"role": "user", "content": "x" * 4000}]

    async def answers() -> None:
        for i in range(100):
            pub.publish("t", events.NextState(session_id="F", messages=big, after_turn_index=i, created_at=i), "F")
            if i == 50:
                pub.publish("t", object(), "F")  # a bug upstream: cannot be encoded
            await pub.durable()

    try:
        asyncio.run(answers())
        st = pub.stats()
        assert st["dropped"] == {"invalid": 1}, st
        assert 0 < st["on_disk"] < 100 and st["on_disk"] + st["in_memory"] == 100, st
        assert st["not_durable"]["buffer_full"] >= 1 and set(st["not_durable"]) <= {"buffer_full", "behind_memory"}
        assert sum(st["not_durable"].values()) == st["in_memory"], st
        fake.down = False
        assert pub.wait_idle(30), pub.stats()
    finally:
        pub.close(timeout_s=1.0)
    got = [events.decode(v).after_turn_index for _, _, v in fake.sent]
    assert got == list(range(100))  # the disk part then the memory part, in order, once each


def test_rows_committed_before_a_disk_error_are_sent_once_in_order(tmp_path, monkeypatch):
    """A group the full buffer takes only in part: the halves it took stay committed and
    visible to the sender even when a later half fails with an I/O error; only the rest goes
    to memory (counted as a disk error), so nothing is sent twice or out of order."""
    config = load_config(None, kafka={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    pub = EventPublisher(config, buffer_dir=str(tmp_path / "buf"))  # threads not started: _store by hand
    real_append = pub._buf.append
    calls = []

    def append(items, delete_through=None):
        calls.append(len(items))
        if len(items) == 8:
            raise EventBufferFull("full")
        if len(calls) == 4:  # the second half of 8 (the group, the group again, its first half)
            raise EventBufferError("I/O error")
        return real_append(items, delete_through)

    monkeypatch.setattr(pub._buf, "append", append)
    items = [("t", f"k{i}", bytes([i])) for i in range(8)]
    try:
        with pub._commit_lock:
            pub._store(items)
        assert calls == [8, 8, 4, 4]
        assert pub._buf.count == 4 and pub._committed_id == pub._buf.last_id == 4
        assert [r[0] for r in pub._take_rows()] == [1, 2, 3, 4]
        assert list(pub._mem) == items[4:] and pub.not_durable == {"disk_error": 4}
    finally:
        pub._buf.close()


def test_a_new_event_waits_behind_a_memory_window_in_flight(tmp_path, monkeypatch):
    """Events the disk refused are sent from memory; while the sender has such a window in
    flight, a new event must not go to disk ahead of it (a failed window goes back to memory,
    and the sender would send the disk first): it goes behind the memory backlog, in order."""
    sent: list = []
    started, release = threading.Event(), threading.Event()

    class SlowFirstWindow(FakeBrokerTransport):
        def send_window(self, items, give_up):
            if not started.is_set():  # the memory window: in flight until released, then failed
                started.set()
                release.wait(10)
                return [False] * len(items)
            sent.extend(v for _, _, v in items)
            return [True] * len(items)

    fake = SlowFirstWindow()
    monkeypatch.setattr("pipeline.proxy.publisher.make_transport", lambda *a, **k: fake)
    config = load_config(None, kafka={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    pub = EventPublisher(config, buffer_dir=str(tmp_path / "buf"), linger_s=0).start()
    try:
        with pub._commit_lock:
            pub._to_memory([("t", "k", b"OLD-%d" % i) for i in range(3)], "disk_error")  # as if refused
        with pub._lock:
            pub._lock.notify_all()
        assert started.wait(10) and pub._inflight and not pub._mem

        async def answer() -> None:
            pub.publish("t", events.SessionEnd(session_id="NEW", created_at=0), "k")
            await pub.durable()

        asyncio.run(answer())
        release.set()
        assert pub.wait_idle(30), pub.stats()
    finally:
        release.set()
        pub.close(timeout_s=1.0)
    assert [v if v.startswith(b"OLD") else b"NEW" for v in sent] == [b"OLD-0", b"OLD-1", b"OLD-2", b"NEW"]
    assert pub.stats()["not_durable"] == {"disk_error": 3, "behind_memory": 1}


def test_the_first_commit_of_a_new_wal_is_the_writer_threads(tmp_path, monkeypatch):
    """A new WAL (at start, after a compaction) syncs its header at its first commit: that
    commit is the writer thread's, the event loop's come after it."""
    fake = FakeBrokerTransport()
    fake.down = False
    monkeypatch.setattr("pipeline.proxy.publisher.make_transport", lambda *a, **k: fake)
    config = load_config(None, kafka={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    pub = EventPublisher(config, buffer_dir=str(tmp_path / "buf"), compact_bytes=0, linger_s=0)
    trace = _traced(pub, monkeypatch)
    real_compact = pub._buf.compact
    monkeypatch.setattr(pub._buf, "compact", lambda: trace.append(("", "compact")) or real_compact())
    pub.start()
    try:
        for _ in range(2):
            _publish_all(pub, [f"e{i}" for i in range(12)], in_loop=True)
            assert pub.wait_idle(30), pub.stats()
            assert until(lambda: trace[-1][1] == "compact", timeout_s=10)  # drained: compacted
    finally:
        pub.close(timeout_s=1.0)
    appends = [i for i, t in enumerate(trace) if t[1].startswith("append")]
    assert trace[appends[0]][0] == "proxy-publish-writer"  # the first commit after the start
    compacts = [i for i, t in enumerate(trace) if t[1] == "compact"]
    after = [i for i in appends if i > compacts[0]]
    assert after and trace[after[0]][0] == "proxy-publish-writer", trace  # the first after a compaction
    assert any(t[0] == threading.current_thread().name for t in trace)  # and the loop commits otherwise
