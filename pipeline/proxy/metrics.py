"""Prometheus metrics of the proxy (names used by the dashboard in deploy/).

The bus metrics of :mod:`pipeline.metrics` (``pipeline_events_produced_total`` ...) are reported
too, with ``stage="proxy"``. Histograms are in seconds.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LAT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0, 120.0, 300.0)

REQUESTS = Counter("pipeline_proxy_requests_total", "Chat completion requests answered",
                   ["status", "stream"])
LATENCY = Histogram("pipeline_proxy_request_latency_seconds",
                    "Request arrival to last byte sent (includes any sync hold)", ["stream"],
                    buckets=_LAT_BUCKETS)
TTFT = Histogram("pipeline_proxy_ttft_seconds", "Streaming: request arrival to first chunk sent",
                 buckets=_LAT_BUCKETS)
WITHOUT_SESSION = Counter("pipeline_proxy_requests_without_session_total",
                          "Requests no client-given value names a session of (header, body, agent marker, "
                          "user field): sessions derived by continuation, or skipped/rejected per proxy.anonymous")
SESSION_SOURCE = Counter("pipeline_proxy_session_source_total",
                         "Recorded requests by the rule that decided their session: header, body, marker:<agent>, "
                         "user, continuation, new, housekeeping", ["source"])
HOUSEKEEPING = Counter("pipeline_proxy_housekeeping_total",
                       "Requests recognised as an agent's own housekeeping (compaction, title, memory flush, "
                       "heartbeat; pipeline.proxy.housekeeping): recorded as side turns, never trained",
                       ["agent", "kind"])
SESSION_IDS_IGNORED = Counter("pipeline_proxy_session_ids_ignored_total",
                              "Session values that are not ids (unfilled template, empty, invalid), by field; the "
                              "request is served under the next rule and the response says so in x-session-warning",
                              ["field", "reason"])
REFUSED = Counter("pipeline_proxy_refused_requests_total",
                  "Main requests the engine refused or never answered (by HTTP status or error): no turn, no turn "
                  "index, no next state", ["status"])
TURNS = Counter("pipeline_proxy_turns_total", "Turn events queued for publishing", ["turn_type"])
TURNS_WITHOUT_IDS = Counter("pipeline_proxy_turns_without_token_ids_total",
                            "Turns whose engine response lacked token ids or log-probs")
ADAPTER_MISMATCH = Counter("pipeline_proxy_adapter_mismatch_total",
                           "Turns the engine reports another LoRA adapter served than the one of the tenant's last "
                           "resume (recorded without token ids, log-probs and adapter: they train nothing)")
UNFINISHED = Counter("pipeline_proxy_unfinished_generations_total",
                     "Generations that did not finish (recorded with finish_reason abort, never trained as an "
                     "answer): engine_abort, client_disconnect, engine_error, timeout, truncated, no_finish_reason",
                     ["cause"])
EVENTS_BUFFERED = Gauge("pipeline_proxy_events_buffered",
                        "Events accepted but not yet acknowledged by the broker (disk buffer + memory)")
EVENTS_DROPPED = Counter("pipeline_proxy_events_dropped_total", "Events given up (never delivered)",
                         ["reason"])
EVENTS_NOT_DURABLE = Counter("pipeline_proxy_events_not_durable_total",
                             "Events held in memory only because the disk buffer refused them (buffer_full, "
                             "disk_error) or queued behind such events (behind_memory); lost if the proxy crashes",
                             ["reason"])
BUFFER_COMMIT = Histogram("pipeline_proxy_buffer_commit_seconds",
                          "One group commit of events to the disk buffer (responses wait for it)",
                          buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                   0.5))
EVENTS_DELIVERED = Counter("pipeline_proxy_events_delivered_total", "Events acknowledged by the broker")
PUBLISH_RETRIES = Counter("pipeline_proxy_publish_retries_total",
                          "Windows of events re-sent after a broker error")
BROKER_UP = Gauge("pipeline_proxy_broker_connected", "1 while the last publish window succeeded")
SYNC_HOLD = Histogram("pipeline_proxy_sync_hold_seconds", "Time a request was held by a weight sync",
                      buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0))
SYNC_PAUSED = Gauge("pipeline_proxy_sync_paused", "1 while the control topic says a weight sync runs")
POLICY_VERSION = Gauge("pipeline_proxy_policy_version", "Policy version of the latest served turn")
DOOR_REQUESTS = Counter("pipeline_proxy_door_requests_total",
                        "Requests to the Responses (/v1/responses) and Messages (/v1/messages) front doors, by "
                        "status (each also counts as a chat request once translated)", ["api", "status"])
SESSIONS = Gauge("pipeline_proxy_sessions", "Sessions held in memory")
FEEDBACK = Counter("pipeline_proxy_feedback_total",
                   "POST /v1/feedback: accepted by source (user, reviewer, app), or not_found (no such turn of the "
                   "tenant here)", ["result"])


class _Cache:
    """Pre-resolved label children (``labels()`` costs a lock and a dict lookup per call)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[int, bool], object] = {}
        self.latency = {True: LATENCY.labels("true"), False: LATENCY.labels("false")}
        self.children: dict[tuple, object] = {}

    def child(self, metric, *values: str):
        """``metric.labels(*values)``, resolved once per label values (the hot path's counters)."""
        key = (metric, values)
        c = self.children.get(key)
        if c is None:
            c = self.children[key] = metric.labels(*values)
        return c

    def request(self, status: int, stream: bool):
        c = self.requests.get((status, stream))
        if c is None:
            c = self.requests[(status, stream)] = REQUESTS.labels(str(status), "true" if stream else "false")
        return c


CACHE = _Cache()
