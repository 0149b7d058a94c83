"""What the demos share (``pipeline demo``, :mod:`pipeline.orchestrate.demo`, and its two-user
form, :mod:`pipeline.orchestrate.tenant_demo` with :mod:`pipeline.orchestrate.tenant_report`):
the demo's config, the simulated users as a child process, reading topics and the trainer's
log, stopping a run, and the numbers every report uses (topic counts, trainer summary, the
Wilson interval).

It imports none of those modules, so they import it without a circle.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import Config
from pipeline.engine_api.client import ask_once
from pipeline.engine_api.errors import EngineError
from pipeline.jsonl import read_jsonl
from pipeline.orchestrate.supervisor import StopOutcome
from pipeline.orchestrate.up import Stack, scrape, scrape_by_label
from pipeline.procutil import die_with_parent, stop_group
from pipeline.rollout.stats import wilson_interval  # noqa: F401  (re-exported: the demo reports use it)


def demo_config(config: Config, args, run_dir: Path) -> Config:
    """``config`` with the demo's defaults on top (explicit flags win; a validated copy)."""
    model = args.model or config.engine.model
    return config.replace(
        engine={"model": model, "threads": 1},  # one thread each: the engine keeps the other core
        judge={**({"mode": args.judge_mode} if args.judge_mode else {})},  # the idle horizon: hours (late replies)
        trainer={"model": model, "lr": args.lr, "rollout_batch_size": args.batch_size,
                 "max_steps": args.steps,  # exactly --steps updates; the last one is evaluated
                 "normalize_advantages": True,  # reward minus batch mean (GRPO-style baseline)
                 "checkpoint_dir": str(run_dir / "checkpoints"), "export_dir": str(run_dir / "weights"),
                 "metrics_file": str(run_dir / "trainer_metrics.jsonl"), "progress": False, "threads": 1})


class Simulator:
    """``pipeline simulate`` as a child process, frozen (SIGSTOP) while a version is evaluated.

    ``name`` names its log files (``<name>.jsonl``, ``logs/<name>.log``); ``feedback`` is the
    users' policy, ``tenant`` their ``X-Tenant-Id`` (None: none), ``seed`` their problem choice.
    """

    def __init__(self, stack: Stack, run_dir: Path, args, *, name: str = "simulate", feedback: str = "brevity",
                 tenant: str | None = None, seed: int = 1) -> None:
        self.log_path = run_dir / f"{name}.jsonl"
        argv = [sys.executable, "-m", "pipeline", "simulate", "--dataset", "gsm8k", "--sessions", "100000",
                "--proxy-url", stack.proxy_url, "--concurrency", str(args.concurrency), "--max-tokens",
                str(args.max_tokens), "--log", str(self.log_path), "--no-progress", "--seed", str(seed),
                "--repeat", str(args.repeat), "--max-turns", str(args.max_turns), "--feedback", feedback,
                "--config", str(run_dir / "config.yaml")] + (["--tenant", tenant] if tenant is not None else []) + (
                    ["--thumbs"] if getattr(args, "reward", "judge") == "feedback" else [])
        self.out = open(run_dir / "logs" / f"{name}.log", "ab")
        self.proc = subprocess.Popen(argv, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=die_with_parent)

    def stop(self) -> None:
        """Stop the simulator (SIGCONT first so it can handle SIGTERM)."""
        stop_group(self.proc, 20, resume_first=True)
        self.out.close()

    def records(self) -> list[dict]:
        """The JSON lines the simulator logged (one per reply)."""
        return read_jsonl(self.log_path, strict=False, missing_ok=True)  # a line cut by the stop is skipped


def engine_version(url: str) -> str | None:
    """The weight version the engine serves now (``GET /model_info``), or None if unreachable."""
    try:
        version = ask_once(url, lambda c: c.weight_version(), 5.0)
    except (EngineError, AttributeError):  # unreachable, an error answer, or not a JSON object
        return None
    return None if version is None else str(version)


def read_topic(config: Config, logical: str) -> list:
    """Every decodable event currently on a topic (assign-mode reader: no group, nothing committed)."""
    from pipeline.bus import read_events

    return read_events(config, logical)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


def summarize_topics(turn_events: list, sample_events: list) -> dict:
    """Counts of turns/next states/sessions and samples by kind, reward mean, by policy version."""
    kinds = Counter(type(e).__name__ for e in turn_events)
    sessions = {e.session_id for e in turn_events}
    by_kind = Counter(s.kind for s in sample_events)
    trained = [s for s in sample_events if s.loss_mask]
    by_version: dict[int, list] = defaultdict(list)
    for s in sample_events:
        by_version[s.policy_version].append(s)
    return {
        "sessions": len(sessions),
        "turns": kinds.get("Turn", 0),
        "next_states": kinds.get("NextState", 0),
        "session_ends": kinds.get("SessionEnd", 0),
        "samples": len(sample_events),
        "samples_by_kind": dict(by_kind),
        "samples_with_loss": len(trained),  # loss mask 1 (whether or not a trainer step took them yet)
        "samples_masked": len(sample_events) - len(trained),
        "reward_mean": _mean([s.reward for s in trained]),  # over samples with a reward (None: absent)
        "samples_by_policy_version": {
            str(v): {"samples": len(ss), "reward_mean": _mean([s.reward for s in ss if s.loss_mask]),
                     "rewarded": sum(1 for s in ss if s.loss_mask and s.reward is not None),
                     "positive": sum(1 for s in ss if s.loss_mask and (s.reward or 0) > 0)}
            for v, ss in sorted(by_version.items())},
    }


def judge_unjudged(stack: Stack) -> dict:
    """Main turns that ended without a judgement, by reason, and turns still waiting for their
    next state, from the judge's metrics (``{}`` when the judge does not answer)."""
    url = stack.metrics.get("judge", "")
    if not url:
        return {}
    reasons = scrape_by_label(url, "pipeline_judge_unjudged_turns_total", "reason")
    waiting = scrape(url).get("pipeline_judge_sessions_waiting")
    return {"by_reason": reasons, "total": sum(reasons.values()), "waiting_at_end": waiting}


def trainer_log(path: Path) -> list[dict]:
    """The trainer's per-step JSONL metrics (empty if none yet)."""
    from pipeline.trainer.metrics import MetricsLog  # torch-free module

    return MetricsLog(path).records()


def trainer_steps(config: Config) -> list[dict]:
    """The trainer's per-step records so far (the lines of its metrics file that have a ``step``)."""
    return [r for r in trainer_log(Path(config.trainer.metrics_file)) if "step" in r]


@dataclass(frozen=True)
class Ending:
    """What a demo run left for its report once every stage stopped.

    Attributes:
        unjudged: :func:`judge_unjudged`, read while the judge still served its metrics.
        stopped: how each stage stopped, by name.
        topics: ``turns``, ``samples`` and ``control`` -> every event on that topic at the end
            (no events when the topics could not be read).
    """

    unjudged: dict
    stopped: dict[str, StopOutcome]
    topics: dict[str, list]


def shut_down(stack: Stack, sim: Simulator | None, producer, notes: list[str]) -> Ending:
    """Stop the simulated users (``sim``, when started) and every stage, the broker last: the
    topics are read in between, with no writer left, so their counts are the final ones (a read
    that fails leaves them empty, with a note in ``notes``)."""
    if sim is not None:
        sim.stop()
    producer.close()
    unjudged = judge_unjudged(stack)  # from the judge's metrics, while it still serves them
    print("[demo] stopping every stage ...", flush=True)
    stack.stop(keep_broker=True)
    names = ("turns", "samples", "control", "metrics")
    try:
        topics = {name: read_topic(stack.config, name) for name in names}
    except Exception as e:  # the report must still be written
        notes.append(f"could not read topics: {e}")
        topics = {name: [] for name in names}
    return Ending(unjudged, stack.stop(), topics)


def trainer_summary(config: Config, steps_log: list[dict]) -> dict:
    """The report's ``trainer`` section from the trainer's per-step records."""
    return {"steps": len(steps_log), "steps_with_gradient": sum(1 for r in steps_log if r.get("grad_norm")),
            "lr": config.trainer.lr, "kl_coef": config.trainer.kl_coef,
            # trained = went through a trainer step (the batches' sizes, from the trainer's log)
            "samples_trained": int(sum(r.get("batch_samples") or 0 for r in steps_log)),
            "rollout_batch_size": config.trainer.rollout_batch_size,
            "last_step": steps_log[-1] if steps_log else None,
            # per step; the train-vs-rollout log-prob |diff| (nats) of samples of the
            # trainer's own version (engine/trainer mismatch) apart from stale ones (drift)
            "per_step": [{k: r.get(k) for k in (
                "step", "policy_version", "reward_mean", "kl", "ppo_kl", "logprob_abs_diff",
                "logprob_abs_diff_current", "logprob_tokens_current", "logprob_abs_diff_stale",
                "logprob_tokens_stale", "loss", "step_s")} for r in steps_log]}


def signal_all(procs, sig) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
