"""``pipeline up --engine vllm``: what :func:`plan_stack` starts (vLLM policy and teacher stages, the
teacher without LoRA) and what it refuses (several vLLM engines behind one front)."""

from __future__ import annotations

import itertools

import pytest

from pipeline.config import load_config
from pipeline.orchestrate.up import plan_stack


def _plan(tmp_path, replicas=None, **sections):
    ports = itertools.count(31000)
    return plan_stack(load_config(None, **sections), tmp_path, lambda: next(ports), replicas=replicas)


def test_vllm_engines_and_a_teacher_without_lora(tmp_path):
    plan = _plan(tmp_path, engine={"kind": "vllm"}, judge={"mode": "combine"},
                 trainer={"per_tenant": True, "lora": {"rank": 8}})
    by_name = {s.name: s.args for s in plan.stages}
    assert by_name["engine"][:3] == ("engine", "--kind", "vllm")
    teacher = by_name["teacher"]
    assert teacher[:3] == ("engine", "--kind", "vllm") and "engine.enable_lora=false" in teacher
    assert plan.config.engine.enable_lora  # the policy serves the tenants' adapters


def test_native_stays_native(tmp_path):
    plan = _plan(tmp_path, judge={"mode": "combine"})
    assert {s.args[2] for s in plan.stages if s.args[0] == "engine"} == {"native"}


def test_several_vllm_engines_are_refused(tmp_path):
    with pytest.raises(ValueError, match="one engine"):
        _plan(tmp_path, replicas={"engine": 2}, engine={"kind": "vllm"})
    assert _plan(tmp_path, replicas={"engine": 2})  # several of ours are fine
