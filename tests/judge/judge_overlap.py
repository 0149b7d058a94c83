"""Text overlap between what a judge learns from and what it is measured on (test helper).

Two texts overlap when they share an 8-word shingle (a run of 8 consecutive words after
normalisation), when their normalised forms are equal, or when they are near-duplicates
(``difflib`` ratio >= 0.9) of at least 4 words. Normalisation: lower case, words only (letters and
digits of any script), single spaces. Texts with no word at all (``[]``, ``{}``, empty) carry no
wording and are skipped.
"""

from __future__ import annotations

import difflib
import re

_WORD = re.compile(r"[^\W_]+", re.UNICODE)
SHINGLE = 8
NEAR = 0.9


def normalise(text: str) -> str:
    return " ".join(_WORD.findall((text or "").lower()))


def shingles(norm: str, n: int = SHINGLE) -> set[tuple[str, ...]]:
    words = norm.split()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def overlaps(learned: list[str], measured: list[str]) -> list[tuple[int, int, str]]:
    """``(index in learned, index in measured, kind)`` for every overlapping pair; kind is
    ``shingle``, ``equal`` or ``near``."""
    out = []
    norm_l = [normalise(t) for t in learned]
    norm_m = [normalise(t) for t in measured]
    index: dict = {}
    for i, n in enumerate(norm_l):
        for sh in shingles(n):
            index.setdefault(sh, set()).add(i)
    by_norm: dict = {}
    for i, n in enumerate(norm_l):
        if n:
            by_norm.setdefault(n, []).append(i)
    for j, n in enumerate(norm_m):
        if not n:
            continue
        hit = set()
        for sh in shingles(n):
            hit |= index.get(sh, set())
        out += [(i, j, "shingle") for i in sorted(hit)]
        out += [(i, j, "equal") for i in by_norm.get(n, []) if i not in hit]
        if len(n.split()) >= 4:
            for i, nl in enumerate(norm_l):
                if i in hit or nl == n or len(nl.split()) < 4:
                    continue
                sm = difflib.SequenceMatcher(None, nl, n)
                if sm.real_quick_ratio() >= NEAR and sm.quick_ratio() >= NEAR and sm.ratio() >= NEAR:
                    out.append((i, j, "near"))
    return out
