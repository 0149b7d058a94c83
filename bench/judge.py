"""Judge benchmark: one run prints

(a) turns/s through one judge process's stream path (consume, decode, join, state, build and
    encode the sample, produce with acks=all, delivery callback, ack, commit) with the
    in-process instant scorer (``constant`` backend), from a backlog; and p50/p99 turn-to-sample
    latency (next state published -> sample read back by a consumer) at a paced rate below
    capacity. Targets on this machine: >= 2,000 turns/s, p50 <= 50 ms.
(b) judge HTTP calls/s with m=3 votes (the ``llm`` backend) against an instant judge server
    (``pipeline.testing.servers.StandInJudge(instant=True)`` in a subprocess), as a ratio of what a bare httpx client reaches
    against the same server in the same run with the same concurrency (target >= 0.8); and, since
    the judge's client is aiohttp, also the ratio to a bare aiohttp client (the judge's own overhead).

(c) the CPU default backend (``embedding``: tool-result structure, reply cues, MiniLM heads):
    turns/s scoring the labelled fixture and development set one turn at a time, as a ratio of
    what the bare sentence encoder reaches on the same next-state texts in the same run (one
    MiniLM forward per text: the floor cost of any embedding judge). Target >= 0.5.

Usage: python bench/judge.py [--turns 10000] [--paced-rate 400] [--http-seconds 4] [--parts stream,http,embedding]
Needs no network; starts an embedded broker (Tansu) unless --bootstrap is given.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pipeline

from pipeline.bus import EventProducer, Record, TopicReader  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.judge.samples import sample_id  # noqa: E402
from pipeline.testing.judge import make_next_state, make_turn  # noqa: E402
from pipeline.bus.admin import apply_topics  # noqa: E402
from pipeline.topics import load_topics  # noqa: E402

PROMPT = list(range(1000, 1300))  # 300 prompt tokens
RESPONSE = list(range(2000, 2100))  # 100 response tokens


def turn_events(n_turns: int, turns_per_session: int = 5):
    """(turn, next_state) pairs for n_turns, sessions of turns_per_session, plus session ends."""
    out = []
    for i in range(n_turns):
        sid, k = f"b{i // turns_per_session}", i % turns_per_session
        out.append((make_turn(sid, k, prompt_ids=PROMPT, response_ids=RESPONSE), make_next_state(sid, k, "thanks")))
    return out


class SampleReader(threading.Thread):
    """Reads the samples topic from the start; records (arrival time, sample_id) per sample."""

    def __init__(self, config) -> None:
        super().__init__(daemon=True)
        self.config, self.seen, self.stop_flag = config, {}, threading.Event()
        self.ready = threading.Event()

    def run(self) -> None:
        with TopicReader(self.config, self.config.topics.name("samples"), name="bench-reader", wait_s=60,
                         fetch_max_wait_ms=5) as reader:
            self.ready.set()
            while not self.stop_flag.is_set():
                recs = reader.poll(timeout_ms=20)
                now = time.perf_counter()
                for r in recs:
                    if isinstance(r, Record):
                        self.seen.setdefault(r.event.sample_id, now)


def publish(config, evs, rate: float | None = None, sent_at: dict | None = None) -> None:
    p = EventProducer(config, name="bench-publisher")
    topic = config.topics.name("turns")
    t0 = time.perf_counter()
    for i, (turn, ns) in enumerate(evs):
        if rate:
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        p.send(topic, turn, key=turn.session_id)
        p.send(topic, ns, key=ns.session_id)
        if sent_at is not None:
            sent_at[sample_id(turn, "rl")] = time.perf_counter()
    p.flush(60)
    p.close()


def bench_stream(bootstrap: str, n_turns: int, paced_rate: float, paced_turns: int) -> None:
    prefix = f"bench-{uuid.uuid4().hex[:6]}-"
    config = load_config(None, kafka={"bootstrap_servers": bootstrap}, topics={"prefix": prefix},
                         judge={"backend": "constant", "group_id": f"{prefix}judge", "max_in_flight": 4096})
    apply_topics(config, load_topics(config.topics.file))
    backlog = turn_events(n_turns)
    t = time.perf_counter()
    publish(config, backlog)
    print(f"  published a backlog of {n_turns} turns ({2 * n_turns} events) in {time.perf_counter() - t:.1f} s")
    reader = SampleReader(config)
    reader.start()
    reader.ready.wait()
    judge = subprocess.Popen([sys.executable, "-m", "pipeline", "judge", "--backend", "constant", "--mode", "rl",
                              "--bootstrap", bootstrap, "--group-id", config.judge.group_id, "--log-level", "WARNING",
                              "--set", f"topics.prefix={prefix}", "--set", "judge.max_in_flight=4096"])
    try:
        deadline = time.monotonic() + 300
        while len(reader.seen) < n_turns and time.monotonic() < deadline:
            time.sleep(0.05)
        got = len(reader.seen)
        times = sorted(reader.seen.values())
        # steady state: from the 5th to the 95th percentile sample (excludes group join and tail)
        lo, hi = int(0.05 * got), int(0.95 * got) - 1
        # too few samples to measure a rate: n/a, not 0 turns/s
        rate = f"{(hi - lo) / (times[hi] - times[lo]):,.0f}" if hi > lo and times[hi] > times[lo] else "n/a"
        whole = f"{(got - 1) / (times[-1] - times[0]):,.0f}" if got > 1 and times[-1] > times[0] else "n/a"
        print(f"(a) stream path of one judge process (constant scorer), from a backlog: {got}/{n_turns} samples; "
              f"{rate} turns/s steady ({whole} turns/s first to last sample)  [target >= 2,000]")
        paced = [(make_turn(f"p{i // 5}", i % 5, prompt_ids=PROMPT, response_ids=RESPONSE),
                  make_next_state(f"p{i // 5}", i % 5, "thanks")) for i in range(paced_turns)]
        sent_at: dict = {}
        publish(config, paced, rate=paced_rate, sent_at=sent_at)
        deadline = time.monotonic() + 60
        while any(k not in reader.seen for k in sent_at) and time.monotonic() < deadline:
            time.sleep(0.05)
        lat = sorted((reader.seen[k] - t0) * 1000 for k, t0 in sent_at.items() if k in reader.seen)
        n = len(lat)
        p50, p99 = statistics.median(lat), lat[min(n - 1, int(0.99 * n))]
        print(f"    paced at {paced_rate:.0f} turns/s: {n}/{paced_turns} samples; turn-to-sample latency "
              f"(next state sent -> sample read) p50 {p50:.1f} ms, p99 {p99:.1f} ms  [target p50 <= 50 ms]")
    finally:
        judge.terminate()
        judge.wait(30)
        reader.stop_flag.set()
        reader.join(5)


async def _bare(url: str, body: bytes, seconds: float, concurrency: int) -> int:
    import httpx

    n = 0
    async with httpx.AsyncClient(base_url=url, headers={"content-type": "application/json"},
                                 limits=httpx.Limits(max_connections=concurrency,
                                                     max_keepalive_connections=concurrency)) as client:
        stop = time.perf_counter() + seconds

        async def worker():
            nonlocal n
            while time.perf_counter() < stop:
                r = await client.post("/v1/chat/completions", content=body)
                r.raise_for_status()
                n += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n


async def _bare_aiohttp(url: str, body: bytes, seconds: float, concurrency: int) -> int:
    import aiohttp

    n = 0
    async with aiohttp.ClientSession(headers={"content-type": "application/json"},
                                     connector=aiohttp.TCPConnector(limit=concurrency)) as client:
        stop = time.perf_counter() + seconds

        async def worker():
            nonlocal n
            while time.perf_counter() < stop:
                async with client.post(url + "/v1/chat/completions", data=body) as r:
                    r.raise_for_status()
                    await r.read()
                n += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n


async def _judge(url: str, seconds: float, concurrency: int, votes: int) -> int:
    from pipeline.judge.backends.llm import LLMBackend
    from pipeline.judge.prompts import JudgeInput

    config = load_config(None, judge={"url": url, "votes": votes, "max_in_flight": concurrency})
    backend = LLMBackend(config)
    await backend.start()
    inp = JudgeInput("How far is Paris from Berlin?", "About 880 km by road.",
                     [{"role": "user", "content": "Thanks, that's what I needed."}])
    n = 0
    stop = time.perf_counter() + seconds

    async def worker():
        nonlocal n
        while time.perf_counter() < stop:
            v = await backend.score(inp)
            assert v.score == 1, v
            n += votes

    try:
        await asyncio.gather(*(worker() for _ in range(max(1, concurrency // votes))))
    finally:
        await backend.aclose()
    return n


def bench_http(seconds: float, concurrency: int, votes: int = 3, rounds: int = 2) -> None:
    import orjson

    from pipeline.judge.prompts import JudgeInput, prm_messages

    root = Path(__file__).resolve().parents[1]
    srv = subprocess.Popen([sys.executable, "-m", "pipeline.testing.servers", "instant-judge"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, cwd=root)
    try:
        port = int(srv.stdout.readline().split()[1])
        url = f"http://127.0.0.1:{port}"
        inp = JudgeInput("How far is Paris from Berlin?", "About 880 km by road.",
                         [{"role": "user", "content": "Thanks, that's what I needed."}])
        body = orjson.dumps({"model": "default", "messages": prm_messages(inp), "temperature": 0.6,
                             "max_tokens": 512, "stream": False})
        asyncio.run(_bare(url, body, 0.5, concurrency))  # warm-up
        bare, aio, judge = [], [], []
        for _ in range(rounds):  # interleaved, best of each
            bare.append(asyncio.run(_bare(url, body, seconds, concurrency)) / seconds)
            aio.append(asyncio.run(_bare_aiohttp(url, body, seconds, concurrency)) / seconds)
            judge.append(asyncio.run(_judge(url, seconds, concurrency, votes)) / seconds)
        b, a, j = max(bare), max(aio), max(judge)
        print(f"(b) judge HTTP calls/s with m={votes} votes: {j:,.0f}; bare httpx client: {b:,.0f}; "
              f"ratio {j / b:.2f}  [target >= 0.8]  (concurrency {concurrency})")
        print(f"    the judge's client is aiohttp (httpx degrades with concurrency, encode/httpx#3215); "
              f"bare aiohttp client: {a:,.0f} calls/s; judge / bare aiohttp = {j / a:.2f}")
    finally:
        srv.stdin.close()
        srv.wait(10)


def bench_embedding(rounds: int = 2) -> None:
    from pipeline.judge.backends.embedding import EmbeddingBackend
    from pipeline.judge.evaluate import load_rows, row_input
    from pipeline.engine_api.render import content_text

    root = Path(__file__).resolve().parent.parent
    rows = [r for f in (root / "tests" / "fixtures" / "judge_next_states.jsonl",
                        root / "pipeline" / "judge" / "data" / "tuning_next_states.jsonl") if f.is_file()
            for r in load_rows(f)]
    config = load_config(None)
    t0 = time.perf_counter()
    backend = EmbeddingBackend(config)
    load_s = time.perf_counter() - t0
    texts = ["\n".join(content_text(m.get("content")) for m in r["next_state"]) for r in rows]
    encoder = backend.clf.embedder
    inputs = [row_input(r) for r in rows]

    async def judge_all():
        await backend.start()
        for inp in inputs:
            await backend.score(inp)

    encoder.encode(texts[:8])  # warm-up
    bare, judge = [], []
    for _ in range(rounds):  # interleaved, best of each
        t = time.perf_counter()
        for text in texts:
            encoder.encode([text])
        bare.append(len(texts) / (time.perf_counter() - t))
        t = time.perf_counter()
        asyncio.run(judge_all())
        judge.append(len(inputs) / (time.perf_counter() - t))
    b, j = max(bare), max(judge)
    print(f"(c) embedding judge: {j:,.1f} turns/s over {len(inputs)} labelled turns, one at a time "
          f"(torch threads {config.judge.embedding_threads}); bare MiniLM encode of the same texts: {b:,.1f} "
          f"texts/s; ratio {j / b:.2f}  [target >= 0.5]; start-up {load_s:.1f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=10_000, help="backlog size for (a)")
    ap.add_argument("--paced-rate", type=float, default=400.0, help="turns/s for the latency phase")
    ap.add_argument("--paced-turns", type=int, default=2_000)
    ap.add_argument("--http-seconds", type=float, default=4.0)
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--bootstrap", help="use this broker instead of an embedded Tansu")
    ap.add_argument("--parts", default="stream,http,embedding",
                    help="comma-separated: stream (a), http (b), embedding (c)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    logging.basicConfig(level=logging.WARNING)
    print(f"judge benchmark on {os.cpu_count()} CPUs")
    if "stream" in parts:
        if args.bootstrap:
            bench_stream(args.bootstrap, args.turns, args.paced_rate, args.paced_turns)
        else:
            from pipeline.broker import EmbeddedBroker

            with EmbeddedBroker() as broker:
                bench_stream(broker.bootstrap, args.turns, args.paced_rate, args.paced_turns)
    if "http" in parts:
        bench_http(args.http_seconds, args.concurrency)
    if "embedding" in parts:
        bench_embedding()
    return 0


if __name__ == "__main__":
    sys.exit(main())
