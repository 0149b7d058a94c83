"""``pipeline judge --eval``: the figures training needs (agreement, coverage, sign errors, confusion
matrix, per role and category, the OPD hint path), their exit-status gates, and the same figures as
Prometheus metrics from labelled traffic flowing through a real judge on a real broker.

Reference values are computed here from the definitions, independently of pipeline.judge.evaluate.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from pipeline import events
from pipeline.judge.backends.base import Backend, HintVerdict, Verdict
from pipeline.judge.evaluate import Tally, evaluate, load_rows, report, row_conversation, row_role
from pipeline.judge.parse import hint_rejection
from pipeline.testing.judge import JudgeThread
from pipeline.testing.topics import publish, read_events

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "judge_next_states.jsonl"


def reference(pairs):
    """(agreement, coverage, sign error share) of (label, predicted) pairs, from the definitions
    (predicted None: every vote failed, no score: agrees with nothing, covers nothing)."""
    n = len(pairs)
    return (sum(a == b for a, b in pairs) / n, sum(b is not None and b != 0 for _, b in pairs) / n,
            sum((a, b) in ((1, -1), (-1, 1)) for a, b in pairs) / n)


def test_tally_matches_the_definitions():
    pairs = [(1, 1), (1, 0), (1, -1), (0, 0), (0, 1), (-1, -1), (-1, 1), (-1, 0), (1, 1), (0, -1)]
    t = Tally()
    for a, b in pairs:
        t.add(a, b)
    assert (t.agreement, t.coverage, t.sign_error_rate) == pytest.approx(reference(pairs))
    assert t.sign_errors == 2 and t.n == 10 and t.confusion[(1, -1)] == 1
    assert t.precision == pytest.approx(3 / 7)  # 7 non-zero predictions, 3 of them right


class LabelEcho(Backend):
    """A stand-in judge for tests: scores the row's label, except rows whose text names another score."""

    name = "echo"

    async def score(self, inp):
        text = inp.next_state[0]["content"]
        m = re.search(r"score=(-?\d)", text)
        if "<<fail>>" in text:  # every vote failed: no score
            return Verdict(None, [None])
        return Verdict(int(m.group(1)) if m else 0, [0])

    async def hint(self, inp):
        text = inp.next_state[0]["content"]
        return HintVerdict(text, [1]) if "hint" in text else HintVerdict(None, [-1], "judged_no_hint")


def _row(i, label, score, role="user", cat="x", extra=""):
    return {"id": f"r{i}", "label": label, "category": cat,
            "next_state": [{"role": role, "content": f"score={score} {extra}"}]}


def test_evaluate_by_role_category_and_hints():
    rows = [_row(0, 1, 1), _row(1, 1, -1, "tool", "y"), _row(2, -1, 0), _row(3, 0, 0, "tool", "y", "hint here"),
            _row(4, -1, -1, extra="hint <<fail>>")]
    res, preds = asyncio.run(evaluate(LabelEcho(None), rows, hints=True))
    assert preds == {"r0": 1, "r1": -1, "r2": 0, "r3": 0, "r4": None}
    assert (res.agreement, res.coverage, res.sign_error_rate) == pytest.approx(
        reference([(r["label"], preds[r["id"]]) for r in rows]))
    assert res.roles["tool"].sign_errors == 1 and res.roles["user"].n == 3
    assert res.categories["y"].n == 2 and res.failed == 1
    assert res.hints.accepted == 2 and res.hints.rejected == {"judged_no_hint": 3}
    assert res.hints.accepted_by_label == {0: 1, -1: 1}
    text = report(res, rows, preds, misses=False)
    assert "coverage 40.0%" in text and "sign errors 1 (20.0%)" in text and "r1" not in text
    # the failed row is reported as failed, never as a predicted 0
    assert res.confusion[(-1, None)] == 1 and res.confusion[(-1, 0)] == 1 and "failed 1 (20.0%)" in text
    matrix = text.split("label \\ predicted")[1].splitlines()
    assert matrix[0].split() == ["+1", "0", "-1", "failed"]
    assert [line.split() for line in matrix[1:4]] == [["+1", "1", "0", "1", "0"], ["0", "0", "1", "0", "0"],
                                                      ["-1", "0", "1", "0", "1"]]
    assert "hints: accepted 2/5" in text and "rejected: judged_no_hint 3" in text
    assert "label \\ predicted" in text
    full = report(res, rows, preds, misses=True)
    assert "r1 (+1 as -1)" in full and "r4 (-1 as failed)" in full


def test_figures_without_data_are_absent_not_zero():
    """A tally over no rows has no agreement, coverage, sign-error share or precision: None, printed
    ``n/a`` (was 0.0 / "0.0%", a figure that looks measured)."""
    t = Tally()
    assert (t.agreement, t.coverage, t.sign_error_rate, t.precision) == (None, None, None, None)
    assert t.summary() == "agreement 0/0 = n/a  coverage n/a  sign errors 0 (n/a)  failed 0 (n/a)"
    t.add(1, 0)
    assert t.precision is None and t.agreement == 0.0  # no non-zero score: precision has no data
    res, _ = asyncio.run(evaluate(LabelEcho(None), []))
    assert "agreement 0/0 = n/a" in report(res)


def test_row_role_prefers_the_user():
    assert row_role({"next_state": [{"role": "tool"}, {"role": "user"}]}) == "user"
    assert row_role({"next_state": [{"role": "tool"}]}) == "tool"


def test_hint_rejection_reasons():
    ok, neg, nobox = "\\boxed{1} [HINT_START]Use the metric unit.[HINT_END]", "\\boxed{-1}", "\\boxed{1} no block"
    assert hint_rejection([ok, neg]) is None
    assert hint_rejection([None, "no box at all"]) == "all_votes_failed"
    assert hint_rejection([neg, None]) == "judged_no_hint"
    assert hint_rejection([nobox, neg]) == "no_hint_block"
    assert hint_rejection(["\\boxed{1} [HINT_START]short[HINT_END]"]) == "hint_too_short"


def _cli(*args, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "pipeline", "judge", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


def test_cli_prints_the_figures_and_gates_on_them(tmp_path):
    """The ``constant`` backend scores +1 everywhere, so every figure is known from the labels."""
    rows = load_rows(FIXTURE)
    pairs = [(r["label"], 1) for r in rows]
    agree, cover, sign = reference(pairs)
    out = _cli("--eval", str(FIXTURE), "--backend", "constant")
    assert out.returncode == 0, out.stdout + out.stderr
    n_pos, n_neg = sum(r["label"] == 1 for r in rows), sum(r["label"] == -1 for r in rows)
    assert f"agreement {n_pos}/{len(rows)} = {agree:.1%}" in out.stdout
    assert f"coverage {cover:.1%}" in out.stdout and f"sign errors {n_neg} ({sign:.1%})" in out.stdout
    for role in ("user", "tool"):
        sel = [r for r in rows if row_role(r) == role]
        assert f"{role} next states:" in out.stdout
        assert f"sign errors {sum(r['label'] == -1 for r in sel)} " in out.stdout.split(f"{role} next states:")[1]
    assert re.search(r"^\s+-1\s+" + str(n_neg) + r"\s+0\s+0\s+0\s*$", out.stdout, re.M), out.stdout  # matrix row -1 (+1, 0, -1, failed)
    assert f"hints: accepted {len(rows)}/{len(rows)}" in out.stdout

    conv = tmp_path / "conv.jsonl"
    gate = _cli("--eval", str(FIXTURE), "--backend", "constant", "--min-agreement", f"{agree + 0.01:.2f}",
                "--max-sign-errors", "0.03", "--no-hints", "--write-conversations", str(conv))
    assert gate.returncode == 1 and "FAILED: agreement" in gate.stdout and "sign errors" in gate.stdout
    assert "hints:" not in gate.stdout
    lines = [json.loads(x) for x in conv.read_text().splitlines()]
    assert len(lines) == len(rows) and all(m["label"] == r["label"] for c, r in zip(lines, rows)
                                           for m in c["messages"][2:])


def test_cli_bad_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"label": 5, "next_state": []}\n')
    out = _cli("--eval", str(bad), "--backend", "constant")
    assert out.returncode == 2 and "bad.jsonl:1" in out.stdout and "Traceback" not in out.stderr


@pytest.mark.parametrize("row,says", [
    ('{"label": 5, "next_state": []}', "label must be 1, 0 or -1 (the number; got 5)"),
    ('{"label": "+1", "next_state": []}', "got '+1'"),
    ('{"next_state": []}', "no label"),
    ('{"label": 1, "next_state": {"role": "user", "content": "ok"}}', "next_state must be a list of messages"),
    ('{"label": 1}', "(missing)"),
    ('[1, 2]', "a row must be a JSON object, got list"),
], ids=["label-5", "label-str", "no-label", "next-state-dict", "no-next-state", "not-object"])
def test_a_bad_row_names_the_field_and_the_value(tmp_path, row, says):
    from pipeline.judge.evaluate import EvalFileError

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"label": 0, "next_state": []}\n' + row + "\n")
    with pytest.raises(EvalFileError) as e:
        load_rows(bad)
    assert "bad.jsonl:2: " in str(e.value) and says in str(e.value)


def test_cli_refuses_an_empty_file_and_warns_of_an_absent_by_field(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    out = _cli("--eval", str(empty), "--backend", "constant")
    assert out.returncode == 2 and "no labelled rows" in out.stdout, out.stdout
    one = tmp_path / "one.jsonl"
    one.write_text('{"label": 1, "next_state": [{"role": "user", "content": "thanks"}]}\n')
    out = _cli("--eval", str(one), "--backend", "constant", "--by", "lang")
    assert out.returncode == 0 and "no row of" in out.stdout and "'lang'" in out.stdout, out.stdout


def _metric(name, labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_labelled_traffic_metrics_equal_the_offline_figures(kafka_config):
    """Labelled conversations imported onto ``turns`` and judged by a real judge process give
    Prometheus counters equal to the confusion matrix ``evaluate`` computes offline."""
    from pipeline.history.importer import Tokenizer, conversation_events

    rows = load_rows(FIXTURE)[::2]  # 20 turns, both roles
    c = kafka_config
    c = c.replace(judge={"group_id": f"{c.topics.prefix}judge"})
    c = c.replace(engine={"model": "tiny-random"})
    backend = LabelEcho(c)
    for i, r in enumerate(rows):  # scores: the label, except every third row flipped or zeroed
        fail = "<<fail>> " if i % 4 == 3 else ""  # and every fourth judgement fails (no score)
        r["next_state"] = [dict(m, content=f"{fail}score={(r['label'], -r['label'], 0)[i % 3]} {m['content']}")
                           for m in r["next_state"]]
    res, _ = asyncio.run(evaluate(backend, rows))
    tok = Tokenizer.load("tiny-random", c.engine.cache_dir)
    evs = []
    for r in rows:
        conv = row_conversation(r)
        evs += conversation_events(conv, tok, conv["session_id"])
    predicted = (1, 0, -1, None)
    assert res.failed == len(rows) // 4 and all(res.roles[role].failed for role in ("user", "tool"))

    def key(p):
        return "failed" if p is None else str(p)

    keys = [(role, str(lab), key(p)) for role in ("user", "tool") for lab in (1, 0, -1) for p in predicted]
    before = {k: _metric("pipeline_judge_labelled_total", dict(zip(("role", "label", "predicted"), k))) for k in keys}
    publish(c, evs)
    with JudgeThread(c, mode="rl", backend=backend):
        got = read_events(c, "samples", len(rows), timeout_s=60)
    assert len({s.sample_id for s in got}) == len(rows)
    for role in ("user", "tool"):
        for lab in (1, 0, -1):
            for p in predicted:
                k = (role, str(lab), key(p))
                labels = dict(zip(("role", "label", "predicted"), k))
                delta = _metric("pipeline_judge_labelled_total", labels) - before[k]
                assert delta == res.roles[role].confusion.get((lab, p), 0), k
    assert _metric("pipeline_judge_labelled_sign_error_rate", {"role": "all"}) > 0
    for g in ("agreement", "coverage", "sign_error_rate"):
        assert 0 <= _metric(f"pipeline_judge_labelled_{g}", {"role": "user"}) <= 1
    # a failed judgement is its own sample: no reward, never trained (not a predicted 0)
    failed = [s for s in got if s.votes and all(v is None for v in s.votes)]
    assert len(failed) == res.failed and all((s.reward, s.loss_mask) == (None, 0) for s in failed)


def test_hint_metrics_count_accepted_and_rejected_with_reasons(kafka_config):
    """OPD in the stream: accepted hints with their length, rejections by reason, backend failures."""
    from pipeline.engine_api.render import ChatRenderer, load_tokenizer
    from pipeline.testing.judge import make_next_state, make_turn
    from pipeline.testing.servers import StandInJudge

    class Failing(LabelEcho):
        async def hint(self, inp):
            if "boom" in inp.next_state[0]["content"]:
                raise RuntimeError("boom")
            return await super().hint(inp)

    c = kafka_config
    c = c.replace(judge={"group_id": f"{c.topics.prefix}judge"})
    c = c.replace(engine={"model": "tiny-random"})
    names = ("pipeline_judge_hint_requests_total", "pipeline_judge_hints_accepted_total",
             "pipeline_judge_hint_chars_sum")
    before = {n: _metric(n, {}) for n in names}
    rej = {r: _metric("pipeline_judge_hints_rejected_total", {"reason": r})
           for r in ("judged_no_hint", "backend_error")}
    hint = "hint: use kilometres"
    with StandInJudge() as teacher:
        c = c.replace(engine={"teacher_url": teacher.url})
        rend = ChatRenderer(load_tokenizer("tiny-random"))  # the teacher checks the turn's prompt ids
        publish(c, [make_turn("h", 0, renderer=rend), make_next_state("h", 0, hint), make_turn("h", 1, renderer=rend),
                    make_next_state("h", 1, "thanks"), make_turn("h", 2, renderer=rend),
                    make_next_state("h", 2, "boom"),
                    events.SessionEnd(session_id="h")])
        with JudgeThread(c, mode="opd", backend=Failing(c)):
            got = read_events(c, "samples", 1, timeout_s=30, settle_s=1.0)
    assert [s.hint for s in got] == [hint]
    assert _metric(names[0], {}) - before[names[0]] == 3
    assert _metric(names[1], {}) - before[names[1]] == 1
    assert _metric(names[2], {}) - before[names[2]] == len(hint)
    assert _metric("pipeline_judge_hints_rejected_total", {"reason": "judged_no_hint"}) - rej["judged_no_hint"] == 1
    assert _metric("pipeline_judge_hints_rejected_total", {"reason": "backend_error"}) - rej["backend_error"] == 1


def test_overlap_helper_finds_shingles_equal_and_near_duplicates():
    from tests.judge.judge_overlap import overlaps

    learned = ["one two three four five six seven eight nine", "Thanks, that works!", "the cat sat on the mat today"]
    measured = ["zero one two three four five six seven eight", "thanks that works", "the cat sat on the mat today!",
                "the cat sat on a mat today", "[]", "something else entirely"]
    kinds = {(i, j): k for i, j, k in overlaps(learned, measured)}
    assert kinds == {(0, 0): "shingle", (1, 1): "equal", (2, 2): "equal", (2, 3): "near"}
