"""What the syncer's topic-level tests share: their config, a real engine serving tiny-random with
the config pointing at it, the real :class:`pipeline.syncer.Syncer` running in a thread, the
trainer's side of a sync (:class:`pipeline.trainer.sync.WeightPublisher`) and what the engine
serves (its weight version and its log-probs of a fixed sequence, which tell the weights apart)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.error
import urllib.request

from pipeline import events
from pipeline.config import Config, load_config
from pipeline.testing.engine import running_engine

#: a fixed token sequence: the engine's log-probs of it tell which weights it serves
TOKENS = list(range(200, 230))


def syncer_config(kafka_config: Config, tmp_path, **syncer) -> Config:
    """``kafka_config`` with one engine (``engine-0``), a syncer group of its own (no stale members),
    quick retries and checks, and the trainer's export folder ``tmp_path/weights`` (run
    ``reconcile``)."""
    base = kafka_config.model_dump(mode="python")
    s = dict(engine_id="engine-0", retries=1, retry_backoff_s=0.1, check_interval_s=0.3,
             group_id=f"syncer-{kafka_config.topics.prefix}")
    s.update(syncer)
    t = dict(export_dir=str(tmp_path / "weights"), run_id="reconcile", engines=["engine-0"], sync_timeout_s=60.0)
    return load_config(None, kafka=base["kafka"], topics=base["topics"], trainer=t, syncer=s)


@contextlib.contextmanager
def engine_for(cfg: Config, **settings):
    """A real CPU engine serving tiny-random (``settings``: of :func:`running_engine`, one torch
    thread unless given); yields ``(cfg pointing the syncer at it, its URL)``."""
    with running_engine("tiny-random", **{"threads": 1, **settings}) as url:
        yield cfg.replace(syncer={"engine_url": url}), url


def new_syncer(cfg: Config):
    """A :class:`pipeline.syncer.Syncer` for ``cfg`` (not running yet)."""
    from pipeline.syncer import Syncer

    return Syncer(cfg)


@contextlib.contextmanager
def running(syncer, ready: bool = True):
    """``syncer`` running in a thread; with ``ready``, reconciled and in its group before the body
    runs. Stopped (and its thread joined) on exit."""
    t = threading.Thread(target=syncer.run, daemon=True)
    t.start()
    try:
        if ready:
            assert syncer.ready.wait(30), "the syncer never joined its group"
        yield syncer
    finally:
        syncer.stop.set()
        t.join(30)
        assert not t.is_alive()


async def _served(url: str) -> tuple[str | None, list]:
    """``(weight version, log-probs of TOKENS)`` the engine at ``url`` serves."""
    from pipeline.engine_api.client import EngineClient

    async with EngineClient(url, timeout_s=60) as eng:
        return await eng.weight_version(), await eng.score(TOKENS, 10)


def info(url: str) -> tuple[str | None, list]:
    """``(weight version, log-probs of TOKENS)`` the engine at ``url`` serves."""
    return asyncio.run(_served(url))


def version(url: str) -> str | None:
    """The weight version the engine at ``url`` reports."""
    return info(url)[0]


def control(cfg: Config, want: int, timeout_s: float = 15.0) -> list[events.Control]:
    """The ``control`` topic's events (waits for ``want``)."""
    from pipeline.testing.topics import read_events

    return read_events(cfg, "control", want, timeout_s, settle_s=0.2)


def publish(cfg: Config, version: int, folder, sha: str, wait: bool = True):
    """What the trainer does: pause, weights, (with ``wait``: wait for applied), resume; returns
    the :class:`WeightPublisher`'s report."""
    from pipeline.trainer.sync import WeightPublisher

    if not wait:
        cfg = cfg.replace(trainer={"engines": []})
    pub = WeightPublisher(cfg)
    try:
        return pub.sync(version, str(folder), sha)
    finally:
        pub.close()


def readyz(port: int) -> tuple[int, dict]:
    """``(status, body)`` of a syncer's ``GET /readyz`` on 127.0.0.1:``port``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class RecordingProducer:
    """A producer stand-in for syncers driven with records (no broker): keeps what they publish."""

    def __init__(self) -> None:
        self.sent: list[events.Control] = []

    def send(self, topic, ev, key=None):
        self.sent.append(ev)
        return self

    def get(self, timeout=None):
        return None


@contextlib.contextmanager
def syncer_maker():
    """Yield ``make(config, engine)``: a :class:`pipeline.syncer.Syncer` of ``config`` calling the
    stand-in ``engine`` (no broker; drive it with records); every one made is closed on exit."""
    from pipeline.syncer import Syncer

    made = []

    def make(config: Config, engine):
        s = Syncer(config)
        s._engine = engine
        made.append(s)
        return s

    try:
        yield make
    finally:
        for s in made:
            s.close()
