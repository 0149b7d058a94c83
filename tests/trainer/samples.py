"""Samples for the trainer's topic-level tests."""

from __future__ import annotations

from pipeline import events


def rl_sample(i: int, session: str = "s") -> events.Sample:
    """The RL sample of turn 0 of session ``{session}{i}``: 10 token ids derived from ``i`` (all
    below tiny-random's vocabulary), the last 4 the response with rollout log-prob -2.0 each,
    reward +1 for an even ``i`` and -1 for an odd one."""
    toks = [(i * 7 + j) % 5000 + 1 for j in range(10)]
    return events.Sample(sample_id=f"{session}{i}:0:rl", session_id=f"{session}{i}", turn_index=0, tokens=toks,
                         response_length=4, rollout_log_probs=[-2.0] * 4, reward=(-1.0) ** i)
