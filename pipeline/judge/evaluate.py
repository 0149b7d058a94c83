"""How well a judge backend scores a labelled set of next states, in the figures training needs.

File format (JSONL), one judged turn per line::

    {"id": "...", "label": 1|0|-1, "request": "the user's request",
     "response": "the assistant's text", "tool_calls": [...optional OpenAI tool calls...],
     "next_state": [{"role": "user"|"tool", "content": "...", "name": "..."}],
     "category": "optional free tag, e.g. coding or shell"}

Figures (:class:`Tally`), overall, per next-state role (``user`` / ``tool``) and per category:

- **agreement**: share of rows whose score equals the label;
- **coverage**: share of rows given a non-zero score (a 0 produces a sample with no reward
  signal: it costs data, not direction);
- **sign errors**: rows labelled +1 scored -1 or the reverse. These push the policy the wrong
  way, so they matter more than a miss: a judge should abstain (0) rather than guess;
- the **confusion matrix** (label x predicted), with a ``failed`` column: rows whose votes all
  failed (backend errors, unparseable answers) have no score. They are reported apart, never as
  a predicted 0: they count in ``n`` (a failed row agrees with no label and covers nothing, as
  it gives the trainer no reward) but are neither a 0 nor a sign error.

A figure over no rows (an empty file, a role with no row) is None and printed ``n/a``, never 0.

With ``hints=True`` the backend's OPD hint path runs on every row too (:class:`HintTally`):
share of turns with an accepted hint, hint length in characters, rejections by reason.
The shipped development set is ``tests/fixtures/judge_next_states.jsonl``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.jsonl import JsonlError, read_jsonl
from pipeline.judge.prompts import JudgeInput, render_tool_calls

LABELS = (1, 0, -1)


def _sign(v: int | None) -> str:
    if v is None:
        return "failed"
    return f"{v:+d}" if v else "0"


def _pct(x: float | None) -> str:
    """A share as ``12.3%``, or ``n/a`` when there is no data."""
    return "n/a" if x is None else f"{x:.1%}"


class EvalFileError(PipelineError, ValueError):
    """A labelled file that cannot be read (the message names the file and line)."""


def load_rows(path: str | Path) -> list[dict]:
    """Rows of a labelled JSONL file.

    Raises:
        EvalFileError: a line is not JSON, lacks ``label`` in (1, 0, -1) or a ``next_state``
            list, or repeats an ``id``.
    """
    rows, ids = [], set()
    try:
        numbered = read_jsonl(path, numbered=True)
    except JsonlError as e:
        raise EvalFileError(str(e)) from None
    for n, row in numbered:
        if not isinstance(row, dict):
            raise EvalFileError(f"{path}:{n}: a row must be a JSON object, got {type(row).__name__}")
        if "label" not in row or row["label"] not in LABELS or isinstance(row["label"], bool):
            got = "no label" if "label" not in row else f"got {row['label']!r}"
            raise EvalFileError(f"{path}:{n}: label must be 1, 0 or -1 (the number; {got})")
        if not isinstance(row.get("next_state"), list):
            got = "missing" if "next_state" not in row else f"got {type(row['next_state']).__name__}"
            raise EvalFileError(f"{path}:{n}: next_state must be a list of messages such as "
                                f'[{{"role": "user", "content": "..."}}] ({got})')
        row.setdefault("id", f"line-{n}")
        if row["id"] in ids:
            raise EvalFileError(f"{path}:{n}: id {row['id']!r} repeats")
        ids.add(row["id"])
        rows.append(row)
    return rows


def row_input(row: dict) -> JudgeInput:
    """The :class:`JudgeInput` of a labelled row."""
    text = row.get("response") or ""
    calls = render_tool_calls(row.get("tool_calls"))
    if calls:
        text = f"{text}\n[tool calls]\n{calls}" if text else f"[tool calls]\n{calls}"
    return JudgeInput(request=row.get("request", ""), response=text, next_state=row["next_state"])


def row_role(row: dict) -> str:
    """The next-state role a row is counted under: ``user`` if the user spoke, else the first role."""
    roles = [m.get("role") for m in row["next_state"] if isinstance(m, dict)]
    if "user" in roles:
        return "user"
    return str(roles[0]) if roles else "none"


def row_conversation(row: dict) -> dict:
    """The row as an OpenAI-format conversation for ``pipeline import``, next state labelled.

    Each next-state message carries the row's ``label``, so a judge consuming the imported
    turns counts its agreement, coverage and sign errors as metrics (labelled traffic).
    """
    assistant: dict = {"role": "assistant", "content": row.get("response") or ""}
    if row.get("tool_calls"):
        assistant["tool_calls"] = row["tool_calls"]
    nxt = [dict(m, label=row["label"]) for m in row["next_state"] if isinstance(m, dict)]
    return {"session_id": f"eval-{row['id']}",
            "messages": [{"role": "user", "content": row.get("request", "")}, assistant, *nxt]}


class _Share:
    """A read-only attribute of a :class:`Tally`: ``numerator / denominator`` (two of its counts),
    None when the denominator is 0 (no rows: no figure, never a 0)."""

    def __init__(self, numerator: str, denominator: str = "n") -> None:
        self.numerator, self.denominator = numerator, denominator

    def __get__(self, tally, owner=None):
        if tally is None:
            return self
        d = getattr(tally, self.denominator)
        return getattr(tally, self.numerator) / d if d else None


@dataclass
class Tally:
    """Counts of (label, predicted score) pairs and the figures derived from them.

    ``predicted`` None is a failed judgement (every vote failed): counted in ``n`` and
    ``failed``, never as a 0. The shares are None when ``n`` (``covered`` for precision) is 0.
    """

    confusion: Counter = field(default_factory=Counter)

    def add(self, label: int, predicted: int | None) -> None:
        self.confusion[(label, predicted)] += 1

    def _count(self, keep) -> int:
        return sum(c for (lab, p), c in self.confusion.items() if keep(lab, p))

    @property
    def n(self) -> int:
        return sum(self.confusion.values())

    @property
    def failed(self) -> int:
        """Rows whose votes all failed (no score)."""
        return self._count(lambda lab, p: p is None)

    @property
    def correct(self) -> int:
        return self._count(lambda lab, p: lab == p)

    @property
    def covered(self) -> int:
        """Rows given a non-zero score (a failed row has none)."""
        return self._count(lambda lab, p: p is not None and p != 0)

    @property
    def covered_correct(self) -> int:
        """Rows given a non-zero score equal to their label."""
        return self._count(lambda lab, p: p is not None and p != 0 and lab == p)

    @property
    def sign_errors(self) -> int:
        """Rows labelled +1 scored -1, or labelled -1 scored +1."""
        return self._count(lambda lab, p: p is not None and lab * p == -1)

    agreement = _Share("correct")
    coverage = _Share("covered")
    sign_error_rate = _Share("sign_errors")
    failed_rate = _Share("failed")
    #: share of the non-zero scores that equal the label (how far a covered score can be trusted)
    precision = _Share("covered_correct", "covered")

    def summary(self) -> str:
        """``agreement a/n = x%  coverage y%  sign errors s (z%)  failed f (w%)`` (``n/a``: no rows)."""
        return (f"agreement {self.correct}/{self.n} = {_pct(self.agreement)}  coverage {_pct(self.coverage)}"
                f"  sign errors {self.sign_errors} ({_pct(self.sign_error_rate)})"
                f"  failed {self.failed} ({_pct(self.failed_rate)})")

    def matrix(self, indent: str = "  ") -> list[str]:
        """The confusion matrix as text lines (rows: label, columns: predicted, then ``failed``)."""
        cols = (*LABELS, None)
        out = [indent + "label \\ predicted " + "".join(f"{_sign(p):>7}" for p in cols)]
        for lab in LABELS:
            out.append(f"{indent}{_sign(lab):>5}{'':<13}" + "".join(
                f"{self.confusion.get((lab, p), 0):>7}" for p in cols))
        return out


@dataclass
class HintTally:
    """The OPD hint path over a labelled set: accepted hints, their lengths, rejections by reason."""

    n: int = 0
    lengths: list = field(default_factory=list)
    rejected: Counter = field(default_factory=Counter)
    accepted_by_label: Counter = field(default_factory=Counter)
    n_by_label: Counter = field(default_factory=Counter)

    def add(self, label: int, hint: str | None, reason: str | None) -> None:
        self.n += 1
        self.n_by_label[label] += 1
        if hint:
            self.lengths.append(len(hint))
            self.accepted_by_label[label] += 1
        else:
            self.rejected[reason or "unspecified"] += 1

    @property
    def accepted(self) -> int:
        return len(self.lengths)

    def lines(self) -> list[str]:
        if not self.n:
            return []
        out = [f"hints: accepted {self.accepted}/{self.n} = {self.accepted / self.n:.1%}"]
        if self.lengths:
            out[0] += (f"  length (chars) median {statistics.median(self.lengths):.0f}, "
                       f"min {min(self.lengths)}, max {max(self.lengths)}")
        out.append("  accepted by label: " + ", ".join(
            f"{_sign(lab)}: {self.accepted_by_label.get(lab, 0)}/{self.n_by_label[lab]}"
            for lab in LABELS if self.n_by_label.get(lab)))
        if self.rejected:
            out.append("  rejected: " + ", ".join(f"{r} {c}" for r, c in self.rejected.most_common()))
        return out


@dataclass
class Agreement:
    """Result of :func:`evaluate`: overall, per-role and per-category tallies, misses, hints."""

    backend: str
    total: Tally = field(default_factory=Tally)
    roles: dict = field(default_factory=dict)
    categories: dict = field(default_factory=dict)
    by: tuple = ()  # further row fields to tally by (e.g. "style", "lang")
    groups: dict = field(default_factory=dict)  # {field: {value: Tally}}
    seconds: float = 0.0
    misses: list = field(default_factory=list)
    hints: HintTally | None = None

    # the overall figures, for callers that read them directly
    n = property(lambda self: self.total.n)
    correct = property(lambda self: self.total.correct)
    agreement = property(lambda self: self.total.agreement)
    coverage = property(lambda self: self.total.coverage)
    sign_errors = property(lambda self: self.total.sign_errors)
    sign_error_rate = property(lambda self: self.total.sign_error_rate)
    confusion = property(lambda self: self.total.confusion)
    failed = property(lambda self: self.total.failed)  # rows whose votes all failed (no score)

    def add(self, row: dict, predicted: int | None) -> None:
        """Tally one row; ``predicted`` None: every vote failed (reported as ``failed``, not 0)."""
        label = row["label"]
        self.total.add(label, predicted)
        self.roles.setdefault(row_role(row), Tally()).add(label, predicted)
        if row.get("category"):
            self.categories.setdefault(str(row["category"]), Tally()).add(label, predicted)
        for name in self.by:  # a list-valued field (tags) counts the row under each of its values
            values = row.get(name)
            for value in (values if isinstance(values, list) else [] if values is None else [values]):
                self.groups.setdefault(name, {}).setdefault(str(value), Tally()).add(label, predicted)
        if predicted != label:
            self.misses.append((row["id"], label, predicted))

    def line(self) -> str:
        rate = f"; {self.n / self.seconds:.1f} turns/s" if self.seconds > 0 else ""
        return f"{self.backend:<10} {self.total.summary()}  ({self.seconds:.1f} s{rate})"


async def evaluate(backend, rows: list[dict], concurrency: int = 4, hints: bool = False,
                   by: tuple = ()) -> tuple[Agreement, dict]:
    """Score every row with ``backend`` (already started).

    Args:
        backend: a started :class:`pipeline.judge.backends.Backend`.
        rows: labelled rows (:func:`load_rows`).
        concurrency: rows judged at once.
        hints: also run the OPD hint path and tally it (``Agreement.hints``).
        by: row fields to break the figures down by, besides role and ``category``.
    Returns:
        ``(Agreement, {row id: predicted score, None where every vote failed})``.
    """
    res = Agreement(getattr(backend, "name", type(backend).__name__), by=tuple(by))
    if hints:
        res.hints = HintTally()
    sem = asyncio.Semaphore(concurrency)
    preds: dict = {}
    done: dict = {}

    async def one(i, row):
        async with sem:
            inp = row_input(row)
            v = await backend.score(inp)
            hv = await backend.hint(inp) if hints else None
        done[i] = (v, hv)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
    res.seconds = time.perf_counter() - t0
    for i, row in enumerate(rows):  # tallied in file order: the report does not depend on timing
        v, hv = done[i]
        preds[row["id"]] = v.score
        res.add(row, v.score)
        if hv is not None:
            res.hints.add(row["label"], hv.hint, getattr(hv, "reason", None))
    return res, preds


def report(res: Agreement, rows: list[dict] | None = None, preds: dict | None = None, misses: bool = True) -> str:
    """A printable report: the overall line, per role and per category, the confusion matrix,
    the hint path (when evaluated) and, with ``misses``, the ids of the rows scored wrong."""
    lines = [res.line()]
    for role, t in sorted(res.roles.items()):
        lines.append(f"  {role + ' next states:':<22} {t.summary()}")
    for cat, t in sorted(res.categories.items()):
        lines.append(f"  {'category ' + cat + ':':<22} {t.summary()}")
    for name, values in res.groups.items():
        for value, t in sorted(values.items()):
            lines.append(f"  {name + ' ' + value + ':':<22} {t.summary()}")
    lines.append("  confusion matrix:")
    lines.extend(res.total.matrix(indent="    "))
    if res.hints is not None:
        lines.extend("  " + s for s in res.hints.lines())
    if misses and res.misses:
        lines.append("  misses: " + ", ".join(f"{i} ({_sign(lab)} as {_sign(p)})"
                                              for i, lab, p in sorted(res.misses, key=lambda m: m[0])))
    return "\n".join(lines)
