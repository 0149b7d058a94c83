"""``pipeline tail versions``: live metrics per version (:mod:`pipeline.rollout.live`) as text tables.

One table per scope (the full weights, then each tenant), one row per version::

    tenant alice: incumbent alice@aaaaaaaaaaaaaaaa
    version                 role         turns  judged reward         feedback  unfinished  refusals  words/reply  eval  decision
    alice@aaaaaaaaaaaaaaaa  incumbent    30     0.80 [0.63, 0.91] n=30 ...

A rate is ``rate [low, high] n=N`` (95% Wilson interval), ``n/a`` without data. Refusals are a
heuristic (:func:`pipeline.rollout.live.is_refusal`). The view reads every record of ``turns``,
``samples``, ``control`` and ``metrics`` from the beginning (no consumer group, nothing
committed); ``--follow`` prints the tables again after new records (at most every
:data:`REPRINT_S` seconds), ``--json`` prints the view as JSON.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

from pipeline.rollout.live import LiveVersions

COLUMNS = ("version", "role", "turns", "judged reward", "feedback", "unfinished", "refusals", "words/reply",
           "eval", "decision")
REPRINT_S = 2.0
TOPICS = ("turns", "samples", "control", "metrics")


def fmt_rate(r: dict) -> str:
    """``0.80 [0.63, 0.91] n=30``, or ``n/a`` when ``n`` is 0."""
    if not r["n"]:
        return "n/a"
    return f"{r['rate']:.2f} [{r['low']:.2f}, {r['high']:.2f}] n={r['n']}"


def fmt_evals(evals: list) -> str:
    """``name: metric value [low, high] n=N; ...`` for each eval set (a mean without bounds: its value)."""
    out = []
    for e in evals:
        parts = []
        for m in e["metrics"]:
            bounds = f" [{m['low']:.2f}, {m['high']:.2f}] n={m['n']}" if m["low"] is not None else ""
            parts.append(f"{m['metric']} {m['value']:.2f}{bounds}")
        out.append(f"{e['name']}: {', '.join(parts)}")
    return "; ".join(out) or "-"


def fmt_decision(d: dict | None) -> str:
    """``rollback reward_fell: reward d in [-0.85, -0.25]`` (bounds on candidate - incumbent)."""
    if d is None:
        return "-"
    bounds = ", ".join(f"{k} d in [{lo:.2f}, {hi:.2f}]" for k, (lo, hi) in sorted(d["bounds"].items()))
    return f"{d['action']} {d['reason']}" + (f": {bounds}" if bounds else "")


def row(v: dict) -> list[str]:
    """One version's cells, in :data:`COLUMNS` order."""
    role = v["role"] + (" (live)" if v["live"] else "")
    words = "n/a" if v["words_per_reply"] is None else f"{v['words_per_reply']:.1f}"
    turns = str(v["turns"]) + (f" ({v['canary_turns']} canary)" if v["canary_turns"] else "")
    return [v["label"], role or "-", turns, fmt_rate(v["reward"]), fmt_rate(v["feedback"]),
            fmt_rate(v["unfinished"]), fmt_rate(v["refusals"]), words, fmt_evals(v["evals"]),
            fmt_decision(v["decision"])]


def tables(snapshot: list[dict]) -> str:
    """Every scope of a :meth:`LiveVersions.snapshot` as a header line and an aligned table."""
    out = []
    for s in snapshot:
        head = "full weights" if s["scope"] is None else f"tenant {s['scope']}"
        head += f": incumbent {s['incumbent']}"
        if s["candidate"] is not None:
            head += f", candidate {s['candidate']}" + (" (live)" if s["live"] else " (loading)")
        rows = [list(COLUMNS)] + [row(v) for v in s["versions"]]
        widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
        out.append(head)
        out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        out.append("")
    return "\n".join(out)


def fold(config, records) -> LiveVersions:
    """A :class:`LiveVersions` of ``config``'s run (``trainer.run_id``, ``rollout.enabled``) over
    ``records`` (:class:`pipeline.bus.Record` s; undecodable ones are skipped)."""
    view = LiveVersions(run_id=config.trainer.run_id, rollout=config.rollout.enabled)
    for rec in records:
        event = getattr(rec, "event", None)
        if event is not None:
            view.apply(event)
    return view


def _print(view: LiveVersions, as_json: bool) -> None:
    snap = view.snapshot()
    print(json.dumps(snap, default=str) if as_json else tables(snap), flush=True)


def run(args, config) -> int:
    """``pipeline tail versions [--follow] [--json]``."""
    from pipeline.bus import TopicReader

    if args.start is not None or args.session or args.types or args.partition:
        print("pipeline tail versions: reads every record from the beginning (no --from, --session, --type, "
              "--partition)", file=sys.stderr)
        return 2
    stop = threading.Event()
    if args.follow:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    with TopicReader(config, [config.topics.name(t) for t in TOPICS], start="beginning") as reader:
        if not reader.assignment():
            print(f"pipeline tail versions: no topic of {TOPICS} on {config.kafka.bootstrap_servers}", file=sys.stderr)
            return 1
        view = fold(config, reader.read(idle_timeout_s=3.0, stop=stop))
        _print(view, args.json)
        changed, printed = False, time.monotonic()
        while args.follow and not stop.is_set():
            for rec in reader.poll(200):
                changed = (getattr(rec, "event", None) is not None and view.apply(rec.event)) or changed
            if changed and time.monotonic() - printed >= REPRINT_S:
                _print(view, args.json)
                changed, printed = False, time.monotonic()
    return 0
