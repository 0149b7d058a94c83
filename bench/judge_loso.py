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
set is never read. Folds may group sets (``--folds dev+tuning,replies``: two fine-tunes instead of five, each
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
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pipeline

from pipeline.judge.cpu.bank import generated_examples  # noqa: E402
from pipeline.judge.cpu.cues import Cues  # noqa: E402
from pipeline.judge.cpu.classifier import (LABELLED_SETS, Embedder, NextStateClassifier,  # noqa: E402
                                          labelled_replies, load_examples)
from pipeline.judge.cpu.toolread import ToolReading  # noqa: E402
from pipeline.judge.evaluate import Tally, load_rows, row_input, row_role  # noqa: E402

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
    examples = load_examples() + generated_examples() + labelled_replies(others)
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folds", default="", help="folds to leave out, comma-separated, each a '+'-joined list of set "
                    "name prefixes (default: each of the five sets alone), e.g. dev+tuning,replies")
    ap.add_argument("--cache-dir", default="~/.cache/openclaw-pipeline")
    ap.add_argument("--out", default="", help="write every row's predictions here (JSON)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    folds = [[p for p in LABELLED_SETS if any(p.name.startswith(w) for w in f.split("+"))]
             for f in args.folds.split(",") if f] or [[p] for p in LABELLED_SETS]
    embedder = Embedder(threads=2)
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
