"""The two-tenant demo's report logic: curves, Wilson points, verdicts."""

from __future__ import annotations

import math

import pytest

from pipeline.orchestrate.tenant_report import USERS, curves, point, summary_lines, tenant_verdicts


def _wilson_reference(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The two roots in p of (k/n - p)^2 = z^2 p (1 - p) / n (the Wilson interval's definition)."""
    ph = k / n
    a, b, c = 1 + z * z / n, -(2 * ph + z * z / n), ph * ph
    d = math.sqrt(b * b - 4 * a * c)
    return (-b - d) / (2 * a), (-b + d) / (2 * a)


@pytest.mark.parametrize("k,n", [(4, 64), (9, 64), (0, 32), (32, 32), (21, 64)])
def test_point_counts_successes_and_wilson_interval(k, n):
    p = point({"n": n, "brief_rate": round(k / n, 4)}, "brief_rate")
    assert p["successes"] == k and p["n"] == n and p["rate"] == round(k / n, 4)
    lo, hi = _wilson_reference(k, n)
    assert p["ci95"] == pytest.approx([lo, hi], abs=1e-4)


def test_point_of_a_missing_metric_is_absent_not_zero():
    assert point({"n": 32}, "stepwise_rate") == {"rate": None, "successes": 0, "n": 32, "ci95": [0.0, 1.0]}
    assert point({"n": 0, "brief_rate": None}, "brief_rate")["rate"] is None
    with pytest.raises(ValueError, match="not a rate"):
        point({"n": 8, "brief_rate": 1.5}, "brief_rate")


def _ev(target, version, brief, steps, n=64):
    return {"target": target, "version": version, "n": n, "brief_rate": brief / n, "stepwise_rate": steps / n}


def test_curves_and_verdicts_per_tenant_with_the_base_beside():
    evs = [_ev("base", "0", 4, 9), _ev("alice", "alice@1", 20, 8), _ev("bob", "bob@1", 3, 20),
           _ev("alice", "alice@2", 40, 10), _ev("bob", "bob@2", 5, 35)]
    c = curves(evs)
    assert c["base"]["brief_rate"]["successes"] == 4 and c["base"]["stepwise_rate"]["successes"] == 9
    alice, bob = c["users"]["alice"], c["users"]["bob"]
    assert (alice["metric"], alice["other_metric"], bob["metric"], bob["other_metric"]) == (
        "brief_rate", "stepwise_rate", "stepwise_rate", "brief_rate")
    assert [p["version"] for p in alice["points"]] == ["alice@1", "alice@2"]
    assert [p["own"]["successes"] for p in bob["points"]] == [20, 35]
    assert [p["other"]["successes"] for p in bob["points"]] == [3, 5]
    v = tenant_verdicts(c)
    assert v["alice"]["learned"] and not v["alice"]["moved_toward_other"]
    assert v["bob"]["learned"] and not v["bob"]["moved_toward_other"]
    assert v["alice"]["base_own"] == 4 / 64 and v["alice"]["last_own"] == 40 / 64


def test_shared_policy_serves_both_users_and_a_blend_is_caught():
    # one policy for both: it learns brevity, so bob's metric does not rise and alice's "other" metric drops
    evs = [_ev("base", "0", 4, 9), _ev("shared", "1", 30, 2), _ev("shared", "2", 50, 1)]
    c = curves(evs)
    assert [p["version"] for p in c["users"]["alice"]["points"]] == ["1", "2"] == [
        p["version"] for p in c["users"]["bob"]["points"]]
    v = tenant_verdicts(c)
    assert v["alice"]["learned"] and not v["bob"]["learned"]
    assert v["bob"]["moved_toward_other"]  # what bob is served moved toward alice's preference


def test_overlapping_intervals_are_not_learning_and_no_points_no_verdict():
    c = curves([_ev("base", "0", 4, 9), _ev("alice", "a", 9, 9)])  # 4/64 -> 9/64: intervals overlap
    v = tenant_verdicts(c)
    assert v["alice"]["learned"] is False and v["bob"] is None
    assert tenant_verdicts(curves([_ev("alice", "a", 40, 9)]))["alice"] is None  # no base evaluated


def test_summary_lines_name_every_version_and_verdict():
    report = {"mode": "tenants", "curves": curves([_ev("base", "0", 4, 9), _ev("alice", "alice@1", 20, 8)])}
    report["verdicts"] = tenant_verdicts(report["curves"])
    text = "\n".join(summary_lines(report))
    assert "alice@1" in text and "20/64" in text and "4/64" in text and "learned: yes" in text
    assert "verdict bob: no evaluated version" in text
    assert [u.tenant for u in USERS] == ["alice", "bob"]
