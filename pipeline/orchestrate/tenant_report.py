"""The two-tenant demo's report logic (``pipeline demo --tenants`` / ``--shared``): pure functions.

Two simulated users want different things (docs/tenants.md, Demo): ``alice`` rewards brevity
(``brief_rate``: within 64 tokens and at most 40 words), ``bob`` the working laid out one step per
line (``stepwise_rate``: at least 4 lines holding a word). Every held-out evaluation grades the
same replies for both properties, so each evaluation gives both users' metrics.

- :func:`curves`: one curve per user: its own metric and the other user's metric, per evaluated
  version of what served it (its adapter with ``--tenants``, the one shared policy with
  ``--shared``), each with successes, n and the Wilson 95% interval; the base's evaluation beside.
- :func:`tenant_verdicts`: per user, ``learned`` (the last version's interval of its own metric
  lies wholly above the base's) and ``moved_toward_other`` (the last version's interval of the
  other user's metric lies wholly above the base's: the adapter picked up the other user's
  preference).

Nothing here reads a clock or a topic; ``pipeline.orchestrate.tenant_demo`` feeds it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.orchestrate.demo_common import wilson_interval


@dataclass(frozen=True)
class User:
    """One simulated user population: ``tenant`` (its ``X-Tenant-Id``), ``feedback`` (its
    :mod:`pipeline.simulate.feedback` policy) and ``metric`` (the key of
    :func:`pipeline.simulate.evaluate.evaluate`'s result that measures that preference)."""

    tenant: str
    feedback: str
    metric: str


USERS = (User("alice", "brevity", "brief_rate"), User("bob", "steps", "stepwise_rate"))


def point(evaluation: dict, metric: str) -> dict:
    """``metric`` of one evaluation as ``{rate, successes, n, ci95}`` (Wilson 95%); a missing metric
    or n = 0 gives ``rate`` None and the uninformative interval [0, 1] (never a stand-in rate).

    Raises:
        ValueError: a rate outside [0, 1].
    """
    n = int(evaluation.get("n") or 0)
    rate = evaluation.get(metric)
    if rate is None or n == 0:
        return {"rate": None, "successes": 0, "n": n, "ci95": [0.0, 1.0]}
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"{metric} {rate} is not a rate in [0, 1]")
    k = round(rate * n)
    return {"rate": rate, "successes": k, "n": n, "ci95": [round(x, 4) for x in wilson_interval(k, n)]}


def curves(evaluations: list[dict], users=USERS) -> dict:
    """Per user, its curve over the versions that served it, with the base beside.

    ``evaluations``: held-out evaluations in the order they ran, each with ``target`` (a tenant,
    ``"base"`` or ``"shared"``: the one policy of ``--shared``, serving every user), ``version``
    (what was evaluated: an adapter name, or the shared policy's weight version), ``n`` and the
    metric rates. A user's curve holds the evaluations of its own tenant and of ``"shared"``.

    Returns ``{"base": {metric: point} | None, "users": {tenant: {feedback, metric, other_metric,
    points: [{version, own: point, other: point}]}}}``; the base is the first ``"base"`` evaluation.
    """
    base_ev = next((e for e in evaluations if e.get("target") == "base"), None)
    metrics = [u.metric for u in users]
    out = {"base": None if base_ev is None else {m: point(base_ev, m) for m in metrics}, "users": {}}
    for u in users:
        other = [v.metric for v in users if v.metric != u.metric]
        other_metric = other[0] if other else None
        pts = [{"version": str(e.get("version")), "own": point(e, u.metric),
                "other": point(e, other_metric) if other_metric else None}
               for e in evaluations if e.get("target") in (u.tenant, "shared")]
        out["users"][u.tenant] = {"feedback": u.feedback, "metric": u.metric, "other_metric": other_metric,
                                  "points": pts}
    return out


def _above(p: dict, q: dict) -> bool:
    """``p``'s interval lies wholly above ``q``'s (both with a rate)."""
    return p["rate"] is not None and q["rate"] is not None and p["ci95"][0] > q["ci95"][1]


def tenant_verdicts(report_curves: dict) -> dict:
    """Per user: ``learned`` (last point's own metric wholly above the base's interval),
    ``moved_toward_other`` (last point's other-user metric wholly above the base's), the rates
    compared; None for a user without points or without a base evaluation."""
    base = report_curves.get("base")
    out: dict[str, dict | None] = {}
    for tenant, c in report_curves["users"].items():
        if not c["points"] or base is None:
            out[tenant] = None
            continue
        last = c["points"][-1]
        own_b, other_b = base[c["metric"]], base.get(c["other_metric"]) if c["other_metric"] else None
        out[tenant] = {
            "last_version": last["version"], "own_metric": c["metric"],
            "base_own": own_b["rate"], "last_own": last["own"]["rate"], "learned": _above(last["own"], own_b),
            "other_metric": c["other_metric"],
            "base_other": other_b["rate"] if other_b else None,
            "last_other": last["other"]["rate"] if last["other"] else None,
            "moved_toward_other": bool(other_b and last["other"] and _above(last["other"], other_b))}
    return out


def _cell(p: dict | None) -> str:
    if p is None or p["rate"] is None:
        return "n/a"
    lo, hi = p["ci95"]
    return f"{p['successes']}/{p['n']} = {p['rate']:.2f} ({lo:.2f}-{hi:.2f})"


def summary_lines(report: dict) -> list[str]:
    """The console table: per user and version, its own metric and the other user's, with the
    base first; then the verdicts."""
    c = report["curves"]
    lines = [f"two-tenant demo ({report['mode']}): held-out successes/n = rate (Wilson 95%)"]
    for tenant, u in c["users"].items():
        lines.append(f"  {tenant} ({u['feedback']}): own {u['metric']} | other user's {u['other_metric']}")
        if c["base"] is not None:
            lines.append(f"    {'base':>20}  {_cell(c['base'][u['metric']]):>28} | "
                         f"{_cell(c['base'].get(u['other_metric'])):>28}")
        for p in u["points"]:
            lines.append(f"    {p['version'][:20]:>20}  {_cell(p['own']):>28} | {_cell(p['other']):>28}")
    for tenant, v in (report.get("verdicts") or {}).items():
        if v is None:
            lines.append(f"  verdict {tenant}: no evaluated version")
            continue
        lines.append(f"  verdict {tenant}: own {v['own_metric']} {v['base_own']} -> {v['last_own']} "
                     f"(learned: {'yes' if v['learned'] else 'no'}); other user's {v['other_metric']} "
                     f"{v['base_other']} -> {v['last_other']} (moved toward the other user: "
                     f"{'yes' if v['moved_toward_other'] else 'no'})")
    return lines
