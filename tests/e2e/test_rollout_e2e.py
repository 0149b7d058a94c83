"""Canary rollout through the whole stack (every stage its own process, issue 39), on each engine
path: this package's CPU engine (tiny-random) and a real vLLM (tiny-random-64: vLLM's CPU build
refuses 16-wide heads), whose adapters the syncer loads and unloads through vLLM's own API.

Alice's users give explicit feedback (``POST /v1/feedback``, which takes precedence over the
judge): in the first canary they thumb down every answer of the candidate and up every answer
of the incumbent, so the candidate is worse by the records; in the second they thumb everything
up. Checked from the records:

- the candidate serves exactly the new sessions whose sticky hash is below the share, every turn
  of such a session, and nothing else: a session that began on the incumbent before the canary
  went live is never switched mid-conversation;
- the evaluator rolls the worse candidate back (``rollback`` on ``control`` with its evidence),
  after which it serves no new session; the trainer continues from the incumbent and its next
  candidate is promoted once the rule's n is reached, after which it serves every new session.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx
import pytest

from pipeline import events
from pipeline.config import load_config
from pipeline.orchestrate.demo import read_topic
from pipeline.orchestrate.up import start_stack
from pipeline.rollout.assign import assign_arm
from pipeline.rollout.serving import ServingView
from pipeline.testing.vllm import require_vllm

TENANT = "alice"
SHARE = 0.5


def _config(run_dir: Path, kind: str):
    model = "tiny-random-64" if kind == "vllm" else "tiny-random"
    engine = {"kind": "vllm", "context_length": 1024} if kind == "vllm" else {"threads": 1, "max_batch_size": 8}
    return load_config(
        None,
        engine={"model": model, "enable_lora": True, **engine},
        trainer={"model": model, "rollout_batch_size": 4, "lr": 1e-3, "threads": 1,
                 "checkpoint_dir": str(run_dir / "ckpt"), "export_dir": str(run_dir / "weights"),
                 "metrics_file": str(run_dir / "trainer.jsonl"), "progress": False, "max_staleness": None,
                 "per_tenant": True, "tenant_max_wait_records": 64, "lora": {"rank": 4, "alpha": 8}},
        judge={"mode": "rl", "backend": "constant", "idle_timeout_s": 5},
        rollout={"enabled": True, "share": SHARE, "rollback_min_n": 6, "min_n": 8, "max_n": 400, "margin": 0.5,
                 "rollback_z": 1.645})


class Alice:
    """Alice's users, one HTTP client; every answer is found on ``turns`` to learn its arm."""

    def __init__(self, stack):
        self.config, self.http = stack.config, httpx.Client(base_url=stack.proxy_url, timeout=120)
        self.model = "default" if stack.config.engine.kind == "native" else stack.config.engine.model

    def ask(self, sid: str) -> str:
        r = self.http.post("/v1/chat/completions", headers={"X-Tenant-Id": TENANT, "X-Session-Id": sid},
                           json={"model": self.model, "messages": [{"role": "user", "content": f"hello {sid}"}],
                                 "max_tokens": 8})
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def turn(self, response_id: str) -> events.Turn:
        deadline = time.monotonic() + 60
        while True:
            for t in read_topic(self.config, "turns"):
                if isinstance(t, events.Turn) and t.response_id == response_id:
                    return t
            assert time.monotonic() < deadline, f"turn {response_id} never reached the topic"
            time.sleep(0.3)

    def rate(self, response_id: str, score: int) -> None:
        r = self.http.post("/v1/feedback", headers={"X-Tenant-Id": TENANT},
                           json={"response_id": response_id, "score": score})
        assert r.status_code == 200, r.text

    def end(self, sid: str) -> None:
        r = self.http.post(f"/v1/sessions/{sid}/end", headers={"X-Tenant-Id": TENANT}, json={})
        assert r.status_code == 200, r.text

    def session(self, score) -> events.Turn:
        """One single-turn session rated ``score(turn)``; returns its turn."""
        sid = f"s-{uuid.uuid4().hex[:12]}"
        turn = self.turn(self.ask(sid))
        self.rate(turn.response_id, score(turn))
        self.end(sid)
        return turn


def _view(config) -> ServingView:
    view = ServingView(config.trainer.run_id)
    for ev in read_topic(config, "control"):
        view.apply(ev)
    return view


def _until(what, check, seconds=300, tick=None):
    deadline = time.monotonic() + seconds
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if tick is not None:
            tick()
        else:
            time.sleep(0.5)
    return got


def _decision(config, action: str, version: str):
    return next((c for c in read_topic(config, "control") if isinstance(c, events.Control) and c.action == action
                 and c.tenant == TENANT and (c.adapter or {}).get("version") == version), None)


@pytest.mark.slow(seconds=420)
def test_a_worse_candidate_is_rolled_back_on_its_share_and_a_good_one_promoted(tmp_path):
    worse_rolled_back_better_promoted(tmp_path, "native")


def worse_rolled_back_better_promoted(tmp_path: Path, kind: str) -> None:
    """The scenario of the module docstring on engine ``kind`` (``native`` or ``vllm``; the
    vLLM one is in ``test_rollout_vllm_e2e.py``, so the two can run on two test workers)."""
    if kind == "vllm":
        require_vllm()
    run_dir = tmp_path / "run"
    stack = start_stack(_config(run_dir, kind), run_dir, ready_timeout_s=400)
    config, alice = stack.config, None
    try:
        alice = Alice(stack)
        early = "early-session"
        first = alice.turn(alice.ask(early))  # begins on the base model, before any candidate
        assert first.adapter is None and first.canary is None
        # phase 0: liked answers of the base train alice's first adapter: the first candidate
        # (the proxy may route a session to the candidate before this test reads that it is live: the
        # candidate's answers are disliked from its first, as in phase 1)
        live = _until("alice's first candidate to go live", lambda: _view(config).scope(TENANT).live or None,
                      tick=lambda: alice.session(lambda t: -1 if t.canary == "candidate" else 1))
        cand = _view(config).scope(TENANT).candidate
        # phase 1: the candidate's answers are disliked, the incumbent's liked
        turns = []
        _until("the rollback", lambda: _decision(config, "rollback", cand["version"]), seconds=300,
               tick=lambda: turns.append(alice.session(lambda t: -1 if t.canary == "candidate" else 1)))
        again = alice.turn(alice.ask(early))  # the early session, after the canary: still the incumbent's
        assert live and again.adapter is None
        for t in turns:
            want = assign_arm(TENANT, t.session_id, cand["version"], SHARE)
            served = (t.adapter or {}).get("version")
            if t.canary is not None:  # while the canary was open: exactly the sessions the hash gives it
                assert t.canary == want and served == (cand["version"] if want == "candidate" else None), t
        on_candidate = [t for t in turns if t.canary == "candidate"]
        assert on_candidate and len(on_candidate) < len(turns)
        rollback = _decision(config, "rollback", cand["version"])
        assert rollback.evidence["reason"] == "reward_fell"
        arms = rollback.evidence["arms"]
        assert arms["candidate"]["reward"][0] == 0 and arms["incumbent"]["reward"][0] == arms["incumbent"]["reward"][1]
        after = [alice.session(lambda t: 1) for _ in range(6)]  # a rolled-back version serves no one new
        assert all((t.adapter or {}).get("version") != cand["version"] for t in after)
        # phase 2: the trainer continues from the incumbent; its next candidate is liked everywhere
        nxt = _until("a second candidate", lambda: (c := _view(config).scope(TENANT).candidate) is not None
                     and c["version"] != cand["version"] and c, tick=lambda: alice.session(lambda t: 1))
        _until("the promotion", lambda: _decision(config, "promote", nxt["version"]), seconds=300,
               tick=lambda: alice.session(lambda t: 1))
        assert _view(config).scope(TENANT).incumbent["version"] == nxt["version"]
        last = alice.session(lambda t: 1)  # the new incumbent, or a newer candidate's canary on its share
        newer = _view(config).scope(TENANT).candidate
        assert last.adapter["version"] == (newer["version"] if last.canary == "candidate" else nxt["version"])
    finally:
        if alice is not None:
            alice.http.close()
        stack.stop()
