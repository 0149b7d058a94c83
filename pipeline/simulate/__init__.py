"""Simulated users (GSM8K feedback loop, MT-Bench two-turn follow-ups) and held-out evaluation.

- :func:`pipeline.simulate.runner.simulate`: run sessions against the proxy (``pipeline simulate``).
- :func:`pipeline.simulate.evaluate.evaluate`: held-out GSM8K metrics of the engine's current
  policy version (requests bypass the proxy, so evaluation never becomes training data).
- :mod:`pipeline.simulate.grading`: the pure grading rules (word counts, final numbers).
"""
