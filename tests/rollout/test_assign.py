"""Issue 39: sticky canary assignment (pipeline/rollout/assign.py)."""

from __future__ import annotations

import pytest

from pipeline.rollout.assign import CANDIDATE, INCUMBENT, SessionArms, assign_arm


def test_the_share_of_sessions_matches_the_configured_share():
    arms = [assign_arm("t", f"s{i}", 5, 0.1) for i in range(20000)]
    assert 0.09 < arms.count(CANDIDATE) / len(arms) < 0.11
    assert assign_arm("t", "s1", None, 0.5) == INCUMBENT
    assert {assign_arm("t", f"s{i}", 5, 0.0) for i in range(200)} == {INCUMBENT}
    with pytest.raises(ValueError):
        assign_arm("t", "s", 5, 1.5)


def test_assignment_depends_on_tenant_session_and_candidate():
    same = [assign_arm("alice", f"s{i}", 5, 0.5) == assign_arm("bob", f"s{i}", 5, 0.5) for i in range(2000)]
    assert 0.4 < sum(same) / len(same) < 0.6  # independent across tenants
    again = [assign_arm("alice", f"s{i}", 5, 0.5) == assign_arm("alice", f"s{i}", 6, 0.5) for i in range(2000)]
    assert 0.4 < sum(again) / len(again) < 0.6  # a new candidate reshuffles new sessions


def test_a_session_that_began_on_the_incumbent_is_never_switched():
    router = SessionArms()
    began = {f"s{i}": router.serve("t", f"s{i}", 4, 5, 0.3) for i in range(500)}
    on_inc = [s for s, (arm, _) in began.items() if arm == INCUMBENT]
    assert on_inc and len(on_inc) < 500
    for cand, share in ((5, 1.0), (6, 1.0), (None, 0.5)):  # the share grows, a new candidate, none
        for s in on_inc:
            assert router.serve("t", s, 4, cand, share) == (INCUMBENT, 4)


def test_a_rolled_back_candidate_serves_its_sessions_no_more_and_a_promoted_one_keeps_them():
    router = SessionArms()
    on_cand = [f"s{i}" for i in range(300) if router.serve("t", f"s{i}", 4, 5, 0.3)[0] == CANDIDATE]
    assert on_cand
    assert router.serve("t", on_cand[0], 5, None, 0.3) == (INCUMBENT, 5)  # 5 promoted: still on 5
    assert router.serve("t", on_cand[1], 4, None, 0.3) == (INCUMBENT, 4)  # 5 rolled back: to the incumbent
    assert router.serve("t", on_cand[1], 4, 6, 1.0) == (INCUMBENT, 4)  # and never back to a candidate
