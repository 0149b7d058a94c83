"""Test helpers for the dashboard: an in-process dashboard on a real HTTP port, a conversation
whose every piece of text carries a marker, and a minimal Chrome DevTools Protocol client."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
from pipeline import events
from pipeline.bus import TopicReader
from pipeline.procutil import free_port

MARK = "SECRETTEXT"  # every conversation string below contains it; no view may serve it without the flag


class DashboardServer:
    """``pipeline dashboard`` in this process: its real app on uvicorn in a thread."""

    def __init__(self, config) -> None:
        import uvicorn

        from pipeline.dashboard.cli import build

        self.config = config
        self.port = free_port()
        self.state, self.follower, self.scraper, self.app = build(config)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> DashboardServer:
        self.follower.start()
        self.scraper.start()
        self.thread.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).is_success:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("dashboard did not start")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.scraper.stop()
        self.follower.stop()

    def wait(self, predicate, timeout_s: float = 30.0, headers=None) -> dict:
        """Poll ``/api/overview`` until ``predicate(overview)``; returns it (AssertionError on time-out)."""
        deadline = time.monotonic() + timeout_s
        o = {}
        while time.monotonic() < deadline:
            o = httpx.get(f"{self.url}/api/overview", headers=headers or {}, timeout=5).json()
            if predicate(o):
                return o
            time.sleep(0.1)
        raise AssertionError(f"dashboard never reached the expected state: {json.dumps(o)[:2000]}")


def marked_conversation(session_id: str, turns: int = 2) -> tuple[list, list]:
    """Turns/next states/session end and their samples; every text field holds :data:`MARK`."""
    now = events.now_ms()
    turn_events, samples = [], []
    for i in range(turns):
        turn_events.append(events.Turn(
            session_id=session_id, turn_index=i, request_id=f"{session_id}-r{i}", created_at=now + i, policy_version=0,
            model="m", messages=[{"role": "system", "content": f"{MARK} system {i}"},
                                 {"role": "user", "content": [{"type": "text", "text": f"{MARK} user part {i}"}]}],
            tools=[{"type": "function", "function": {"name": "lookup", "description": f"{MARK} tool doc"}}],
            sampling={"temperature": 1.0}, prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5],
            response_logprobs=[-0.5, -0.25],
            response={"content": f"{MARK} reply {i}", "reasoning_content": f"{MARK} thinking {i}",
                      "tool_calls": [{"id": "c1", "type": "function",
                                      "function": {"name": "lookup", "arguments": f'{{"q": "{MARK} args"}}'}}]},
            finish_reason="stop"))
        turn_events.append(events.NextState(session_id=session_id, after_turn_index=i, created_at=now + i,
                                            messages=[{"role": "tool", "tool_call_id": "c1", "content": f"{MARK} result {i}"},
                                                      {"role": "user", "content": f"{MARK} next {i}"}]))
        samples.append(events.Sample(
            sample_id=f"{session_id}:{i}:combine", session_id=session_id, turn_index=i, kind="opd+rl",
            tokens=[1, 2, 3, 4, 5], response_length=2, rollout_log_probs=[-0.5, -0.25], teacher_log_probs=[-0.25, -0.25],
            reward=1.0 if i == 0 else -1.0, loss_mask=1, votes=[[1, 1, None] if i == 0 else [-1, 0, -1], [1, -1, 1]],
            hint=f"{MARK} hint {i}", judge="test", created_at=now + i))
    turn_events.append(events.SessionEnd(session_id=session_id, reason="header", created_at=now + turns))
    return turn_events, samples


def topic_records(config, logical: str) -> list:
    """Every record of a topic up to its end: :class:`pipeline.bus.Record` s and, for records
    that do not decode, :class:`pipeline.bus.Undecodable` s."""
    with TopicReader(config, config.topics.name(logical), name="test-reader", accept=None) as reader:
        return list(reader.read(idle_timeout_s=2.0))


# ---------------------------------------------------------------- headless Chromium over the DevTools protocol

def chromium_path() -> str | None:
    """Debian's Chromium (``apt-get install chromium``), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


class Browser:
    """Headless Chromium driven over the Chrome DevTools Protocol (aiohttp's websocket client)."""

    def __init__(self, width: int = 1400, height: int = 1000) -> None:
        exe = chromium_path()
        if exe is None:
            raise RuntimeError("no chromium binary (deploy/install.sh installs Debian's chromium)")
        self.profile = tempfile.mkdtemp(prefix="cdp-")
        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--disable-extensions", "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=5).json()
        page = next(t for t in targets if t.get("type") == "page")
        self.loop = asyncio.new_event_loop()
        self._id = 0
        self.ws = self.session = None
        self.loop.run_until_complete(self._connect(page["webSocketDebuggerUrl"]))
        self.send("Page.enable")
        self.send("Runtime.enable")

    async def _connect(self, url: str) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession()
        self.ws = await self.session.ws_connect(url, max_msg_size=0)

    async def _call(self, method: str, params: dict) -> dict:
        self._id += 1
        my = self._id
        await self.ws.send_str(json.dumps({"id": my, "method": method, "params": params}))
        while True:
            msg = json.loads((await self.ws.receive(timeout=60)).data)
            if msg.get("id") == my:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def send(self, method: str, **params) -> dict:
        """One CDP command; its result."""
        return self.loop.run_until_complete(self._call(method, params))

    def goto(self, url: str) -> None:
        """Navigate and wait for the document to load."""
        self.send("Page.navigate", url=url)
        self.wait("document.readyState === 'complete'")

    def eval(self, expression: str):
        """Evaluate JavaScript in the page; its JSON value."""
        r = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page error: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expression: str, timeout_s: float = 30.0):
        """Poll ``expression`` until truthy; its value (AssertionError on time-out)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            v = self.eval(expression)
            if v:
                return v
            time.sleep(0.1)
        raise AssertionError(f"page never satisfied: {expression}")

    def screenshot(self, path: Path) -> None:
        """Full-page PNG."""
        import base64

        self.send("Emulation.clearDeviceMetricsOverride")
        metrics = self.send("Page.getLayoutMetrics")
        size = metrics.get("cssContentSize") or metrics["contentSize"]
        self.send("Emulation.setDeviceMetricsOverride", width=int(size["width"]), height=int(min(size["height"], 4000)),
                  deviceScaleFactor=1, mobile=False)
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        Path(path).write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            if self.ws is not None:
                self.loop.run_until_complete(self.ws.close())
            if self.session is not None:
                self.loop.run_until_complete(self.session.close())
        except Exception:
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
