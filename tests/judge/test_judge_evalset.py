"""The judge's evaluation set (pipeline/judge/data/eval_next_states.jsonl) and its description.

Loads the set with the project's loader (:func:`pipeline.judge.evaluate.load_rows`) and checks
that the counts tabled in ``eval_next_states.md`` are the file's counts, that the label balance
and the share of tool results hold, that the roles, categories, languages and kinds of reply or
tool output the description claims are present, that no record is duplicated, and that no text
was copied from the shipped fixture (tests/fixtures/judge_next_states.jsonl).
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path


from pipeline.judge.evaluate import load_rows, row_input

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "pipeline" / "judge" / "data" / "eval_next_states.jsonl"
ROWS = DATA  # for judge/conftest.rows
DESCRIPTION = DATA.with_suffix(".md")
FIXTURE = ROOT / "tests" / "fixtures" / "judge_next_states.jsonl"

USER_CATEGORIES = {"coding", "writing", "maths", "support", "casual"}
REQUIRED_LANGS = ("fr", "de", "es", "zh", "ja", "pt")
USER_STYLES = {"short", "long", "sarcastic", "mixed", "correction", "follow-up", "topic-change",
               "praise", "confirm", "complaint", "deferred"}
TOOL_STYLES = {"exit-code", "test-pass", "test-fail", "compiler-ok", "compiler-error", "http-ok",
               "http-error", "api-ok", "search-relevant", "search-irrelevant", "empty-output",
               "timeout", "permission", "wrong-target", "queued", "partial"}


def _tables(text: str) -> dict[str, dict[str, int]]:
    """``{"label": {"+1": 100, ...}, "role": {...}, ...}`` from the ``### By X`` tables."""
    tables, name = {}, None
    for line in text.splitlines():
        head = re.match(r"^### By (\w+)\s*$", line)
        if head:
            name = head.group(1)
            tables[name] = {}
            continue
        cell = re.match(r"^\|\s*([^|]+?)\s*\|\s*(\d+)\s*\|$", line)
        if name and cell:
            tables[name][cell.group(1)] = int(cell.group(2))
        elif name and tables[name] and not line.startswith("|"):
            name = None
    return tables


def _texts(row: dict) -> list[str]:
    return [row.get("request", ""), row.get("response", "")] + [m["content"] for m in row["next_state"]]


def test_counts_match_the_description(rows):
    tables = _tables(DESCRIPTION.read_text())
    assert set(tables) == {"label", "role", "category", "language"}, tables.keys()
    assert tables["label"] == {f"{k:+d}" if k else "0": v for k, v in Counter(r["label"] for r in rows).items()}
    assert tables["role"] == dict(Counter(r["role"] for r in rows))
    assert tables["category"] == dict(Counter(r["category"] for r in rows))
    assert tables["language"] == dict(Counter(r["lang"] for r in rows))
    assert f"{len(rows)} labelled next states" in DESCRIPTION.read_text()


def test_size_and_balance(rows):
    n = len(rows)
    share = {k: v / n for k, v in Counter(r["label"] for r in rows).items()}
    assert n >= 240
    assert abs(share[1] - 0.40) <= 0.03 and abs(share[0] - 0.25) <= 0.03 and abs(share[-1] - 0.35) <= 0.03, share
    tool = [r for r in rows if r["role"] == "tool"]
    assert len(tool) / n >= 0.35
    for role in ("user", "tool"):  # every label in both roles, neither role one-sided
        per = Counter(r["label"] for r in rows if r["role"] == role)
        assert set(per) == {1, 0, -1} and min(per.values()) >= 15, (role, per)


def test_record_fields(rows):
    for r in rows:
        ns = r["next_state"]
        assert len(ns) == 1 and ns[0]["role"] == r["role"] and ns[0]["content"].strip(), r["id"]
        assert r["request"].strip(), r["id"]
        assert re.fullmatch(r"[a-z]{2}", r["lang"]) and r["style"] and isinstance(r["style"], list), r["id"]
        if r["role"] == "user":
            assert r["category"] in USER_CATEGORIES and "tool_calls" not in r and r["response"].strip(), r["id"]
        else:
            assert r["category"] == "agentic-tool", r["id"]
            (call,) = r["tool_calls"]
            assert ns[0]["name"] == call["function"]["name"], r["id"]
            json.loads(call["function"]["arguments"])
        # the loader's own reading of the row: the judge sees the tool call it is judging
        seen = row_input(r)
        assert seen.next_state == ns
        if r["role"] == "tool":
            assert r["tool_calls"][0]["function"]["name"] in seen.response, r["id"]


def test_coverage_of_kinds_languages_and_styles(rows):
    user = [r for r in rows if r["role"] == "user"]
    tool = [r for r in rows if r["role"] == "tool"]
    assert {r["category"] for r in user} == USER_CATEGORIES
    for cat in USER_CATEGORIES:
        assert {r["label"] for r in user if r["category"] == cat} == {1, 0, -1}, cat
    for lang in REQUIRED_LANGS:
        sel = [r for r in user if r["lang"] == lang]
        assert len(sel) >= 7 and {1, -1} <= {r["label"] for r in sel}, (lang, len(sel))
        assert lang in {r["lang"] for r in tool}, lang  # tool requests in each language too
    styles = {role: Counter(t for r in rows if r["role"] == role for t in r["style"]) for role in ("user", "tool")}
    assert USER_STYLES <= set(styles["user"]), USER_STYLES - set(styles["user"])
    assert TOOL_STYLES <= set(styles["tool"]), TOOL_STYLES - set(styles["tool"])
    for tag in ("sarcastic", "mixed", "correction", "follow-up", "long", "short"):
        assert styles["user"][tag] >= 3, tag
    # the "succeeded at the wrong thing" rows are all labelled -1
    assert {r["label"] for r in tool if "wrong-target" in r["style"]} == {-1}
    # every tag a row carries is described in the companion file
    described = set(re.findall(r"`([a-z-]+)`", DESCRIPTION.read_text()))
    assert set(styles["user"]) | set(styles["tool"]) <= described


def test_no_record_is_duplicated(rows):
    assert len({r["id"] for r in rows}) == len(rows)
    content = [json.dumps({k: v for k, v in r.items() if k not in ("id", "style")}, sort_keys=True) for r in rows]
    assert len(set(content)) == len(content)
    turns = [json.dumps([r["request"], r["response"], r.get("tool_calls")]) for r in rows]
    assert len(set(turns)) == len(turns), [t for t, c in Counter(turns).items() if c > 1]
    replies = [r["next_state"][0]["content"] for r in rows if r["role"] == "user"]
    assert len(set(replies)) == len(replies)
    # a tool result may recur only as a deliberate context contrast: different requests
    by_state = defaultdict(list)
    for r in rows:
        by_state[r["next_state"][0]["content"]].append(r)
    for state, group in by_state.items():
        if len(group) > 1:
            assert len({r["request"] for r in group}) == len(group), state
            assert len({r["label"] for r in group}) > 1, state


def test_disjoint_from_the_fixture(rows):
    fixture = load_rows(FIXTURE)
    fixture_texts = {t.strip().lower() for r in fixture for t in _texts(r) if t.strip()}
    for r in rows:
        for t in _texts(r):
            assert t.strip().lower() not in fixture_texts, (r["id"], t)

    def shingles(text: str, n: int = 7) -> set:
        words = re.findall(r"\w+", text.lower())
        return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}

    fixture_shingles = set().union(*(shingles(t) for r in fixture for t in _texts(r)))
    shared = {r["id"] for r in rows for t in _texts(r) if shingles(t) & fixture_shingles}
    assert not shared, shared
