"""``pipeline demo --rollout``: canary rollout on the whole stack, one update deliberately poisoned.

One simulated GSM8K user population, tenant ``alice``, who wants brief replies (the brevity
user of ``pipeline demo --tenants``: a reply within 64 tokens and at most 40 words is thanked,
a longer one corrected). The stack is the tenants' one (a LoRA adapter per tenant) with
``rollout.enabled`` and the evaluator stage:

1. the trainer trains alice's adapter from her judged turns and publishes each update as a
   **candidate**; while its canary is open the trainer publishes nothing newer;
2. the syncer loads the candidate beside the incumbent (the base model at first); the proxy
   serves it to ``rollout.share`` of alice's *new* sessions (sticky, recorded as ``Turn.canary``);
3. the evaluator runs the eval set (the 32 held-out GSM8K prompts: ``brief`` = at most 40 words,
   ``accuracy`` = the reply contains the right number; ``accuracy`` is the guard) on every
   version, and decides each canary from the records (docs/rollout.md, with this demo's smaller
   n: :data:`DEMO_RULE`) by publishing ``promote`` or ``rollback`` on ``control``;
4. alice's candidate number ``--poison-step`` (default 3) is trained with its signal inverted
   (``trainer.poison_steps``, a test device: every reward and OPD term negated, from fresh
   optimizer moments): it teaches the opposite of what alice wants, and should be rolled back
   having served only the canary share; the honest candidates before it should be promoted.

The run ends when the poisoned version and at least one honest version were decided (or at
``--max-minutes``). ``report.json`` in ``--report-dir``: per version its eval-set results with
Wilson 95% intervals, the canary's live judged reward against the incumbent's (the decision's
evidence), the decision and the share of turns it served; the same table on the console.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from pipeline import events
from pipeline.config import Config
from pipeline.orchestrate.demo_common import (Simulator, demo_config, read_topic, shut_down, summarize_topics,
                                              trainer_steps, trainer_summary, wilson_interval)
from pipeline.orchestrate.up import Stack, start_or_status, start_stack

TENANT = "alice"
LORA = {"rank": 16, "alpha": 32}
#: the rule's parameters for a demo of a few minutes per canary (the defaults need thousands of
#: judged turns: docs/rollout.md gives their error rates). The guard's margin is wide because the
#: eval set has 32 items: at 3/32 against 2/32 the lower bound on the difference is -0.16, so
#: with a margin of 0.15 an honest version would wait for an n the eval set never reaches.
DEMO_RULE = {"share": 0.5, "rollback_min_n": 24, "min_n": 32, "max_n": 160, "margin": 0.15,
             "guard_margin": 0.25, "rollback_z": 1.645}


def add_arguments(parser) -> None:
    """``--rollout``'s own flags (the others are ``pipeline demo``'s)."""
    parser.add_argument("--poison-step", type=int, default=3,
                        help="--rollout: alice's candidate (1, 2, ...) trained with its signal inverted (default 3; "
                             "0: none)")
    parser.add_argument("--share", type=float, default=DEMO_RULE["share"],
                        help=f"--rollout: the canary's share of new sessions (default {DEMO_RULE['share']})")


def write_eval_set(path: Path, n: int) -> Path:
    """The held-out GSM8K prompts as an eval set (docs/rollout.md's format): ``brief`` (at most
    40 words) and ``accuracy`` (the reply contains the final number, not inside a longer one),
    ``accuracy`` declared as the guard."""
    from pipeline.simulate.datasets import load_gsm8k

    rows: list[dict] = [{"eval_set": "gsm8k-heldout", "guards": ["accuracy"]}]
    for p in load_gsm8k("heldout")[:n]:
        n = p.answer.final
        final = format(n.normalize() if n == n.to_integral_value() else n, "f").replace(".", r"\.")
        rows.append({"id": str(p.id), "prompt": p.question,
                     "checks": {"brief": {"max_words": 40},
                                "accuracy": {"regex": rf"(?<![\d.]){final}(?:\.0+)?(?![\d])"}}})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rollout_config(config: Config, args, run_dir: Path) -> Config:
    """The demo's configuration: the tenants' stack (LoRA per tenant at ``--lora-lr``, no
    ``max_steps``) with ``rollout`` on (:data:`DEMO_RULE`, ``--share``, the eval set) and the
    poisoned update."""
    cfg = demo_config(config, args, run_dir)
    eval_set = write_eval_set(run_dir / "eval_set.jsonl", args.eval_prompts)
    return cfg.replace(
        trainer={"max_steps": None, "lora": LORA, "per_tenant": True, "lr": args.lora_lr, "max_staleness": None,
                 "poison_steps": [args.poison_step] if args.poison_step > 0 else []},
        rollout={**DEMO_RULE, "enabled": True, "share": args.share, "eval_set": str(eval_set),
                 "guard_min_n": args.eval_prompts, "eval_max_tokens": 64, "eval_seed": args.eval_seed})


def _is(ev, *actions) -> bool:
    return isinstance(ev, events.Control) and ev.tenant == TENANT and ev.action in actions


def versions(control: list, metrics: list, turns: list) -> list[dict]:
    """Alice's versions in the order they were published, each with its eval-set results, the
    decision and its evidence, and the turns it served (from the records alone)."""
    out: dict[str, dict] = {}
    for ev in control:
        if _is(ev, "weights") and ev.adapter["version"] not in out:
            out[ev.adapter["version"]] = {"name": ev.adapter["name"], "version": ev.adapter["version"],
                                          "update": ev.policy_version, "decision": None}
        elif _is(ev, "promote", "rollback") and ev.adapter and ev.adapter["version"] in out:
            out[ev.adapter["version"]].update(decision=ev.action, evidence=ev.evidence)
    for ev in metrics:
        adapter = getattr(ev, "adapter", None)
        if isinstance(ev, events.Evaluation) and getattr(ev, "tenant", None) == TENANT and adapter:
            if adapter["version"] in out:
                out[adapter["version"]]["eval"] = _eval_row(ev)
    for v in out.values():
        served = [t for t in turns if isinstance(t, events.Turn) and t.tenant == TENANT
                  and (t.adapter or {}).get("version") == v["version"]]
        v["turns"] = len(served)
        v["sessions"] = len({t.session_id for t in served})
    return list(out.values())


def _eval_row(ev) -> dict:
    row = {"n": ev.n}
    for name in ("brief", "accuracy"):
        if name in ev.metrics:
            k, n = round(ev.metrics[name] * ev.metrics.get(f"{name}_n", ev.n)), ev.metrics.get(f"{name}_n", ev.n)
            row[name] = {"rate": round(ev.metrics[name], 4), "k": k, "n": n,
                         "ci95": [round(x, 4) for x in wilson_interval(k, n)]}
    return row


def base_eval(metrics: list) -> dict | None:
    """The eval-set results of alice's base model (the first incumbent)."""
    for ev in metrics:
        if isinstance(ev, events.Evaluation) and getattr(ev, "tenant", None) == TENANT and \
                getattr(ev, "adapter", None) is None:
            return _eval_row(ev)
    return None


def poisoned_updates(config: Config) -> set[int]:
    """Alice's update numbers (``n``) the trainer trained poisoned (its step records say so; a
    candidate is published as the ``n`` of its newest update)."""
    return {int(s["policy_version"]) for s in trainer_steps(config)
            if s.get("poisoned") and s.get("tenant", TENANT) == TENANT and "policy_version" in s}


def mark_poisoned(rows: list[dict], poison_step: int, updates: set[int]) -> list[dict]:
    """``rows`` with ``poisoned``: the ``poison_step``-th candidate (``trainer.poison_steps``
    counts alice's candidates with rollout on), and ``trained_poisoned``: its update ``n`` is one
    the trainer's records say it trained poisoned (the two must agree)."""
    return [dict(r, poisoned=i + 1 == poison_step, trained_poisoned=r["update"] in updates)
            for i, r in enumerate(rows)]


def finished(rows: list[dict], poison_step: int) -> bool:
    """The poisoned candidate (the ``poison_step``-th; 0: none) and at least one honest one were
    decided."""
    decided = [i + 1 for i, r in enumerate(rows) if r["decision"]]
    honest = [k for k in decided if k != poison_step]
    return bool(honest) and (poison_step <= 0 or poison_step in decided)


def watch(args, stack: Stack, sim: Simulator, stop: threading.Event, t0: float, notes: list[str]) -> int:
    """Let alice's users talk to the stack until :func:`finished`, a stage exits early (1),
    ``--max-minutes`` or ``stop``; progress every 20 s."""
    config, deadline, last = stack.config, t0 + args.max_minutes * 60, 0.0
    while not stop.is_set():
        rows = versions(read_topic(config, "control"), read_topic(config, "metrics"), [])
        if finished(rows, args.poison_step):
            return 0
        dead = [d for d in stack.supervisor.dead()]
        if dead:
            notes.append("stage(s) exited early: " + ", ".join(f"{d.name} (exit {d.proc.returncode}, log "
                                                               f"{d.log_path})" for d in dead))
            print(f"pipeline demo: {notes[-1]}", file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            notes.append(f"stopped at the {args.max_minutes:.0f}-minute limit")
            print(f"[demo] {notes[-1]}", flush=True)
            return 0
        if time.monotonic() - last > 20:
            last = time.monotonic()
            state = ", ".join(f"{r['name']}: {r['decision'] or 'canary'}" for r in rows) or "no candidate yet"
            print(f"[demo] {last - t0:5.0f} s  replies {len(sim.records()):4d}  trainer steps "
                  f"{len(trainer_steps(config))}  versions: {state}", flush=True)
        stop.wait(3.0)
    notes.append("interrupted by the user")
    return 0


def run_rollout(args, config: Config) -> int:
    """``pipeline demo --rollout`` (module docstring)."""
    report_dir = Path(args.report_dir)
    run_dir = report_dir / "run"
    config = rollout_config(config, args, run_dir)
    stop, t0 = threading.Event(), time.monotonic()
    print(f"[demo] rollout: starting the stack; logs in {run_dir / 'logs'}", flush=True)
    stack = start_or_status("demo", stop, lambda: start_stack(config, run_dir))
    if isinstance(stack, int):
        return stack
    config = stack.config
    from pipeline.bus import EventProducer

    producer = EventProducer(config, name="demo")  # shut_down closes it
    notes: list[str] = []
    sim = None
    try:
        sim = Simulator(stack, run_dir, args, name=f"simulate-{TENANT}", feedback="brevity", tenant=TENANT, seed=1)
        rc = watch(args, stack, sim, stop, t0, notes)
    finally:
        if sim is not None:
            sim.stop()
        ending = shut_down(stack, None, producer, notes)
    report = rollout_report(config, t0, ending, notes, args.poison_step)
    write_rollout_report(report, report_dir)
    return rc


def rollout_report(config: Config, t0: float, ending, notes: list[str], poison_step: int) -> dict:
    """The content of ``report.json`` (module docstring)."""
    metrics = ending.topics["metrics"]  # read before the broker stopped
    turns = [t for t in ending.topics["turns"] if isinstance(t, events.Turn) and t.tenant == TENANT]
    rows = mark_poisoned(versions(ending.topics["control"], metrics, turns), poison_step, poisoned_updates(config))
    return {"mode": "rollout", "model": config.engine.model, "duration_s": round(time.monotonic() - t0, 1),
            "rule": config.rollout.model_dump(), "base_eval": base_eval(metrics), "versions": rows,
            "turns": len(turns), "canary_turns": sum(1 for t in turns if t.canary == "candidate"),
            "trainer": trainer_summary(config, trainer_steps(config)),
            "topics": summarize_topics(ending.topics["turns"], ending.topics["samples"]),
            "stages_stopped": {k: str(v) for k, v in ending.stopped.items()}, "notes": notes}


def _cell(x: dict | None) -> str:
    return "-" if not x else f"{x['k']}/{x['n']} = {x['rate']:.0%} ({x['ci95'][0]:.0%}-{x['ci95'][1]:.0%})"


def _arms(ev: dict | None) -> str:
    if not ev:
        return "-"
    c, i = ev["arms"]["candidate"]["reward"], ev["arms"]["incumbent"]["reward"]
    b = ev["bounds"].get("reward_rollback") or ev["bounds"]["reward"]
    return (f"{c[0]}/{c[1]} vs {i[0]}/{i[1]}, d in [{b[0]:+.2f}, {b[1]:+.2f}]")


def summary_lines(report: dict) -> list[str]:
    """The console table: per version its eval set, canary vs incumbent and the decision."""
    lines = [f"pipeline demo --rollout: {report['model']}, {report['duration_s']:.0f} s, {report['turns']} turns of "
             f"{TENANT} ({report['canary_turns']} served by a candidate)",
             f"  base          eval brief {_cell((report['base_eval'] or {}).get('brief'))}  accuracy "
             f"{_cell((report['base_eval'] or {}).get('accuracy'))}"]
    for r in report["versions"]:
        ev, e = r.get("evidence"), r.get("eval") or {}
        served = ev["arms"]["candidate"]["served"] if ev else None
        lines.append(f"  {r['name']:<13} {'POISONED ' if r['poisoned'] else ''}eval brief {_cell(e.get('brief'))}  "
                     f"accuracy {_cell(e.get('accuracy'))}")
        lines.append(f"  {'':<13} live reward candidate vs incumbent {_arms(ev)}; served {r['turns']} turns in "
                     f"{r['sessions']} sessions" + (f" ({served[0]}/{served[1]} of the canary's)" if served else ""))
        lines.append(f"  {'':<13} decision: {r['decision'] or 'none yet'}" +
                     (f" ({ev['reason']})" if ev else ""))
    return lines + [f"  note: {n}" for n in report["notes"]]


def write_rollout_report(report: dict, report_dir: Path) -> None:
    """``report.json`` and the console table."""
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    print("\n".join(summary_lines(report)))
    print(f"report              {report_dir / 'report.json'}")

