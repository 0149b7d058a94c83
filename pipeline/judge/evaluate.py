"""Agreement of a judge backend with a labelled set of next states.

File format (JSONL), one judged turn per line::

    {"id": "...", "label": 1|0|-1, "request": "the user's request",
     "response": "the assistant's text", "tool_calls": [...optional OpenAI tool calls...],
     "next_state": [{"role": "user"|"tool", "content": "...", "name": "..."}]}

``agreement`` is the fraction of rows whose backend score equals the label; ``failed`` counts
rows where every vote failed (scored 0). The shipped set is ``tests/fixtures/judge_next_states.jsonl``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.judge.prompts import JudgeInput, render_tool_calls


def load_rows(path: str | Path) -> list[dict]:
    """Rows of a labelled JSONL file. Raises ValueError naming the line of a bad row."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from None
        if row.get("label") not in (1, 0, -1) or not isinstance(row.get("next_state"), list):
            raise ValueError(f"{path}:{n}: needs label in (1, 0, -1) and a next_state list")
        rows.append(row)
    return rows


def row_input(row: dict) -> JudgeInput:
    """The :class:`JudgeInput` of a labelled row."""
    text = row.get("response") or ""
    calls = render_tool_calls(row.get("tool_calls"))
    if calls:
        text = f"{text}\n[tool calls]\n{calls}" if text else f"[tool calls]\n{calls}"
    return JudgeInput(request=row.get("request", ""), response=text, next_state=row["next_state"])


@dataclass
class Agreement:
    """Result of :func:`evaluate`: counts, confusion (label, predicted) and the misses."""

    backend: str
    n: int = 0
    correct: int = 0
    failed: int = 0
    seconds: float = 0.0
    confusion: Counter = field(default_factory=Counter)
    misses: list = field(default_factory=list)

    @property
    def agreement(self) -> float:
        return self.correct / self.n if self.n else 0.0

    def by_role(self, rows: list[dict], predictions: dict) -> dict:
        out = {}
        for role in ("user", "tool"):
            sel = [r for r in rows if r["next_state"] and r["next_state"][0].get("role") == role]
            if sel:
                out[role] = (sum(predictions[r["id"]] == r["label"] for r in sel), len(sel))
        return out

    def line(self) -> str:
        return (f"{self.backend:<10} agreement {self.correct}/{self.n} = {self.agreement:.0%}"
                f"  (all votes failed: {self.failed}; {self.seconds:.1f} s)")


async def evaluate(backend, rows: list[dict], concurrency: int = 4) -> tuple[Agreement, dict]:
    """Score every row with ``backend`` (already started); returns the agreement and predictions."""
    res = Agreement(getattr(backend, "name", type(backend).__name__))
    sem = asyncio.Semaphore(concurrency)
    preds: dict = {}

    async def one(row):
        async with sem:
            v = await backend.score(row_input(row))
        preds[row["id"]] = v.score
        res.n += 1
        res.correct += v.score == row["label"]
        res.failed += v.all_failed
        res.confusion[(row["label"], v.score)] += 1
        if v.score != row["label"]:
            res.misses.append((row.get("id"), row["label"], v.score))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(r) for r in rows))
    res.seconds = time.perf_counter() - t0
    return res, preds


def report(res: Agreement, rows: list[dict], preds: dict) -> str:
    """A printable report: the agreement line, per-role counts, confusion matrix, misses."""
    lines = [res.line()]
    for role, (ok, n) in res.by_role(rows, preds).items():
        lines.append(f"  {role} next states: {ok}/{n}")
    lines.append("  confusion (label -> predicted): " + ", ".join(
        f"{lab:+d}->{pred:+d}: {c}" for (lab, pred), c in sorted(res.confusion.items())))
    if res.misses:
        lines.append("  misses: " + ", ".join(f"{i} ({lab:+d} as {p:+d})" for i, lab, p in sorted(res.misses)))
    return "\n".join(lines)
