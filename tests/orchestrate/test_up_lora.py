"""``pipeline up`` with per-tenant adapters: the stack's own engines serve what the trainer trains
(:func:`pipeline.orchestrate.up.serving_lora`, applied by :func:`plan_stack`)."""

from __future__ import annotations

import itertools

from pipeline.config import load_config
from pipeline.orchestrate.up import plan_stack


def _plan(tmp_path, engine_url=None, replicas=None, **sections):
    ports = itertools.count(30000)
    return plan_stack(load_config(None, **sections), tmp_path, lambda: next(ports), engine_url=engine_url,
                      replicas=replicas)


def test_trainer_lora_turns_the_stacks_engines_lora_on_with_room_for_the_adapters(tmp_path):
    plan = _plan(tmp_path, trainer={"per_tenant": True, "lora": {"rank": 128, "alpha": 256, "targets": ["q_proj"]}},
                 engine={"max_lora_rank": 64, "lora_target_modules": ["v_proj"]})
    e = plan.config.engine
    assert e.enable_lora and e.max_lora_rank == 128 and set(e.lora_target_modules) == {"q_proj", "v_proj"}
    assert plan.final_config.engine.enable_lora  # what the stages read (config.yaml)


def test_without_trainer_lora_or_with_an_external_engine_the_engine_settings_are_kept(tmp_path):
    assert not _plan(tmp_path).config.engine.enable_lora
    external = _plan(tmp_path, engine_url="http://127.0.0.1:1", trainer={"per_tenant": True, "lora": {"rank": 8}})
    assert not external.config.engine.enable_lora  # not ours to configure: its own flags decide


def test_rollout_adds_the_evaluator_stage_and_full_weights_need_the_eval_set_gate(tmp_path):
    import pytest

    lora = {"per_tenant": True, "lora": {"rank": 8}}
    names = [s.name for s in _plan(tmp_path, trainer=lora).stages]
    assert "evaluator" not in names  # off by default: today's stack
    plan = _plan(tmp_path, trainer=lora, rollout={"enabled": True})
    names = [s.name for s in plan.stages]
    assert names.index("trainer") < names.index("evaluator") < names.index("syncer")
    assert plan.final_config.rollout.enabled
    with pytest.raises(ValueError, match="set rollout.eval_set"):
        _plan(tmp_path, rollout={"enabled": True})  # full weights: the eval set's guards alone decide
    gated = {"enabled": True, "eval_set": str(tmp_path / "team.jsonl"), "guards": ["accuracy"]}
    names = [s.name for s in _plan(tmp_path, rollout=gated).stages]  # one full-weight engine: gated by the eval set
    assert names.index("trainer") < names.index("evaluator") < names.index("syncer")
    with pytest.raises(ValueError, match="built for one engine"):
        _plan(tmp_path, rollout=gated, replicas={"engine": 2})
