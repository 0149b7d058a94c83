"""The proxy's durable event buffer (pipeline/proxy/buffer.py): FIFO, bounds, one owner, and
recovery from a crash at any point — a torn WAL tail (property test) and kill -9 in the middle
of a compaction (a real child process killed while it rewrites the file)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.proxy.buffer import DB_NAME, ROWS_PER_INSERT, DiskBuffer, EventBufferError, EventBufferFull, EventBufferLocked


def _value(i: int, size: int = 64) -> bytes:
    return (f"{i:08d}".encode() * (size // 8 + 1))[:size]


def test_buffer_is_a_persistent_fifo_with_one_owner(tmp_path):
    b = DiskBuffer(tmp_path / "buf")
    last = b.append([("t", "k1", b"a"), ("t", None, b"b"), ("t", "k3", b"c")])
    rows = b.read(0, 2)
    assert [(r[1], r[2], r[3]) for r in rows] == [("t", "k1", b"a"), ("t", None, b"b")]
    assert [r[3] for r in b.read(rows[-1][0], 10)] == [b"c"] and last == rows[-1][0] + 1
    with pytest.raises(EventBufferLocked, match="in use by another process"):
        DiskBuffer(tmp_path / "buf")  # two proxies never share a buffer
    b.append([("t", "k4", b"d")], delete_through=rows[0][0])  # "a" delivered, deleted in the same commit
    assert len(b) == 3 and b.last_id == last + 1
    b.close()
    b = DiskBuffer(tmp_path / "buf")  # a restart resumes with what was not delivered, in order
    assert len(b) == 3 and [r[3] for r in b.read(0, 10)] == [b"b", b"c", b"d"]
    assert b.delete_through(b.last_id) == 3 and len(b) == 0
    b.close()



def test_row_ids_are_contiguous_across_statements_restarts_and_older_files(tmp_path):
    """``append`` gives the ids itself (one writer owns the file): a group of more rows than one
    INSERT statement takes gets contiguous ids in order, a restart goes on after the newest row,
    and a file made before (ids from AUTOINCREMENT, with gaps) is read in its order and extended."""
    b = DiskBuffer(tmp_path / "buf")
    n = 2 * ROWS_PER_INSERT + 5  # three INSERT statements in one transaction
    assert b.append([("t", f"k{i}", _value(i)) for i in range(n)]) == n
    assert [r[0] for r in b.read(0, n)] == list(range(1, n + 1))
    assert b.delete_through(ROWS_PER_INSERT) == ROWS_PER_INSERT and len(b) == n - ROWS_PER_INSERT
    b.close()
    b = DiskBuffer(tmp_path / "buf")
    assert (len(b), b.last_id) == (n - ROWS_PER_INSERT, n)
    assert b.append([("t", None, b"x"), ("t", None, b"y")]) == n + 2
    assert [r[3] for r in b.read(n - 1, 10)] == [_value(n - 1), b"x", b"y"]
    b.delete_through(b.last_id)
    b.close()
    b = DiskBuffer(tmp_path / "buf")  # drained: ids may start again (each process sends from its own start)
    assert len(b) == 0 and [r[3] for r in b.read(0, 10)] == []
    b.close()

    old = tmp_path / "old"
    old.mkdir()
    c = sqlite3.connect(old / DB_NAME)
    c.execute("CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, topic TEXT NOT NULL, key TEXT, "
              "value BLOB NOT NULL)")
    c.executemany("INSERT INTO events(id, topic, key, value) VALUES (?, ?, ?, ?)",
                  [(5, "t", "a", b"a"), (9, "t", "b", b"b"), (10, "t", None, b"c")])
    c.commit()
    c.close()
    b = DiskBuffer(old)
    assert (len(b), b.last_id) == (3, 10)
    assert b.append([("t", "d", b"d")]) == 11
    assert [(r[0], r[3]) for r in b.read(0, 10)] == [(5, b"a"), (9, b"b"), (10, b"c"), (11, b"d")]
    assert b.delete_through(9) == 2 and len(b) == 2
    b.close()


def test_an_append_recovers_from_ids_or_a_transaction_left_out_of_step(tmp_path):
    """Hardening against a bug elsewhere: an id already in the file fails that append alone (an
    error, nothing applied) and re-reads the ids, so the next append goes on; a transaction a
    failed rollback left open is rolled back, not joined (its rows would never be committed)."""
    b = DiskBuffer(tmp_path / "buf")
    b.append([("t", None, b"a"), ("t", None, b"b")])
    b.last_id = 1  # out of step with the file
    with pytest.raises(EventBufferError, match="UNIQUE"):
        b.append([("t", None, b"c")])
    assert (b.last_id, len(b)) == (2, 2)
    assert b.append([("t", None, b"c")]) == 3
    b._w.execute("BEGIN IMMEDIATE")  # as a failed ROLLBACK would leave it
    b._w.execute("INSERT INTO events(id, topic, key, value) VALUES (99, 't', NULL, x'00')")
    assert b.append([("t", None, b"d")]) == 4 and not b._w.in_transaction
    b.close()
    b = DiskBuffer(tmp_path / "buf")
    assert [r[3] for r in b.read(0, 10)] == [b"a", b"b", b"c", b"d"]
    b.close()


def test_the_wal_is_checkpointed_by_maybe_checkpoint_only(tmp_path):
    """The writer connection never checkpoints inside a commit; ``maybe_checkpoint`` does, once
    every ``every`` commits, and what was committed stays readable across it and a restart."""
    b = DiskBuffer(tmp_path / "buf")
    assert b._w.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    for i in range(5):
        b.append([("t", "k", _value(i))])
        assert b.maybe_checkpoint(every=3) == (i == 2)
    assert b.maybe_checkpoint(every=2) and not b.maybe_checkpoint(every=2)
    assert [r[3] for r in b.read(0, 10)] == [_value(i) for i in range(5)]
    b.close()
    b = DiskBuffer(tmp_path / "buf")
    assert [r[3] for r in b.read(0, 10)] == [_value(i) for i in range(5)]
    b.close()

def test_a_full_buffer_refuses_the_whole_group_and_keeps_what_it_had(tmp_path):
    b = DiskBuffer(tmp_path / "buf", max_bytes=64 * 4096)
    kept = 0
    with pytest.raises(EventBufferFull):
        for i in range(1000):
            b.append([("t", "k", _value(i, 4000))])
            kept += 1
    assert 0 < kept < 1000 and len(b) == kept
    with pytest.raises(EventBufferFull):
        b.append([("t", "k", _value(-1, 4000))] * 5)
    assert len(b) == kept and [r[3] for r in b.read(0, kept)] == [_value(i, 4000) for i in range(kept)]
    with pytest.raises(EventBufferFull):  # a group of several INSERT statements is refused whole
        b.append([("t", "k", _value(-1, 4000))] * (2 * ROWS_PER_INSERT + 1))
    assert len(b) == kept and [r[3] for r in b.read(0, kept + 1)] == [_value(i, 4000) for i in range(kept)]
    b.delete_through(b.read(0, kept)[kept // 2][0])  # delivered: room again
    b.append([("t", "k", _value(-2, 4000))])
    b.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(groups=st.lists(st.integers(1, 6), min_size=1, max_size=12), delete_after=st.integers(0, 12),
       cut=st.floats(0.0, 1.0), garble=st.booleans(), data=st.data())
def test_recovery_from_a_torn_tail_is_a_committed_state(tmp_path_factory, groups, delete_after, cut, garble, data):
    """A crash can tear the last write of the WAL (cut anywhere, or garbage at the end): the
    reopened buffer must hold exactly the rows of one committed state, never a mixture, and
    with an intact file exactly the last one."""
    d = tmp_path_factory.mktemp("torn")
    b = DiskBuffer(d / "buf")
    states = [[]]
    i = 0
    for g, n in enumerate(groups):
        b.append([("t", f"k{j}", _value(j)) for j in range(i, i + n)])
        i += n
        states.append(states[-1] + [_value(j) for j in range(i - n, i)])
        if g == delete_after:  # the sender acknowledged the first half
            half = len(states[-1]) // 2
            if half:
                b.delete_through(b.read(0, half)[-1][0])
                states.append(states[-1][half:])
    crashed = d / "crashed"  # the files as a kill -9 leaves them: the connection is still open
    crashed.mkdir()
    for name in (DB_NAME, DB_NAME + "-wal"):
        if (d / "buf" / name).exists():
            shutil.copy(d / "buf" / name, crashed / name)
    b.close()
    wal = crashed / (DB_NAME + "-wal")
    intact = cut == 1.0 and not garble
    if wal.exists() and not intact:
        size = wal.stat().st_size
        keep = int(size * cut)
        with open(wal, "r+b") as f:
            f.truncate(keep)
            if garble and keep:
                n = data.draw(st.integers(1, min(keep, 4096)))
                f.seek(keep - n)
                f.write(random.Random(keep).randbytes(n))
    r = DiskBuffer(crashed)
    got = [row[3] for row in r.read(0, 10_000)]
    assert len(r) == len(got)
    r.close()
    assert got in states
    if intact:
        assert got == states[-1]


_CHILD = textwrap.dedent("""
    import sys
    from pipeline.proxy.buffer import DiskBuffer
    size = 4000
    def value(i):
        return (f"{i:08d}".encode() * (size // 8 + 1))[:size]
    b = DiskBuffer(sys.argv[1])
    if len(b) == 0:  # first run: 2000 events, the first 1000 delivered (deleted)
        for start in range(0, 2000, 100):
            b.append([("turns", f"s{i % 13}", value(i)) for i in range(start, start + 100)])
        b.delete_through(b.read(0, 1000)[-1][0])
    print("ready", len(b), flush=True)
    while True:
        print("compacting", flush=True)
        b.compact()
        print("compacted", flush=True)
""")


def test_kill_minus_9_during_compaction_loses_nothing(tmp_path):
    """A real process rewriting its buffer (VACUUM) is killed in the middle, three times; every
    undelivered event is still there, in order, and nothing delivered comes back."""
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    d = tmp_path / "buf"
    rng = random.Random(7)
    expected = [_value(i, 4000) for i in range(1000, 2000)]
    kills_mid_compaction = 0
    for attempt in range(8):
        p = subprocess.Popen([sys.executable, str(script), str(d)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
        lines = []
        want = rng.randint(1, 3)  # the k-th compaction of this run
        while True:
            line = p.stdout.readline()
            assert line, f"child exited: {lines}"
            lines.append(line.strip())
            if lines.count("compacting") == want:
                break
        os.kill(p.pid, signal.SIGKILL)  # while it rewrites the file (the state was just announced)
        p.wait(10)
        lines += [x.strip() for x in p.stdout.read().splitlines()]
        assert lines[0] == "ready 1000"
        if lines[-1] == "compacting":  # it had not finished that compaction when it died
            kills_mid_compaction += 1
        b = DiskBuffer(d)
        got = [row[3] for row in b.read(0, 5000)]
        b.close()
        assert got == expected, f"attempt {attempt}: {len(got)} events after the kill"
        if kills_mid_compaction >= 3:
            break
    assert kills_mid_compaction >= 3, "never killed inside a compaction"
