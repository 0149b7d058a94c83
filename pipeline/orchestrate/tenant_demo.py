"""``pipeline demo --tenants`` / ``--shared``: two simulated users who want different things.

``alice`` rewards brevity, ``bob`` the working laid out one step per line
(:data:`pipeline.orchestrate.tenant_report.USERS`; docs/tenants.md, Demo, has the measured base
rates and what a few adapter steps reach).

- ``--tenants``: the stack with ``trainer.lora`` + ``trainer.per_tenant`` and ``engine.enable_lora``;
  each population sends its ``X-Tenant-Id``, the trainer trains one adapter per tenant and
  publishes each update through ``control`` (adapter sync), the syncer loads it and the proxy
  routes the tenant to it. Whenever a tenant's last ``resume`` names an adapter not evaluated yet,
  the users and the trainer are frozen (SIGSTOP) and the held-out prompts go straight to the
  engine through that adapter (chat ``model: "<base>:<adapter name>"``).
- ``--shared``: the same two populations without tenants, one full-weight policy for both; each
  new weight version the engine serves is evaluated the same way.

The base is evaluated first in both. Every evaluation grades the same replies for both users'
properties, so each user's curve shows its own metric and the other user's beside the base's
(:func:`pipeline.orchestrate.tenant_report.curves`). ``report.json`` (and ``report.png``) in
``--report-dir``, the console table at the end.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

from pipeline.config import Config
from pipeline.engine_api.errors import EngineError
from pipeline.orchestrate.demo_common import (Simulator, demo_config, engine_version, read_topic, shut_down, signal_all,
                                              summarize_topics, trainer_steps, trainer_summary)
from pipeline.orchestrate.tenant_report import USERS, curves, summary_lines, tenant_verdicts
from pipeline.orchestrate.up import Stack, start_or_status, start_stack

LORA = {"rank": 16, "alpha": 32}  # every attention and MLP projection (the default targets)


def two_user_config(config: Config, args, run_dir: Path) -> Config:
    """The demo's configuration (:func:`pipeline.orchestrate.demo.demo_config`) for two users.
    ``--shared``: ``--steps`` updates per user (``trainer.max_steps`` = steps x users).
    ``--tenants``: LoRA adapters per tenant at ``--lora-lr`` (the stack's engine then serves
    adapters: :func:`pipeline.orchestrate.up.serving_lora`), and no
    ``max_steps`` (a count of batches of any tenant: one busy tenant could take them all); the
    run ends when each tenant's first ``--steps`` adapter versions were evaluated."""
    cfg = demo_config(config, args, run_dir)
    if args.shared:
        return cfg.replace(trainer={"max_steps": args.steps * len(USERS)})
    return cfg.replace(trainer={"max_steps": None, "lora": LORA, "per_tenant": True, "lr": args.lora_lr})


class Evaluations:
    """The held-out evaluations of a two-user run, straight against the engine: the 32 held-out
    GSM8K prompts x ``--eval-samples`` replies with the same seeds for every version."""

    def __init__(self, config: Config, args) -> None:
        from pipeline.simulate.datasets import load_gsm8k

        self.config, self.args = config, args
        self.prompts = load_gsm8k("heldout")[: args.eval_prompts]
        self.results: list[dict] = []

    def run(self, target: str, version: str, adapter: str | None) -> dict:
        """Evaluate what serves ``target`` (a tenant, ``base`` or ``shared``) now: ``adapter`` (an
        engine adapter name) or the engine's weights (None). Kept, printed and returned."""
        from pipeline.simulate.evaluate import evaluate

        t0 = time.monotonic()
        model = "default" if adapter is None else f"default:{adapter}"
        res = evaluate(self.config.engine.url, self.prompts, self.args.max_tokens, concurrency=64,
                       seed=self.args.eval_seed, samples_per_prompt=self.args.eval_samples, model=model)
        res.update(target=target, version=version, adapter=adapter, seconds=round(time.monotonic() - t0, 1))
        self.results.append(res)
        print(f"[demo] held-out eval, {target} {version}: brief {res['brief_rate']:.2f}  steps "
              f"{res['stepwise_rate']:.2f}  ({res['n']} replies, {res['seconds']} s)", flush=True)
        return res


def to_evaluate(args, config: Config, done: dict[str, list[str]]) -> list[tuple[str, str, str | None]]:
    """What serves a user now and was not evaluated yet: ``(target, version, adapter)`` triples.
    ``--tenants``: each tenant's adapter named by its last ``resume`` on ``control``
    (:func:`pipeline.weightsync.current_adapters`), until the
    tenant has ``--steps`` evaluated versions; ``--shared``:
    the weight version the engine serves (version 0, the base, is evaluated at the start)."""
    if args.shared:
        v = engine_version(config.engine.url)
        return [("shared", v, None)] if v is not None and v != "0" and v not in done["shared"] else []
    from pipeline.weightsync import current_adapters

    served = current_adapters(read_topic(config, "control"), config.trainer.run_id)
    return [(u.tenant, a["name"], a["name"]) for u in USERS
            if len(done[u.tenant]) < args.steps and (cur := served.get(u.tenant)) is not None
            and (a := cur[0])["name"] not in done[u.tenant]]


def finished(args, config: Config, done: dict[str, list[str]]) -> bool:
    """Every user was evaluated at ``--steps`` versions (``--tenants``), or the trainer made its
    last step and the engine's version of it was evaluated (``--shared``)."""
    if args.tenants:
        return all(len(done[u.tenant]) >= args.steps for u in USERS)
    steps = trainer_steps(config)
    last = str(steps[-1].get("policy_version")) if steps else None
    return len(steps) >= args.steps * len(USERS) and last in done["shared"]


def watch(args, stack: Stack, sims: list[Simulator], evals: Evaluations, stop: threading.Event, t0: float,
          notes: list[str]) -> int:
    """Let both populations talk to the stack, evaluating each new version (users and trainer
    frozen meanwhile) until :func:`finished`, a stage exits early (returns 1), ``--max-minutes``
    or ``stop``; progress every 20 s."""
    config = stack.config
    done: dict[str, list[str]] = {"shared": [], **{u.tenant: [] for u in USERS}}
    deadline, last_status = t0 + args.max_minutes * 60, 0.0
    while not stop.is_set():
        for target, version, adapter in to_evaluate(args, config, done):
            frozen = [s.proc for s in sims] + [s.proc for s in stack.supervisor.stages if s.name == "trainer" and s.alive]
            signal_all(frozen, signal.SIGSTOP)
            try:
                evals.run(target, version, adapter)
            except EngineError as e:  # e.g. the adapter was replaced (and unloaded) meanwhile: the next one counts
                notes.append(f"{target} {version} not evaluated: {e}")
                print(f"[demo] {notes[-1]}", file=sys.stderr)
            finally:
                signal_all(frozen, signal.SIGCONT)
            done[target].append(version)
        if finished(args, config, done):
            return 0
        dead = [d for d in stack.supervisor.dead() if not (d.name == "trainer" and d.proc.returncode == 0)]
        if dead:
            notes.append("stage(s) exited early: " + ", ".join(f"{d.name} (exit {d.proc.returncode}, log "
                                                               f"{d.log_path})" for d in dead))
            print(f"pipeline demo: {notes[-1]}", file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            notes.append(f"stopped at the {args.max_minutes:.0f}-minute limit; evaluated {done}")
            print(f"[demo] {notes[-1]}", flush=True)
            return 0
        if time.monotonic() - last_status > 20:
            last_status = time.monotonic()
            print(f"[demo] {time.monotonic() - t0:5.0f} s  replies {sum(len(s.records()) for s in sims):4d}  "
                  f"trainer steps {len(trainer_steps(config))}  evaluated {done}", flush=True)
        stop.wait(3.0)
    notes.append("interrupted by the user")
    return 0


def run_two_users(args, config: Config) -> int:
    """``pipeline demo --tenants`` or ``--shared`` (module docstring)."""
    report_dir = Path(args.report_dir)
    run_dir = report_dir / "run"
    config = two_user_config(config, args, run_dir)
    mode = "tenants" if args.tenants else "shared"
    stop, t0 = threading.Event(), time.monotonic()
    print(f"[demo] two users ({mode}): starting the stack; logs in {run_dir / 'logs'}", flush=True)
    stack = start_or_status("demo", stop, lambda: start_stack(config, run_dir))
    if isinstance(stack, int):
        return stack
    config = stack.config
    from pipeline.bus import EventProducer

    producer = EventProducer(config, name="demo")  # shut_down closes it
    sims: list[Simulator] = []
    notes: list[str] = []
    evals = Evaluations(config, args)
    try:
        evals.run("base", engine_version(config.engine.url) or "0", None)
        for i, u in enumerate(USERS):
            sims.append(Simulator(stack, run_dir, args, name=f"simulate-{u.tenant}", feedback=u.feedback,
                                  tenant=u.tenant if args.tenants else None, seed=1 + i))
        rc = watch(args, stack, sims, evals, stop, t0, notes)
    finally:
        for s in sims:
            s.stop()
        ending = shut_down(stack, None, producer, notes)
    report = two_user_report(config, mode, t0, sims, evals.results, ending, notes)
    write_two_user_report(report, report_dir)
    return rc


def two_user_report(config: Config, mode: str, t0: float, sims: list[Simulator], evaluations: list[dict],
                    ending, notes: list[str]) -> dict:
    """The content of ``report.json``: the users, every evaluation, the curves and verdicts
    (:mod:`pipeline.orchestrate.tenant_report`), the trainer's steps, the topics' counts."""
    from pipeline.simulate.runner import summarize

    c = curves(evaluations)
    return {"mode": mode, "model": config.engine.model, "duration_s": round(time.monotonic() - t0, 1),
            "users": [{"tenant": u.tenant, "feedback": u.feedback, "metric": u.metric} for u in USERS],
            "evaluations": evaluations, "curves": c, "verdicts": tenant_verdicts(c),
            "trainer": trainer_summary(config, trainer_steps(config)),
            "simulators": {u.tenant: summarize(s.records()) for u, s in zip(USERS, sims)},
            "topics": summarize_topics(ending.topics["turns"], ending.topics["samples"]),
            "stages_stopped": {k: str(v) for k, v in ending.stopped.items()}, "notes": notes}


def write_two_user_report(report: dict, report_dir: Path) -> None:
    """``report.json`` and ``report.png`` (a plot that fails is printed, not raised), then the table."""
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "report.json").write_text(json.dumps(report, indent=2))
    try:
        plot_two_users(report, report_dir / "report.png")
    except Exception as e:  # noqa: BLE001 - the report is written already
        print(f"[demo] plot failed: {e}", file=sys.stderr)
    print("\n".join(summary_lines(report)))
    print(f"report              {report_dir / 'report.json'}, {report_dir / 'report.png'}")


def plot_two_users(report: dict, path: Path) -> None:
    """One panel per user: its own metric (solid) and the other user's (dashed) per evaluated
    version, Wilson 95% error bars, the base's values as horizontal lines with their band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = report["curves"]
    fig, axes = plt.subplots(1, len(c["users"]), figsize=(12, 4.5), squeeze=False)
    for ax, (tenant, u) in zip(axes[0], c["users"].items()):
        for key, metric, style in (("own", u["metric"], "o-"), ("other", u["other_metric"], "s--")):
            pts = [p[key] for p in u["points"] if p[key] and p[key]["rate"] is not None]
            xs = list(range(1, len(pts) + 1))
            if pts:
                ax.errorbar(xs, [p["rate"] for p in pts], yerr=[[p["rate"] - p["ci95"][0] for p in pts],
                                                               [p["ci95"][1] - p["rate"] for p in pts]],
                            fmt=style, capsize=3, label=f"{metric} ({'own' if key == 'own' else 'other user'})")
            b = (c["base"] or {}).get(metric)
            if b and b["rate"] is not None:
                ax.axhline(b["rate"], ls=":", color="C0" if key == "own" else "C1", lw=1)
                ax.axhspan(b["ci95"][0], b["ci95"][1], color="C0" if key == "own" else "C1", alpha=0.08)
        ax.set_title(f"{tenant} ({u['feedback']}), {report['mode']}", fontsize=10)
        ax.set_xlabel("evaluated version (dotted: the base, band: its 95% interval)")
        ax.set_ylim(-0.02, 1.02)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
