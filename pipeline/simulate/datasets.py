"""The conversation data shipped inside the package (``pipeline/data``; see each SOURCE.md).

- GSM8K: ``train`` (300 problems the simulated users ask) and ``heldout`` (32 fixed problems for
  evaluating every policy version), from GSM8K's test split (MIT).
- MT-Bench: all 80 two-turn questions (Apache-2.0).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from pipeline.jsonl import read_jsonl
from pipeline.simulate.grading import GSM8KAnswer, parse_gsm8k_answer

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
GSM8K_SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class GSM8KProblem:
    """One GSM8K problem: ``id``, the ``question``, and the parsed worked ``answer``."""

    id: str
    question: str
    answer: GSM8KAnswer


@dataclass(frozen=True)
class MTBenchQuestion:
    """One MT-Bench question: ``id``, ``category`` and the two user ``turns``."""

    id: str
    category: str
    turns: tuple[str, ...]


def load_gsm8k(split: str = "train") -> list[GSM8KProblem]:
    """GSM8K problems of a shipped split (``train``: 300, ``heldout``: 32), in file order.

    Raises:
        ValueError: unknown split.
    """
    if split not in GSM8K_SPLITS:
        raise ValueError(f"unknown GSM8K split {split!r}; choose from {GSM8K_SPLITS}")
    return [GSM8KProblem(id=r["id"], question=r["question"], answer=parse_gsm8k_answer(r["answer"]))
            for r in read_jsonl(DATA_DIR / "gsm8k" / f"{split}.jsonl")]


def load_mt_bench() -> list[MTBenchQuestion]:
    """All 80 MT-Bench questions, in file order."""
    return [MTBenchQuestion(id=f"mt-bench-{r['question_id']}", category=r["category"], turns=tuple(r["turns"]))
            for r in read_jsonl(DATA_DIR / "mt_bench" / "question.jsonl")]


def pick(items: list, n: int, seed: int) -> list:
    """``n`` items chosen with a seeded RNG: a shuffled pass without repeats, reshuffled for more."""
    if not items:
        return []
    rng = random.Random(seed)
    out: list = []
    while len(out) < n:
        order = list(items)
        rng.shuffle(order)
        out.extend(order[: n - len(out)])
    return out
