"""Fold the ``control`` + ``turns`` + ``samples`` (+ ``metrics`` evaluations) records into canary
state and decisions: the same records in the same order always decide the same.

Scopes: the full weights (scope None, versions are ``policy_version`` ints, the first incumbent
is version 0) and each tenant's adapter (scope = the tenant, versions are adapter content ids,
the first incumbent is the base model: None). A record belongs to a tenant's scope when it names
an adapter, or its tenant has had an adapter order on ``control``; every other record to the full
weights' scope.

A canary opens at a ``weights`` order of its scope (not of its incumbent, of a version it
rolled back, nor again of its open candidate: a re-published order changes nothing); its arms
count from then on (the incumbent's
earlier samples are not counted: both arms see the same period's users). A newer ``weights``
while a canary is open supersedes its candidate (dropped undecided, never served to new sessions;
the incumbent stays). After each judged sample (``reward`` not None; success: ``reward > 0``) and
each evaluation of an arm, :func:`pipeline.rollout.rule.decide` runs (a sample counts only when its
turn was recorded with token ids: a turn the proxy recorded without them, because the engine
reported another adapter or the version that served it is unknown, cannot say which arm served
it, and its adapter field would read as the base model's; the ``served`` counts are the proxy's
main turns whose routed arm, ``Turn.canary``, agrees with the version recorded); a ``promote``/``rollback``
becomes a :class:`~pipeline.events.Control` with its evidence, applied at once, and its
``created_at`` is the triggering record's (so a replay builds the identical record). A decision
read on ``control`` (published earlier, or by another instance before a restart) is applied as
it is and never made again; the *first* decision recorded for a candidate is the one the
proxy and the syncers followed (:mod:`pipeline.rollout.serving`), so when this fold already
decided that candidate otherwise (it saw the records in another order) and nothing happened in
the scope since, the recorded decision overrules its own. A tenant's ``reset``/``delete``
closes its canary (the base model serves it).

Which rule decides: a tenant's adapter is compared live (both arms serve during its canary:
:func:`pipeline.rollout.rule.decide`). The full weights' scope is decided by ``full_weights``:
``"evalset"`` (one full-weight engine serves the live candidate to everyone, so the
eval set's guards alone decide, :func:`pipeline.rollout.rule.decide_evalset`, evidence ``rule``
:data:`~pipeline.rollout.rule.EVALSET_RULE_NAME`) or ``"live"`` (the live-arm rule, then the eval guards when configured: a full-weight canary over
several engines, ``rollout.canary_engines``, where the candidate serves only the canary share;
the evaluator's decider picks it from ``rollout.full_weights_gate``). There is no default: the
gate is the records' config's (``rollout.full_weights_gate``), never a silent guess.

Guards come from :class:`~pipeline.events.Evaluation` records (``metrics[name]`` a rate over
``metrics[name + '_n']``, else ``n``; :mod:`pipeline.rollout.evalset` writes them): of the full
weights (no ``tenant``: version ``policy_version``) or of a tenant's scope (``tenant`` set:
version = its ``adapter``'s, None: the base model). An evaluation is of a version, not of a
period: the latest one of each (scope, version) is kept, and a canary that opens starts with
its arms' kept evaluations (the incumbent is usually evaluated before its successor's canary).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pipeline import events
from pipeline.rollout.rule import EVALSET_RULE_NAME, RULE_NAME, Arm, Counts, RolloutConfig, decide, decide_evalset

#: how the full weights' scope is decided (module docstring)
FULL_WEIGHTS_GATES = ("evalset", "live")


@dataclass
class Canary:
    """One open canary of a scope: ``candidate`` vs ``incumbent`` (versions), the adapter and
    epoch of the candidate's ``weights`` order, and per arm its reward counts, guard counts and
    turns served (``turns``: ``candidate``/``incumbent`` -> count)."""

    candidate: int | str
    incumbent: int | str | None
    epoch: int
    policy_version: int
    adapter: dict | None
    reward: dict = field(default_factory=lambda: {"candidate": Counts(), "incumbent": Counts()})
    guards: dict = field(default_factory=lambda: {"candidate": {}, "incumbent": {}})
    turns: dict = field(default_factory=lambda: {"candidate": 0, "incumbent": 0})

    def arm_of(self, version) -> str | None:
        return "candidate" if version == self.candidate else "incumbent" if version == self.incumbent else None


@dataclass
class ScopeState:
    """A scope's incumbent, its open canary (or None) and the versions it rolled back."""

    incumbent: int | str | None
    canary: Canary | None = None
    rolled_back: set = field(default_factory=set)
    decisions: list = field(default_factory=list)  # (action, candidate) in the order applied
    decided: dict = field(default_factory=dict)  # candidate -> (action, the incumbent it was compared with)
    recorded: set = field(default_factory=set)  # candidates whose decision was read on control


class RolloutFold:
    """Feed records with :meth:`apply`; read :attr:`scopes`. ``run_id``: only this run's orders;
    ``full_weights``: the full weights' gate, one of :data:`FULL_WEIGHTS_GATES` (module docstring).
    Raises ValueError on another gate."""

    def __init__(self, config: RolloutConfig, run_id: str = "default", *, full_weights: str):
        if full_weights not in FULL_WEIGHTS_GATES:
            raise ValueError(f"full_weights must be one of {FULL_WEIGHTS_GATES}, got {full_weights!r}")
        self.config, self.run_id, self.full_weights = config, run_id, full_weights
        self.scopes: dict[str | None, ScopeState] = {None: ScopeState(incumbent=0)}
        self.evaluations: dict[tuple, dict] = {}  # (scope, version) -> guard name -> Counts (latest)

    def _scope(self, ev) -> tuple[str | None, int | str | None]:
        """(scope, version) of a turn, sample or evaluation."""
        tenant, adapter = getattr(ev, "tenant", None), getattr(ev, "adapter", None)
        if tenant is not None and (adapter is not None or tenant in self.scopes):
            return tenant, adapter["version"] if adapter is not None else None
        return None, ev.policy_version

    def apply(self, ev: events.Event) -> events.Control | None:
        """Fold one record; returns the decision it triggered (already applied), or None."""
        if isinstance(ev, events.Control):
            if ev.run_id == self.run_id:
                self._control(ev)
            return None
        if isinstance(ev, events.Turn):
            if ev.turn_type != "main" or ev.source != "proxy":  # served: the users' own turns
                return None
            scope, version = self._scope(ev)
            canary = self.scopes.get(scope, ScopeState(None)).canary
            arm = canary.arm_of(version) if canary else None
            if arm and ev.canary in (None, arm):  # routed to one arm, recorded as another: unknown
                canary.turns[arm] += 1
            return None
        if isinstance(ev, events.Sample) and ev.reward is not None and ev.response_length > 0:
            scope, version = self._scope(ev)
            return self._count(scope, version, ev.created_at, reward=ev.reward > 0)
        if isinstance(ev, events.Evaluation) and ev.run_id == self.run_id:
            scope = ev.tenant
            version = (ev.adapter or {}).get("version") if scope is not None else ev.policy_version
            self.evaluations[(scope, version)] = self._guards(ev)
            return self._count(scope, version, ev.created_at, evaluation=ev)
        return None

    def _guards(self, evaluation: events.Evaluation) -> dict:
        """The configured guards an evaluation holds, as counts (a malformed metric is left out)."""
        out = {}
        for name in self.config.guards:
            rate, n = evaluation.metrics.get(name), evaluation.metrics.get(f"{name}_n", evaluation.n)
            if isinstance(rate, (int, float)) and 0 <= rate <= 1 and isinstance(n, int) and n >= 0:
                out[name] = Counts(round(rate * n), n)
        return out

    def _control(self, ev: events.Control) -> None:
        scope = None if ev.full_weights else ev.tenant
        state = self.scopes.setdefault(scope, ScopeState(incumbent=None if scope is not None else 0))
        if ev.action == "weights":
            version = ev.policy_version if scope is None else ev.adapter["version"]
            open_same = state.canary is not None and state.canary.candidate == version
            if version != state.incumbent and version not in state.rolled_back and not open_same:
                state.canary = Canary(version, state.incumbent, ev.epoch, ev.policy_version, ev.adapter)
                for arm, v in (("candidate", version), ("incumbent", state.incumbent)):
                    state.canary.guards[arm] = dict(self.evaluations.get((scope, v), {}))
        elif ev.action in ("reset", "delete"):  # the tenant's adapters are gone: served by the base
            state.canary, state.incumbent = None, None
        elif ev.action in events.ROLLOUT_DECISIONS:
            version = ev.policy_version if scope is None else (ev.adapter or {}).get("version")
            first = version not in state.recorded
            state.recorded.add(version)
            if state.canary is not None and state.canary.candidate == version:
                self._decided(state, ev.action)
            elif first and version in state.decided and state.decided[version][0] != ev.action:
                self._overrule(state, version, ev.action)
            # else: this fold already made it (the record of its own decision), the candidate
            # was superseded, or a later record about a decided candidate: nothing to apply

    def _decided(self, state: ScopeState, action: str) -> None:
        cand = state.canary.candidate
        state.decided[cand] = (action, state.canary.incumbent)
        if action == "promote":
            state.incumbent = cand
        else:
            state.rolled_back.add(cand)
        state.decisions.append((action, cand))
        state.canary = None

    @staticmethod
    def _overrule(state: ScopeState, version, action: str) -> None:
        """The first recorded decision about ``version`` is ``action``, not this fold's own: take
        the record's, when nothing happened in the scope since (no canary open; after an own
        promote, ``version`` still the incumbent). Otherwise the fold keeps its own."""
        own, before = state.decided[version]
        if state.canary is not None or (own == "promote" and state.incumbent != version):
            return
        if action == "promote":
            state.rolled_back.discard(version)
            state.incumbent = version
        else:
            state.rolled_back.add(version)
            state.incumbent = before
        state.decided[version] = (action, before)
        state.decisions.append((action, version))

    def _count(self, scope, version, created_at: int, reward: bool | None = None,
               evaluation: events.Evaluation | None = None) -> events.Control | None:
        state = self.scopes.get(scope)
        canary = state.canary if state else None
        arm = canary.arm_of(version) if canary else None
        if arm is None:
            return None
        if reward is not None:
            canary.reward[arm] = canary.reward[arm].add(reward)
        else:
            canary.guards[arm] = dict(self._guards(evaluation))
        return self._maybe_decide(scope, state, created_at)

    def _maybe_decide(self, scope, state: ScopeState, created_at: int) -> events.Control | None:
        canary = state.canary
        gate = scope is None and self.full_weights == "evalset"
        d = (decide_evalset if gate else decide)(Arm(canary.reward["candidate"], canary.guards["candidate"]),
                                                 Arm(canary.reward["incumbent"], canary.guards["incumbent"]),
                                                 self.config)
        if d.action == "wait":
            return None
        arms = {a: {"reward": [canary.reward[a].successes, canary.reward[a].n],
                    "served": [canary.turns[a], canary.turns["candidate"] + canary.turns["incumbent"]],
                    **{g: [c.successes, c.n] for g, c in canary.guards[a].items()}} for a in events.CANARY_ARMS}
        config = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.config).items()}
        evidence = {"rule": EVALSET_RULE_NAME if gate else RULE_NAME, "reason": d.reason, "config": config,
                    "incumbent": canary.incumbent, "arms": arms, "bounds": d.bounds}
        out = events.Control(action=d.action, epoch=canary.epoch, policy_version=canary.policy_version,
                             run_id=self.run_id, created_at=created_at, tenant=scope,
                             adapter=canary.adapter, evidence=evidence)
        self._decided(state, d.action)
        return out


def replay(records, config: RolloutConfig, run_id: str = "default", *, full_weights: str) -> list[events.Control]:
    """The decisions a :class:`RolloutFold` (``run_id``, ``full_weights``: its gate) makes over
    ``records`` (events, in log order) that the
    records do not already hold: a decision equal to one recorded later in ``records`` (the
    record a live decider published right after the sample that triggered it) is not new, so a
    replay of a log with its decisions returns ``[]`` and one without them returns them all."""
    records = list(records)
    recorded = [r for r in records if isinstance(r, events.Control) and r.action in events.ROLLOUT_DECISIONS]
    fold = RolloutFold(config, run_id, full_weights=full_weights)
    out = []
    for d in map(fold.apply, records):
        if d is None:
            continue
        if d in recorded:
            recorded.remove(d)
        else:
            out.append(d)
    return out
