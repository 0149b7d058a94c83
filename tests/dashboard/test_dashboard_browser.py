"""The dashboard in a real browser: the tiny-model stack (every stage its own process, the
dashboard started by ``start_stack`` like ``pipeline up`` does), simulated multi-turn sessions,
then headless Chromium (Debian's package) driven over the DevTools protocol: the overview's
counters equal an independent count of the topics, and a session's page shows each turn's PRM
votes as the samples topic has them. Screenshots go to the test's folder, and to ``docs/`` with
``PIPELINE_UPDATE_SCREENSHOTS=1`` (how the README's pictures are made)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from pipeline import events
from pipeline.bus import Record
from pipeline.orchestrate.up import start_stack
from tests.conftest import tiny_stack_config
from tests.dashboard.dashboard_helpers import Browser, chromium_path, topic_records

ROOT = Path(__file__).resolve().parents[2]
SESSIONS = 4


def decoded(records) -> list:
    return [r.event for r in records if isinstance(r, Record)]


@pytest.mark.slow(seconds=80)
def test_dashboard_in_headless_chromium(tmp_path):
    if chromium_path() is None:
        pytest.skip("no chromium binary: deploy/install.sh installs Debian's chromium where apt-get is available")
    run_dir = tmp_path / "run"
    config = tiny_stack_config(run_dir, judge={"mode": "rl", "backend": "tests.dashboard.stand_in_judge:StandInVotesBackend",
                                               "idle_timeout_s": 5},
                               dashboard={"scrape_interval_s": 1.0, "push_interval_s": 0.5})
    stack = start_stack(config, run_dir, ready_timeout_s=300, durable_broker=False)
    config = stack.config
    assert stack.dashboard_url and stack.supervisor.stages[-1].name == "dashboard"
    try:
        sim = subprocess.run(
            [sys.executable, "-m", "pipeline", "simulate", "--dataset", "gsm8k", "--sessions", str(SESSIONS),
             "--proxy-url", stack.proxy_url, "--concurrency", "2", "--max-tokens", "12", "--max-turns", "2",
             "--no-progress", "--config", str(run_dir / "config.yaml")],
            capture_output=True, text=True, timeout=180)
        assert sim.returncode == 0, sim.stderr[-2000:]

        # the judge has scored every main turn (the closing one is flushed by its session end)
        deadline = time.monotonic() + 60
        while True:
            turns = decoded(topic_records(config, "turns"))
            samples = decoded(topic_records(config, "samples"))
            mains = [e for e in turns if isinstance(e, events.Turn) and e.turn_type == "main"]
            if len({s.sample_id for s in samples}) >= len(mains) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert len({s.sample_id for s in samples}) == len(mains)
        # the trainer takes one step per rollout_batch_size trainable samples: wait for all of them
        unique = list({s.sample_id: s for s in samples}.values())
        want_steps = sum(1 for s in unique if s.loss_mask and s.response_length) // 4
        assert want_steps >= 1  # the at-least-one rule makes a sample of every session trainable
        deadline = time.monotonic() + 120
        while True:
            steps = [e for e in decoded(topic_records(config, "metrics")) if isinstance(e, events.TrainStep)]
            if len(steps) >= want_steps or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert len(steps) == want_steps
        trained_at = {sid: st.step for st in steps for sid in st.trained}
        turn_records = len(topic_records(config, "turns"))
        kinds = Counter(type(e).__name__ for e in turns)
        votes = Counter("failed" if v is None else str(v) for s in {s.sample_id: s for s in samples}.values()
                        for v in s.votes)
        expected = {"n-main-turns": len(mains), "n-next-states": kinds["NextState"],
                    "n-session-ends": kinds["SessionEnd"], "n-sessions": len({e.session_id for e in turns}),
                    "n-samples": len({s.sample_id for s in samples}),
                    "votes-1": votes["1"], "votes-0": votes["0"], "votes-m1": votes["-1"], "votes-failed": votes["failed"],
                    f"records-{config.topics.name('turns')}": turn_records,
                    "n-steps": len(steps), "n-trained": len(trained_at)}
        assert expected["n-sessions"] == SESSIONS and expected["n-session-ends"] == SESSIONS
        assert sum(votes.values()) > 0 and len(votes) >= 2  # the stand-in judge's votes vary

        with Browser() as b:
            b.goto(stack.dashboard_url)
            want = json.dumps({k: str(v) for k, v in expected.items()})
            shown = b.wait(f"""(() => {{ const want = {want}; const got = {{}};
                for (const id in want) {{ const el = document.getElementById(id); got[id] = el && el.textContent; }}
                return Object.keys(want).every((k) => got[k] === want[k]) && got; }})()""", timeout_s=30)
            assert shown == {k: str(v) for k, v in expected.items()}
            # live: the stream says so, and the stages' metrics endpoints are up
            b.wait("document.getElementById('status').textContent.startsWith('live')")
            b.wait("document.querySelectorAll('#stages .pill.ok').length >= 5", timeout_s=15)
            b.wait("document.querySelector('#chart-loss canvas') !== null")  # the trainer's steps are charted
            b.screenshot(tmp_path / "dashboard.png")

            # one session's page: each main turn with its PRM votes, as on the samples topic
            by_session: dict[str, list] = {}
            for s in {s.sample_id: s for s in samples}.values():
                by_session.setdefault(s.session_id, []).append(s)
            sid = max(by_session, key=lambda k: (any(s.sample_id in trained_at for s in by_session[k]),
                                                 len(by_session[k]), k))
            b.goto(f"{stack.dashboard_url}#/session/{sid}")
            n = len(by_session[sid])
            got = b.wait(f"""(() => {{ const xs = [...document.querySelectorAll('.sample')];
                return xs.length === {n} && xs.map((x) => [x.dataset.sampleId, [x.dataset.votes, x.dataset.majority,
                                                                             x.dataset.trainedStep]]); }})()""")
            from pipeline.votes import majority_vote

            def shown(votes):  # the page's majority: empty without votes or when every vote failed (no score)
                m = majority_vote(votes) if votes else None
                return "" if m is None else str(m)

            want = {s.sample_id: [",".join("failed" if v is None else str(v) for v in s.votes),
                                  shown(s.votes), str(trained_at.get(s.sample_id, ""))]
                    for s in by_session[sid]}
            assert dict(got) == want
            assert b.eval("document.querySelectorAll('.turn').length") >= 2  # a multi-turn session
            assert b.eval("document.querySelectorAll('.vote').length") == sum(len(s.votes) for s in by_session[sid])
            b.screenshot(tmp_path / "dashboard-session.png")
    finally:
        stack.stop()
    for name in ("dashboard.png", "dashboard-session.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
        if os.environ.get("PIPELINE_UPDATE_SCREENSHOTS") == "1":
            shutil.copy(tmp_path / name, ROOT / "docs" / name)


@pytest.mark.slow(seconds=15)
def test_versions_view_in_headless_chromium(kafka_config, tmp_path):
    """The versions page over seeded topics (control: alice's A1 promoted, A2 canaried and rolled
    back with its evidence, bob's B1 live; turns with their canary arm; samples): alice's card puts
    her incumbent and the rolled-back candidate side by side with each rate's 95% Wilson interval
    and the decision's evidence; a promotion published while the page is open shows up live."""
    from pipeline.rollout.stats import wilson_interval
    from pipeline.testing.topics import publish
    from tests.dashboard.dashboard_helpers import DashboardServer
    from tests.rollout.live_records import A1, A2, B1, PROMOTE, canary_log, ctl, turn_and_sample

    if chromium_path() is None:
        pytest.skip("no chromium binary: deploy/install.sh installs Debian's chromium where apt-get is available")
    log = canary_log()
    for topic, records in log.items():
        publish(kafka_config, records, topic)
    cfg = kafka_config.replace(rollout={"enabled": True}, trainer={"lora": {"rank": 4}}, dashboard={"push_interval_s": 0.2})
    n_records = sum(len(r) for r in log.values())
    with DashboardServer(cfg) as d, Browser() as b:
        d.wait(lambda o: sum(o["topics"]["records"].values()) >= n_records)
        b.goto(f"{d.url}#/versions")
        sides = b.wait("""(() => { const c = document.querySelector('section.versions[data-scope="alice"] .compare');
            const xs = c ? [...c.querySelectorAll('.side[data-version]')] : [];
            return xs.length === 2 && xs.map((x) => [x.dataset.side, x.dataset.version, x.dataset.role,
              [...x.querySelectorAll('.rate')].map((r) => [r.dataset.metric, r.dataset.n, r.dataset.low, r.dataset.high])]); })()""")
        f = lambda x: f"{x:.2f}"  # noqa: E731 - the page's two decimals
        (inc_side, inc, inc_role, inc_rates), (cand_side, cand, cand_role, cand_rates) = sides
        assert (inc_side, inc, inc_role) == ("incumbent", A1["name"], "incumbent")
        assert (cand_side, cand, cand_role) == ("candidate", A2["name"], "rolled back")
        lo, hi = wilson_interval(2, 10)
        assert ["reward", "10", f(lo), f(hi)] in cand_rates
        lo, hi = wilson_interval(24, 30)
        assert ["reward", "30", f(lo), f(hi)] in inc_rates
        lo, hi = wilson_interval(3, 10)
        assert ["refusals", "10", f(lo), f(hi)] in cand_rates
        evidence = b.eval("""(() => { const e = document.querySelector('section.versions[data-scope="alice"] .evidence .decision');
            return e && [e.dataset.action, e.dataset.reason, e.textContent]; })()""")
        assert evidence[:2] == ["rollback", "reward_fell"] and "[-0.85, -0.25]" in evidence[2]
        assert "reward 2/10" in evidence[2] and "reward 24/30" in evidence[2]  # the arms' counts
        assert b.eval("document.getElementById('nav-versions').classList.contains('active')")
        b.screenshot(tmp_path / "dashboard-versions.png")

        # live: bob's candidate is promoted and serves one more turn; the page follows without a reload
        bob_row = """(() => { const s = document.querySelector('section.versions[data-scope="bob"]');
            const r = s && [...s.querySelectorAll('table tr')].find((tr) => tr.textContent.includes('%s'));
            return r && [r.querySelector('.role').textContent, r.querySelector('td:nth-child(3)').textContent]; })()
            """ % B1["name"]
        assert b.eval(bob_row) == ["candidate (live)", "5"]
        publish(kafka_config, [ctl("promote", 1, "bob", B1, 40, evidence=PROMOTE)], "control")
        publish(kafka_config, [turn_and_sample("b9", 0, "bob", B1, 1.0, 200)[0]], "turns")
        b.wait(f"JSON.stringify({bob_row}) === JSON.stringify(['incumbent', '6'])", timeout_s=20)
    data = (tmp_path / "dashboard-versions.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("PIPELINE_UPDATE_SCREENSHOTS") == "1":
        shutil.copy(tmp_path / "dashboard-versions.png", ROOT / "docs" / "dashboard-versions.png")
