"""The demo report's figure: the held-out success curve shows n, a Wilson 95% interval per point,
the target line, the values on the points and words per reply on its own axis from zero; the
training-health panels plot reward, KL and log-prob mismatch per trainer step."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.orchestrate.demo import figure, plot, success_target, wilson_interval

Z = 1.959963984540054  # the 97.5% normal quantile


@pytest.mark.parametrize("k,n", [(0, 32), (1, 32), (3, 32), (16, 32), (31, 32), (32, 32), (7, 8), (1, 1), (50, 400)])
def test_wilson_interval_solves_its_defining_equation(k, n):
    # Wilson's interval is {p : (k/n - p)^2 <= z^2 p (1 - p) / n}; its ends are the roots of the
    # quadratic (1 + z^2/n) p^2 - (2 k/n + z^2/n) p + (k/n)^2 = 0, found here independently
    lo, hi = wilson_interval(k, n, z=Z)
    ph = k / n
    a, b, c = 1 + Z * Z / n, -(2 * ph + Z * Z / n), ph * ph
    roots = sorted(np.roots([a, b, c]).real)
    assert lo == pytest.approx(max(0.0, roots[0]), abs=1e-9) and hi == pytest.approx(min(1.0, roots[1]), abs=1e-9)
    assert 0.0 <= lo <= ph <= hi <= 1.0
    for p in (lo, hi):
        assert (ph - p) ** 2 == pytest.approx(Z * Z * p * (1 - p) / n, abs=1e-9)


def test_wilson_interval_known_values_and_errors():
    # 32 prompts at 50% make about +-16 points of noise: the "32 prompts make +-15 points"
    lo, hi = wilson_interval(16, 32)
    assert (round(lo, 3), round(hi, 3)) == (0.336, 0.664)
    assert wilson_interval(0, 32)[0] == 0.0 and round(wilson_interval(0, 32)[1], 4) == 0.1072
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(5, 4)


def _report():
    return {
        "model": "tiny-random", "judge": {"mode": "combine", "backend": "embedding"}, "brevity_max_words": 40,
        "evaluations": [
            {"policy_version": "0", "n": 32, "success_rate": 3 / 32, "accuracy": 0.0, "words_per_reply": 46.7},
            {"policy_version": "1", "n": 32, "success_rate": 12 / 32, "accuracy": 1 / 32, "words_per_reply": 30.2},
            {"policy_version": "2", "n": 32, "success_rate": 17 / 32, "accuracy": 1 / 32, "words_per_reply": 25.3}],
        "topics": {"samples_by_policy_version": {"0": {"samples": 16, "reward_mean": -0.5, "positive": 4},
                                                 "1": {"samples": 16, "reward_mean": 0.25, "positive": 10}}},
        "trainer": {"per_step": [
            {"step": 1, "policy_version": 1, "reward_mean": -0.5, "kl": 0.0, "ppo_kl": 0.001, "logprob_abs_diff": 0.1,
             "logprob_abs_diff_current": 2e-6, "logprob_abs_diff_stale": 0.2},
            {"step": 2, "policy_version": 2, "reward_mean": 0.25, "kl": 0.01, "ppo_kl": 0.003, "logprob_abs_diff": 0.15,
             "logprob_abs_diff_current": 3e-6, "logprob_abs_diff_stale": 0.3}]},
    }


def test_success_curve_shows_n_intervals_target_values_and_words_axis(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    report = _report()
    fig = figure(report)
    success_ax = fig.axes[0]
    texts = [t.get_text() for t in success_ax.texts]
    for e in report["evaluations"]:
        assert f"{e['success_rate']:.0%}\nn=32" in texts  # the value and n on each point
    # one error bar per point, spanning exactly the Wilson interval
    bars = [c for c in success_ax.collections if c.__class__.__name__ == "LineCollection"]
    segments = [seg for c in bars for seg in c.get_segments()]
    assert len(segments) == 3
    for seg, e in zip(sorted(segments, key=lambda s: s[0][0]), report["evaluations"]):
        lo, hi = wilson_interval(round(e["success_rate"] * 32), 32)
        assert sorted([seg[0][1], seg[1][1]]) == pytest.approx([lo, hi])
    # the target line: twice version 0's success
    target = success_target(report)
    assert target == pytest.approx(6 / 32)
    assert any(list(line.get_ydata()) == [target, target] for line in success_ax.lines)
    assert any("target" in t for t in texts)
    # words per reply on its own axis, from zero, with the brevity limit
    words_ax = next(a for a in fig.axes if a is not success_ax and a.bbox.bounds == success_ax.bbox.bounds)
    assert words_ax.get_ylim()[0] == 0 and words_ax.get_ylabel() == "words per reply"
    assert any(list(line.get_ydata()) == [40, 40] for line in words_ax.lines)
    # training health: reward, KL (and ppo_kl), mismatch, per step
    health = [a for a in fig.axes if a not in (success_ax, words_ax)]
    assert [a.get_title().split(" ")[0] for a in health] == ["batch", "KL", "|train"]
    steps = report["trainer"]["per_step"]
    for ax, key in zip(health, ("reward_mean", "kl", "logprob_abs_diff_stale")):
        assert list(ax.lines[0].get_xdata()) == [1, 2]
        assert list(ax.lines[0].get_ydata()) == pytest.approx([r[key] for r in steps])
    assert list(health[1].lines[1].get_ydata()) == pytest.approx([0.001, 0.003])
    # the engine/trainer mismatch on own-version samples, beside the drift on stale ones
    assert list(health[2].lines[1].get_ydata()) == pytest.approx([2e-6, 3e-6])
    plot(report, tmp_path / "report.png")
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_figure_without_evaluations_or_steps_still_renders(tmp_path):
    report = _report()
    report["evaluations"] = []
    report["trainer"]["per_step"] = []
    fig = figure(report)
    assert [a.texts[0].get_text() for a in fig.axes[1:]] == ["no trainer step"] * 3
    plot(report, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
