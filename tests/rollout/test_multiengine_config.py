"""Config of a full-weight canary over several engines (``rollout.canary_engines``,
``proxy.canary_engine_url``; docs/rollout.md): inconsistent settings are refused at validation
with a message naming the setting; consistent ones pick the live-arm gate."""

from __future__ import annotations

import pytest

from pipeline.config import Config

URL = "http://127.0.0.1:30001"


def _config(canary=("engine-1",), url=URL, engines=("engine-0", "engine-1"), enabled=True, **more) -> Config:
    return Config().replace(trainer={"engines": list(engines), **more.pop("trainer", {})},
                            rollout={"enabled": enabled, "canary_engines": list(canary)},
                            proxy={"canary_engine_url": url}, **more)


def test_a_consistent_canary_is_accepted_and_decided_by_the_live_arms_without_an_eval_set():
    c = _config()
    assert c.rollout.canary_engines == ["engine-1"] and c.proxy.canary_engine_url == URL
    assert c.rollout.full_weights_gate == "live"
    assert Config().rollout.full_weights_gate == "evalset"


@pytest.mark.parametrize("kw, match", [
    ({"canary": ("engine-9",)}, r"\['engine-9'\] are not in trainer.engines"),
    ({"canary": ("engine-0", "engine-1")}, "names every engine of trainer.engines"),
    ({"canary": ("engine-1", "engine-1"), "engines": ("engine-0", "engine-1", "engine-2")}, "lists an engine twice"),
    ({"url": None}, "needs proxy.canary_engine_url"),
    ({"url": "http://127.0.0.1:30000/"}, "proxy.canary_engine_url is engine.url"),
    ({"canary": (), "url": URL}, "rollout.canary_engines is empty"),
    ({"trainer": {"lora": {"rank": 8}, "per_tenant": True}}, "with trainer.lora"),
    ({"engine": {"kind": "vllm"}}, "rollout.canary_engines with engine.kind vllm is not built"),
    ({"enabled": False}, r"do nothing with rollout.enabled false"),
    ({"enabled": False, "canary": ()}, r"proxy.canary_engine_url \('http://127.0.0.1:30001'\) do nothing"),
])
def test_inconsistent_settings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        _config(**kw)


def test_without_canary_engines_full_weights_still_need_the_eval_set_gate():
    with pytest.raises(ValueError, match="set rollout.eval_set"):
        _config(canary=(), url=None)


def test_pipeline_up_refuses_canary_engines_on_the_engines_it_starts(tmp_path):
    """``plan_stack`` starts the engine(s) behind ``engine.url``: the canary URL would point at
    nothing; several full-weight engines are started by hand (docs/rollout.md)."""
    import itertools

    from pipeline.orchestrate.up import plan_stack

    ports = itertools.count(31000)
    with pytest.raises(ValueError, match="several full-weight engines are started by hand"):
        plan_stack(_config(), tmp_path, lambda: next(ports))
    plan = plan_stack(_config(), tmp_path, lambda: next(ports), engine_url="http://127.0.0.1:30000")
    assert "evaluator" in [s.name for s in plan.stages]  # by hand: the engines' URLs given
