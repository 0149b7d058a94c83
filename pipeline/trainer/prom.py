"""Prometheus metrics of the trainer (served on ``config.metrics_port`` when set).

The JSONL log (:mod:`pipeline.trainer.metrics`) has every per-step number; these are the ones
dashboards and ``pipeline up`` read. The syncer's metrics (``pipeline_syncer_*``) are in
:mod:`pipeline.weightsync`, the module both sides of a weight sync share.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

STEPS = Counter("pipeline_trainer_steps_total", "Trainer steps (batches) completed")
SKIPPED = Counter("pipeline_trainer_skipped_steps_total", "Steps that changed no weights (no trainable token, or every optimizer step non-finite)")
POLICY_VERSION = Gauge("pipeline_trainer_policy_version", "Policy version of the trainer's weights (syncs so far)")
SAMPLES = Counter("pipeline_trainer_samples_total", "Samples consumed, by outcome",
                  ["outcome"])  # trained, masked, duplicate, stale_dropped, dead_letter, no_tenant, frozen, unknown_adapter
BATCH_SIZE = Gauge("pipeline_trainer_batch_size", "Samples a step needs (trainer.rollout_batch_size)")
BATCH_COUNTED = Gauge("pipeline_trainer_batch_counted",
                      "Samples counted toward the next step so far (one shared batch; not set with "
                      "trainer.per_tenant)")
LOSS = Gauge("pipeline_trainer_loss", "Loss of the last step (NaN: no trainable sample)")
REWARD = Gauge("pipeline_trainer_reward_mean", "Mean reward of the last batch's trained samples with a reward "
               "(NaN: none)")
STALENESS = Gauge("pipeline_trainer_staleness_mean", "Mean staleness (versions) of the last batch's samples "
                  "sampled by a policy (NaN: none)")
LOGPROB_DIFF = Gauge("pipeline_trainer_logprob_abs_diff",
                     "Mean |train - rollout| log-prob of the last batch's sampled tokens (nats; NaN: none)")
LOGPROB_DIFF_CURRENT = Gauge(
    "pipeline_trainer_logprob_abs_diff_current",
    "Engine/trainer mismatch: mean |train - rollout| log-prob over samples of the trainer's own policy "
    "version in the last batch (nats; NaN: none)")
LOGPROB_DIFF_STALE = Gauge(
    "pipeline_trainer_logprob_abs_diff_stale",
    "Policy drift: mean |train - rollout| log-prob over samples of older policy versions in the last "
    "batch (nats; NaN: none)")
PHASE = Histogram("pipeline_trainer_phase_seconds", "Seconds per step phase",
                  ["phase"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
NONFINITE = Counter("pipeline_trainer_nonfinite_steps_total",
                    "Optimizer steps not taken because the loss or a gradient was NaN/inf (counted live)")
OPTIMIZER_STEPS = Counter("pipeline_trainer_optimizer_steps_total",
                          "Optimizer steps taken, counted live (steps_per_batch per trainer step; with "
                          "pipeline_trainer_nonfinite_steps_total it shows a trainer in the middle of a batch)")
PUBLISHED_VERSION = Gauge("pipeline_trainer_published_version",
                          "Last policy version the trainer published on control (its weights event)")
SYNC_FAILED = Counter("pipeline_trainer_sync_failures_total", "Engines that failed or timed out a weight sync")


def observe_step(record: dict) -> None:
    """Update the trainer metrics from one step record of the JSONL log."""
    STEPS.inc()
    if record.get("skipped"):
        SKIPPED.inc()
    POLICY_VERSION.set(record.get("policy_version", 0))
    SAMPLES.labels("trained").inc(record.get("train_samples", 0))
    for key, outcome in (("masked", "masked"), ("duplicates", "duplicate"), ("stale_dropped", "stale_dropped"),
                         ("dead_letters", "dead_letter"), ("no_tenant_samples", "no_tenant"),
                         ("frozen_samples", "frozen"), ("unknown_adapter", "unknown_adapter")):
        SAMPLES.labels(outcome).inc(record.get(key, 0))
    # a figure the step could not measure (absent from the record, or null in the JSONL log) reads
    # NaN: never 0, and never the previous step's value (a skipped step included)
    for gauge, key in ((LOSS, "loss"), (STALENESS, "staleness_mean"), (REWARD, "reward_mean"),
                       (LOGPROB_DIFF, "logprob_abs_diff"), (LOGPROB_DIFF_CURRENT, "logprob_abs_diff_current"),
                       (LOGPROB_DIFF_STALE, "logprob_abs_diff_stale")):
        value = record.get(key)
        gauge.set(value if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan"))
    for phase in ("consume_s", "forward_backward_s", "optimizer_s", "checkpoint_s", "export_s", "sync_s", "step_s"):
        if isinstance(record.get(phase), (int, float)):
            PHASE.labels(phase[:-2]).observe(record[phase])
    SYNC_FAILED.inc(len(record.get("sync_failed") or {}))
