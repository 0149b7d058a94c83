"""Prometheus metrics of the judge stage (served on ``config.metrics_port`` when set)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

TURNS = Counter("pipeline_judge_turns_total", "Main turns consumed by the judge")
SAMPLES = Counter("pipeline_judge_samples_total", "Samples produced", ["kind"])
VOTES = Counter("pipeline_judge_votes_total", "Judge votes by value (1, 0, -1, failed)", ["value"])
PARSE_FAILURES = Counter("pipeline_judge_parse_failures_total", "Judge outputs without a valid \\boxed{} answer")
ALL_FAILED = Counter("pipeline_judge_all_votes_failed_total", "Judgements where every vote failed (score 0)")
FLUSHED = Counter("pipeline_judge_flushed_total", "Waiting turns settled without a next state", ["reason"])
DROPPED = Counter("pipeline_judge_dropped_total", "Judged turns that produced no sample", ["reason"])
TEACHER_FAILURES = Counter("pipeline_judge_teacher_failures_total", "Turns whose teacher log-probs failed")
TEACHER_UNSUPPORTED = Counter("pipeline_judge_teacher_unsupported_total",
                              "Hinted turns the teacher cannot score on the student's distribution (no OPD term)",
                              ["reason"])
UNFINISHED = Counter("pipeline_judge_unfinished_turns_total",
                     "Main turns whose generation did not finish (never trained as an answer)", ["finish_reason"])
DUPLICATE_TURNS = Counter("pipeline_judge_duplicate_turns_total",
                          "Turn records ignored: a request_id already held or settled, or older than the waiting turn")
IDLE_ENDS = Counter("pipeline_judge_idle_session_ends_total",
                    "session_end records (reason idle_timeout) this judge published to the turns topic")
LATENCY = Histogram("pipeline_judge_latency_seconds", "Join (next state seen) to sample delivered",
                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
SESSIONS_WAITING = Gauge("pipeline_judge_sessions_waiting", "Sessions whose latest main turn waits for a next state")
JOBS_IN_FLIGHT = Gauge("pipeline_judge_jobs_in_flight", "Judge jobs submitted and not yet produced")


_VOTE_CHILDREN = {v: VOTES.labels("failed" if v is None else str(v)) for v in (1, 0, -1, None)}


def count_vote(v: int | None) -> None:
    """Count one vote (``None`` = failed)."""
    _VOTE_CHILDREN[v].inc()
