"""What each rule module of the CPU judge adds over the fine-tuned encoder, leaving each labelled
set out in turn (the method of ``docs/judge.md``, "leave one labelled set out").

For each of the five labelled sets (:data:`LABELLED_SETS`) the judge learns from the examples,
the bank and the user replies of the other four (MiniLM fine-tuned on them, cached under
``--cache-dir``), and scores the left-out set's rows under five configurations:

- ``encoder``: the models alone (user replies: fine-tuned encoder, head and kNN without the cue
  inputs; tool results: the frozen encoder's head, +1 or abstain, as shipped);
- ``+cues``, ``+toolread``, ``+context``: the encoder plus one rule module;
- ``full``: the judge as shipped (all rule modules).

Prints agreement and sign errors (with n) per configuration and set, and writes every row's
predictions and reasons as JSON (``--out``), so rules can be attributed row by row. The held-out
set is never read. ``--single-rules`` also switches single rules off one at a time inside the full
judge (:func:`single_rules`: each named rule of ``toolread.RULES``, each context check and target
kind, each cue pattern group and cue decision) and prints, per rule, the rows whose score changes
and the agreement and sign errors it earns over the judge without it. ``--extra-rows FILE`` adds training rows
(e.g. rows written to replace lexical rules) to every fold before the shipped judge learns from them. Folds may group sets (``--folds dev+tuning,replies``: two fine-tunes instead of five, each
learning from fewer rows). Usage: ``python bench/judge_loso.py [--folds ...] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pipeline

from pipeline.judge.cpu.bank import generated_examples  # noqa: E402
from pipeline.judge.cpu import classifier as clf_mod, context as ctx_mod, cues as cues_mod  # noqa: E402
from pipeline.judge.cpu import toolread as tool_mod  # noqa: E402
from pipeline.judge.cpu.cues import Cues  # noqa: E402
from pipeline.judge.cpu.classifier import (LABELLED_SETS, Embedder, NextStateClassifier,  # noqa: E402
                                          labelled_replies, load_examples)
from pipeline.judge.cpu.toolread import ToolReading  # noqa: E402
from pipeline.judge.evaluate import Tally, load_rows, row_input, row_role  # noqa: E402

EXTRA_ROWS: list[dict] = []  # --extra-rows: training rows to try before the judge learns from them
CONFIGS = ("encoder", "+cues", "+toolread", "+context", "full")
# which rule modules each configuration switches on: (cues, toolread, context)
_ON = {"encoder": (0, 0, 0), "+cues": (1, 0, 0), "+toolread": (0, 1, 0), "+context": (0, 0, 1), "full": (1, 1, 1)}


@contextlib.contextmanager
def rules(cues: bool, toolread: bool, context: bool):
    """Switch rule modules off inside the classifier's module (a module off reads as "nothing found")."""
    mod = importlib.import_module(NextStateClassifier.__module__)
    saved = dict(vars(mod))
    off = {}
    if not cues:
        blank = Cues(**{f.name: {"str": "", "bool": False}.get(str(f.type), 0) for f in dataclasses.fields(Cues)
                        if f.default is dataclasses.MISSING})
        off["read_cues"] = lambda *a, **k: blank
        if hasattr(mod, "cue_vector"):  # the cue counts are inputs of the head
            off["cue_vector"] = lambda t: [0.0] * mod.CUE_DIM
    if not toolread:
        off |= {"read_tool_result": lambda text, call="": ToolReading(None, "rules off")}
    if not context:
        off |= {name: (lambda *a, **k: None) for name in ("wrong_action", "target_mismatch", "unrequested_target",
                                                          "other_day", "call_query")}
        off["is_search_call"] = lambda *a, **k: False
    try:
        off = {name: fn for name, fn in off.items() if hasattr(mod, name)}  # (a check this version lacks)
        for name, fn in off.items():
            setattr(mod, name, fn)
        yield
    finally:
        for name in off:
            setattr(mod, name, saved[name])


def judge_rows(clfs: dict, rows: list[dict]) -> list[dict]:
    """Every row's prediction and reason under each configuration."""
    out = []
    for row in rows:
        inp = row_input(row)
        rec = {"id": row["id"], "label": row["label"], "role": row_role(row), "pred": {}, "why": {}}
        for cfg in CONFIGS:
            cues, toolread, context = _ON[cfg]
            if rec["role"] == "user" and cfg in ("+toolread", "+context"):
                rec["pred"][cfg], rec["why"][cfg] = rec["pred"]["encoder"], rec["why"]["encoder"]
                continue
            if rec["role"] != "user" and cfg == "+cues":
                rec["pred"][cfg], rec["why"][cfg] = rec["pred"]["encoder"], rec["why"]["encoder"]
                continue
            with rules(cues, toolread, context):
                j = clfs[bool(cues)].judge(inp.next_state, inp.response, inp.request)
            rec["pred"][cfg], rec["why"][cfg] = j.label, j.reason
        out.append(rec)
    return out


def fold(left_out: list[Path], embedder, cache_dir: str) -> list[dict]:
    """Train without the sets ``left_out`` (with and without the cue inputs), judge their rows."""
    others = [p for p in LABELLED_SETS if p not in left_out]
    examples = load_examples() + EXTRA_ROWS + generated_examples() + labelled_replies(others)
    clfs = {}
    for cues in (True, False):
        with rules(cues, True, True):
            clfs[cues] = NextStateClassifier(embedder, examples, cache_dir=cache_dir)
    return judge_rows(clfs, [row for p in left_out for row in load_rows(p)])


def table(results: dict) -> str:
    """Agreement and sign errors per configuration, per set and in all."""
    lines = ["| configuration | " + " | ".join(results) + " | all |", "|---" * (len(results) + 2) + "|"]
    for cfg in CONFIGS:
        cells, total = [], Tally()
        for recs in results.values():
            t = Tally()
            for r in recs:
                t.add(r["label"], r["pred"][cfg])
                total.add(r["label"], r["pred"][cfg])
            cells.append(f"{t.correct}/{t.n}, {t.sign_errors} sign")
        cells.append(f"{total.correct}/{total.n} = {total.agreement:.1%}, {total.sign_errors} sign")
        lines.append(f"| {cfg} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


_NEVER = re.compile(r"(?!)")  # a pattern that matches nothing: a lexical rule switched off


def _patch_attr(mod, name: str, value):
    """``[(mod, name, value)]`` when ``mod`` has ``name`` (a rule this version lacks is skipped)."""
    return [(mod, name, value)] if hasattr(mod, name) else []


def single_rules() -> dict:
    """Every single rule that can be switched off: name -> (role it affects, refit, patches).

    ``patches`` are ``(module, attribute, value)`` set for the run; ``refit``: the user head must
    be fitted again (the rule feeds the cue inputs of the head)."""
    out = {}
    for name, _ in getattr(tool_mod, "RULES", ()):
        out[f"toolread:{name}"] = ("tool", False, [(tool_mod, "RULES", tuple(r for r in tool_mod.RULES
                                                                             if r[0] != name))])
    # word lists the rules read through the module at call time (a pattern a rule of RULES holds
    # itself, such as _UNSETTLED, is switched with its rule; _SUCCESS and _ZERO_COUNTS only where
    # other rules read them, not in the success and zero_errors rules)
    for pat in ("_WEAK_ERROR", "_SUCCESS", "_PENDING", "_NO_RESULTS", "_ZERO_COUNTS", "_SILENT_OK", "_SEARCH_CALL",
                "_READ_CALL", "_FOUND_N"):
        if hasattr(tool_mod, pat):
            out[f"toolread:{pat}"] = ("tool", False, [(tool_mod, pat, _NEVER)])
    for check in ("misspelt_target", "reversed_direction", "wrong_conversion_target", "public_instead_of_private",
                  "narrower_scope", "wrong_count", "git_ref_mismatch", "_swapped"):
        if hasattr(ctx_mod, check):
            out[f"context:{check}"] = ("tool", False, [(ctx_mod, check, lambda *a, **k: None)])
    for kind in getattr(ctx_mod, "KINDS", ()):
        out[f"context:kind:{kind}"] = ("tool", False, [(ctx_mod, "KINDS", tuple(k for k in ctx_mod.KINDS
                                                                               if k != kind))])
    for check in ("target_mismatch", "unrequested_target", "other_day"):
        out[f"context:{check}"] = ("tool", False, _patch_attr(clf_mod, check, lambda *a, **k: None))
    out["context:search_relevance"] = ("tool", False, _patch_attr(clf_mod, "call_query", lambda *a, **k: None)
                                       + _patch_attr(clf_mod, "is_search_call", lambda *a, **k: False))
    for pat in ("_PRAISE_PHRASES", "_POSITIVE_EN", "_POSITIVE_OTHER", "_POSITIVE_CJK", "_NEGATIVE_EN",
                "_NEGATIVE_OTHER", "_NEGATIVE_CJK", "_SARCASM", "_TROUBLE", "_DEFERRED", "_HOLD", "_HOLD_CJK",
                "_CONTRAST", "_CORRECTION_FORM", "_QUESTION_START", "_TERSE_CORRECTION", "_MOVING_ON",
                "_CONTINUATION", "_IGNORE", "_NEGATOR", "_WEAK_PRAISE"):
        if hasattr(cues_mod, pat):
            out[f"cues:{pat}"] = ("user", True, [(cues_mod, pat, _NEVER)])
    for fn in ("conflicting_number", "restates_request"):
        if hasattr(cues_mod, fn):
            out[f"cues:{fn}"] = ("user", True, [(cues_mod, fn, lambda *a, **k: False)])
    out["decide:cue_rescue"] = ("user", False, _patch_attr(clf_mod, "USER_CUE_RESCUE", False))
    blank = Cues(**{f.name: {"str": "", "bool": False}.get(str(f.type), 0) for f in dataclasses.fields(Cues)
                    if f.default is dataclasses.MISSING})
    out["decide:all_cue_decisions"] = ("user", False, _patch_attr(clf_mod, "read_cues", lambda *a, **k: blank))
    out["cues:head_inputs"] = ("user", True, _patch_attr(clf_mod, "cue_vector",
                                                         lambda t: [0.0] * clf_mod.CUE_DIM))
    return {name: rule for name, rule in out.items() if rule[2]}


def _regroup_cues() -> None:
    """Rebuild the cue module's tuples of pattern groups from its (possibly patched) patterns."""
    for group, names in (("_POS", ("_POSITIVE_EN", "_POSITIVE_OTHER", "_POSITIVE_CJK")),
                         ("_NEG", ("_NEGATIVE_EN", "_NEGATIVE_OTHER", "_NEGATIVE_CJK"))):
        if hasattr(cues_mod, group):
            setattr(cues_mod, group, tuple(getattr(cues_mod, n) for n in names))


@contextlib.contextmanager
def patched(patches):
    """Set ``(module, attribute, value)`` for the duration (cue pattern tuples rebuilt)."""
    saved = [(m, a, getattr(m, a)) for m, a, _ in patches]
    try:
        for m, a, v in patches:
            setattr(m, a, v)
        _regroup_cues()
        yield
    finally:
        for m, a, v in reversed(saved):
            setattr(m, a, v)
        _regroup_cues()


def _memo_encode(embedder_cls) -> None:
    """Embeddings memoised by (weights, texts): the rule runs judge the same texts many times."""
    memo, encode = {}, embedder_cls.encode

    def cached(self, texts, batch_size=64):
        key = (self.fingerprint(), tuple(texts))
        if key not in memo:
            memo[key] = encode(self, texts, batch_size)
        return memo[key]

    embedder_cls.encode = cached


def single_rule_fold(left_out: list[Path], embedder, cache_dir: str, names: list[str]) -> dict:
    """Rows of the sets ``left_out`` judged by the full judge and with each rule of ``names``
    switched off: ``{"full": [pred...], rule: [pred...]}`` plus ``"rows"`` (id, label, role)."""
    others = [p for p in LABELLED_SETS if p not in left_out]
    examples = load_examples() + EXTRA_ROWS + generated_examples() + labelled_replies(others)
    rows = [row for p in left_out for row in load_rows(p)]
    inputs = [row_input(r) for r in rows]
    roles = [row_role(r) for r in rows]
    full = NextStateClassifier(embedder, examples, cache_dir=cache_dir)
    res = {"rows": [(r["id"], r["label"], role) for r, role in zip(rows, roles)]}
    res["full"] = [full.judge(i.next_state, i.response, i.request).label for i in inputs]
    rules_ = single_rules()
    for name in names:
        role, refit, patches = rules_[name]
        with patched(patches):
            clf = NextStateClassifier(embedder, examples, cache_dir=cache_dir) if refit else full
            res[name] = [clf.judge(i.next_state, i.response, i.request).label if (ro == "user") == (role == "user")
                         else res["full"][k] for k, (i, ro) in enumerate(zip(inputs, roles))]
        print(f"rule off: {name}", flush=True)
    return res


def rule_table(res: dict) -> str:
    """Per rule: rows whose score changes without it, and what it earns (agreement, sign errors)."""
    labels = [lab for _, lab, _ in res["rows"]]

    def tally(preds):
        t = Tally()
        for lab, p in zip(labels, preds):
            t.add(lab, p)
        return t

    f = tally(res["full"])
    lines = [f"full judge: {f.correct}/{f.n}, {f.sign_errors} sign errors", "",
             "| rule switched off | rows changed | rows earned (full - off) | sign errors avoided (off - full) |",
             "|---|---|---|---|"]
    for name, preds in res.items():
        if name in ("rows", "full"):
            continue
        t = tally(preds)
        changed = sum(a != b for a, b in zip(preds, res["full"]))
        lines.append(f"| {name} | {changed} | {f.correct - t.correct:+d} | {t.sign_errors - f.sign_errors:+d} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folds", default="", help="folds to leave out, comma-separated, each a '+'-joined list of set "
                    "name prefixes (default: each of the five sets alone), e.g. dev+tuning,replies")
    ap.add_argument("--cache-dir", default="~/.cache/openclaw-pipeline")
    ap.add_argument("--out", default="", help="write every row's predictions here (JSON)")
    ap.add_argument("--single-rules", default="", help="switch these rules off one at a time in the full judge "
                    "(comma-separated name prefixes, 'all' for every rule of single_rules()) instead of the "
                    "module configurations")
    ap.add_argument("--extra-rows", default="", help="also learn from these rows ({text, label, role} JSONL), "
                    "e.g. rows written to replace lexical rules, before the shipped judge learns from them")
    args = ap.parse_args(argv)
    if args.extra_rows:
        EXTRA_ROWS[:] = load_examples(args.extra_rows)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    folds = [[p for p in LABELLED_SETS if any(p.name.startswith(w) for w in f.split("+"))]
             for f in args.folds.split(",") if f] or [[p] for p in LABELLED_SETS]
    embedder = Embedder(threads=2)
    _memo_encode(Embedder)
    if args.single_rules:
        wanted = [w for w in args.single_rules.split(",") if w]
        names = [n for n in single_rules() if "all" in wanted or any(n.startswith(w) for w in wanted)]
        for sets in folds:
            res = single_rule_fold(sets, embedder, args.cache_dir, names)
            if args.out:
                Path(args.out).write_text(json.dumps(res))
            print(rule_table(res))
        return
    results = {}
    for sets in folds:
        name = "+".join(p.name.removesuffix("_next_states.jsonl") for p in sets)
        results[name] = fold(sets, embedder, args.cache_dir)
        print(f"done: {name}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results))
    print(table(results))


if __name__ == "__main__":
    main()
