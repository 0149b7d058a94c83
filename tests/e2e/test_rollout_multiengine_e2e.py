"""A full-weight canary over two engines through the stack (docs/rollout.md, "Full-weight canaries
over several engines"): two native CPU engines serving tiny-random (``engine-0`` behind
``engine.url``; ``engine-1``, the canary engine, behind ``proxy.canary_engine_url``), a syncer per
engine, the proxy, the judge (backend constant), the trainer (full weights) and the evaluator
(the decider, live arms: ``rollout.canary_engines``), each its own process except the engines and
``engine-1``'s syncer, which this test starts itself (``pipeline up --rollout`` still refuses
several full-weight engines: ``start_stack`` is given ``engine-0``'s URL as an external engine).

Users give explicit feedback (``POST /v1/feedback``): the first candidate's answers are thumbed
down, the incumbent's up. Checked from the records: the candidate served exactly the new sessions
whose sticky hash is below the share (no session switched mid-conversation), it is rolled back
(``reward_fell``), the canary engine serves the incumbent again and no new session reaches the
rolled-back version; then a second candidate, liked everywhere, is promoted and ``engine-0``
applies it.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from pipeline import events
from pipeline.config import load_config
from pipeline.orchestrate.demo import read_topic
from pipeline.orchestrate.up import start_stack
from pipeline.proxy.canary import full_session
from pipeline.rollout.assign import assign_arm
from pipeline.testing.engine import running_engine
from tests.e2e.test_rollout_e2e import SHARE, TENANT, Alice, _until, _view


def _config(run_dir: Path, main_url: str, canary_url: str):
    return load_config(
        None,
        engine={"model": "tiny-random", "url": main_url},
        trainer={"model": "tiny-random", "rollout_batch_size": 4, "lr": 1e-3, "threads": 1,
                 "checkpoint_dir": str(run_dir / "ckpt"), "export_dir": str(run_dir / "weights"),
                 "metrics_file": str(run_dir / "trainer.jsonl"), "progress": False, "max_staleness": None,
                 "engines": ["engine-0", "engine-1"], "sync_timeout_s": 120},
        judge={"mode": "rl", "backend": "constant", "idle_timeout_s": 5},
        proxy={"canary_engine_url": canary_url},
        rollout={"enabled": True, "share": SHARE, "rollback_min_n": 6, "min_n": 8, "max_n": 400, "margin": 0.5,
                 "rollback_z": 1.645, "canary_engines": ["engine-1"]})


def _decision(config, action: str, version: int):
    return next((c for c in read_topic(config, "control") if isinstance(c, events.Control) and c.action == action
                 and c.full_weights and c.policy_version == version), None)


def _served(url: str) -> str:
    from pipeline.engine_api.client import EngineClient

    async def ask():
        async with EngineClient(url, timeout_s=30) as eng:
            return await eng.weight_version()
    return asyncio.run(ask())


def _canary_syncer(config, url: str):
    from pipeline.syncer import Syncer

    s = Syncer(config.replace(syncer={"engine_id": "engine-1", "engine_url": url}))
    t = threading.Thread(target=s.run, name="syncer-engine-1", daemon=True)
    t.start()
    return s, t


@pytest.mark.slow(seconds=300)
def test_a_thumbed_down_full_weight_candidate_is_rolled_back_on_its_share_and_a_liked_one_promoted(tmp_path):
    run_dir = tmp_path / "run"
    with running_engine("tiny-random", subprocess=True, threads=1) as main_url, \
            running_engine("tiny-random", subprocess=True, threads=1) as canary_url:
        stack = start_stack(_config(run_dir, main_url, canary_url), run_dir, engine_url=main_url,
                            ready_timeout_s=300, dashboard=False)
        config, alice, syncer = stack.config, None, None
        try:
            syncer = _canary_syncer(config, canary_url)
            alice = Alice(stack)
            early = alice.turn(alice.ask("early-session"))  # before any candidate
            assert early.canary is None
            # (the proxy may route a session to the candidate before this test reads that it is live:
            # its answers are disliked from the first, as below)
            _until("the first candidate to go live", lambda: _view(config).scope(None).live or None,
                   tick=lambda: alice.session(lambda t: -1 if t.canary == "candidate" else 1))
            cand = _view(config).scope(None).candidate
            turns = []
            _until("the rollback", lambda: _decision(config, "rollback", cand), seconds=240,
                   tick=lambda: turns.append(alice.session(lambda t: -1 if t.canary == "candidate" else 1)))
            for t in turns:  # the canary: exactly the sessions the hash gives it, served by the candidate
                if t.canary is not None:
                    want = assign_arm(None, full_session(TENANT, t.session_id), cand, SHARE)
                    assert t.canary == want and (t.policy_version == cand) == (want == "candidate"), t
            on_candidate = [t for t in turns if t.canary == "candidate"]
            assert on_candidate and len(on_candidate) < len(turns)
            rollback = _decision(config, "rollback", cand)
            assert rollback.evidence["reason"] == "reward_fell"
            incumbent = rollback.evidence["incumbent"]
            _until("the canary engine to serve the incumbent again", lambda: _served(canary_url) == str(incumbent))
            again = alice.turn(alice.ask("early-session"))
            assert again.policy_version == incumbent
            after = [alice.session(lambda t: 1) for _ in range(6)]  # a rolled-back version serves no one new
            assert all(t.policy_version != cand for t in after)
            nxt = _until("a second candidate", lambda: (c := _view(config).scope(None).candidate) is not None
                         and c != cand and c, tick=lambda: alice.session(lambda t: 1))
            _until("the promotion", lambda: _decision(config, "promote", nxt), seconds=240,
                   tick=lambda: alice.session(lambda t: 1))
            _until("engine-0 to apply the promoted version", lambda: _served(main_url) == str(nxt), seconds=60)
        finally:
            if syncer is not None:
                syncer[0].stop.set()
                syncer[1].join(30)
            if alice is not None:
                alice.http.close()
            stack.stop()
