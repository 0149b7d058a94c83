"""Prometheus metrics of the judge stage (served on ``config.metrics_port`` when set)."""

from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge, Histogram

TURNS = Counter("pipeline_judge_turns_total", "Main turns consumed by the judge")
REWARD_SOURCE = Counter("pipeline_judge_reward_source_total",
                        "Samples with a reward, by where it came from (judge, feedback, outcome, or several joined "
                        "by +)", ["source"])
LATE_SIGNALS = Counter("pipeline_judge_late_feedback_total",
                       "Feedback and session outcomes not used because their turn was already decided, by reason: "
                       "after_decision (feedback read after its turn's sample was decided), unknown_turn (this "
                       "judge holds no record of the turn), unfinished (the turn never trains), "
                       "outcome_after_decision (a session outcome with no undecided turn left)", ["reason"])
SAMPLES = Counter("pipeline_judge_samples_total", "Samples produced", ["kind"])
VOTES = Counter("pipeline_judge_votes_total", "Judge votes by value (1, 0, -1, failed)", ["value"])
PARSE_FAILURES = Counter("pipeline_judge_parse_failures_total", "Judge outputs without a valid \\boxed{} answer")
ALL_FAILED = Counter("pipeline_judge_all_votes_failed_total", "Judgements where every vote failed (no score: the sample carries no reward)")
FLUSHED = Counter("pipeline_judge_flushed_total", "Waiting turns settled without a next state", ["reason"])
DROPPED = Counter("pipeline_judge_dropped_total", "Judged turns that produced no sample", ["reason"])
TEACHER_FAILURES = Counter("pipeline_judge_teacher_failures_total", "Turns whose teacher log-probs failed")
TEACHER_UNSUPPORTED = Counter("pipeline_judge_teacher_unsupported_total",
                              "Hinted turns the teacher cannot score on the student's distribution (no OPD term)",
                              ["reason"])
UNFINISHED = Counter("pipeline_judge_unfinished_turns_total",
                     "Main turns whose generation did not finish (never trained as an answer)", ["finish_reason"])
DUPLICATE_TURNS = Counter("pipeline_judge_duplicate_turns_total",
                          "Turn records ignored: their request_id is already held or settled (the same request)")
NEW_CONVERSATIONS = Counter("pipeline_judge_new_conversations_total",
                            "Turns that restarted their session's turn indices (a new conversation, e.g. after the "
                            "proxy evicted or forgot the session): judged as a new conversation, never as duplicates")
UNJUDGED = Counter("pipeline_judge_unjudged_turns_total",
                   "Main turns that ended without a judgement, by reason: no_next_state (a newer turn came first), "
                   "unfinished, empty_next_state, session_end, idle_timeout (the idle horizon), out_of_order (a late "
                   "record), votes_failed, judge_error", ["reason"])
REUSED = Counter("pipeline_judge_published_decisions_reused_total",
                 "Re-read turns (after a restart or a rebalance) whose published sample was kept, not judged again")
PROMOTED = Counter("pipeline_judge_at_least_one_promoted_total",
                   "Turns judged 0 and trained with reward 0 (the at-least-one rule: first judged turn of a "
                   "conversation that trained nothing yet)")
IDLE_ENDS = Counter("pipeline_judge_idle_session_ends_total",
                    "session_end records (reason idle_timeout) this judge published to the turns topic")
LATENCY = Histogram("pipeline_judge_latency_seconds", "Join (next state seen) to sample delivered",
                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
SESSIONS_WAITING = Gauge("pipeline_judge_sessions_waiting", "Sessions whose latest main turn waits for a next state")
RECORDS_HELD = Gauge("pipeline_judge_records_held",
                     "Records held back because they overtook an earlier record of their session (several proxies)")
JOBS_IN_FLIGHT = Gauge("pipeline_judge_jobs_in_flight", "Judge jobs submitted and not yet produced")


_VOTE_CHILDREN = {v: VOTES.labels("failed" if v is None else str(v)) for v in (1, 0, -1, None)}


def count_vote(v: int | None) -> None:
    """Count one vote (``None`` = failed)."""
    _VOTE_CHILDREN[v].inc()


# ---- the OPD hint path ---------------------------------------------------------------------
HINTS = Counter("pipeline_judge_hint_requests_total", "Turns whose next state was asked for an OPD hint")
HINTS_ACCEPTED = Counter("pipeline_judge_hints_accepted_total",
                         "OPD hints accepted by the judge (before the teacher call)")
HINTS_REJECTED = Counter("pipeline_judge_hints_rejected_total",
                         "Turns without an accepted OPD hint, by reason (judged_no_hint, hint_too_short, "
                         "no_hint_block, all_votes_failed, not_corrective, empty_next_state, backend_error)",
                         ["reason"])
HINT_CHARS = Histogram("pipeline_judge_hint_chars", "Length of accepted OPD hints (characters)",
                       buckets=(10, 20, 40, 80, 160, 320, 640, 1280, 2560))


def observe_hint(hint: str | None, reason: str | None) -> None:
    """Count one hint judgement: accepted with its length, or rejected with ``reason``.

    Share accepted = ``pipeline_judge_hints_accepted_total / pipeline_judge_hint_requests_total``.
    """
    HINTS.inc()
    if hint:
        HINTS_ACCEPTED.inc()
        HINT_CHARS.observe(len(hint))
    else:
        HINTS_REJECTED.labels(reason or "unspecified").inc()


# ---- labelled traffic: agreement, coverage, sign errors --------------------------------------
LABELLED = Counter("pipeline_judge_labelled_total",
                   "Judged turns whose next state carries a label (e.g. an imported labelled set): the "
                   "confusion matrix by next-state role, label and predicted score (failed: every vote "
                   "failed, no score)",
                   ["role", "label", "predicted"])
LABELLED_AGREEMENT = Gauge("pipeline_judge_labelled_agreement",
                           "Share of labelled turns scored as labelled (since start)", ["role"])
LABELLED_COVERAGE = Gauge("pipeline_judge_labelled_coverage",
                          "Share of labelled turns given a non-zero score (since start)", ["role"])
LABELLED_SIGN_ERRORS = Gauge("pipeline_judge_labelled_sign_error_rate",
                             "Share of labelled turns scored with the opposite sign (+1 as -1 or -1 as +1)",
                             ["role"])
_labelled_counts: dict = {}
_labelled_lock = threading.Lock()


def next_state_label(messages: list) -> tuple[int | None, str]:
    """``(label, role)`` of a labelled next state: the ``label`` (1, 0 or -1) its messages carry
    (the last one wins) and its role (``user`` if the user spoke, else the first role); label
    None when no message carries a valid one."""
    label, roles = None, []
    for m in messages or []:
        if not isinstance(m, dict):
            continue
        roles.append(str(m.get("role")))
        lab = m.get("label")
        if lab in (1, 0, -1) and not isinstance(lab, bool):
            label = int(lab)
    role = "user" if "user" in roles else (roles[0] if roles else "none")
    return label, role


def observe_labelled(messages: list, predicted: int | None) -> None:
    """Count a judged turn if its next state carries a label (no-op otherwise).

    ``predicted`` None (every vote failed) is counted as ``predicted="failed"``, never as a 0: it
    agrees with no label, covers nothing and is no sign error (the figures of
    :mod:`pipeline.judge.evaluate`).
    """
    label, role = next_state_label(messages)
    if label is None:
        return
    LABELLED.labels(role, str(label), "failed" if predicted is None else str(predicted)).inc()
    scored = predicted is not None
    with _labelled_lock:
        for key in (role, "all"):
            n, agree, covered, sign = _labelled_counts.get(key, (0, 0, 0, 0))
            n, agree, covered, sign = (n + 1, agree + (label == predicted), covered + (scored and predicted != 0),
                                       sign + (scored and label * predicted == -1))
            _labelled_counts[key] = (n, agree, covered, sign)
            LABELLED_AGREEMENT.labels(key).set(agree / n)
            LABELLED_COVERAGE.labels(key).set(covered / n)
            LABELLED_SIGN_ERRORS.labels(key).set(sign / n)
