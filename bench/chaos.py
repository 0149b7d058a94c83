"""Chaos benchmark: ``kill -9`` every kind of stage of the scaled-out stack under traffic, then count.

    .venv/bin/python bench/chaos.py                          # ~5 min: 2 kills of each target
    .venv/bin/python bench/chaos.py --duration 120 --kills 1 --seed 3 --json reports/chaos.json

What runs: ``pipeline up``'s stack in process (:func:`pipeline.orchestrate.up.start_stack`) with
``proxy=2, judge=2, engine=2``: the durable broker, two tiny-random engines behind the engine
front (each with its syncer), two proxies behind the round-robin front, two judges in one group
(Binary RL, the instant ``constant`` backend: the join, not the scoring, is under test), the
Megatron-core trainer (tiny-random, ``steps_per_batch`` optimizer steps per trainer step); the
supervisor restarts what dies. ``--clients`` simulated users hold multi-turn conversations
through the front (2-5 turns, the last one with ``X-Session-Done``); a failed request is
retried like a user would (same messages, after a pause).

Kills (seeded times, spread over ``--duration``): each of ``proxy``, ``judge``, ``trainer``,
``syncer``, ``engine``, ``broker`` ``--kills`` times (a random replica of the scaled stages). One
trainer kill in two waits for the trainer to be in the middle of a step and records the
observable state that proves it: the optimizer-step counter of its ``/metrics`` between two
multiples of ``steps_per_batch`` (half-trained, when the trainer exposes that counter), or the
step's weight sync in progress (``weights v`` on ``control`` with no ``resume v`` yet and no
log record of step v). Each kill waits until its target is up again (the supervisor restarted
it) before the next kill of the same stage.

Counted afterwards, from the topics (``turns``, ``samples``, ``control``), the trainer's metrics
log (sample ids of every committed step) and the clients' own records:

- requests answered 200 whose ``X-Request-Id`` has no ``turn`` event (loss);
- turn records seen twice (same request id: at-least-once delivery), and those duplicates that
  survive into samples (a second sample id for the same turn) or into training (loss columns:
  must be 0);
- turns with a next state that were never judged, and turns with no sample at all;
- samples trained twice; trainable samples the trainer consumed but never trained (apart from
  those dropped as stale by ``trainer.max_staleness``, counted on their own);
- policy versions going backwards (``weights`` on ``control``, the trainer's steps);
- user requests that failed, and what was down at that moment (the proxy the request went to,
  by ``X-Upstream``, or something else);
- per engine, after every restart of an engine, its syncer or the trainer: the seconds until the
  engine serves the trainer's latest published version (the syncer's check interval is the
  bound).

It prints one table and writes the numbers as JSON (``--json``). Nothing asserts; the
exit status is 1 when a loss or double-count column is not 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGETS = ("proxy", "judge", "trainer", "syncer", "engine", "broker")
STEPS_PER_BATCH = 4


@dataclass
class Timeline:
    """What happened when (monotonic seconds since the bench started)."""

    t0: float = field(default_factory=time.monotonic)
    kills: list = field(default_factory=list)  # {t, stage, pid, proof}
    restarts: list = field(default_factory=list)  # {t, stage, pid}
    crashes: list = field(default_factory=list)  # {t, stage, exit}: exits that were not our kills
    ready: list = field(default_factory=list)  # {t, stage}
    down: dict = field(default_factory=dict)  # stage -> [(t_down, t_up or None)]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def mark_down(self, stage: str, t: float) -> None:
        with self.lock:
            self.down.setdefault(stage, []).append([t, None])

    def mark_up(self, stage: str, t: float) -> None:
        with self.lock:
            spans = self.down.get(stage)
            if spans and spans[-1][1] is None:
                spans[-1][1] = t
                self.ready.append({"t": round(t, 2), "stage": stage})

    def down_at(self, t: float, margin_s: float = 0.0) -> list[str]:
        """Stages down at ``t`` (a span is extended by ``margin_s`` after it came back)."""
        out = []
        with self.lock:
            for stage, spans in self.down.items():
                for a, b in spans:
                    if a - 0.05 <= t <= (b if b is not None else float("inf")) + margin_s:
                        out.append(stage)
                        break
        return sorted(out)


# ---------------------------------------------------------------------------------------- stack

def make_config(run_dir: Path, args):
    from pipeline.config import load_config

    return load_config(None, engine={"model": "tiny-random", "threads": 1, "max_batch_size": 8},
                       trainer={"model": "tiny-random", "rollout_batch_size": 32, "micro_batch_size": 8,
                                "steps_per_batch": STEPS_PER_BATCH, "lr": 1e-3, "threads": 1,
                                "checkpoint_dir": str(run_dir / "checkpoints"), "export_dir": str(run_dir / "weights"),
                                "metrics_file": str(run_dir / "trainer_metrics.jsonl"), "progress": False,
                                "poll_timeout_s": 0.2, "sync_timeout_s": 60.0},
                       judge={"mode": "rl", "backend": "constant", "idle_timeout_s": 20.0,
                              "reorder_lateness_s": 60.0},
                       syncer={"retries": 2, "retry_backoff_s": 1.0},
                       log_level="INFO")


def supervise(stack, tl: Timeline, stop: threading.Event, fatal: list) -> None:
    """Run the supervisor's checks; record exits, restarts and readiness on the timeline."""
    sup = stack.supervisor
    was_up = {s.name: True for s in sup.stages}
    while not stop.wait(0.1):
        try:
            lines = sup.check()
        except Exception as e:  # noqa: BLE001 - StageFailed: the stack gave up
            fatal.append(str(e))
            return
        t = tl.now()
        for line in lines:
            name = line.split()[1]
            if " restarted (pid " in line:
                tl.restarts.append({"t": round(t, 2), "stage": name, "pid": sup.get(name).pid})
            elif " exited with " in line:
                code = line.split(" exited with ")[1].split()[0]
                if not any(k["stage"] == name and t - k["t"] < 5 for k in tl.kills):  # not ours: a crash
                    tl.crashes.append({"t": round(t, 2), "stage": name, "exit": code})
                    tl.mark_down(name, t)
        for s in sup.stages:
            up = s.alive and s.is_ready
            if up and not was_up.get(s.name):
                tl.mark_up(s.name, t)
            was_up[s.name] = up


# ---------------------------------------------------------------------------------------- traffic

@dataclass
class Attempt:
    session: str
    turn: int
    t_start: float
    t_end: float
    status: int  # 0: no HTTP answer (connection failed / broken)
    request_id: str | None
    upstream: str | None
    turn_index: int | None
    policy_version: str | None
    error: str = ""


async def user(i: int, url: str, rng: random.Random, stop: asyncio.Event, tl: Timeline, out: list, max_tokens: int):
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0)) as http:
        n = 0
        while not stop.is_set():
            sid = f"chaos-{i}-{n}"
            n += 1
            turns = rng.randint(2, 5)
            msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"question {sid}"}]
            for k in range(turns):
                last = k == turns - 1
                headers = {"X-Session-Id": sid}
                if last:
                    headers["X-Session-Done"] = "true"
                body = {"model": "default", "messages": msgs, "max_tokens": max_tokens, "temperature": 1.0}
                reply = None
                for attempt in range(8):  # a user retries a failed request
                    t_start = tl.now()
                    try:
                        r = await http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
                        a = Attempt(sid, k, t_start, tl.now(), r.status_code, r.headers.get("x-request-id"),
                                    r.headers.get("x-upstream"),
                                    int(r.headers["x-turn-index"]) if r.headers.get("x-turn-index") else None,
                                    None, "" if r.status_code == 200 else r.text[:200])
                        if r.status_code == 200:
                            data = r.json()
                            a.policy_version = str((data.get("metadata") or {}).get("weight_version"))
                            reply = data["choices"][0]["message"].get("content") or ""
                    except httpx.HTTPError as e:
                        a = Attempt(sid, k, t_start, tl.now(), 0, None, None, None, None, f"{type(e).__name__}: {e}")
                    out.append(a)
                    if reply is not None:
                        break
                    await asyncio.sleep(0.5 * (attempt + 1))
                if reply is None:
                    break  # gave up on this session
                msgs = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": f"more {k}"}]
                await asyncio.sleep(rng.uniform(0.0, 0.3))  # think time


def run_traffic(url: str, clients: int, seed: int, stop: threading.Event, tl: Timeline, out: list,
                max_tokens: int) -> None:
    async def main():
        astop = asyncio.Event()

        async def watch():
            while not stop.is_set():
                await asyncio.sleep(0.1)
            astop.set()

        w = asyncio.create_task(watch())
        await asyncio.gather(*[user(i, url, random.Random(seed * 1000 + i), astop, tl, out, max_tokens)
                               for i in range(clients)])
        w.cancel()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------- observers

class ControlWatch(threading.Thread):
    """Follows ``control``: the newest published ``weights`` version, when, and the whole sequence."""

    def __init__(self, config, tl: Timeline) -> None:
        super().__init__(daemon=True, name="control-watch")
        self.config, self.tl = config, tl
        self.published: list[tuple[float, int]] = []  # (t, version) of each weights event, in log order
        self.resumed: set[int] = set()
        self.seen = 0  # the next control offset to read (kept across reconnects: nothing counted twice)
        self.stop = threading.Event()

    def latest(self, t: float | None = None) -> int:
        vs = [v for (tt, v) in self.published if t is None or tt <= t]
        return max(vs, default=0)

    def run(self) -> None:
        from pipeline.bus import Offset, Record, TopicReader

        while not self.stop.is_set():
            try:
                with TopicReader(self.config, self.config.topics.name("control"), start=Offset(self.seen),
                                 partitions=[0], name="chaos-control-watch", accept=None) as reader:
                    while not self.stop.is_set():
                        for r in reader.poll(timeout_ms=200):
                            if isinstance(r, Record):  # an undecodable record is passed over
                                self.seen = r.offset + 1
                                self._apply(r.event)
            except Exception:  # noqa: BLE001 - the broker is being killed: reconnect where it was
                time.sleep(0.5)

    def _apply(self, ev) -> None:
        if ev.action == "weights":
            self.published.append((self.tl.now(), ev.policy_version))
        elif ev.action == "resume":
            self.resumed.add(ev.policy_version)


class EngineWatch(threading.Thread):
    """Polls each engine's served weight version (``/model_info``) every 0.2 s."""

    def __init__(self, engine_urls: dict[str, str], tl: Timeline) -> None:
        super().__init__(daemon=True, name="engine-watch")
        self.urls, self.tl = engine_urls, tl
        self.samples: dict[str, list[tuple[float, int | None]]] = {n: [] for n in engine_urls}
        self.stop = threading.Event()

    def run(self) -> None:
        import httpx

        while not self.stop.wait(0.2):
            for name, url in self.urls.items():
                try:
                    v = int(httpx.get(f"{url}/model_info", timeout=1.0).json()["weight_version"])
                except Exception:  # noqa: BLE001 - down or restarting
                    v = None
                self.samples[name].append((self.tl.now(), v))


def scrape(url: str) -> dict:
    from pipeline.orchestrate.up import scrape as _s

    return _s(url)


# ---------------------------------------------------------------------------------------- kills

def wait_up(sup, name: str, timeout_s: float = 180.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = sup.get(name)
        if st.alive and st.is_ready:
            return True
        time.sleep(0.1)
    return False


def trainer_mid_step(stack, control: ControlWatch, metrics_file: Path, timeout_s: float) -> dict | None:
    """Wait for an observable mid-step state of the trainer; returns the observation."""
    url = stack.metrics["trainer"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = scrape(url)
        n = m.get("pipeline_trainer_optimizer_steps_total")
        if n is not None and int(n) % STEPS_PER_BATCH:
            return {"phase": "training", "optimizer_steps": int(n), "steps_per_batch": STEPS_PER_BATCH,
                    "logged_steps": _logged_steps(metrics_file)}
        v = control.latest()
        if v and v not in control.resumed:
            logged = _logged_versions(metrics_file)
            if v not in logged:
                return {"phase": "syncing", "weights_published": v, "resume_seen": False,
                        "step_logged": False, "logged_steps": _logged_steps(metrics_file)}
        time.sleep(0.005)
    return None


def _records(path: Path) -> list[dict]:
    from pipeline.jsonl import read_jsonl

    return read_jsonl(path, strict=False, missing_ok=True)  # a line being written is skipped


def _logged_steps(path: Path) -> int:
    return len(_records(path))


def _logged_versions(path: Path) -> set[int]:
    return {int(r.get("policy_version", -1)) for r in _records(path)}


def chaos(stack, args, tl: Timeline, control: ControlWatch, stop: threading.Event) -> None:
    sup = stack.supervisor
    rng = random.Random(args.seed)
    plan = [t for t in args.targets for _ in range(args.kills)]
    rng.shuffle(plan)
    warmup = min(20.0, args.duration * 0.15)
    slot = (args.duration - warmup) / max(1, len(plan))
    trainer_kills = 0
    for i, target in enumerate(plan):
        at = warmup + i * slot + rng.uniform(0, slot * 0.5)
        while tl.now() < at and not stop.is_set():
            time.sleep(0.1)
        if stop.is_set():
            return
        names = [s.name for s in sup.stages if s.name == target or
                 (s.name.startswith(target + "-") and s.name[len(target) + 1:].isdigit())]
        name = rng.choice(names)
        if not wait_up(sup, name):
            print(f"chaos: {name} not up, kill skipped", flush=True)
            continue
        proof = None
        if target == "trainer":
            trainer_kills += 1
            if trainer_kills % 2 == 1:  # the first, third ... trainer kill lands mid-step
                proof = trainer_mid_step(stack, control, Path(stack.config.trainer.metrics_file), timeout_s=90.0)
                if proof is None:
                    print("chaos: no mid-step state of the trainer within 90 s; killing anyway", flush=True)
        st = sup.get(name)
        pid = st.pid
        os.kill(pid, signal.SIGKILL)
        t = tl.now()
        tl.mark_down(name, t)
        tl.kills.append({"t": round(t, 2), "stage": name, "pid": pid, "proof": proof})
        if proof is not None:  # the killed step was not finished: no log record of it
            time.sleep(0.2)
            proof["logged_steps_after_kill"] = _logged_steps(Path(stack.config.trainer.metrics_file))
        print(f"chaos: t={t:6.1f}s kill -9 {name} (pid {pid})" + (f" mid-step: {proof}" if proof else ""), flush=True)


# ---------------------------------------------------------------------------------------- counting

def read_all(config, logical: str) -> list:
    """Every record of a topic up to its end: ``(partition, offset, event or None)`` (None: a
    record that does not decode)."""
    from pipeline.bus import Record, TopicReader

    with TopicReader(config, config.topics.name(logical), name="chaos-count", accept=None) as reader:
        return [(r.partition, r.offset, r.event if isinstance(r, Record) else None)
                for r in reader.read(idle_timeout_s=10.0)]


def count(config, attempts: list[Attempt], tl: Timeline, control: ControlWatch, engines: EngineWatch,
          stack, sync_interval_s: float) -> dict:
    from pipeline import events

    turns_recs = read_all(config, "turns")
    sample_recs = read_all(config, "samples")
    turns = [e for _, _, e in turns_recs if isinstance(e, events.Turn) and e.turn_type == "main"]
    nexts = [e for _, _, e in turns_recs if isinstance(e, events.NextState)]
    by_rid = Counter(t.request_id for t in turns)
    unique_turns = {t.request_id: t for t in turns}
    ok = [a for a in attempts if a.status == 200]
    answered_no_turn = [a.request_id for a in ok if a.request_id not in by_rid]
    raw_dup_turns = sum(n - 1 for n in by_rid.values() if n > 1)
    reused_index = Counter((t.session_id, t.turn_index) for t in unique_turns.values())
    index_reused = sum(n - 1 for n in reused_index.values() if n > 1)
    # samples: first occurrence per sample_id; duplicates that survive = two sample ids for one turn
    samples = [(p, o, e) for p, o, e in sample_recs if isinstance(e, events.Sample)]
    first: dict[str, tuple] = {}
    raw_dup_samples = 0
    for p, o, s in samples:
        if s.sample_id in first:
            raw_dup_samples += 1
        else:
            first[s.sample_id] = (p, o, s)
    # each answered turn (request id) gives at most one sample: more samples than turns in a
    # session means a duplicate turn record survived the de-duplication by ids
    samples_per_session = Counter(s.session_id for (_, _, s) in first.values())
    turns_per_session = Counter(t.session_id for t in unique_turns.values())
    dup_into_samples = sum(max(0, n - turns_per_session[sid_]) for sid_, n in samples_per_session.items())
    has_ns = {(n.session_id, n.after_turn_index) for n in nexts if n.messages and n.after_turn_index is not None}
    # records that reached the topic before a record they follow (several proxies, restarts)
    seen_idx: dict[str, set] = defaultdict(set)
    out_of_order = 0
    for _, _, e in sorted(turns_recs, key=lambda x: (x[0], x[1])):
        if isinstance(e, events.Turn) and e.turn_type == "main":
            if any(i > e.turn_index for i in seen_idx[e.session_id]):
                out_of_order += 1
            seen_idx[e.session_id].add(e.turn_index)
        elif isinstance(e, events.NextState) and e.after_turn_index is not None:
            if e.after_turn_index not in seen_idx[e.session_id]:
                out_of_order += 1
    judged = {(s.session_id, s.turn_index) for (_, _, s) in first.values() if s.votes}
    decided = {(s.session_id, s.turn_index) for (_, _, s) in first.values()}
    turn_keys = {(t.session_id, t.turn_index) for t in unique_turns.values()}
    never_judged = sorted(k for k in turn_keys if k in has_ns and k not in judged)
    no_sample = sorted(k for k in turn_keys if k not in decided)
    # training: the committed steps' sample ids (the trainer reconciles its log with its checkpoint)
    steps = _records(Path(config.trainer.metrics_file))
    trained = Counter(i for r in steps for i in r.get("sample_ids", []))
    trained_twice = sum(n - 1 for n in trained.values() if n > 1)
    consumed_to = {}
    version_at: list[tuple[dict, int]] = []  # (offsets after step, trainer version while consuming it)
    prev_version = 0
    for r in steps:
        offs = {int(p): int(o) for p, o in (r.get("offsets") or {}).items()}
        version_at.append((offs, prev_version))
        prev_version = int(r.get("policy_version", prev_version))
        consumed_to = offs or consumed_to
    max_stale = config.trainer.max_staleness
    never_trained, stale_dropped, pending = [], [], 0
    for sid_, (p, o, s) in first.items():
        trainable = s.loss_mask == 1 and s.response_length > 0
        if not trainable or sid_ in trained:
            continue
        if o >= consumed_to.get(p, 0):
            pending += 1
            continue
        v = next((ver for offs, ver in version_at if o < offs.get(p, 0)), prev_version)
        if max_stale is not None and v - s.policy_version > max_stale:
            stale_dropped.append(sid_)
        else:
            never_trained.append(sid_)
    # policy versions
    pub = [v for _, v in control.published]
    backwards_published = sum(1 for a, b in zip(pub, pub[1:]) if b < a)
    tv = [int(r.get("policy_version", 0)) for r in steps]
    backwards_trainer = sum(1 for a, b in zip(tv, tv[1:]) if b < a)
    first_pub = min((t for t, v in control.published if v >= 1), default=None)
    base_after_v1 = sum(1 for a in ok if first_pub is not None and a.t_start > first_pub + 1.0
                        and a.policy_version == "0")
    # user failures and what was down
    proxy_of = {u: n for n, u in stack.proxy_urls.items()}
    failed = [a for a in attempts if a.status != 200]
    fail_rows = []
    for a in failed:
        down = tl.down_at(a.t_end, margin_s=1.0)
        proxy = proxy_of.get(a.upstream or "")
        fail_rows.append({"t": round(a.t_end, 2), "status": a.status, "proxy": proxy, "down": down,
                          "own_proxy_down": bool(proxy and proxy in down), "error": a.error[:120]})
    unexplained = [f for f in fail_rows if not f["own_proxy_down"]]
    # engines: after each restart of an engine, a syncer or the trainer, time until each engine
    # serves the latest published version
    lags = []
    for r in tl.ready:
        if not any(r["stage"].startswith(x) for x in ("engine-", "syncer-", "trainer")) or r["stage"] == "engine-front":
            continue
        for name, series in engines.samples.items():
            if r["stage"].startswith("engine-") and r["stage"] != name:
                continue
            if r["stage"].startswith("syncer-") and r["stage"][len("syncer-"):] != name[len("engine-"):]:
                continue
            t0 = r["t"]
            hit = next((t for t, v in series if t >= t0 and v is not None and v >= control.latest(t)), None)
            lags.append({"restart_of": r["stage"], "engine": name, "t": t0,
                         "seconds": None if hit is None else round(hit - t0, 2)})
    worst_lag = max((x["seconds"] for x in lags if x["seconds"] is not None), default=None)
    never_in_sync = sum(1 for x in lags if x["seconds"] is None)
    trainer_kills = [k for k in tl.kills if k["stage"] == "trainer"]
    mid_step = [k for k in trainer_kills if k["proof"] and
                k["proof"].get("logged_steps_after_kill") == k["proof"].get("logged_steps")]
    # a step killed in its sync was synced again by the restarted trainer
    resynced = all(k["proof"]["weights_published"] in control.resumed for k in mid_step
                   if k["proof"]["phase"] == "syncing")
    return {
        "requests": len(attempts), "answered_200": len(ok), "sessions": len({a.session for a in attempts}),
        "turn_events": len(unique_turns), "next_states": len(nexts), "samples_unique": len(first),
        "trainer_steps": len(steps), "published_versions": pub[-1] if pub else 0,
        "records_out_of_protocol_order": out_of_order,
        "answered_200_without_turn": len(answered_no_turn),
        "turn_records_seen_twice": raw_dup_turns,
        "turn_index_reused_after_failure": index_reused,
        "duplicate_turns_into_samples": dup_into_samples,
        "sample_records_seen_twice": raw_dup_samples,
        "turns_never_judged": len(never_judged), "turns_without_sample": len(no_sample),
        "samples_trained_twice": trained_twice, "samples_never_trained": len(never_trained),
        "samples_dropped_stale": len(stale_dropped), "samples_not_consumed_yet": pending,
        "versions_backwards_published": backwards_published, "versions_backwards_trainer": backwards_trainer,
        "requests_on_base_model_after_v1": base_after_v1,
        "user_failures": len(failed), "user_failures_own_proxy_down": len(failed) - len(unexplained),
        "user_failures_other": len(unexplained),
        "engine_latest_version_lag_s_max": worst_lag, "engine_never_in_sync": never_in_sync,
        "sync_interval_s": sync_interval_s,
        "trainer_kills": len(trainer_kills), "trainer_kills_mid_step": len(mid_step),
        "mid_step_phases": [k["proof"]["phase"] for k in mid_step], "killed_syncs_completed": resynced,
        "engine_lags": lags, "failures": fail_rows[:50],
        "never_judged": [list(k) for k in never_judged[:20]], "without_sample": [list(k) for k in no_sample[:20]],
        "answered_without_turn_ids": answered_no_turn[:20], "never_trained_ids": never_trained[:20],
        "kills": tl.kills, "restarts": tl.restarts, "crashes": tl.crashes, "down": {k: v for k, v in tl.down.items()},
    }


LOSS_COLUMNS = ("answered_200_without_turn", "duplicate_turns_into_samples", "turns_never_judged", "engine_never_in_sync",
                "turns_without_sample", "samples_trained_twice", "samples_never_trained",
                "versions_backwards_published", "versions_backwards_trainer", "user_failures_other")


# rows of the table that show one count of the result as it is: (label, key in the result)
COUNT_ROWS = (
    ("records out of protocol order on turns (reordered by the judge)", "records_out_of_protocol_order"),
    ("answered 200 with no turn event", "answered_200_without_turn"),
    ("turn records seen twice (at-least-once, raw)", "turn_records_seen_twice"),
    ("turn index reused by a user's retry", "turn_index_reused_after_failure"),
    ("duplicate turns that reached samples", "duplicate_turns_into_samples"),
    ("sample records seen twice (raw, de-duplicated by id)", "sample_records_seen_twice"),
    ("turns with a next state never judged", "turns_never_judged"),
    ("turns without any sample", "turns_without_sample"),
    ("samples trained twice", "samples_trained_twice"),
    ("samples consumed, never trained", "samples_never_trained"),
    ("samples dropped as stale (max_staleness)", "samples_dropped_stale"),
    ("samples not consumed yet (partial batch)", "samples_not_consumed_yet"),
)


def table(res: dict) -> str:
    rows = [
        ("requests (200 / all)", f"{res['answered_200']} / {res['requests']}"),
        ("sessions / turn events / next states", f"{res['sessions']} / {res['turn_events']} / {res['next_states']}"),
        ("samples (unique) / trainer steps / last version", f"{res['samples_unique']} / {res['trainer_steps']} / "
                                                            f"v{res['published_versions']}"),
        ("kills (restarts by the supervisor)", f"{len(res['kills'])} ({len(res['restarts'])})"),
        ("kills by stage", ", ".join(f"{k} {v}" for k, v in sorted(Counter(
            x["stage"].split("-")[0] for x in res["kills"]).items()))),
        ("stages that exited on their own (restarted)", ", ".join(
            f"{c['stage']} ({c['exit']})" for c in res["crashes"]) or "none"),
        ("trainer kills / proven mid-step (phase)", f"{res['trainer_kills']} / {res['trainer_kills_mid_step']} "
                                                    f"({', '.join(res['mid_step_phases']) or '-'})"),
        *((label, res[key]) for label, key in COUNT_ROWS),
        ("policy versions going backwards (published / trainer)",
         f"{res['versions_backwards_published']} / {res['versions_backwards_trainer']}"),
        ("requests served by v0 after v1 was published", res["requests_on_base_model_after_v1"]),
        ("user failures (all / own proxy down / other)",
         f"{res['user_failures']} / {res['user_failures_own_proxy_down']} / {res['user_failures_other']}"),
        ("engine: restart -> latest version, worst (s)",
         f"{res['engine_latest_version_lag_s_max']} over {len(res['engine_lags'])} restarts, "
         f"{res['engine_never_in_sync']} never (syncer check interval {res['sync_interval_s']} s)"),
    ]
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=240.0, help="seconds of traffic under kills")
    ap.add_argument("--kills", type=int, default=2, help="kills of each target")
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated subset of {','.join(TARGETS)}")
    ap.add_argument("--clients", type=int, default=4, help="concurrent simulated users")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per reply")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle", type=float, default=90.0, help="max seconds to wait for the pipeline to drain")
    ap.add_argument("--run-dir", default=None, help="stack run directory (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="write the numbers here")
    ap.add_argument("--broker", choices=("auto", "kafka", "tansu"), default="auto",
                    help="the durable broker to kill: Apache Kafka, Tansu, or auto (Kafka when installed)")
    args = ap.parse_args()
    args.targets = [t for t in args.targets.split(",") if t]
    bad = set(args.targets) - set(TARGETS)
    if bad:
        ap.error(f"unknown targets {sorted(bad)}")

    import tempfile

    from pipeline.orchestrate.supervisor import RestartPolicy
    from pipeline.orchestrate.up import start_stack

    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="chaos-"))
    config = make_config(run_dir, args)
    tl = Timeline()
    print(f"chaos: starting the scaled-out stack in {run_dir} ...", flush=True)
    stack = start_stack(config, run_dir, replicas={"proxy": 2, "judge": 2, "engine": 2}, dashboard=False,
                        restart=RestartPolicy(backoff_s=0.5, max_backoff_s=5.0, stable_s=10.0, max_fast_failures=6),
                        broker_kind=args.broker)
    config = stack.config
    print(f"chaos: stack up in {tl.now():.0f} s on {stack.broker_kind}; front {stack.proxy_url}", flush=True)
    tl.t0 = time.monotonic()
    stop_sup, fatal = threading.Event(), []
    sup_thread = threading.Thread(target=supervise, args=(stack, tl, stop_sup, fatal), daemon=True)
    sup_thread.start()
    control = ControlWatch(config, tl)
    control.start()
    engines = EngineWatch(stack.engine_urls, tl)
    engines.start()
    attempts: list[Attempt] = []
    stop_traffic = threading.Event()
    traffic = threading.Thread(target=run_traffic, args=(stack.proxy_url, args.clients, args.seed, stop_traffic, tl,
                                                         attempts, args.max_tokens), daemon=True)
    res = None
    try:
        traffic.start()
        killer = threading.Thread(target=chaos, args=(stack, args, tl, control, stop_traffic), daemon=True)
        killer.start()
        while tl.now() < args.duration and not fatal:
            time.sleep(0.5)
        stop_traffic.set()
        killer.join(timeout=120)
        traffic.join(timeout=180)
        print(f"chaos: traffic stopped at {tl.now():.0f} s ({len(attempts)} requests); waiting for every stage "
              "to be up and the pipeline to drain ...", flush=True)
        for s in stack.supervisor.stages:
            wait_up(stack.supervisor, s.name, timeout_s=120)
        settle(config, args.settle)
        sync_interval = float(getattr(config.syncer, "check_interval_s", 0.0) or 0.0)
        res = count(config, attempts, tl, control, engines, stack, sync_interval)
        res["fatal"] = fatal
        res["args"] = {k: v for k, v in vars(args).items()}
    finally:
        stop_sup.set()
        control.stop.set()
        engines.stop.set()
        stack.stop()
    print()
    print(table(res))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
        print(f"\nwritten: {args.json}")
    bad = [c for c in LOSS_COLUMNS if res.get(c)]
    if fatal:
        print(f"chaos: the supervisor gave up: {fatal[0][:500]}")
    return 1 if bad or fatal else 0


def settle(config, max_s: float) -> None:
    """Wait until samples stop arriving (the judges and trainer caught up), at most ``max_s``.

    Quiet means no new sample for longer than the judge's idle time-out: sessions cut by the end
    of the traffic (no ``X-Session-Done``) get their last turn settled by it.
    """
    from pipeline import events

    quiet_s = config.judge.idle_timeout_s + 5
    deadline = time.monotonic() + max(max_s, quiet_s + 10)
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = sum(1 for _, _, e in read_all(config, "samples") if isinstance(e, events.Sample))
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since > quiet_s:
            return
        time.sleep(3)


if __name__ == "__main__":
    sys.exit(main())
