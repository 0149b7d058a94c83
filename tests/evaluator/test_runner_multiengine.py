"""The eval runner with a full-weight canary over several engines (``rollout.canary_engines``):
the live candidate is evaluated at ``proxy.canary_engine_url``, the incumbent at ``engine.url``
(pipeline/evaluator/runner.py, :meth:`EvalRunner.url_of`). Two stand-in engines, each reporting
the version it serves; a version asked of the wrong engine would be refused (``NotServing``)."""

from __future__ import annotations

import asyncio
import json

from pipeline import events
from pipeline.config import Config
from pipeline.evaluator.runner import EvalRunner
from pipeline.rollout.evalset import load_eval_set
from pipeline.testing.servers import StandInEngine


def test_the_candidate_is_evaluated_on_the_canary_engines_and_the_incumbent_on_engine_url(tmp_path):
    path = tmp_path / "team.jsonl"
    rows = [{"eval_set": "team", "guards": ["accuracy"]}]
    rows += [{"id": f"q{i}", "prompt": f"q{i}", "checks": {"accuracy": {"exact": "42"}}} for i in range(4)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with StandInEngine(lambda req: "42", weight_version="0") as main, \
            StandInEngine(lambda req: "41", weight_version="1") as canary:
        cfg = Config().replace(engine={"url": main.url}, trainer={"engines": ["engine-0", "engine-1"]},
                               rollout={"enabled": True, "canary_engines": ["engine-1"]},
                               proxy={"canary_engine_url": canary.url})
        runner = EvalRunner(cfg, load_eval_set(str(path)))
        for action in ("weights", "resume"):
            runner.view.apply(events.Control(action=action, epoch=1, policy_version=1, run_id=runner.run_id))
        assert [w[:2] for w in runner.wanted()] == [(None, 0), (None, 1)]
        assert runner.url_of(None, 1) == canary.url and runner.url_of(None, 0) == main.url
        runner._loop = asyncio.new_event_loop()
        try:
            inc, cand = runner.evaluate(None, 0, None), runner.evaluate(None, 1, None)
        finally:
            for client in runner._clients.values():
                runner._loop.run_until_complete(client.aclose())
            runner._loop.close()
        assert (inc.policy_version, inc.metrics["accuracy"]) == (0, 1.0)
        assert (cand.policy_version, cand.metrics["accuracy"]) == (1, 0.0)
        assert len(main.requests) == 4 and len(canary.requests) == 4
