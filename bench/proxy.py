"""Proxy benchmark: what the proxy adds on top of the engine, against a naive forwarder.

    .venv/bin/python bench/proxy.py                 # 1, 16, 64 clients, ~2 minutes
    .venv/bin/python bench/proxy.py --duration 1 --clients 1 16

One run starts, each in its own process:

- a real broker (the embedded Tansu, topics created with a ``bench-`` prefix);
- ``upstream``: :class:`pipeline.testing.servers.StandInEngine`, a stand-in OpenAI-compatible
  engine that answers instantly (the same ~6 KB answer with 67 token ids and log-probs for every
  request; streamed as 69 SSE chunks, ``--token-ms`` apart: 5 ms = 200 tokens/s per stream, a
  fast GPU engine; 1 ms is a stress test of the per-chunk cost);
- ``naive``: a forward-only proxy written the textbook way — FastAPI route, ``await
  request.body()``, one shared ``httpx.AsyncClient``, ``Response``/``StreamingResponse`` — on
  the same uvicorn stack as the proxy (``--naive-stack h11`` gives it uvicorn's pure-Python
  defaults instead);
- ``proxy``: ``python -m pipeline proxy`` with event publishing on (every request publishes a
  ``next_state`` and a ``turn``; sessions of 8 turns end with ``X-Session-Done``) and its durable
  event buffer (``--buffer``: committed before each response completes; ``fsync`` also fsyncs);
- ``memproxy`` (unless ``--buffer memory``): the same proxy with events in memory only, so the
  buffer's own cost is printed from the same run.

The load generator (this process, aiohttp) runs the same multi-turn workload straight to the
upstream (``direct``), through ``naive`` and through ``proxy``, at each client count, in the
order direct, naive, proxy, proxy, naive, direct (drift from other load on the machine cancels
out), and prints per target: requests/s, latency p50/p99, the latency *added* over direct,
throughput ratios, and streaming time-to-first-token (first content chunk) through each target.
The targets of the proxy issue are checked at the end (PASS/MISS); nothing here asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402
from fastapi import Request  # noqa: E402  (module level: the naive app's annotations are resolved here)

from pipeline.procutil import free_port  # noqa: E402

REPLY = ("Sure. The capital of France is Paris; it has been the seat of government for centuries and "
         "is known for the Louvre, the Eiffel Tower and its cafes. Anything else you would like to know?")
SYSTEM = "You are a helpful assistant. " * 20
TURNS_PER_SESSION = 8


# ---- servers (run as child processes of this script) --------------------------------------------
def serve_upstream(port: int, token_ms: float) -> None:
    import uvicorn

    from pipeline.testing.servers import Reply, StandInEngine

    app = StandInEngine(lambda req: Reply(content=REPLY), fixed=True, record=False, always_extras=True,
                        token_interval_s=token_ms / 1000)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def serve_naive(port: int, upstream: str, stack: str) -> None:
    import json

    import httpx
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import Response, StreamingResponse
    from starlette.background import BackgroundTask

    app = FastAPI()
    client = httpx.AsyncClient(base_url=upstream, timeout=60,
                               limits=httpx.Limits(max_connections=512, max_keepalive_connections=512))

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.body()
        if json.loads(body).get("stream"):
            r = await client.send(client.build_request("POST", "/v1/chat/completions", content=body,
                                                       headers={"content-type": "application/json"}), stream=True)
            return StreamingResponse(r.aiter_raw(), status_code=r.status_code, media_type="text/event-stream",
                                     background=BackgroundTask(r.aclose))
        r = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    kw = {"loop": "asyncio", "http": "h11"} if stack == "h11" else {}
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, **kw)


# ---- load generation ----------------------------------------------------------------------------
class Conversation:
    """One client's multi-turn sessions (the same sequence for every target)."""

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.session = 0
        self._new()

    def _new(self) -> None:
        self.session += 1
        self.turn = 0
        self.messages = [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Question {self.worker}.{self.session}: the capital of France?"}]

    def request(self, stream: bool) -> tuple[bytes, dict]:
        headers = {"Content-Type": "application/json", "X-Session-Id": f"bench-{self.worker}-{self.session}"}
        if self.turn == TURNS_PER_SESSION - 1:
            headers["X-Session-Done"] = "true"
        body = {"model": "bench", "messages": self.messages, "max_tokens": 128, "temperature": 0.7}
        if stream:
            body["stream"] = True
        return orjson.dumps(body), headers

    def advance(self) -> None:
        self.turn += 1
        if self.turn >= TURNS_PER_SESSION:
            self._new()
        else:
            self.messages = self.messages + [{"role": "assistant", "content": REPLY},
                                             {"role": "user", "content": f"Thanks. And follow-up {self.turn}?"}]


async def load(url: str, clients: int, duration: float, stream: bool, warmup: float = 0.3) -> dict:
    """Closed-loop load: ``clients`` workers, each sending its next request when the last is done."""
    import aiohttp

    lat: list[float] = []
    ttft: list[float] = []
    errors = 0
    conn = aiohttp.TCPConnector(limit=clients * 2 + 4)
    async with aiohttp.ClientSession(connector=conn) as s:
        t_start = time.perf_counter()
        t_measure = t_start + warmup
        t_end = t_measure + duration

        async def worker(w: int) -> None:
            nonlocal errors
            conv = Conversation(w)
            while True:
                now = time.perf_counter()
                if now >= t_end:
                    return
                body, headers = conv.request(stream)
                t0 = time.perf_counter()
                first = None
                async with s.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                    if stream:
                        async for line in r.content:
                            if first is None and line.startswith(b"data: {") and b'"content":"' in line \
                                    and b'"content":""' not in line:
                                first = time.perf_counter()
                    else:
                        await r.read()
                    ok = r.status == 200
                t1 = time.perf_counter()
                if not ok:
                    errors += 1
                if t0 >= t_measure and t1 <= t_end:
                    lat.append(t1 - t0)
                    if first is not None:
                        ttft.append(first - t0)
                conv.advance()

        await asyncio.gather(*(worker(w) for w in range(clients)))
    lat.sort()
    ttft.sort()
    pct = lambda xs, q: 1000 * xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")  # noqa: E731
    return {"n": len(lat), "rps": len(lat) / duration, "p50": pct(lat, 0.5), "p99": pct(lat, 0.99),
            "ttft50": pct(ttft, 0.5), "ttft99": pct(ttft, 0.99), "errors": errors, "lat": lat, "ttft": ttft}


def _merge(a: dict, b: dict, duration: float) -> dict:
    lat = sorted(a["lat"] + b["lat"])
    ttft = sorted(a["ttft"] + b["ttft"])
    pct = lambda xs, q: 1000 * xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")  # noqa: E731
    return {"n": len(lat), "rps": len(lat) / (2 * duration), "p50": pct(lat, 0.5), "p99": pct(lat, 0.99),
            "ttft50": pct(ttft, 0.5), "ttft99": pct(ttft, 0.99), "errors": a["errors"] + b["errors"]}


# ---- orchestration ------------------------------------------------------------------------------
def _wait_http(url: str, timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def _metric(text: str, name: str) -> float:
    total = 0.0
    for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M):
        total += float(m.group(1))
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--duration", type=float, default=2.0, help="seconds per measured run (each run twice)")
    ap.add_argument("--stream-clients", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--stream-duration", type=float, default=4.0, help="seconds per measured streaming run")
    ap.add_argument("--token-ms", type=float, default=5.0,
                    help="streaming: ms between two tokens of the stand-in engine (5 = 200 tokens/s per stream)")
    ap.add_argument("--buffer", choices=["disk", "fsync", "memory"], default="disk",
                    help="the proxy's event buffer: disk (default, durable against a crash), fsync (also against "
                         "power loss) or memory (nothing durable; the cost of the buffer is disk minus memory)")
    ap.add_argument("--naive-stack", choices=["same", "h11"], default="same",
                    help="naive forwarder on the proxy's uvicorn stack (uvloop+httptools) or on h11/asyncio")
    args = ap.parse_args(argv)

    import httpx

    from pipeline.broker import EmbeddedBroker
    from pipeline.config import load_config
    from pipeline.bus.admin import apply_topics
    from pipeline.topics import load_topics

    py = sys.executable
    procs: list[subprocess.Popen] = []
    broker = EmbeddedBroker().start()
    try:
        config = load_config(None, kafka={"bootstrap_servers": broker.bootstrap}, topics={"prefix": "bench-"})
        apply_topics(config, load_topics(config.topics.file))
        up_port, naive_port, proxy_port = free_port(), free_port(), free_port()
        up = f"http://127.0.0.1:{up_port}"
        procs.append(subprocess.Popen([py, __file__, "_upstream", str(up_port), str(args.token_ms)]))
        procs.append(subprocess.Popen([py, __file__, "_naive", str(naive_port), up, args.naive_stack]))
        env = dict(os.environ, PIPELINE_LOG_LEVEL="WARNING")
        import tempfile

        buf_dir = tempfile.mkdtemp(prefix="bench-proxy-buffer-")
        buf_args = (["--set", "proxy.buffer_dir=null"] if args.buffer == "memory" else
                    ["--buffer-dir", buf_dir] + (["--set", "proxy.buffer_fsync=true"] if args.buffer == "fsync" else []))
        procs.append(subprocess.Popen([py, "-m", "pipeline", "proxy", "--port", str(proxy_port), "--engine-url", up,
                                       "--bootstrap", broker.bootstrap, "--set", "topics.prefix=bench-", *buf_args],
                                      env=env, stdout=subprocess.DEVNULL))
        targets = {"direct": up, "naive": f"http://127.0.0.1:{naive_port}", "proxy": f"http://127.0.0.1:{proxy_port}"}
        if args.buffer != "memory":  # same proxy, events in memory only: the buffer's cost, measured in this run
            mem_port = free_port()
            procs.append(subprocess.Popen([py, "-m", "pipeline", "proxy", "--port", str(mem_port), "--engine-url", up,
                                           "--bootstrap", broker.bootstrap, "--set", "topics.prefix=bench-",
                                           "--set", "proxy.buffer_dir=null"], env=env, stdout=subprocess.DEVNULL))
            targets["memproxy"] = f"http://127.0.0.1:{mem_port}"
            _wait_http(targets["memproxy"] + "/readyz")
        _wait_http(up + "/health")
        _wait_http(targets["naive"] + "/healthz")
        _wait_http(targets["proxy"] + "/readyz")
        print(f"broker {broker.bootstrap}; upstream {up}; naive on {'uvloop+httptools' if args.naive_stack == 'same' else 'h11+asyncio'};"
              f" proxy with event publishing on, {args.buffer} event buffer; {os.cpu_count()} cores; {args.duration:g} s per run, each run twice;"
              f" streams: 69 chunks, {args.token_ms:g} ms apart\n")

        order = ["direct", "naive", "proxy", "proxy", "naive", "direct"]
        if "memproxy" in targets:
            order = ["direct", "naive", "memproxy", "proxy", "proxy", "memproxy", "naive", "direct"]
        results: dict = {}
        for stream in (False, True):
            for c in (args.stream_clients if stream else args.clients):
                runs: dict = {}
                dur = args.stream_duration if stream else args.duration
                for name in order:
                    r = asyncio.run(load(targets[name], c, dur, stream))
                    runs.setdefault(name, []).append(r)
                results[(stream, c)] = {n: _merge(*rs, dur) for n, rs in runs.items()}

        print("non-stream requests (latency in ms; added = target minus direct)")
        print(f"{'clients':>7} {'target':>7} {'req/s':>8} {'p50':>7} {'p99':>7} {'+p50':>7} {'+p99':>7} {'errors':>6}")
        for c in args.clients:
            res = results[(False, c)]
            d = res["direct"]
            for n in [t for t in ("direct", "naive", "memproxy", "proxy") if t in res]:
                r = res[n]
                add = "" if n == "direct" else f"{r['p50'] - d['p50']:7.2f} {r['p99'] - d['p99']:7.2f}"
                print(f"{c:>7} {n:>7} {r['rps']:8.0f} {r['p50']:7.2f} {r['p99']:7.2f} {add:>15} {r['errors']:>6}")
            print(f"{'':>7} throughput proxy/direct {res['proxy']['rps'] / d['rps']:.2f}  "
                  f"proxy/naive {res['proxy']['rps'] / res['naive']['rps']:.2f}  "
                  f"naive/direct {res['naive']['rps'] / d['rps']:.2f}")
        print("\nstreaming: time to first content chunk (ms)")
        print(f"{'clients':>7} {'target':>7} {'ttft p50':>9} {'ttft p99':>9} {'+p50':>7} {'req/s':>7}")
        for c in args.stream_clients:
            res = results[(True, c)]
            d = res["direct"]
            for n in ("direct", "naive", "proxy"):
                r = res[n]
                add = "" if n == "direct" else f"{r['ttft50'] - d['ttft50']:7.2f}"
                print(f"{c:>7} {n:>7} {r['ttft50']:9.2f} {r['ttft99']:9.2f} {add:>7} {r['rps']:7.0f}")

        metrics = httpx.get(targets["proxy"] + "/metrics").text
        delivered = _metric(metrics, "pipeline_proxy_events_delivered_total")
        dropped = _metric(metrics, "pipeline_proxy_events_dropped_total")
        served = _metric(metrics, "pipeline_proxy_requests_total")
        turns = _metric(metrics, "pipeline_proxy_turns_total")
        buffered = _metric(metrics, "pipeline_proxy_events_buffered")
        print(f"\nproxy: {served:.0f} requests, {turns:.0f} turns recorded, {delivered:.0f} events delivered to the "
              f"broker, {buffered:.0f} still buffered, {dropped:.0f} dropped")

        print("\ntargets (proxy issue):")
        checks = []
        if (False, 1) in results:
            r = results[(False, 1)]
            checks.append(("added p50 at 1 client <= 2 ms", r["proxy"]["p50"] - r["direct"]["p50"], 2.0, "<="))
            if "memproxy" in r:
                print(f"  info  the {args.buffer} event buffer's own cost at 1 client (proxy minus memproxy, same run): "
                      f"p50 {r['proxy']['p50'] - r['memproxy']['p50']:+.2f} ms, p99 "
                      f"{r['proxy']['p99'] - r['memproxy']['p99']:+.2f} ms")
        if (False, 16) in results:
            r = results[(False, 16)]
            checks.append(("throughput at 16 clients >= 1.5x naive", r["proxy"]["rps"] / r["naive"]["rps"], 1.5, ">="))
        if (True, 1) in results:
            r = results[(True, 1)]
            checks.append(("streaming TTFT p50 at 1 client within 2 ms of direct",
                           r["proxy"]["ttft50"] - r["direct"]["ttft50"], 2.0, "<="))
        for name, value, bound, op in checks:
            ok = value <= bound if op == "<=" else value >= bound
            print(f"  {'PASS' if ok else 'MISS'}  {name}: {value:.2f}")
        for c in args.stream_clients:
            if c != 1:
                r = results[(True, c)]
                print(f"  info  streaming TTFT p50 at {c} clients, added over direct: proxy "
                      f"{r['proxy']['ttft50'] - r['direct']['ttft50']:.2f} ms, naive "
                      f"{r['naive']['ttft50'] - r['direct']['ttft50']:.2f} ms")
        return 0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        broker.stop()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_upstream":
        serve_upstream(int(sys.argv[2]), float(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_naive":
        serve_naive(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        sys.exit(main())
