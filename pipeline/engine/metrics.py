"""Prometheus metrics of one engine (own registry, so several engines can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class EngineMetrics:
    """Counters, gauges and histograms exposed at ``GET /metrics``.

    - ``pipeline_engine_requests_total{endpoint,status}``: finished HTTP requests.
    - ``pipeline_engine_generated_tokens_total``: sampled tokens (all requests).
    - ``pipeline_engine_prompt_tokens_total``: prompt tokens prefilled.
    - ``pipeline_engine_weight_version``: current policy version (when it is an integer).
    - ``pipeline_engine_weight_updates_total{result}``: ``/update_weights_from_disk`` calls.
    - ``pipeline_engine_request_latency_seconds{endpoint}``: end-to-end latency (s).
    - ``pipeline_engine_prefix_cache_lookups_total`` / ``..._hits_total``: prefills that looked
      up / reused a cached prompt prefix; ``..._reused_tokens_total``: prompt tokens not
      recomputed; ``pipeline_engine_prefix_cache_entries`` / ``..._bytes``: what it holds now.
    - ``pipeline_engine_running_requests`` / ``pipeline_engine_waiting_requests``: batch load.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pipeline_engine_requests_total", "HTTP requests handled",
                                ["endpoint", "status"], registry=r)
        self.generated_tokens = Counter("pipeline_engine_generated_tokens_total", "Tokens sampled", registry=r)
        self.prompt_tokens = Counter("pipeline_engine_prompt_tokens_total", "Prompt tokens prefilled", registry=r)
        self.weight_version = Gauge("pipeline_engine_weight_version", "Current policy (weight) version", registry=r)
        self.weight_updates = Counter("pipeline_engine_weight_updates_total", "Weight update calls", ["result"],
                                      registry=r)
        self.latency = Histogram("pipeline_engine_request_latency_seconds", "End-to-end request latency",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.prefix_lookups = Counter("pipeline_engine_prefix_cache_lookups_total", "Prefills that looked up the "
                                      "prefix cache", registry=r)
        self.prefix_hits = Counter("pipeline_engine_prefix_cache_hits_total", "Prefills that reused a cached prefix",
                                   registry=r)
        self.prefix_tokens = Counter("pipeline_engine_prefix_cache_reused_tokens_total", "Prompt tokens whose KV "
                                     "came from the prefix cache", registry=r)
        self.prefix_entries = Gauge("pipeline_engine_prefix_cache_entries", "Prompts held by the prefix cache",
                                    registry=r)
        self.prefix_bytes = Gauge("pipeline_engine_prefix_cache_bytes", "Bytes of keys/values held by the prefix "
                                  "cache", registry=r)
        self.running = Gauge("pipeline_engine_running_requests", "Rows in the decode batch", registry=r)
        self.waiting = Gauge("pipeline_engine_waiting_requests", "Requests waiting for a batch slot", registry=r)

    def on_prefix(self, reused_tokens: int) -> None:
        """One prefix-cache lookup that reused ``reused_tokens`` tokens (0: a miss)."""
        self.prefix_lookups.inc()
        if reused_tokens > 0:
            self.prefix_hits.inc()
            self.prefix_tokens.inc(reused_tokens)

    def set_version(self, version: str) -> None:
        try:
            self.weight_version.set(float(int(version)))
        except ValueError:
            pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
