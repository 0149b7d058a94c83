"""The CPU default judge on the held-out evaluation set (issue 12's bar), and that the set is held out.

``pipeline/judge/data/eval_next_states.jsonl`` was written independently of the judge; the judge
learns from ``pipeline/judge/data/examples.jsonl``, the generated bank (``pipeline/judge/cpu/bank.py``)
and the user replies of the labelled sets (``LABELLED_SETS``; MiniLM is fine-tuned on those
replies), never from this set. The first test runs the real command a user runs, ``pipeline judge --eval``, with the default backend and its exit-status gates; the
second checks that the examples share no text with the set (no 8-word shingle, no equal
normalised text, no near-duplicate), naming only the examples, not the held-out texts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.judge.judge_overlap import overlaps
from pipeline.judge.cpu.classifier import training_examples
from pipeline.judge.evaluate import load_rows

ROOT = Path(__file__).resolve().parents[2]
EVAL = ROOT / "pipeline" / "judge" / "data" / "eval_next_states.jsonl"
MIN_AGREEMENT = 0.80
MAX_SIGN_ERRORS = 0.03


@pytest.mark.slow(seconds=18)
def test_cpu_default_reaches_the_bar_on_the_held_out_set():
    """Measured when written: 201/250 = 80.4 % agreement, 70.0 % coverage, 6 sign errors (2.4 %),
    with MiniLM fine-tuned on the labelled replies (fine-tuned with 1 or 2 torch threads: the same
    figures; the same after the tool-rule fixes of round three). The margin is one row: a change
    that loses it must be looked at, not loosened."""
    out = subprocess.run([sys.executable, "-m", "pipeline", "judge", "--eval", str(EVAL), "--no-hints",
                          "--min-agreement", str(MIN_AGREEMENT), "--max-sign-errors", str(MAX_SIGN_ERRORS)],
                         capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                         timeout=600)
    print(out.stdout)
    assert out.stdout.startswith("embedding "), out.stdout + out.stderr[-2000:]  # the CPU default
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]


def test_examples_share_no_text_with_the_held_out_set():
    examples = [e["text"] for e in training_examples()]
    held_out = [m.get("content") or "" for r in load_rows(EVAL) for m in r["next_state"] if isinstance(m, dict)]
    assert len(held_out) >= 200
    found = overlaps(examples, held_out)
    assert not found, "examples overlapping the held-out set: " + "; ".join(
        f"{kind}: {examples[i][:60]!r}" for i, _, kind in found)
