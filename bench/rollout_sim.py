"""Simulated error rates of the rollout rule (pipeline/rollout/rule.py) at its default config.

Each run draws live judged rewards (Bernoulli) for a candidate and an incumbent arm, looks at the
counts every ``--look`` judged turns per arm (as the live fold does, after every sample), and
stops at the first ``promote`` or ``rollback`` (or at ``max_n``). Reported per true difference:
the share of runs promoted, rolled back, and the mean judged turns per arm at the decision.
"Truly worse promoted" is the promote rate of a candidate below the incumbent by more than the
margin; "truly better rolled back" the rollback rate of a candidate above it.

    python bench/rollout_sim.py --runs 2000 --seed 0

Output: one line per scenario (stdout), then the guard table. CPU only, ~10 s at 2000 runs.
"""

from __future__ import annotations

import argparse

import numpy as np

from pipeline.rollout.rule import Arm, Counts, RolloutConfig, decide


def one_run(rng, p_cand: float, p_inc: float, config: RolloutConfig, look: int,
            guards: tuple[dict, dict] = ({}, {})) -> tuple[str, int]:
    """(decision, judged turns per arm at it) of one simulated canary; ``guards``: the eval
    set's counts per arm (fixed for the run: one evaluation per version)."""
    cand = np.cumsum(rng.random(config.max_n) < p_cand)
    inc = np.cumsum(rng.random(config.max_n) < p_inc)
    for n in range(look, config.max_n + 1, look):
        d = decide(Arm(Counts(int(cand[n - 1]), n), guards[0]), Arm(Counts(int(inc[n - 1]), n), guards[1]), config)
        if d.action != "wait":
            return d.action, n
    return "wait", config.max_n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--look", type=int, default=50, help="judged turns per arm between looks")
    ap.add_argument("--p-incumbent", type=float, default=0.5)
    ap.add_argument("--eval-n", type=int, default=200, help="items of the guard's eval set per version")
    args = ap.parse_args()
    config = RolloutConfig()
    rng = np.random.default_rng(args.seed)
    print(f"config {config}  runs {args.runs}  seed {args.seed}  look every {args.look}  "
          f"p_incumbent {args.p_incumbent}")
    for delta in (-0.20, -0.10, -0.07, -0.05, 0.0, 0.05, 0.10):
        out = [one_run(rng, args.p_incumbent + delta, args.p_incumbent, config, args.look) for _ in range(args.runs)]
        acts = [a for a, _ in out]
        mean_n = float(np.mean([n for _, n in out]))
        print(f"delta {delta:+.2f}: promoted {acts.count('promote') / args.runs:.4f}  "
              f"rolled back {acts.count('rollback') / args.runs:.4f}  "
              f"undecided {acts.count('wait') / args.runs:.4f}  mean n/arm at decision {mean_n:.0f}")
    guarded(rng, args, eval_n=args.eval_n)


def guarded(rng, args, eval_n: int = 200, p_guard: float = 0.5) -> None:
    """The reward-hacking table: the candidate's live reward is truly +0.10 better, its guard
    (an eval set of ``eval_n`` items, incumbent rate ``p_guard``) truly moves by ``delta``."""
    config = RolloutConfig(guards=("accuracy",))
    print(f"guard 'accuracy': eval n {eval_n} per version, p_incumbent {p_guard}, live reward delta +0.10")
    for delta in (-0.30, -0.20, -0.10, 0.0, 0.05):
        out = []
        for _ in range(args.runs):
            g = ({"accuracy": Counts(int(rng.binomial(eval_n, p_guard + delta)), eval_n)},
                 {"accuracy": Counts(int(rng.binomial(eval_n, p_guard)), eval_n)})
            out.append(one_run(rng, args.p_incumbent + 0.10, args.p_incumbent, config, args.look, g)[0])
        print(f"guard delta {delta:+.2f}: promoted {out.count('promote') / args.runs:.4f}  "
              f"rolled back {out.count('rollback') / args.runs:.4f}")


if __name__ == "__main__":
    main()
