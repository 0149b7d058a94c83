"""``pipeline up``'s scaled-out stack: two proxies behind the front, one of them killed with -9.

Every stage is its own process (memory broker, two proxies, the front, a judge), except the
policy engine: a scripted stand-in served in this process (``--engine-url``), so the test takes
seconds, not minutes. The supervisor restarts the killed proxy; users keep being answered
through the other one meanwhile; every answered turn reaches ``turns``.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from pipeline import events
from pipeline.config import load_config
from pipeline.orchestrate.supervisor import RestartPolicy
from pipeline.orchestrate.up import start_stack, status_line
from pipeline.testing.servers import StandInEngine, serve_app
from pipeline.testing.topics import read_events
from pipeline.testing.waiting import process_gone, wait_for


def _turn(url: str, sid: str, msgs: list, done: bool = False) -> httpx.Response:
    headers = {"X-Session-Id": sid, **({"X-Session-Done": "true"} if done else {})}
    return httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 4},
                      headers=headers, timeout=60)


@pytest.mark.slow
def test_scaled_out_up_restarts_a_killed_proxy_and_users_are_served_meanwhile(tmp_path):
    config = load_config(None, judge={"mode": "rl", "backend": "constant"})
    with serve_app(StandInEngine()) as engine_url:
        config = config.replace(engine={"url": engine_url})  # what `pipeline up --engine-url` does
        stack = start_stack(config, tmp_path / "run", engine_url=engine_url, trainer=False, durable_broker=False,
                            dashboard=False,
                            replicas={"proxy": 2, "judge": 1, "engine": 1},
                            restart=RestartPolicy(backoff_s=0.5, stable_s=1.0), ready_timeout_s=180)
        config = stack.config

        def watch() -> tuple[threading.Event, threading.Thread]:
            """The supervisor's watch loop in a thread (what `pipeline up` runs): it restarts dead stages."""
            flag = threading.Event()
            thread = threading.Thread(target=stack.supervisor.watch, kwargs=dict(stop=flag, interval_s=0.1),
                                      daemon=True)
            thread.start()
            return flag, thread

        stop, watcher = watch()
        try:
            assert stack.front_url and stack.proxy_url == stack.front_url
            assert set(stack.proxy_urls) == {"proxy-0", "proxy-1"}
            rids, upstreams = [], set()
            msgs = [{"role": "user", "content": "hi"}]
            for k in range(4):
                r = _turn(stack.proxy_url, "before", msgs)
                assert r.status_code == 200 and int(r.headers["x-turn-index"]) == k, (r.text, dict(r.headers))
                rids.append(r.headers["x-request-id"])
                upstreams.add(r.headers["x-upstream"])
                msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": f"more {k}"}]
            assert upstreams == set(stack.proxy_urls.values()), "round robin over both proxies"

            victim = stack.supervisor.get("proxy-0")
            victim_pid = victim.pid
            # no restart while the users below are served: they meet a dead proxy-0 (refused: the front tries
            # proxy-1), never one still starting, whose reset the front cannot retry (a timed back-off once lost
            # that race on a loaded CI worker); the watch resumes after them and restarts it
            stop.set()
            watcher.join(5)
            os.kill(victim_pid, signal.SIGKILL)
            # the users below come after the death: a request that reaches it while it is still
            # exiting is reset, and a reset is a 502 under retry="connect" (it may have been recorded)
            wait_for(lambda: process_gone(victim_pid), "proxy-0 to exit after kill -9", timeout_s=30)
            msgs = [{"role": "user", "content": "during"}]
            for k in range(4):  # the front skips the dead proxy: no user sees an error
                r = _turn(stack.proxy_url, "during", msgs, done=k == 3)
                assert r.status_code == 200, r.text
                assert r.headers["x-upstream"] == stack.proxy_urls["proxy-1"]
                rids.append(r.headers["x-request-id"])
                msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": f"more {k}"}]
            assert not victim.restarts and not victim.alive
            stop, watcher = watch()
            deadline = time.monotonic() + 120
            while not (victim.restarts == 1 and victim.alive and victim.is_ready):
                assert time.monotonic() < deadline, "proxy-0 was not restarted"
                time.sleep(0.1)
            line = status_line(stack)
            assert "proxy-0:up(restarts 1)" in line and "| restarts 1" in line, line
            got = read_events(config, timeout_s=60, settle_s=3.0)
            turns = {e.request_id for e in got if isinstance(e, events.Turn)}
            assert set(rids) <= turns, "every answered turn reached Kafka (proxy-0's through its restart)"
        finally:
            stop.set()
            watcher.join(5)
            stack.stop()
