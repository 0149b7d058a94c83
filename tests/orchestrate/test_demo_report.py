"""The demo report's figure: the held-out success curve shows n, a Wilson 95% interval per point,
the target line, the values on the points and words per reply on its own axis from zero; the
training-health panels plot reward, KL and log-prob mismatch per trainer step."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.orchestrate.demo import FEW_SAMPLES, figure, plot, print_summary, success_target, verdict, wilson_interval

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
    # the target line: the high end of version 0's Wilson interval
    target = success_target(report)
    assert target == pytest.approx(wilson_interval(3, 32)[1])
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


def _ev(version, k, n=32):
    return {"policy_version": str(version), "n": n, "success_rate": k / n, "accuracy": 0.0, "words_per_reply": 30.0}


@pytest.mark.parametrize("base,last,expected", [(1, 2, False), (1, 9, False), (1, 10, True), (0, 6, False),
                                                (0, 7, True), (16, 16, False), (16, 32, True), (5, 1, False)])
def test_verdict_needs_the_last_interval_above_the_base_interval(base, last, expected):
    # learning signal iff the last version's Wilson low end exceeds the base's high end (a ratio
    # of small counts, 2/32 against 1/32, is no signal)
    v = verdict([_ev(0, base), _ev(1, 7), _ev(2, last)])
    assert v["learning_signal"] is expected
    assert v["learning_signal"] is (wilson_interval(last, 32)[0] > wilson_interval(base, 32)[1])
    assert v["base_success_ci95"] == pytest.approx(list(wilson_interval(base, 32)), abs=1e-4)
    assert v["last_success_ci95"] == pytest.approx(list(wilson_interval(last, 32)), abs=1e-4)
    assert v["base_n"] == v["last_n"] == 32 and "ratio" not in v
    assert verdict([_ev(0, base)]) is None


def test_summary_prints_every_rate_with_its_interval_and_n(tmp_path, capsys):
    from pipeline.orchestrate.demo import with_interval

    evs = [with_interval(_ev(0, 1)), with_interval(_ev(1, 2))]
    report = {"duration_s": 1.0, "notes": [], "versions_applied": [1], "evaluations": evs, "verdict": verdict(evs),
              "topics": {"sessions": 1, "turns": 2, "next_states": 1, "session_ends": 1, "samples": 2,
                         "samples_by_kind": {"rl": 2}, "samples_with_loss": 1, "samples_masked": 1, "reward_mean": 1.0},
              "simulator": {"replies": 2}, "trainer": {"steps": 1, "samples_trained": 16, "steps_with_gradient": 1}}
    print_summary(report, tmp_path)
    out = capsys.readouterr().out
    assert "0.03 (0.01-0.16, n=32)" in out and "0.06 (0.02-0.20, n=32)" in out
    assert "does not lie above" in out and "learning signal no" in out and "x2" not in out
    assert "16 samples trained" in out and "with a loss (mask 1) 1" in out


def test_plot_marks_reward_points_from_few_samples_and_a_kl_term_that_is_off():
    import matplotlib

    matplotlib.use("Agg")
    report = _report()
    report["topics"]["samples_by_policy_version"]["1"].update(samples=3, rewarded=1)
    report["trainer"]["kl_coef"] = 0.0
    fig = figure(report)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "n=1" in texts and f"n={16}" not in texts  # only the version under FEW_SAMPLES is marked
    assert FEW_SAMPLES == 5
    assert any("term off" in a.get_title() for a in fig.axes if a.get_title().startswith("KL"))


def test_unjudged_turns_come_from_the_judge_metrics_and_are_summarised():
    """Issue 23: the demo reads the judge's ``pipeline_judge_unjudged_turns_total{reason}`` (a real
    Prometheus endpoint) and reports it, with the turns still waiting, in its summary."""
    import contextlib
    import io
    import socket
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

    from pipeline.orchestrate.demo import judge_unjudged, print_summary

    reg = CollectorRegistry()
    c = Counter("pipeline_judge_unjudged_turns_total", "x", ["reason"], registry=reg)
    c.labels("no_next_state").inc(3)
    c.labels("idle_timeout").inc()
    Gauge("pipeline_judge_sessions_waiting", "x", registry=reg).set(2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, thread = start_http_server(port, addr="127.0.0.1", registry=reg)
    try:
        got = judge_unjudged(SimpleNamespace(metrics={"judge": f"http://127.0.0.1:{port}/metrics"}))
    finally:
        server.shutdown()
        thread.join(timeout=5)
    assert got == {"by_reason": {"no_next_state": 3.0, "idle_timeout": 1.0}, "total": 4.0, "waiting_at_end": 2.0}
    from pipeline.orchestrate.demo import with_interval

    report = _report()
    report["evaluations"] = [with_interval(e) for e in report["evaluations"]]
    report.update(unjudged=got, topics={"sessions": 1, "turns": 5, "next_states": 4, "session_ends": 0, "samples": 5,
                                        "samples_by_kind": {}, "samples_with_loss": 1, "samples_masked": 4,
                                        "reward_mean": None},
                  simulator={}, notes=[], versions_applied=[], duration_s=1.0)
    report["trainer"].update(steps=0, steps_with_gradient=0, per_step=[])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_summary(report, __import__("pathlib").Path("."))
    assert "turns not judged    4 (idle_timeout 1, no_next_state 3); still waiting for a reply at the end 2" \
        in out.getvalue()
