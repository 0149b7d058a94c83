"""Eval sets and their grading (the core an ``evaluator`` stage would run per version; issue 39).

An eval set is a JSONL file. An optional first line declares it: ``{"eval_set": name,
"guards": [metric, ...]}`` (the metrics that must not fall; :class:`pipeline.rollout.rule.RolloutConfig`
``guards``). Every other line is an item: ``{"id", "messages" (or "prompt": a user message),
"checks": {metric: check}}`` with one check per metric, each one of:

- ``{"exact": text}``: the reply, stripped, equals ``text``;
- ``{"contains": text}``: the reply contains ``text``;
- ``{"regex": pattern}``: :func:`re.search` finds ``pattern`` in the reply;
- ``{"max_words": k}``: the reply has at most ``k`` whitespace-separated words (brevity).

A metric's rate is its passed checks over the items that check it; :func:`evaluate` publishes
them as an :class:`~pipeline.events.Evaluation` (``metrics[name]`` the rate, with
``<name>_n`` and the 95% Wilson bounds ``<name>_low``/``<name>_high``). The judge as a grader is
not built here (it needs an engine; the stage would pass it as a check function).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from pipeline import events
from pipeline.errors import PipelineError
from pipeline.jsonl import read_jsonl
from pipeline.rollout.stats import newcombe_difference, wilson_interval

CHECKS = ("exact", "contains", "regex", "max_words")


class EvalSetError(PipelineError, ValueError):
    """An eval set file or item that is not of the form of this module's docstring."""


@dataclass(frozen=True)
class EvalSet:
    """A named list of items (dicts as in the file, ``messages`` filled) and its guard metrics."""

    name: str
    guards: tuple
    items: tuple


def _item(n: int, row) -> dict:
    if not isinstance(row, dict) or not isinstance(row.get("checks"), dict) or not row["checks"]:
        raise EvalSetError(f"line {n}: an item needs a non-empty 'checks' object")
    messages = row.get("messages") or ([{"role": "user", "content": row["prompt"]}]
                                       if isinstance(row.get("prompt"), str) else None)
    if not isinstance(messages, list) or not messages:
        raise EvalSetError(f"line {n}: an item needs 'messages' or a 'prompt'")
    for metric, check in row["checks"].items():
        if not (isinstance(check, dict) and len(check) == 1 and next(iter(check)) in CHECKS):
            raise EvalSetError(f"line {n}: check {metric!r} must be one of {'|'.join(CHECKS)}")
        if "regex" in check:
            try:
                re.compile(check["regex"])
            except re.error as e:
                raise EvalSetError(f"line {n}: check {metric!r}: bad regex: {e}") from None
    return {"id": str(row.get("id", n)), "messages": messages, "checks": row["checks"]}


def load_eval_set(path) -> EvalSet:
    """Read an eval set. Raises :class:`EvalSetError` (a bad item, a guard no item checks) or
    :class:`pipeline.jsonl.JsonlError` (unreadable, not JSON)."""
    rows = read_jsonl(path, numbered=True)
    name, guards = str(path), ()
    if rows and isinstance(rows[0][1], dict) and "eval_set" in rows[0][1]:
        head = rows.pop(0)[1]
        name, guards = str(head["eval_set"]), tuple(head.get("guards", ()))
    items = tuple(_item(n, row) for n, row in rows)
    checked = {m for it in items for m in it["checks"]}
    missing = [g for g in guards if g not in checked]
    if missing:
        raise EvalSetError(f"{path}: guard(s) {missing} checked by no item")
    return EvalSet(name, guards, items)


def check_guards(eval_set: EvalSet, guards, min_n: int | None = None, margin: float = 0.10,
                 z: float = 1.645) -> None:
    """Refuse guards the eval set can never decide (docs/rollout.md "The rule").

    Args:
        eval_set: the loaded eval set.
        guards: the effective guards (``rollout.guards``, else the eval set's declared ones).
        min_n: ``rollout.guard_min_n`` when the eval set alone gates the full weights (the guards
            must then be non-empty and each checked by at least ``min_n`` items, enough items that
            two versions passing every one of them show non-inferiority: Newcombe's lower bound at
            ``z`` on n/n vs n/n above ``-margin``, ``rollout.guard_margin``); None otherwise.

    Raises:
        EvalSetError: a guard no item checks, or (``min_n``) no guards or a guard checked by
            fewer than ``min_n`` items, or too few to ever be non-inferior within ``margin``; the
            message names the guard and the counts.
    """
    counts = {g: sum(g in it["checks"] for it in eval_set.items) for g in guards}
    checked = sorted({m for it in eval_set.items for m in it["checks"]})
    for guard, n in counts.items():
        if n == 0:
            raise EvalSetError(f"guard {guard!r} is checked by no item of eval set {eval_set.name!r} (it checks "
                               f"{checked}): fix rollout.guards or the eval set")
    if min_n is None:
        return
    if not counts:
        raise EvalSetError(f"the eval set {eval_set.name!r} gates the full weights and there are no guards: set "
                           f"rollout.guards or declare 'guards' in the eval set (it checks {checked})")
    for guard, n in counts.items():
        if n < min_n:
            raise EvalSetError(f"guard {guard!r} is checked by {n} items of eval set {eval_set.name!r} and "
                               f"rollout.guard_min_n is {min_n}: it could never decide; set rollout.guard_min_n "
                               f"<= {n} or add items")
        best = newcombe_difference(n, n, n, n, z)[0]  # both versions pass every item: the best case
        if best <= -margin:
            raise EvalSetError(f"guard {guard!r} is checked by {n} items of eval set {eval_set.name!r}: even two "
                               f"versions passing all of them give a lower bound of {best:.3f}, not above "
                               f"-rollout.guard_margin ({-margin}), so every candidate would be rolled back "
                               f"inconclusive; add items or widen rollout.guard_margin")


def grade(checks: dict, reply: str) -> dict[str, bool]:
    """Each metric of ``checks`` -> whether ``reply`` passes its check."""
    out = {}
    for metric, check in checks.items():
        (kind, arg), = check.items()
        out[metric] = {"exact": lambda: reply.strip() == str(arg), "contains": lambda: str(arg) in reply,
                       "regex": lambda: re.search(arg, reply) is not None,
                       "max_words": lambda: len(reply.split()) <= int(arg)}[kind]()
    return out


def evaluate(eval_set: EvalSet, ask: Callable[[list], str], policy_version: int,
             run_id: str = "default", created_at: int = 0) -> events.Evaluation:
    """Ask every item (``ask(messages) -> reply``, the version's engine) and grade it; ``n`` is
    the number of items asked."""
    passed: dict[str, list[int]] = {}
    for item in eval_set.items:
        for metric, ok in grade(item["checks"], ask(item["messages"])).items():
            passed.setdefault(metric, [0, 0])
            passed[metric][0] += ok
            passed[metric][1] += 1
    metrics = {}
    for metric, (k, n) in sorted(passed.items()):
        low, high = wilson_interval(k, n)
        metrics.update({metric: k / n, f"{metric}_n": n, f"{metric}_low": low, f"{metric}_high": high})
    return events.Evaluation(policy_version=policy_version, n=len(eval_set.items), name=eval_set.name[:256],
                             run_id=run_id, created_at=created_at, metrics=metrics)
