"""The judge stage: turns become training signal (OpenClaw-RL's Binary RL, OPD and combine).

- :mod:`pipeline.judge.join`: per-session join of a main turn with its next state, session end,
  idle time-out, and the at-least-one rule;
- :mod:`pipeline.judge.backends`: PRM judges (``llm`` votes, ``choice`` scoring, ``embedding``
  classifier, or a user's class);
- :mod:`pipeline.judge.teacher`: OPD teacher log-probs on the student's exact response ids;
- :mod:`pipeline.judge.samples`: the samples of each mode;
- :mod:`pipeline.judge.app`: the consumer-group process (``python -m pipeline judge``).
"""
