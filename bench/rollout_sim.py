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


def _wilson(k, n, z: float):
    """Vectorized :func:`pipeline.rollout.stats.wilson_interval` (arrays of counts; n = 0 -> (0, 1))."""
    nn = np.maximum(n, 1)
    p = k / nn
    denom = 1 + z * z / nn
    centre = (p + z * z / (2 * nn)) / denom
    half = z * np.sqrt(p * (1 - p) / nn + z * z / (4 * nn * nn)) / denom
    return np.where(n > 0, np.maximum(0.0, centre - half), 0.0), np.where(n > 0, np.minimum(1.0, centre + half), 1.0)


def _newcombe(s1, n1, s2, n2, z: float):
    """Vectorized :func:`pipeline.rollout.stats.newcombe_difference`, rounded as the rule rounds."""
    l1, u1 = _wilson(s1, n1, z)
    l2, u2 = _wilson(s2, n2, z)
    p1, p2 = s1 / np.maximum(n1, 1), s2 / np.maximum(n2, 1)
    d = p1 - p2
    empty = (n1 == 0) | (n2 == 0)
    low = np.where(empty, -1.0, np.maximum(-1.0, d - np.hypot(p1 - l1, u2 - p2)))
    high = np.where(empty, 1.0, np.minimum(1.0, d + np.hypot(u1 - p1, p2 - l2)))
    return np.round(low, 6), np.round(high, 6)


def live_run(rng, p_cand: float, p_inc: float, config: RolloutConfig, share: float) -> tuple[str, int]:
    """(decision, judged turns of the smaller arm at it) of one canary as the live fold runs it:
    each judged sample is the candidate's with probability ``share`` (the canary's share of
    sessions) and the rule looks after **every** sample (live reward only, no guard)."""
    t = int(config.max_n / min(share, 1 - share) * 1.3) + 1
    arm = rng.random(t) < share
    win = rng.random(t) < np.where(arm, p_cand, p_inc)
    nc, ni = np.cumsum(arm), np.cumsum(~arm)
    sc, si = np.cumsum(arm & win), np.cumsum(~arm & win)
    n = np.minimum(nc, ni)
    low, _ = _newcombe(sc, nc, si, ni, config.z)
    _, high_rb = _newcombe(sc, nc, si, ni, config.rollback_z)
    rollback = (n >= config.rollback_min_n) & (high_rb < 0)
    promote = (n >= config.min_n) & (low > -config.margin)
    stop = rollback | promote | (n >= config.max_n)
    if not stop.any():
        return "wait", int(n[-1])
    i = int(np.argmax(stop))
    return ("rollback" if rollback[i] else "promote" if promote[i] else "rollback"), int(n[i])


def check_live(rng, config: RolloutConfig, share: float, runs: int = 5) -> None:
    """The vectorized path against :func:`pipeline.rollout.rule.decide` sample by sample."""
    for _ in range(runs):
        seed = int(rng.integers(1 << 30))
        got = live_run(np.random.default_rng(seed), 0.45, 0.5, config, share)
        r = np.random.default_rng(seed)
        t = int(config.max_n / min(share, 1 - share) * 1.3) + 1
        arm = r.random(t) < share
        win = r.random(t) < np.where(arm, 0.45, 0.5)
        c, i, want = Counts(), Counts(), ("wait", None)
        for a, w in zip(arm, win):
            c, i = (c.add(bool(w)), i) if a else (c, i.add(bool(w)))
            d = decide(Arm(c), Arm(i), config)
            if d.action != "wait":
                want = (d.action, min(c.n, i.n))
                break
        assert want[0] == got[0] and (want[1] is None or want[1] == got[1]), (want, got)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--look", type=int, default=50, help="judged turns per arm between looks")
    ap.add_argument("--p-incumbent", type=float, default=0.5)
    ap.add_argument("--eval-n", type=int, default=200, help="items of the guard's eval set per version")
    ap.add_argument("--live", action="store_true",
                    help="as the live fold decides: a look after every judged sample, the arms split by --share")
    ap.add_argument("--share", type=float, default=0.1, help="--live: the canary's share (default 0.1)")
    args = ap.parse_args()
    config = RolloutConfig()
    rng = np.random.default_rng(args.seed)
    if args.live:
        check_live(rng, config, args.share)
        print(f"config {config}  runs {args.runs}  seed {args.seed}  live: a look after every sample, "
              f"share {args.share}  p_incumbent {args.p_incumbent}")
        for delta in (-0.20, -0.10, -0.07, -0.05, 0.0, 0.05, 0.10):
            out = [live_run(rng, args.p_incumbent + delta, args.p_incumbent, config, args.share)
                   for _ in range(args.runs)]
            acts = [a for a, _ in out]
            print(f"delta {delta:+.2f}: promoted {acts.count('promote') / args.runs:.4f}  "
                  f"rolled back {acts.count('rollback') / args.runs:.4f}  undecided {acts.count('wait') / args.runs:.4f}"
                  f"  mean n (smaller arm) at decision {float(np.mean([n for _, n in out])):.0f}")
        return
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
