"""``pipeline retrain``: offline retraining from history in one command.

    pipeline retrain --archive archive/ [--from T] [--to T] --mode rl --steps 2 --batch-size 8
    pipeline retrain --from 2026-11-01T00:00 --mode opd --teacher-url http://127.0.0.1:30001

One run, top to bottom:

1. **Topics**: a fresh set ``retrain-<name>-turns``, ``-samples``, ``-control`` and their DLQs, made
   with the shapes ``topics.yaml`` declares (``<name>`` is ``--name``, default the start time),
   so the live topics and their consumer groups are never touched: a run spends no offsets and
   can be repeated with other settings.
2. **Replay** the archive (``--archive``) or the live ``turns`` topic range (``--from``/``--to``)
   into the new turns topic, then a ``session_end`` (reason ``end_of_range``) for every session
   the range leaves open, so the judge settles each last turn instead of waiting for a reply
   that is not in the range.
3. **Judge** (``pipeline judge`` with ``--mode``/``--backend``; group ``<name>-judge``) until every
   replayed main turn is settled, with a progress bar; an OPD teacher is ``--teacher-url``, or
   a frozen engine of ``--model`` started here (never an address where nothing listens).
4. **Trainer** (``pipeline trainer``, group ``<name>-trainer``, no engine to sync) for
   ``--steps`` batches of ``--batch-size`` (fewer when fewer samples carry a loss), its
   checkpoints and exported weights in ``<run-dir>``.
5. **Summary** (also ``<run-dir>/retrain.json``): turns judged, samples by kind, why turns gave
   no sample (the judge's own counters by reason), how many next states carried an OPD hint,
   and the trainer steps that ran.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

from pipeline import events
from pipeline.config import Config
from pipeline.bus.bounds import BoundError, parse_bound
from pipeline.history.replay import archive_records, replay, topic_records
from pipeline.orchestrate.supervisor import StageFailed, Supervisor, http_ok
from pipeline.procutil import free_port

HELP = "offline retraining in one command: archive or topic range -> replay -> judge -> trainer"


def add_arguments(parser) -> None:
    parser.add_argument("--archive", metavar="DIR", help="replay this archive (default: the live turns topic)")
    parser.add_argument("--from", dest="from_", metavar="TIME|OFFSETS", help="start, inclusive (default: the beginning)")
    parser.add_argument("--to", metavar="TIME|OFFSETS", help="end, exclusive (default: everything present now)")
    parser.add_argument("--mode", choices=("rl", "opd", "combine"), default="rl", help="judge mode (default rl)")
    parser.add_argument("--backend", help="judge backend (default judge.backend)")
    parser.add_argument("--teacher-url", help="OPD teacher engine (opd/combine; default: start a frozen --model)")
    parser.add_argument("--model", help="policy to train (trainer.model; default from config)")
    parser.add_argument("--steps", type=int, default=1, help="trainer steps at most (default 1)")
    parser.add_argument("--batch-size", type=int, help="samples per step (trainer.rollout_batch_size)")
    parser.add_argument("--name", help="names the run's topics and groups (default: retrain-<start time>)")
    parser.add_argument("--run-dir", help="checkpoints, weights, logs (default runs/<name>)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="give up after this long (default 1800)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def retrain_config(config: Config, args, name: str, run_dir: Path) -> Config:
    """``config`` for the run's stages: its own topic prefix, groups and folders."""
    trainer = {"group_id": f"{name}-trainer", "checkpoint_dir": str(run_dir / "checkpoints"),
               "export_dir": str(run_dir / "weights"), "metrics_file": str(run_dir / "trainer_metrics.jsonl"),
               "engines": [], "run_id": name}
    if args.model:
        trainer["model"] = args.model
    if args.batch_size:
        trainer["rollout_batch_size"] = args.batch_size
    judge = {"group_id": f"{name}-judge", "mode": args.mode, **({"backend": args.backend} if args.backend else {})}
    engine = {"teacher_url": args.teacher_url} if args.teacher_url else {}
    return config.replace(topics={"prefix": f"{name}-"}, judge=judge, trainer=trainer, engine=engine)


def source_records(config: Config, args, stats: dict):
    """The records to replay: the archive, or the live turns topic (config's own prefix)."""
    start = parse_bound(args.from_) if args.from_ else None
    end = parse_bound(args.to) if args.to else None
    if args.archive:
        return archive_records(args.archive, start, end, stats)
    return topic_records(config, config.topics.name("turns"), start, end, stats)


class OpenSessions:
    """The sessions a range of ``turns`` records leaves open (pure logic): every session with a
    record after its last applicable ``session_end``. An end that names a ``turn_index`` applies
    only while that is the session's latest main turn, as in the judge (:mod:`pipeline.judge.join`):
    an idle end that a newer turn overtook closes nothing, so that turn still gets its end.

    Attributes:
        open: session (:func:`pipeline.events.session_of`: the id, or ``(tenant, id)``) -> the
            record key to send its end with.
        main_turns: main turns seen.
    """

    def __init__(self) -> None:
        self.open: dict[str | tuple, str | None] = {}
        self.latest: dict[str | tuple, int] = {}  # session -> index of its latest main turn seen
        self.main_turns = 0

    def see(self, rec) -> None:
        """Take one record of the range, in topic order."""
        ev = rec.event
        if getattr(ev, "session_id", None) is None:
            return
        sid = events.session_of(ev)
        if isinstance(ev, events.SessionEnd):
            if ev.turn_index is None or ev.turn_index == self.latest.get(sid):
                self.open.pop(sid, None)
                self.latest.pop(sid, None)
            return
        self.open[sid] = rec.key if rec.key is not None else events.session_key(*events.split_session(sid))
        if isinstance(ev, events.Turn) and ev.turn_type == "main":
            self.main_turns += 1
            if ev.turn_index is not None:
                self.latest[sid] = ev.turn_index


def replay_range(config: Config, source, topic: str) -> dict:
    """Send ``source`` to ``topic``, then a ``session_end`` for each session it leaves open.

    Returns ``{"sent", "turns", "main_turns", "sessions", "closed"}`` (``closed``: sessions given an
    ``end_of_range`` end)."""
    from pipeline.bus import EventProducer

    seen = OpenSessions()

    def watch(records):
        for rec in records:
            seen.see(rec)
            yield rec

    producer = EventProducer(config, name="retrain")
    try:
        got = replay(watch(source), producer, topic)
        for skey, key in seen.open.items():
            tenant, sid = events.split_session(skey)
            producer.send(topic, events.SessionEnd(session_id=sid, reason="end_of_range", created_at=events.now_ms(),
                                                   tenant=tenant), key=key)
        producer.flush()
    finally:
        producer.close()
    return {**got, "main_turns": seen.main_turns, "closed": len(seen.open)}


def judge_settled(metrics: dict[str, float], main_turns: int) -> bool:
    """Every replayed main turn consumed, no job in flight, no record held back, no session waiting."""
    return (metrics.get("pipeline_judge_turns_total", 0) >= main_turns
            and metrics.get("pipeline_judge_jobs_in_flight", 0) == 0
            and metrics.get("pipeline_judge_records_held", 0) == 0
            and metrics.get("pipeline_judge_sessions_waiting", 0) == 0)


def wait_judged(sup: Supervisor, url: str, main_turns: int, deadline: float, bar) -> dict:
    """Poll the judge's metrics until :func:`judge_settled`; returns what it counted (totals and
    the reasons of the turns it did not judge). Raises StageFailed on an exit or a time-out."""
    from pipeline.orchestrate.up import scrape, scrape_by_label

    while True:
        m = scrape(url)
        if bar is not None:
            bar.n = int(min(main_turns, m.get("pipeline_judge_turns_total", 0)))
            bar.refresh()
        if m and judge_settled(m, main_turns):
            return {"totals": m,
                    "unjudged": scrape_by_label(url, "pipeline_judge_unjudged_turns_total", "reason"),
                    "dropped": scrape_by_label(url, "pipeline_judge_dropped_total", "reason")}
        lines = sup.check()
        if lines or time.monotonic() > deadline:
            raise StageFailed("judge: " + ("; ".join(lines) if lines else "did not settle every turn in time"))
        time.sleep(0.5)


def read_samples(config: Config) -> list[events.Sample]:
    """Every sample of the run's samples topic."""
    from pipeline.bus import read_events

    return [e for e in read_events(config, "samples") if isinstance(e, events.Sample)]


def summary(got: dict, judged: dict, samples: list, steps: int, steps_note: str | None) -> dict:
    """What the run judged and trained, and why anything produced no sample."""
    totals = judged["totals"]
    return {
        "replayed": got, "samples": len(samples), "samples_by_kind": dict(Counter(s.kind for s in samples)),
        "samples_with_loss": sum(1 for s in samples if s.loss_mask),
        "not_judged_by_reason": {k: int(v) for k, v in judged["unjudged"].items() if v},
        "no_sample_by_reason": {k: int(v) for k, v in judged["dropped"].items() if v},
        "hints": {"asked": int(totals.get("pipeline_judge_hint_requests_total", 0)),
                  "accepted": int(totals.get("pipeline_judge_hints_accepted_total", 0))},
        "trainer_steps": steps, "trainer_note": steps_note,
    }


def print_summary(s: dict, run_dir: Path) -> None:
    r = s["replayed"]
    print(f"replayed            {r['sent']} records: {r['main_turns']} main turns in {r['sessions']} sessions "
          f"({r['closed']} left open by the range, ended as end_of_range)")
    print(f"samples             {s['samples']} by kind {s['samples_by_kind']}, {s['samples_with_loss']} with a loss")
    if s["no_sample_by_reason"]:
        print(f"no sample           {s['no_sample_by_reason']}")
    if s["not_judged_by_reason"]:
        print(f"not judged          {s['not_judged_by_reason']}")
    h = s["hints"]
    if h["asked"]:
        print(f"OPD hints           {h['accepted']} of {h['asked']} next states carried a hint")
    print(f"trainer             {s['trainer_steps']} steps" + (f" ({s['trainer_note']})" if s["trainer_note"] else ""))
    print(f"run folder          {run_dir} (retrain.json, logs/, checkpoints/, weights/)")


def plan_steps(args, config: Config, samples: list) -> tuple[int, str | None]:
    """Trainer steps to run: ``--steps``, at most as many full batches as the samples make."""
    batch = config.trainer.rollout_batch_size
    usable = len(samples) if config.trainer.count_masked_samples else sum(1 for s in samples if s.loss_mask)
    steps = min(args.steps, usable // batch)
    if steps < args.steps:
        return steps, f"{usable} samples with a loss make {usable // batch} full batch(es) of {batch}"
    return steps, None


def start_judge(sup: Supervisor, config: Config, cfg_path: Path, args, run_dir: Path) -> str:
    """Start the teacher (when needed and not given) and the judge; returns the judge's metrics URL."""
    from pipeline.orchestrate.up import write_config_file

    if args.mode != "rl" and not args.teacher_url:
        port = free_port()
        config = config.replace(engine={"teacher_url": f"http://127.0.0.1:{port}"})
        write_config_file(config, cfg_path)
        model = config.trainer.model
        print(f"[retrain] no --teacher-url: starting a frozen {model} as the OPD teacher on port {port}", flush=True)
        sup.start("teacher", ["engine", "--model", model, "--port", str(port), "--config", str(cfg_path)],
                  ready=http_ok(f"http://127.0.0.1:{port}/health"), timeout_s=600)
    mport = free_port()
    sup.start("judge", ["judge", "--config", str(cfg_path), "--set", f"metrics_port={mport}"],
              ready=http_ok(f"http://127.0.0.1:{mport}/metrics"), timeout_s=600)
    return f"http://127.0.0.1:{mport}/metrics"


def run_trainer(sup: Supervisor, cfg_path: Path, steps: int, deadline: float) -> None:
    """Run the trainer for ``steps`` batches and wait for it to exit. Raises StageFailed."""
    st = sup.start("trainer", ["trainer", "--config", str(cfg_path), "--max-steps", str(steps), "--no-progress"])
    while st.alive:
        if time.monotonic() > deadline:
            raise StageFailed("trainer did not finish in time")
        time.sleep(0.5)
    if st.proc.returncode != 0:
        raise StageFailed(f"trainer exited with {st.proc.returncode}; see {st.log_path}:\n{st.tail()}")


def run(args, config: Config) -> int:
    from pipeline.bus import read_events
    from pipeline.orchestrate.up import write_config_file
    from pipeline.bus.admin import apply_topics
    from pipeline.topics import load_topics

    name = args.name or time.strftime("retrain-%Y%m%d-%H%M%S")
    run_dir = Path(args.run_dir or f"runs/{name}")
    run_dir.mkdir(parents=True, exist_ok=True)
    rconfig = retrain_config(config, args, name, run_dir)
    apply_topics(rconfig, load_topics(rconfig.topics.file))
    if read_events(rconfig, "turns"):  # a second replay into the same topics would count everything twice
        print(f"pipeline retrain: the topics of run {name!r} ({rconfig.topics.name('turns')}) already hold records: "
              f"give another --name (each run judges and trains on topics of its own)", file=sys.stderr)
        return 2
    stats: dict = {}
    try:
        source = source_records(config, args, stats)
    except BoundError as e:
        print(f"pipeline retrain: {e}", file=sys.stderr)
        return 2
    print(f"[retrain] {name}: replaying {'archive ' + args.archive if args.archive else config.topics.name('turns')} "
          f"into {rconfig.topics.name('turns')}", flush=True)
    got = replay_range(rconfig, source, rconfig.topics.name("turns"))
    if not got["main_turns"]:
        print("pipeline retrain: the range holds no main turn: nothing to judge", file=sys.stderr)
        return 1
    cfg_path = run_dir / "config.yaml"
    write_config_file(rconfig, cfg_path)
    sup = Supervisor(run_dir / "logs")
    deadline = time.monotonic() + args.timeout_s
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=got["main_turns"], unit="turn", desc="judged", dynamic_ncols=True)
    try:
        url = start_judge(sup, rconfig, cfg_path, args, run_dir)
        judged = wait_judged(sup, url, got["main_turns"], deadline, bar)
        samples = read_samples(rconfig)
        steps, note = plan_steps(args, rconfig, samples)
        if steps:
            run_trainer(sup, cfg_path, steps, deadline)
    except StageFailed as e:
        print(f"pipeline retrain: {e}", file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
        sup.stop_all()
    result = summary(got, judged, samples, steps, note)
    (run_dir / "retrain.json").write_text(json.dumps(result, indent=2))
    print_summary(result, run_dir)
    return 0
