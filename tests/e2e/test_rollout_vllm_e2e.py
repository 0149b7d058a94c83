"""Canary rollout through the whole stack on a real vLLM (issue 39): the scenario of
``test_rollout_e2e.py`` with ``engine.kind: vllm`` (tiny-random-64), whose adapters the syncer
loads beside each other and unloads through vLLM's own API."""

from __future__ import annotations

import pytest

from tests.e2e.test_rollout_e2e import worse_rolled_back_better_promoted


@pytest.mark.slow(seconds=600)
def test_on_vllm_a_worse_candidate_is_rolled_back_on_its_share_and_a_good_one_promoted(tmp_path):
    worse_rolled_back_better_promoted(tmp_path, "vllm")
