"""Eval sets and their grading (the core an ``evaluator`` stage would run per version; issue 39).

An eval set is a JSONL file. An optional first line declares it: ``{"eval_set": name,
"guards": [metric, ...]}`` (the metrics that must not fall; :class:`pipeline.rollout.rule.RolloutConfig`
``guards``). Every other line is an item: ``{"id", "messages" (or "prompt": a user message),
"checks": {metric: check}}`` with one check per metric, each one of:

- ``{"exact": text}``: the reply, stripped, equals ``text``;
- ``{"contains": text}``: the reply contains ``text``;
- ``{"regex": pattern}``: :func:`re.search` finds ``pattern`` in the reply;
- ``{"max_words": k}``: the reply has at most ``k`` whitespace-separated words (brevity);
- ``{"function": "package.module:callable"}``: your own check, ``callable(reply: str, item: dict)
  -> bool`` (``item``: the item's line as loaded, ``messages`` filled, with any field of your own
  such as an expected answer), imported once per process by import path
  (:func:`pipeline.plugins.load_object`). A path that does not import or names no callable is
  refused at load; an exception the callable raises fails that check (logged);
- ``{"judge": "criterion in words"}``: the LLM judge is asked whether the reply to the item's
  conversation satisfies the criterion (:mod:`pipeline.evaluator.judged`: ``judge.votes`` votes,
  passed when their majority is positive). A judge that gives no verdict (every vote timed out,
  failed or unparsable after its retries) leaves the check **absent** for that item: not a pass,
  not a fail, not counted. :func:`grade` and :func:`evaluate` take the judge as a callable
  (:data:`Judge`); the eval runner supplies one when the eval set has judge checks
  (:attr:`EvalSet.uses_judge`) and refuses such a set without an LLM judge configured.

A metric's rate is its passed checks over the items whose check of it is present; :func:`evaluate`
publishes them as an :class:`~pipeline.events.Evaluation` (``metrics[name]`` the rate, with
``<name>_n`` the present checks and the 95% Wilson bounds ``<name>_low``/``<name>_high``; a metric
with no present check is left out).
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from typing import Callable

from pipeline import events
from pipeline.errors import PipelineError
from pipeline.jsonl import read_jsonl
from pipeline.plugins import PluginError, load_object
from pipeline.rollout.stats import newcombe_difference, wilson_interval

log = logging.getLogger(__name__)
CHECKS = ("exact", "contains", "regex", "max_words", "function", "judge")
Judge = Callable[[str, dict, str], "bool | None"]
"""A ``judge`` check's grader: ``(criterion, item, reply) -> True`` (passed), ``False`` (failed) or
``None`` (no verdict: the check is absent for this item)."""


class EvalSetError(PipelineError, ValueError):
    """An eval set file or item that is not of the form of this module's docstring."""


@dataclass(frozen=True)
class EvalSet:
    """A named list of items (dicts as in the file, ``messages`` filled, ``id`` a string) and its guard
    metrics."""

    name: str
    guards: tuple
    items: tuple

    @property
    def uses_judge(self) -> bool:
        """Whether an item has a ``judge`` check (grading then needs a :data:`Judge`)."""
        return any("judge" in check for it in self.items for check in it["checks"].values())


@functools.lru_cache(maxsize=None)
def check_function(path: str) -> Callable:
    """The callable a ``function`` check names, imported once per process.

    Raises:
        PluginError: ``path`` does not import (:func:`pipeline.plugins.load_object`) or names no callable.
    """
    fn = load_object(path)
    if not callable(fn):
        raise PluginError(f"{path} is a {type(fn).__name__}, not a callable(reply, item) -> bool")
    return fn


def _check_argument(n: int, metric: str, kind: str, arg) -> None:
    """Refuse a check argument that could never grade (a bad regex, a function path that does not
    import, a judge check without a criterion)."""
    where = f"line {n}: check {metric!r}"
    if kind == "regex":
        try:
            re.compile(arg)
        except (re.error, TypeError) as e:
            raise EvalSetError(f"{where}: bad regex: {e}") from None
    elif kind == "function":
        if not isinstance(arg, str):
            raise EvalSetError(f"{where}: 'function' takes an import path 'package.module:callable'")
        try:
            check_function(arg)
        except PluginError as e:
            raise EvalSetError(f"{where}: function {arg!r}: {e}") from None
    elif kind == "judge" and not (isinstance(arg, str) and arg.strip()):
        raise EvalSetError(f"{where}: 'judge' takes a criterion in words (a non-empty string)")


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
        _check_argument(n, metric, *next(iter(check.items())))
    return {**row, "id": str(row.get("id", n)), "messages": messages}  # other fields: for function checks


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


def grade(checks: dict, reply: str, item: dict | None = None, judge: Judge | None = None) -> dict[str, bool | None]:
    """Each metric of ``checks`` -> whether ``reply`` passes its check: True, False, or None when
    the check is absent (a ``judge`` check the judge gave no verdict on).

    Args:
        item: the item graded (what a ``function`` check and the judge are given; default ``{}``).
        judge: grades ``judge`` checks (:data:`Judge`); needed when ``checks`` has one.

    Raises:
        EvalSetError: a ``judge`` check and no ``judge``.
    """
    out: dict[str, bool | None] = {}
    item = item if item is not None else {}
    for metric, check in checks.items():
        (kind, arg), = check.items()
        if kind == "judge":
            if judge is None:
                raise EvalSetError(f"check {metric!r} is a judge check and no judge grades this eval set")
            out[metric] = judge(arg, item, reply)
        elif kind == "function":
            out[metric] = _call_function(arg, reply, item, metric)
        else:
            out[metric] = {"exact": lambda: reply.strip() == str(arg), "contains": lambda: str(arg) in reply,
                           "regex": lambda: re.search(arg, reply) is not None,
                           "max_words": lambda: len(reply.split()) <= int(arg)}[kind]()
    return out


def _call_function(path: str, reply: str, item: dict, metric: str) -> bool:
    """A ``function`` check's result; an exception it raises fails the check (logged)."""
    try:
        return bool(check_function(path)(reply, item))
    except Exception as e:  # noqa: BLE001 (users' code: a failed check, never a crashed runner)
        log.warning("eval set: check %r (function %s) raised on item %s: %s: %s; the check fails", metric, path,
                    item.get("id"), type(e).__name__, e)
        return False


def evaluate(eval_set: EvalSet, ask: Callable[[list], str], policy_version: int,
             run_id: str = "default", created_at: int = 0, judge: Judge | None = None) -> events.Evaluation:
    """Ask every item (``ask(messages) -> reply``, the version's engine) and grade it (:func:`grade`;
    ``judge`` grades the ``judge`` checks).

    The Evaluation's ``n`` is the number of items asked; each metric's rate and ``<metric>_n`` count
    only its present checks (an absent judge check is in neither), and a metric with no present
    check is left out of ``metrics`` (absent, never a rate of 0).
    """
    passed: dict[str, list[int]] = {}
    for item in eval_set.items:
        for metric, ok in grade(item["checks"], ask(item["messages"]), item, judge).items():
            if ok is None:
                continue
            passed.setdefault(metric, [0, 0])
            passed[metric][0] += ok
            passed[metric][1] += 1
    metrics = {}
    for metric, (k, n) in sorted(passed.items()):
        low, high = wilson_interval(k, n)
        metrics.update({metric: k / n, f"{metric}_n": n, f"{metric}_low": low, f"{metric}_high": high})
    return events.Evaluation(policy_version=policy_version, n=len(eval_set.items), name=eval_set.name[:256],
                             run_id=run_id, created_at=created_at, metrics=metrics)
