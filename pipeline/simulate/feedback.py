"""What a simulated GSM8K user says back: thanks, "too long", or a correction with a hint.

Three policies (``--feedback``):

- ``brevity`` (default): the reward-able property is one the 135M base model sometimes shows
  (docs/environment.md §7: a reply within 64 tokens and at most 40 words, ~9% at
  the start, learnable in ~5 Binary-RL steps). A brief reply, or a correct one, gets thanks and
  ends the session; a long one gets "Too long — answer in at most N words." A short wrong reply
  is *thanked* under this policy: correcting it would make brevity look bad to the judge, and the
  base model is almost never right on GSM8K. Correctness is still measured (guard metric).
- ``correctness``: a right final number gets thanks; a long reply gets "too long"; a short wrong
  reply gets a correction that carries a hint: the next step of GSM8K's worked answer (a
  hindsight hint, as OpenClaw-RL's OPD extracts from the next state).
- ``steps``: the user wants the working laid out one step per line (at least ``min_lines``
  lines with a word, :attr:`pipeline.simulate.grading.Grade.stepwise`), whatever the length or
  the number: such a reply gets thanks, any other the request "put each step on its own line"
  (the corrective next state, hence the OPD hint). It is the second tenant of the two-tenant
  demo (docs/tenants.md, Demo): independent of brevity and, at 40 words, pulling against it.

Messages are varied (picked with the session's seeded RNG) so a judge cannot key on one string.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pipeline.simulate.grading import GSM8KAnswer, Grade

POLICIES = ("brevity", "correctness", "steps")

THANKS_BRIEF = (
    "Thanks, that's clear and short.",
    "Great, thank you! Short and to the point.",
    "Perfect, thanks for keeping it brief.",
    "Thanks, that's exactly what I needed.",
    "Nice and concise, thank you!",
)
THANKS_CORRECT = (
    "Thanks, that's right!",
    "Correct, thank you!",
    "That's the right answer, thanks.",
    "Yes, that's correct. Thanks!",
)
THANKS_STEPS = (
    "Thanks, laid out step by step like that it is easy to follow.",
    "Great, one step per line is exactly how I like it. Thanks!",
    "Thank you, the steps are clear.",
)
NOT_STEPWISE = (
    "Please put each step of the working on its own line.",
    "Hard to follow. Write one step per line, please.",
    "No, lay it out step by step, one line per step.",
)
TOO_LONG = "Too long — answer in at most {n} words."
CORRECTIONS = (
    "That's not right. Hint: {hint}",
    "No, that's wrong. Here is a step to start from: {hint}",
    "Incorrect. Try again, using this: {hint}",
)


@dataclass(frozen=True)
class Feedback:
    """The user's reaction to one reply.

    ``kind``: ``thanks``, ``too_long``, ``correction`` or ``not_stepwise``; ``success``: the reply had the property
    the policy rewards; ``hint``: the worked step carried by a correction (else None).
    """

    kind: str
    text: str
    success: bool
    hint: str | None = None


def decide(policy: str, grade: Grade, gold: GSM8KAnswer | None, rng: random.Random, *,
           max_words: int, corrections_so_far: int = 0) -> Feedback:
    """The feedback of ``policy`` (see the module docstring) for a graded reply.

    ``corrections_so_far`` selects which worked step a correction reveals (the first correction
    shows step 1, the next step 2, ...; the last step repeats).

    Raises:
        ValueError: unknown policy.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown feedback policy {policy!r}; choose from {POLICIES}")
    if policy == "steps":
        if grade.stepwise:
            return Feedback("thanks", rng.choice(THANKS_STEPS), success=True)
        return Feedback("not_stepwise", rng.choice(NOT_STEPWISE), success=False)
    if grade.correct:
        return Feedback("thanks", rng.choice(THANKS_CORRECT), success=True)
    if not grade.brief:
        return Feedback("too_long", TOO_LONG.format(n=max_words), success=False)
    if policy == "brevity":
        return Feedback("thanks", rng.choice(THANKS_BRIEF), success=True)
    hint = _hint(gold, corrections_so_far)
    if hint is None:
        return Feedback("correction", "That's not right. Please try again.", success=False)
    return Feedback("correction", rng.choice(CORRECTIONS).format(hint=hint), success=False, hint=hint)


def _hint(gold: GSM8KAnswer | None, k: int) -> str | None:
    if gold is None or not gold.steps:
        return None
    return gold.steps[min(k, len(gold.steps) - 1)]
