"""Full-weight rollout with one engine through the whole stack (every stage its own process, this
package's CPU engine serving tiny-random; docs/rollout.md): the eval set alone gates a candidate.

The eval set is built at test start from the incumbent's own greedy answers (the whole reply), so the
incumbent (v0) scores 16/16. Checked from the records and the engine:

- the trainer (lr 0.5) publishes v0, then its first candidate: large steps change its greedy
  answers, its guard falls (or, with one or two answers changed, is not shown non-inferior:
  ``guard_margin`` 0.2, below) and the evaluator rolls it back (``rollback``, rule
  ``newcombe-evalset-v1``); the syncer re-applies v0's own weights order (``applied`` of v0 with
  its sha256) and the engine serves v0 again, to a new session too;
- the trainer is restarted mid-canary with a tiny lr (1e-9): it holds what it trained, reads the
  rollback and restores v0's export; its next candidate keeps v0's answers: its guard holds and it
  is promoted (which it could not be had the trainer gone on from the large-lr weights it held),
  with nothing reloaded by the promotion.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import httpx
import pytest

from pipeline import events
from pipeline.config import load_config
from pipeline.orchestrate.demo import read_topic
from pipeline.orchestrate.up import start_stack
from pipeline.testing.engine import running_engine

N_ITEMS, MAX_TOKENS = 16, 8
ENGINE = {"threads": 1, "max_batch_size": 1, "prefix_cache_bytes": 0}  # one row at a time: the same numerics


def _ask(url: str, content: str, model: str = "tiny-random") -> str:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "seed": 7}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"] or ""


def _eval_set(path: Path) -> Path:
    """The incumbent's own greedy answers as the expected ones: a ``regex`` anchored on the whole
    reply, whitespace included (tiny-random's greedy reply is eight newlines whatever the prompt;
    ``exact`` strips it, and a candidate whose replies moved to other whitespace would pass it).
    Simulated with transformers, one AdamW step on two sampled replies: at lr 0.5 the stripped
    replies stayed blank on all 16 items in 1 of 100 trials; counted both ways (60 trials at lr
    0.5, 40 at 2.0) the whole reply changed on at least 3 items in every trial (one is enough
    for a rollback, below)."""
    rows = [{"eval_set": "incumbent-answers", "guards": ["accuracy"]}]
    with running_engine("tiny-random", threads=1, max_batch_size=1, prefix_cache_bytes=0) as url:
        for i in range(N_ITEMS):
            prompt = f"Question {i}: what comes next after {i * 7}?"
            reply = _ask(url, prompt)
            rows.append({"id": f"q{i}", "prompt": prompt,
                         "checks": {"accuracy": {"regex": r"\A" + re.escape(reply) + r"\Z"}}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(run_dir: Path, eval_set: Path):
    return load_config(
        None,
        engine={"model": "tiny-random", **ENGINE},
        # lr 0.5: one step must change the greedy answers enough for the guard to fall (at 0.05 a step on two
        # samples once left all 16 unchanged, and the first candidate was promoted)
        trainer={"model": "tiny-random", "rollout_batch_size": 2, "lr": 0.5, "threads": 1,
                 "checkpoint_dir": str(run_dir / "ckpt"), "export_dir": str(run_dir / "weights"),
                 "metrics_file": str(run_dir / "trainer.jsonl"), "progress": False, "max_staleness": None},
        judge={"mode": "rl", "backend": "constant", "idle_timeout_s": 5},
        # guard_margin 0.2: on 16 items Newcombe's lower bound (z 1.645) is -0.144 for 16/16 against 16/16 (the
        # guard holds: promoted) and -0.237 for 15/16 against 16/16 (it falls): one changed answer rolls back
        rollout={"enabled": True, "eval_set": str(eval_set), "guards": ["accuracy"], "guard_min_n": N_ITEMS,
                 "guard_margin": 0.2, "eval_max_tokens": MAX_TOKENS, "eval_seed": 7})


#: what a timed-out wait reports: the run's config (set by the test)
_RUN: dict = {}


def _until(what, check, seconds=150, tick=None):
    deadline = time.monotonic() + seconds
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{_what_happened()}"
        (tick or (lambda: time.sleep(0.5)))()
    return got


def _what_happened() -> str:
    """The run's full-weight control records, its evaluations and its stages' last log lines."""
    if "config" not in _RUN:
        return ""
    config, run_dir = _RUN["config"], _RUN["run_dir"]
    out = ["control: " + ", ".join(f"{c.action} v{c.policy_version} e{c.epoch}" for c in _controls(config)),
           "evaluations: " + ", ".join(f"v{e.policy_version} {e.metrics}" for e in read_topic(config, "metrics")
                                       if isinstance(e, events.Evaluation))]
    for stage in ("evaluator", "trainer", "syncer"):
        log = run_dir / "logs" / f"{stage}.log"
        lines = log.read_text(errors="replace").splitlines()[-25:] if log.exists() else ["(no log)"]
        out += [f"--- {stage}.log", *lines]
    return "\n".join(out)


def _controls(config) -> list[events.Control]:
    return [c for c in read_topic(config, "control") if isinstance(c, events.Control) and c.full_weights]


def _first(config, action: str, version: int | None = None):
    return next((c for c in _controls(config) if c.action == action
                 and (version is None or c.policy_version == version)), None)


def _evaluation(config, version: int):
    return next((e for e in read_topic(config, "metrics") if isinstance(e, events.Evaluation)
                 and e.tenant is None and e.policy_version == version), None)


def _served(config) -> str:
    return str(httpx.get(f"{config.engine.url}/model_info", timeout=10).json()["weight_version"])


class Users:
    """Untenanted sessions of two turns through the proxy: the second is the first's next state,
    so the judge (constant) rewards the first (a closing turn carries no reward)."""

    def __init__(self, stack) -> None:
        self.config, self.http = stack.config, httpx.Client(base_url=stack.proxy_url, timeout=120)

    def _turn(self, sid: str, messages: list) -> dict:
        r = self.http.post("/v1/chat/completions", headers={"X-Session-Id": sid},
                           json={"model": "default", "messages": messages, "max_tokens": 4})
        assert r.status_code == 200, r.text
        return r.json()

    def session(self) -> str:
        """One session; returns its first turn's response id."""
        sid = f"s-{uuid.uuid4().hex[:12]}"
        messages = [{"role": "user", "content": f"hi {sid}"}]
        first = self._turn(sid, messages)
        self._turn(sid, [*messages, first["choices"][0]["message"], {"role": "user", "content": "and then?"}])
        assert self.http.post(f"/v1/sessions/{sid}/end", json={}).status_code == 200
        return first["id"]

    def turn(self, response_id: str) -> events.Turn:
        return _until(f"turn {response_id}", lambda: next(
            (t for t in read_topic(self.config, "turns") if isinstance(t, events.Turn)
             and t.response_id == response_id), None), seconds=60)


def _restart_trainer(stack, *extra: str) -> None:
    """Stop the trainer and start it again with ``extra`` arguments (as the supervisor restarts it)."""
    sup = stack.supervisor
    stage = sup.get("trainer")
    sup.stop(stage)
    stage.argv = [*stage.argv, *extra]
    sup.check(now=time.monotonic() + sup.policy.stable_s + 1)  # a stable run ended: restarted at once
    assert stage.alive and stage.restarts == 1


@pytest.mark.slow(seconds=90)
def test_a_full_weight_candidate_whose_guard_falls_is_rolled_back_and_one_whose_guard_holds_promoted(tmp_path):
    run_dir = tmp_path / "run"
    eval_set = _eval_set(tmp_path / "incumbent.jsonl")
    stack = start_stack(_config(run_dir, eval_set), run_dir, ready_timeout_s=300, dashboard=False)
    config, users = stack.config, None
    _RUN.update(config=config, run_dir=run_dir)
    try:
        users = Users(stack)
        v0 = _until("the trainer's order of v0", lambda: _first(config, "weights", 0))
        inc = _until("the incumbent's evaluation", lambda: _evaluation(config, 0))
        assert inc.metrics["accuracy"] == 1.0 and inc.metrics["accuracy_n"] == N_ITEMS  # its own answers
        # phase 1: large steps: the first candidate's answers change, its guard falls
        cand = _until("the first candidate", lambda: _first(config, "weights", 1), tick=users.session)
        _until("the candidate to go live", lambda: any(c.action == "resume" and c.epoch == 1 for c in _controls(config)))
        # a restart mid-canary, with a tiny lr from now on: the held large-lr updates stay held; what the
        # trainer trains after the rollback keeps the incumbent's answers
        _restart_trainer(stack, "--set", "trainer.lr=1e-9")
        rollback = _until("the rollback", lambda: _first(config, "rollback", cand.policy_version))
        ev = rollback.evidence
        assert (ev["rule"], ev["incumbent"]) == ("newcombe-evalset-v1", 0)
        assert ev["arms"]["incumbent"]["accuracy"] == [N_ITEMS, N_ITEMS]
        low, high = ev["bounds"]["accuracy"]
        # fallen (worse for sure), or not shown non-inferior by the one run of the eval set there will be
        assert (ev["reason"], high < 0) == ("guard_fell:accuracy", True) or \
            (ev["reason"], low <= -0.2, high >= 0) == ("inconclusive", True, True), ev
        assert ev["arms"]["candidate"]["accuracy"][0] < N_ITEMS  # its answers changed
        assert _first(config, "promote") is None
        _until("the incumbent re-applied", lambda: any(
            c.action == "applied" and c.policy_version == 0 and c.sha256 == v0.sha256
            for c in _controls(config)[_controls(config).index(rollback):]))
        after = _controls(config)[_controls(config).index(rollback):]
        assert not any(c.action == "applied" and c.policy_version == cand.policy_version for c in after)
        _until("the engine to serve v0 again", lambda: _served(config) == "0")
        assert users.turn(users.session()).policy_version == 0  # a new session: the incumbent
        # phase 2: the trainer restored v0's export; its next candidate (tiny lr) keeps the answers
        nxt = _until("a second candidate", lambda: next(
            (c for c in _controls(config) if c.action == "weights" and c.policy_version > cand.policy_version), None),
            tick=users.session)
        promote = _until("the promotion", lambda: _first(config, "promote", nxt.policy_version))
        assert (promote.evidence["rule"], promote.evidence["reason"]) == ("newcombe-evalset-v1", "guards_held")
        assert promote.evidence["arms"]["candidate"]["accuracy"][1] == N_ITEMS
        assert int(_served(config)) >= nxt.policy_version  # it, or a newer candidate trained meanwhile
        assert [r for r in _controls(config)[_controls(config).index(promote):]
                if r.action == "applied" and r.policy_version <= nxt.policy_version] == []  # promote: no reload
        rolled = [c.policy_version for c in _controls(config) if c.action == "rollback"]
        assert rolled == [cand.policy_version]
    finally:
        _RUN.clear()
        if users is not None:
            users.http.close()
        stack.stop()
