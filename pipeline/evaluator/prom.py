"""Prometheus metrics of the ``evaluator`` stage (served on ``metrics_port`` with the bus's)."""

from __future__ import annotations

from prometheus_client import Counter

DECISIONS = Counter("pipeline_evaluator_decisions_total", "promote/rollback decisions published on control",
                    ["action"])
EVALUATIONS = Counter("pipeline_evaluator_evaluations_total",
                      "eval-set runs: published on metrics, or failed (engine error, version not served)",
                      ["outcome"])
RESTARTS = Counter("pipeline_evaluator_decider_restarts_total",
                   "times the decider read every record again after an error")
