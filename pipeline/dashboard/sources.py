"""The dashboard's inputs: a topic reader thread and a scraper of the stages' Prometheus endpoints.

:class:`TopicFollower` runs one :class:`pipeline.bus.Follower` (assign mode: no consumer
group, nothing committed) over ``turns``, ``samples``, ``control``, ``metrics`` and every
dead-letter topic, from the beginning or from now, feeding :class:`DashboardState`.

:class:`Scraper` polls each stage's ``/metrics`` every ``dashboard.scrape_interval_s`` and keeps
the ``pipeline_*`` samples (histogram buckets left out), a requests/s rate of the proxy, and the
lag of every consumer group on our topics (committed offset vs the reader's high watermarks).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pipeline.bus import Follower
from pipeline.bus.admin import admin_client, group_lag
from pipeline.config import Config
from pipeline.dashboard.state import DashboardState

log = logging.getLogger(__name__)

LOGICAL_TOPICS = ("turns", "samples", "control", "metrics")


def topic_names(config: Config) -> list[str]:
    """Physical names of the topics the dashboard reads (the four above and their DLQs)."""
    t = config.topics
    return [t.name(n) for n in LOGICAL_TOPICS] + [t.dlq(n) for n in LOGICAL_TOPICS]


class TopicFollower:
    """A daemon thread (a :class:`pipeline.bus.Follower`) folding every record of :func:`topic_names`
    into ``state``. When the broker goes away the error shows on the page, the state is emptied
    and everything is read again from the start (nothing counted twice)."""

    def __init__(self, config: Config, state: DashboardState) -> None:
        self.config = config
        self.state = state
        start = "end" if config.dashboard.start == "now" else "beginning"
        self._follower = Follower(config, topic_names(config), state.apply, name="dashboard-reader", start=start,
                                  resume=False, on_error=self._forget, backoff_s=2.0, max_backoff_s=2.0)

    def start(self) -> TopicFollower:
        self._follower.start()
        return self

    def _forget(self, _error: Exception) -> None:
        self.state.reset()

    @property
    def caught_up(self) -> bool:
        """The reader reached the end of every partition since it (re)started."""
        return self._follower.caught_up

    @property
    def error(self) -> str | None:
        """The last reader error; None once reading works again."""
        return self._follower.error

    def high_watermarks(self) -> dict[tuple[str, int], int]:
        """Known high watermarks of the partitions read."""
        return self._follower.high_watermarks()

    def stop(self) -> None:
        self._follower.stop(5.0)


def parse_metrics(text: str) -> dict[str, float]:
    """``name{label="v",...}`` -> value for every ``pipeline_*`` sample (no histogram buckets)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith("pipeline_") or s.name.endswith(("_bucket", "_created")):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def total(values: dict[str, float], name: str) -> float | None:
    """Sum of every sample of ``name`` (any labels); None when absent."""
    hits = [v for k, v in values.items() if k == name or k.startswith(name + "{")]
    return sum(hits) if hits else None


class Scraper:
    """Background scraper (see the module docstring)."""

    def __init__(self, config: Config, follower: TopicFollower | None = None) -> None:
        self.config = config
        self.urls = dict(config.dashboard.metrics_urls)
        self.follower = follower
        self.interval = config.dashboard.scrape_interval_s
        self.lock = threading.Lock()
        self.stages: dict[str, dict[str, Any]] = {}
        self.lag: list[dict] = []
        self._prev: dict[str, tuple[float, float]] = {}
        self._admin = None
        self.stop_event = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dashboard-scraper", daemon=True)

    def start(self) -> Scraper:
        self._thread.start()
        return self

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self.stop_event.is_set():
                self.scrape_once(client)
                self.stop_event.wait(self.interval)
        if self._admin is not None:
            self._admin.close()

    def scrape_once(self, client: httpx.Client) -> None:
        """One round: every stage's metrics, then consumer-group lag."""
        stages: dict[str, dict[str, Any]] = {}
        now = time.monotonic()
        for name, url in self.urls.items():
            try:
                r = client.get(url)
                r.raise_for_status()
                values = parse_metrics(r.text)
                stages[name] = {"url": url, "up": True, "values": values}
            except httpx.TimeoutException as e:  # it took the connection but is busy (a trainer step holds the GIL)
                last = self.stages.get(name, {})
                stages[name] = {"url": url, "up": True, "busy": True, "values": last.get("values", {}),
                                "error": f"no answer within 2 s ({type(e).__name__}): busy"}
            except (httpx.HTTPError, ValueError) as e:
                stages[name] = {"url": url, "up": False, "error": f"{type(e).__name__}: {e}"[:200], "values": {}}
        proxy = stages.get("proxy", {}).get("values", {})
        req = total(proxy, "pipeline_proxy_requests_total")
        if req is not None:
            prev = self._prev.get("requests")
            if prev is not None and now > prev[0]:
                stages["proxy"]["requests_per_s"] = max(0.0, (req - prev[1]) / (now - prev[0]))
            self._prev["requests"] = (now, req)
        lag = self._group_lag()
        with self.lock:
            self.stages, self.lag = stages, lag

    def _group_lag(self) -> list[dict]:
        if self.follower is None:
            return []
        hws = self.follower.high_watermarks()
        if not hws:
            return []
        try:
            if self._admin is None:
                self._admin = admin_client(self.config)
            return group_lag(self._admin, hws)
        except Exception as e:  # noqa: BLE001 - a broker without these admin calls: stages' gauges remain
            log.debug("consumer-group lag unavailable: %s", e)
            return []

    def snapshot(self) -> dict:
        """``{"stages": {name: {url, up, error}}, "live": {...}, "lag": [...]}`` as of the last round.

        ``live`` holds the numbers the overview shows from Prometheus (None when a stage does
        not serve them); ``lag`` the consumer groups' lag per topic from the broker, or, when
        the broker cannot tell, the stages' own ``pipeline_consumer_lag_records`` gauges.
        """
        with self.lock:
            stages, lag = self.stages, list(self.lag)
        v = {name: st.get("values", {}) for name, st in stages.items()}
        p, j, t, e = v.get("proxy", {}), v.get("judge", {}), v.get("trainer", {}), v.get("engine", {})

        def by_label(values: dict, name: str, label: str) -> dict[str, float]:
            out: dict[str, float] = {}
            for k, val in values.items():
                if k.startswith(name + "{") and f'{label}="' in k:
                    lv = k.split(f'{label}="', 1)[1].split('"', 1)[0]
                    out[lv] = out.get(lv, 0.0) + val
            return out

        live = {
            "requests_per_s": stages.get("proxy", {}).get("requests_per_s"),
            "requests_total": total(p, "pipeline_proxy_requests_total"),
            "proxy_policy_version": total(p, "pipeline_proxy_policy_version"),
            "sync_paused": total(p, "pipeline_proxy_sync_paused"),
            "sync_hold_count": total(p, "pipeline_proxy_sync_hold_seconds_count"),
            "sync_hold_sum_s": total(p, "pipeline_proxy_sync_hold_seconds_sum"),
            "events_buffered": total(p, "pipeline_proxy_events_buffered"),
            "events_dropped": total(p, "pipeline_proxy_events_dropped_total"),
            "judge_sessions_waiting": total(j, "pipeline_judge_sessions_waiting"),
            "judge_jobs_in_flight": total(j, "pipeline_judge_jobs_in_flight"),
            "judge_votes": by_label(j, "pipeline_judge_votes_total", "value"),
            "judge_dropped": by_label(j, "pipeline_judge_dropped_total", "reason"),
            "judge_unjudged": by_label(j, "pipeline_judge_unjudged_turns_total", "reason"),
            "judge_reward_sources": by_label(j, "pipeline_judge_reward_source_total", "source"),
            "judge_late_feedback": by_label(j, "pipeline_judge_late_feedback_total", "reason"),
            "trainer_policy_version": total(t, "pipeline_trainer_policy_version"),
            "trainer_steps": total(t, "pipeline_trainer_steps_total"),
            "trainer_batch_size": total(t, "pipeline_trainer_batch_size"),
            "trainer_batch_counted": total(t, "pipeline_trainer_batch_counted"),
            "engine_weight_version": total(e, "pipeline_engine_weight_version"),
        }
        if not lag:  # the stages' own view (committed position vs high watermark)
            for name, values in v.items():
                for topic, n in by_label(values, "pipeline_consumer_lag_records", "topic").items():
                    lag.append({"group": name, "topic": topic, "lag": n, "source": "prometheus"})
        return {"stages": {n: {k: st.get(k) for k in ("url", "up", "busy", "error")} for n, st in stages.items()},
                "live": live, "lag": lag}

    def stop(self) -> None:
        self.stop_event.set()
        self._thread.join(timeout=5)
