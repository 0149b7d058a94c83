"""Proxy benchmark: what the proxy adds on top of the engine, against a naive forwarder.

    .venv/bin/python bench/proxy.py                 # 1, 16, 64 clients, ~3 minutes
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
After the runs it prints the event buffer's own cost (proxy minus memproxy, and its group
commits), a breakdown of the added time at 1 client (two HTTP hops as the naive forwarder pays
them, the proxy's own work, the wait for the buffer's commit) and the proxy's own work per
stage (:mod:`proxy_stages`, in-process), then the goals of the proxy issue (#42) as PASS/MISS:
added p50 at 1 client <= 1.0 ms; streaming TTFT added no more than the naive forwarder's at 1
and 16 clients; >= 2.5x the naive forwarder's throughput at 16 clients; nothing lost (every
request recorded, every event delivered once the buffer drained, none dropped or held in
memory only). Nothing here asserts.
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


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--duration", type=float, default=2.0, help="seconds per measured run (each run twice)")
    ap.add_argument("--stream-clients", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--stream-duration", type=float, default=6.0,
                    help="seconds per measured streaming run (each run twice; ~35 streams per target at 1 client)")
    ap.add_argument("--token-ms", type=float, default=5.0,
                    help="streaming: ms between two tokens of the stand-in engine (5 = 200 tokens/s per stream)")
    ap.add_argument("--buffer", choices=["disk", "fsync", "memory"], default="disk",
                    help="the proxy's event buffer: disk (default, durable against a crash), fsync (also against "
                         "power loss) or memory (nothing durable; the cost of the buffer is disk minus memory)")
    ap.add_argument("--naive-stack", choices=["same", "h11"], default="same",
                    help="naive forwarder on the proxy's uvicorn stack (uvloop+httptools) or on h11/asyncio")
    ap.add_argument("--no-stages", action="store_true", help="skip the in-process per-stage breakdown")
    return ap.parse_args(argv)


def _start(args, broker, procs: list) -> dict[str, str]:
    """Start upstream, naive, proxy (and memproxy) as child processes; their base URLs by name."""
    import tempfile

    py = sys.executable
    up_port, naive_port, proxy_port = free_port(), free_port(), free_port()
    up = f"http://127.0.0.1:{up_port}"
    procs.append(subprocess.Popen([py, __file__, "_upstream", str(up_port), str(args.token_ms)]))
    procs.append(subprocess.Popen([py, __file__, "_naive", str(naive_port), up, args.naive_stack]))
    env = dict(os.environ, PIPELINE_LOG_LEVEL="WARNING")
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
    return targets


def _run_all(args, targets: dict) -> dict:
    """Every (stream, clients) run against every target, in the interleaved order."""
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
    return results


def _print_tables(args, results: dict) -> None:
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
        for n in [t for t in ("direct", "naive", "memproxy", "proxy") if t in res]:
            r = res[n]
            add = "" if n == "direct" else f"{r['ttft50'] - d['ttft50']:7.2f}"
            print(f"{c:>7} {n:>7} {r['ttft50']:9.2f} {r['ttft99']:9.2f} {add:>7} {r['rps']:7.0f}")


def _settled_metrics(url: str, timeout_s: float = 30.0) -> str:
    """The proxy's /metrics once nothing is buffered any more (or after ``timeout_s``)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(url + "/metrics").text
        if _metric(text, "pipeline_proxy_events_buffered") == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def _print_buffer(args, results: dict, metrics: str) -> None:
    """The disk buffer's own cost (proxy minus memproxy, same run) and its group commits."""
    commits = _metric(metrics, "pipeline_proxy_buffer_commit_seconds_count")
    commit_s = _metric(metrics, "pipeline_proxy_buffer_commit_seconds_sum")
    produced = _metric(metrics, "pipeline_events_produced_total")
    print(f"\nthe {args.buffer} event buffer's own cost (proxy minus memproxy, same run):")
    for c in args.clients:
        r = results[(False, c)]
        if "memproxy" in r:
            print(f"  {c:>3} clients: p50 {r['proxy']['p50'] - r['memproxy']['p50']:+.2f} ms, p99 "
                  f"{r['proxy']['p99'] - r['memproxy']['p99']:+.2f} ms, throughput proxy/memproxy "
                  f"{r['proxy']['rps'] / r['memproxy']['rps']:.2f}")
    if commits:
        print(f"  group commits: {commits:.0f} for {produced:.0f} events ({produced / commits:.1f} per commit), "
              f"{1000 * commit_s / commits:.3f} ms each on average")


def _print_breakdown(args, results: dict) -> None:
    """Where the added p50 at 1 client goes (from the HTTP runs), then the proxy's own stages."""
    if (False, 1) in results and "memproxy" in results[(False, 1)]:
        r = results[(False, 1)]
        d, naive, mem, prox = (r[k]["p50"] for k in ("direct", "naive", "memproxy", "proxy"))
        print("\nper-stage breakdown of the added p50 at 1 client (ms; from the runs above):")
        for label, v in (("two HTTP hops through a Python forwarder (naive minus direct)", naive - d),
                         ("the proxy's own work (memproxy minus naive)", mem - naive),
                         ("the wait for the disk buffer's group commit (proxy minus memproxy)", prox - mem),
                         ("= added by the proxy (proxy minus direct)", prox - d)):
            print(f"  {label:<68} {v:+6.2f}")
    if not args.no_stages:
        import proxy_stages

        proxy_stages.print_table(proxy_stages.measure())


def _checks(results: dict, metrics: str) -> list[tuple[str, bool, str]]:
    """The goals of the proxy issue as ``(name, passed, value)``."""
    checks = []
    if (False, 1) in results:
        r = results[(False, 1)]
        v = r["proxy"]["p50"] - r["direct"]["p50"]
        checks.append(("added p50 at 1 client <= 1.0 ms", v <= 1.0, f"{v:.2f} ms"))
    for c in (1, 16):
        if (True, c) in results:
            r = results[(True, c)]
            p, n = (r[k]["ttft50"] - r["direct"]["ttft50"] for k in ("proxy", "naive"))
            checks.append((f"streaming TTFT p50 added at {c} client{'s' if c > 1 else ''} <= naive's", p <= n,
                           f"proxy {p:+.2f} ms, naive {n:+.2f} ms"))
    if (False, 16) in results:
        r = results[(False, 16)]
        v = r["proxy"]["rps"] / r["naive"]["rps"]
        checks.append(("throughput at 16 clients >= 2.5x naive", v >= 2.5, f"{v:.2f}x"))
    served = _metric(metrics, "pipeline_proxy_requests_total")
    turns = _metric(metrics, "pipeline_proxy_turns_total")
    delivered = _metric(metrics, "pipeline_proxy_events_delivered_total")
    lost = {k: _metric(metrics, f"pipeline_proxy_{k}") for k in
            ("events_buffered", "events_dropped_total", "events_not_durable_total")}
    checks.append(("nothing lost: every request a turn, every event delivered, none dropped or not durable",
                   turns == served and not any(lost.values()),
                   f"{served:.0f} requests, {turns:.0f} turns, {delivered:.0f} events delivered, "
                   + ", ".join(f"{v:.0f} {k.replace('_total', '').replace('events_', '')}" for k, v in lost.items())))
    return checks


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    from pipeline.broker import EmbeddedBroker
    from pipeline.bus.admin import apply_topics
    from pipeline.config import load_config
    from pipeline.topics import load_topics

    procs: list[subprocess.Popen] = []
    broker = EmbeddedBroker().start()
    try:
        config = load_config(None, kafka={"bootstrap_servers": broker.bootstrap}, topics={"prefix": "bench-"})
        apply_topics(config, load_topics(config.topics.file))
        targets = _start(args, broker, procs)
        print(f"broker {broker.bootstrap}; upstream {targets['direct']}; naive on "
              f"{'uvloop+httptools' if args.naive_stack == 'same' else 'h11+asyncio'}; proxy with event publishing "
              f"on, {args.buffer} event buffer; {os.cpu_count()} cores; {args.duration:g} s per run, each run twice;"
              f" streams: 69 chunks, {args.token_ms:g} ms apart\n")
        results = _run_all(args, targets)
        _print_tables(args, results)
        metrics = _settled_metrics(targets["proxy"])
        if "memproxy" in targets:
            _print_buffer(args, results, metrics)
        _print_breakdown(args, results)
        print("\ngoals (proxy issue #42):")
        for name, ok, value in _checks(results, metrics):
            print(f"  {'PASS' if ok else 'MISS'}  {name}: {value}")
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
