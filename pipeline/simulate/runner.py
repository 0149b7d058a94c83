"""Run many simulated sessions concurrently against a proxy and summarise them.

Sessions run as asyncio tasks bounded by a semaphore (``concurrency``): each session is
sequential, different sessions overlap, so the engine can batch their decoding. Every reply is
appended to a JSONL log as soon as it arrives (one :class:`pipeline.simulate.users.TurnRecord`
per line), so a report can aggregate by policy version even if the run is interrupted.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any, Iterable, Iterator

import orjson

from pipeline.simulate.client import ChatClient
from pipeline.simulate.datasets import load_gsm8k, load_mt_bench, pick
from pipeline.simulate.users import SessionResult, TurnRecord, UserSettings, gsm8k_session, mt_bench_session

DATASETS = ("gsm8k", "mt_bench")


@dataclass
class SimulationPlan:
    """What to run: ``sessions`` sessions of ``dataset`` (items picked with ``seed``)."""

    dataset: str = "gsm8k"
    sessions: int = 16
    seed: int = 0
    concurrency: int = 8
    split: str = "train"
    session_prefix: str | None = None
    repeat: int = 1  # consecutive sessions asking the same item (a GRPO-like group of users)


def _mean(xs: list) -> float | None:
    return round(fmean(xs), 4) if xs else None


def summarize(records: Iterable[TurnRecord | dict]) -> dict:
    """Aggregate logged replies (objects or JSONL dicts) into the run's metrics.

    Closing replies are excluded. Returns ``replies``, ``success_rate`` (the feedback policy's
    success, graded replies only), ``first_reply_success_rate``, ``accuracy`` (GSM8K final number
    right), ``words_per_reply`` (mean words, the guard metric beside the reward),
    ``completion_tokens`` (mean) and the same per ``policy_version`` under ``by_policy_version``.
    """
    rows = [r.to_json() if isinstance(r, TurnRecord) else r for r in records]
    rows = [r for r in rows if not r.get("closing")]

    def stats(rs: list[dict]) -> dict:
        graded = [r for r in rs if r.get("graded")]
        first = [r for r in graded if r.get("turn") == 0]
        toks = [r["completion_tokens"] for r in rs if r.get("completion_tokens") is not None]
        return {
            "replies": len(rs),
            "graded_replies": len(graded),
            "success_rate": _mean([bool(r["success"]) for r in graded]),
            "first_reply_success_rate": _mean([bool(r["success"]) for r in first]),
            "accuracy": _mean([bool(r["correct"]) for r in graded if r.get("correct") is not None]),
            "brief_rate": _mean([bool(r["brief"]) for r in graded if r.get("brief") is not None]),
            "words_per_reply": _mean([r["words"] for r in rs]),
            "completion_tokens": _mean(toks),
        }

    out = stats(rows)
    by_version: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_version[str(r.get("policy_version"))].append(r)
    out["by_policy_version"] = {v: stats(rs) for v, rs in sorted(by_version.items())}
    return out


def _session_items(plan: SimulationPlan) -> list:
    """The item each of the ``plan.sessions`` sessions asks, in session order: items picked with
    ``plan.seed``, each asked by ``plan.repeat`` consecutive sessions.

    Raises:
        ValueError: unknown dataset or split.
    """
    if plan.dataset not in DATASETS:
        raise ValueError(f"unknown dataset {plan.dataset!r}; choose from {DATASETS}")
    items = load_gsm8k(plan.split) if plan.dataset == "gsm8k" else load_mt_bench()
    repeat = max(1, plan.repeat)
    return [it for it in pick(items, -(-plan.sessions // repeat), plan.seed) for _ in range(repeat)][:plan.sessions]


class _ReplyLog:
    """The replies of a run as they arrive: kept in ``records``, counted (``graded`` replies and
    their ``success`` count, for the progress bar) and appended to the JSONL file at ``path``
    (None: no file), flushed line by line so an interrupted run keeps its replies."""

    def __init__(self, path: str | Path | None) -> None:
        self.file = open(path, "ab") if path else None
        self.records: list[TurnRecord] = []
        self.graded = self.success = 0

    def add(self, rec: TurnRecord) -> None:
        """Record one reply (a session's ``on_record``)."""
        self.records.append(rec)
        if rec.graded:
            self.graded += 1
            self.success += bool(rec.success)
        if self.file is not None:
            self.file.write(orjson.dumps(rec.to_json()) + b"\n")
            self.file.flush()

    def close(self) -> None:
        """Close the JSONL file (if any)."""
        if self.file is not None:
            self.file.close()


@dataclass
class _Run:
    """The sessions of one :func:`simulate` call, shared by its workers.

    ``todo``: ``(index, item)`` of the sessions not yet started (one iterator: each session is
    taken by exactly one worker); ``bar``: the tqdm progress bar or None; ``stop``: no session
    starts once it is set; ``results``: the finished sessions; ``started``: sessions begun.
    """

    plan: SimulationPlan
    settings: UserSettings
    client: ChatClient
    prefix: str
    todo: Iterator[tuple[int, Any]]
    replies: _ReplyLog
    bar: Any
    stop: asyncio.Event | None
    results: list[SessionResult] = field(default_factory=list)
    started: int = 0

    async def worker(self) -> None:
        """Run the sessions of ``todo`` one at a time until it is empty or ``stop`` is set."""
        run_session = gsm8k_session if self.plan.dataset == "gsm8k" else mt_bench_session
        for i, item in self.todo:
            if self.stop is not None and self.stop.is_set():
                break  # never start a session after the stop
            self.started += 1
            res = await run_session(self.client, f"{self.prefix}-{i:05d}", item, self.settings, seed=self.plan.seed,
                                    on_record=self.replies.add)
            self.results.append(res)
            if self.bar is not None:
                self.bar.set_postfix(success=f"{self.replies.success}/{self.replies.graded}", refresh=False)
                self.bar.update(1)

    def summary(self) -> dict:
        """:func:`simulate`'s result (see there)."""
        plan, results = self.plan, self.results
        failed = [r for r in results if r.error]
        return {"dataset": plan.dataset, "feedback": self.settings.feedback if plan.dataset == "gsm8k" else None,
                "sessions": len(results), "sessions_failed": len(failed),
                "sessions_cancelled": self.started - len(results), "requests": sum(r.requests for r in results),
                "errors": [r.error for r in failed[:5]], **summarize(self.replies.records)}


async def _until_done_or_stopped(workers: list[asyncio.Task], stop: asyncio.Event | None) -> None:
    """Wait for every worker to end; setting ``stop`` cancels them (repeatedly: a cancellation can be
    swallowed inside an HTTP client). Workers' exceptions are left in their tasks."""
    watcher = None
    if stop is not None:
        async def watch() -> None:
            await stop.wait()
            while any(not w.done() for w in workers):
                for w in workers:
                    w.cancel()
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
    try:
        await asyncio.gather(*workers, return_exceptions=True)
    finally:
        if watcher is not None:
            watcher.cancel()


async def simulate(base_url: str, plan: SimulationPlan, settings: UserSettings, *, model: str = "default",
                   api_key: str | None = None, timeout_s: float = 300.0, log_path: str | Path | None = None,
                   progress: bool = True, stop: asyncio.Event | None = None, tenant: str | None = None) -> dict:
    """Run the plan against the proxy at ``base_url``; returns the summary (see :func:`summarize`)
    plus ``sessions`` (completed), ``sessions_failed``, ``sessions_cancelled``, ``requests`` and
    ``errors`` (the first few messages).

    ``plan.concurrency`` workers each run one session at a time, so memory stays flat however
    many sessions are planned. ``tenant``: sent as ``X-Tenant-Id`` with every request. Setting ``stop`` cancels the sessions in flight (their replies so
    far are already logged; the proxy ends such sessions by its idle time-out) and returns.

    Raises:
        ValueError: unknown dataset or split.
    """
    chosen = _session_items(plan)
    prefix = plan.session_prefix or f"sim-{plan.dataset}-{uuid.uuid4().hex[:8]}"
    replies = _ReplyLog(log_path)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(chosen), desc=f"simulate {plan.dataset}", unit="session")
    client = ChatClient(base_url, model=model, api_key=api_key, timeout_s=timeout_s,
                        max_connections=max(8, plan.concurrency * 2), tenant=tenant)
    run = _Run(plan, settings, client, prefix, iter(enumerate(chosen)), replies, bar, stop)
    workers = [asyncio.create_task(run.worker()) for _ in range(max(1, min(plan.concurrency, len(chosen) or 1)))]
    try:
        await _until_done_or_stopped(workers, stop)
    finally:
        await client.aclose()
        if bar is not None:
            bar.close()
        replies.close()
    for w in workers:  # a bug in a session must not vanish silently
        if not w.cancelled() and w.exception() is not None:
            raise w.exception()
    return run.summary()
