"""The syncer retries only what can pass: an unreachable engine, a time-out, a 5xx/429 answer are
retried (with back-off); a checksum mismatch, a missing folder or a 4xx refusal fail at the first
try. Attempts are counted at a real HTTP server standing in for the engine."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from pipeline import events
from pipeline.config import load_config
from pipeline.syncer import Syncer
from pipeline.testing.servers import StandInEngine, serve_app
from pipeline.weightsync import CHECKSUM_FILE, WEIGHTS_FILE, sha256_file


def _weights(tmp_path, corrupt: bool = False) -> events.Control:
    folder = tmp_path / "v000001"
    folder.mkdir()
    (folder / WEIGHTS_FILE).write_bytes(b"weights of version 1")
    sha = sha256_file(folder / WEIGHTS_FILE)
    (folder / CHECKSUM_FILE).write_text(f"{sha}  {WEIGHTS_FILE}\n")
    if corrupt:  # a torn copy: the bytes on disk are not the published ones
        (folder / WEIGHTS_FILE).write_bytes(b"weights of version 1, torn")
    return events.Control(action="weights", epoch=1, policy_version=1, run_id="default", location=str(folder),
                          sha256=sha, created_at=events.now_ms())


def _syncer(url: str, retries: int = 3) -> Syncer:
    return Syncer(load_config(None, syncer={"engine_url": url, "retries": retries, "retry_backoff_s": 0.01,
                                            "apply_timeout_s": 5.0}))


@pytest.mark.parametrize("statuses,updates,ok", [
    ([503, 500], 3, True),          # transient: retried until it passes
    ([429], 2, True),
    ([503, 503, 503, 503], 4, False),  # transient every time: 1 + retries tries, then failed
    ([400], 1, False),              # the engine refused these weights: not retried
    ([404], 1, False),
])
def test_apply_retries_only_transient_answers(tmp_path, statuses, updates, ok):
    engine = StandInEngine(update_statuses=statuses)
    with serve_app(engine) as url:
        got, msg = _syncer(url, retries=3).apply(_weights(tmp_path))
    assert (got, engine.calls["/update_weights_from_disk"]) == (ok, updates), msg
    if not ok:
        assert str(statuses[-1]) in msg


def test_checksum_mismatch_fails_at_once_without_calling_the_engine(tmp_path, caplog, monkeypatch):
    from pipeline import weightsync

    checks = []
    real = weightsync.verify_folder
    monkeypatch.setattr(weightsync, "verify_folder", lambda *a: checks.append(a) or real(*a))
    engine = StandInEngine()
    with serve_app(engine) as url, caplog.at_level(logging.WARNING, "pipeline.syncer"):
        ok, msg = _syncer(url, retries=5).apply(_weights(tmp_path, corrupt=True))
    assert not ok and "sha256" in msg and engine.calls["/update_weights_from_disk"] == 0
    assert len(checks) == 1  # one try: a retry reads the same torn bytes
    assert [r.getMessage() for r in caplog.records if "refused, not retried" in r.getMessage()]
    assert not [r for r in caplog.records if "will retry" in r.getMessage()]


def test_missing_folder_fails_at_once(tmp_path):
    ev = _weights(tmp_path)
    engine = StandInEngine()
    with serve_app(engine) as url:
        syncer = Syncer(load_config(None, syncer={"engine_url": url, "retries": 5, "retry_backoff_s": 5.0}))
        t0 = time.monotonic()
        ok, msg = syncer.apply(_gone(ev, tmp_path))
    assert not ok and "not found" in msg and engine.calls["/update_weights_from_disk"] == 0
    assert time.monotonic() - t0 < 4  # no back-off wait: not retried


def _gone(ev: events.Control, tmp_path) -> events.Control:
    return events.Control(action="weights", epoch=1, policy_version=1, run_id="default",
                          location=str(tmp_path / "gone"), sha256=ev.sha256, created_at=ev.created_at)


def test_unreachable_engine_is_retried_then_reported(tmp_path, caplog):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    url = f"http://127.0.0.1:{s.getsockname()[1]}"
    try:
        with caplog.at_level(logging.WARNING, "pipeline.syncer"):
            ok, msg = _syncer(url, retries=2).apply(_weights(tmp_path))
    finally:
        s.close()
    tries = [r.getMessage() for r in caplog.records if "will retry" in r.getMessage()]
    assert not ok and "after 3 tries" in msg and len(tries) == 3, (msg, tries)


def test_stop_ends_the_back_off(tmp_path):
    engine = StandInEngine(update_statuses=[503] * 10)
    with serve_app(engine) as url:
        syncer = Syncer(load_config(None, syncer={"engine_url": url, "retries": 5, "retry_backoff_s": 30.0}))
        threading.Timer(0.5, syncer.stop.set).start()
        t0 = time.monotonic()
        ok, msg = syncer.apply(_weights(tmp_path))
    assert not ok and msg.startswith("stopped") and time.monotonic() - t0 < 10
    assert engine.calls["/update_weights_from_disk"] == 1


def test_one_engine_client_for_the_syncers_life(tmp_path, monkeypatch):
    """Checks and applies share one HTTP client: building one per check loaded the TLS trust store
    every check interval, CPU that starved the Kafka client's I/O thread of the GIL."""
    from pipeline.engine_api import client

    built = []
    real = client.EngineClient.__init__
    monkeypatch.setattr(client.EngineClient, "__init__", lambda self, *a, **k: built.append(a) or real(self, *a, **k))
    engine = StandInEngine(update_statuses=[503])
    with serve_app(engine) as url:
        syncer = _syncer(url)
        try:
            assert [syncer.served_version() for _ in range(5)] == ["0"] * 5
            assert syncer.apply(_weights(tmp_path))[0] and engine.calls["/update_weights_from_disk"] == 2
            assert syncer.served_version() == "0"
        finally:
            syncer.close()
    assert len(built) == 1
