"""Live metrics per version, folded from the records alone (issue 39, item 2; pure, no I/O).

:class:`LiveVersions` is fed ``turns``, ``samples``, ``control`` and ``metrics`` records in any
interleaving of the topics (each topic in its own order) and keeps, per **scope** and **version**:

- scope ``None`` (the full weights; versions are ``policy_version`` ints) and one scope per tenant
  (versions are adapter content ids, shown by the adapter's name; ``None`` = the base model).
  Where a record goes is decided by the record alone (so any interleaving of the topics gives the
  same counts): a turn or sample that names an ``adapter`` counts for its tenant's adapter
  version; one without an adapter counts for the full weights' ``policy_version`` and, when it
  has a tenant, also for that tenant's ``base`` row (a tenant's table then holds every version
  that served it; the full weights' table every turn the full weights served alone).
- **turns served**: ``turns`` records of type :class:`~pipeline.events.Turn`, main turns from
  the proxy only (``source`` ``proxy``: imported and replayed turns were not served by a version;
  side turns such as titles and agent housekeeping are not conversation answers);
  ``canary_turns``: those recorded with a canary arm (``Turn.canary``);
- **unfinished**: turns whose ``finish_reason`` is not one of :data:`pipeline.events.FINISHED`
  (``stop``, ``length``, ``tool_calls``, ``function_call``): ``abort``, or none;
- **refusals**: a *heuristic* on the reply text (:func:`is_refusal`: one of
  :data:`REFUSAL_MARKERS` in its first :data:`REFUSAL_WINDOW` characters, case-insensitive). It
  misses refusals worded otherwise (and other languages) and counts replies such as "I can't
  wait": a trend to compare versions by, not a classifier;
- **words per reply**: whitespace-separated words of the reply's ``content``, mean over turns
  served (a reply with tool calls only has 0 words);
- **judged reward rate**: samples with ``reward > 0`` over samples with a reward (``None`` = not
  judged: not counted), as the decider counts (:mod:`pipeline.rollout.fold`);
- **explicit feedback**: samples that carry the turn's explicit feedback (``Sample.feedback_score``
  not None, docs/feedback.md), rate of positive ones (``feedback_score > 0``). Feedback events on
  ``turns`` name a session and turn index, not the version that served it; the judge copies them
  into the turn's sample with the turn's version, so the samples are what the records allow
  (counts only: no per-turn memory). ``reward_feedback``: samples whose ``reward_source``
  includes ``feedback``;
- each rate with its n and its 95% Wilson interval (:func:`pipeline.rollout.stats.wilson_interval`);
- its **role** from ``control`` (:class:`pipeline.rollout.serving.ServingView`): ``incumbent``,
  ``candidate`` (``live`` once resumed), ``rolled back``, ``previous`` (an incumbent since
  replaced), ``superseded`` (a candidate dropped undecided); with rollout off (``rollout=False``,
  today's behaviour) a version resumed is the incumbent at once, until a decision or a canary
  turn shows that rollout is on. Its **decision** (the
  ``promote``/``rollback`` record's action and evidence: reason, bounds, counts per arm);
- its **eval-set results**: the latest :class:`~pipeline.events.Evaluation` of each eval-set
  name for the version (``metrics[m]``, ``metrics[m + '_n']`` else ``n``, and the
  ``_low``/``_high`` bounds when present, else Wilson bounds when ``m + '_n'`` is given). An
  evaluation's scope is its ``tenant``/``adapter`` when the record has these fields.

Counts, not records: a re-delivered sample is counted again (as the decider does). Memory: a
fixed set of counters per version, at most :data:`MAX_VERSIONS` versions per scope (the oldest
one that is not the incumbent or the candidate is forgotten).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline import events
from pipeline.rollout.serving import ServingView, version_of
from pipeline.rollout.stats import wilson_interval

#: phrases that mark a reply as a refusal (lower case, straight apostrophes; see :func:`is_refusal`)
REFUSAL_MARKERS = ("i can't", "i cannot", "i can not", "i'm sorry", "i am sorry", "i'm unable", "i am unable",
                   "i won't", "i will not", "as an ai")
#: characters at the start of a reply searched for :data:`REFUSAL_MARKERS`
REFUSAL_WINDOW = 120
#: versions kept per scope (see the module docstring)
MAX_VERSIONS = 64
_SUFFIXES = ("_n", "_low", "_high")


def reply_text(response) -> str:
    """The text of a turn's ``response.content`` (a string, or a list of parts with ``text``)."""
    content = response.get("content") if isinstance(response, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def is_refusal(text: str) -> bool:
    """Heuristic: one of :data:`REFUSAL_MARKERS` in the first :data:`REFUSAL_WINDOW` characters of
    ``text`` (case-insensitive, curly apostrophes read as straight ones)."""
    head = text[:REFUSAL_WINDOW].lower().replace("\u2019", "'")
    return any(m in head for m in REFUSAL_MARKERS)


def label(version: int | dict | None) -> str:
    """How a version is shown: ``v<policy version>``, the adapter's name, or ``base``."""
    if isinstance(version, dict):
        return version["name"]
    return "base" if version is None else f"v{version}"


def rate(successes: int, n: int) -> dict:
    """``{"k", "n", "rate", "low", "high"}``: the proportion (None when ``n`` = 0) and its 95%
    Wilson interval (``(0, 1)`` when ``n`` = 0)."""
    low, high = wilson_interval(successes, n)
    return {"k": successes, "n": n, "rate": successes / n if n else None, "low": low, "high": high}


@dataclass
class VersionCounts:
    """One version's counters (see the module docstring); ``name``: how it is shown."""

    name: str
    turns: int = 0
    canary_turns: int = 0
    unfinished: int = 0
    refusals: int = 0
    words: int = 0
    samples: int = 0
    judged: int = 0
    rewarded: int = 0
    feedback: int = 0
    feedback_positive: int = 0
    reward_feedback: int = 0
    evals: dict = field(default_factory=dict)  # eval-set name -> the latest evaluation's view
    decision: dict | None = None


def eval_view(ev: events.Evaluation) -> dict:
    """An evaluation as ``{"name", "n", "created_at", "metrics": [{"metric", "value", "n", "low",
    "high"}]}``: one entry per metric (``<m>_n``/``_low``/``_high`` fold into ``<m>``'s entry;
    ``low``/``high`` None for a mean without bounds, e.g. ``words_per_reply``)."""
    m = ev.metrics
    out = []
    for name, value in sorted(m.items()):
        if name.endswith(_SUFFIXES) or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        n = m.get(f"{name}_n")
        n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None
        low, high = (m.get(f"{name}_low"), m.get(f"{name}_high"))
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (low, high)):
            low = high = None  # absent, or not numbers: no bounds recorded
            if n and 0 <= value <= 1:
                low, high = wilson_interval(round(value * n), n)
        out.append({"metric": name, "value": value, "n": ev.n if n is None else n,
                    "low": low, "high": high})
    return {"name": ev.name, "n": ev.n, "created_at": ev.created_at, "metrics": out}


class Roles:
    """Each version's role from one run's ``control`` records (:class:`ServingView`, plus the
    versions it replaced). ``rollout``: a new version is a candidate until a ``promote``; False:
    it is the incumbent once resumed (today's behaviour without a canary)."""

    def __init__(self, run_id: str, rollout: bool):
        self.serving, self.rollout = ServingView(run_id), rollout
        self.previous: dict[str | None, set] = {}  # scope -> incumbents since replaced
        self.superseded: dict[str | None, set] = {}  # scope -> candidates dropped undecided

    def apply(self, ev: events.Control, scope) -> None:
        """Fold one control record of ``scope`` (None: the full weights)."""
        s = self.serving.scope(scope)
        old_inc, old_cand = version_of(s.incumbent), version_of(s.candidate)
        self.serving.apply(ev)
        s = self.serving.scopes.get(scope, s)
        if not self.rollout and s.candidate is not None and s.live:  # a version resumed serves everyone
            s.incumbent, s.candidate, s.live = s.candidate, None, False
        if old_inc != version_of(s.incumbent):
            self.previous.setdefault(scope, set()).add(old_inc)
        if old_cand is not None and old_cand not in (version_of(s.candidate), version_of(s.incumbent)) \
                and old_cand not in s.rolled_back:
            self.superseded.setdefault(scope, set()).add(old_cand)

    def role(self, scope, version) -> str:
        """``incumbent``, ``candidate``, ``rolled back``, ``previous``, ``superseded`` or ``""``
        (served, never named by ``control``)."""
        s = self.serving.scope(scope)
        if version == version_of(s.candidate) and s.candidate is not None:
            return "candidate"
        if version == version_of(s.incumbent):
            return "incumbent"
        if version in s.rolled_back:
            return "rolled back"
        if version in self.previous.get(scope, ()):
            return "previous"
        return "superseded" if version in self.superseded.get(scope, ()) else ""


class LiveVersions:
    """The fold of the module docstring.

    Args:
        run_id: ``control`` and ``metrics`` records of this run only (``trainer.run_id``).
        rollout: ``rollout.enabled``: a new version is a candidate until a ``promote``; False:
            it is the incumbent once resumed (today's behaviour), until the records show a
            rollout (a ``promote``/``rollback`` of this run, or a turn served by a canary arm):
            from then on the roles are read as with ``rollout`` True (both are folded, so a view
            whose config does not know the stack's ``rollout.enabled`` still shows the roles).
    """

    def __init__(self, run_id: str = "default", rollout: bool = True):
        self.run_id, self.rollout = run_id, rollout
        self._roles = {True: Roles(run_id, True), False: Roles(run_id, False)}
        self.versions: dict[str | None, dict] = {None: {}}  # scope -> version -> VersionCounts (first seen first)

    @property
    def roles(self) -> Roles:
        """The roles as the rollout setting (given or seen in the records) reads them."""
        return self._roles[self.rollout]

    @property
    def serving(self) -> ServingView:
        """Who serves each scope now (:attr:`roles`)."""
        return self.roles.serving

    # ---- folding ---------------------------------------------------------------------------
    def apply(self, ev: events.Event) -> bool:
        """Fold one record; True when it counted for something."""
        if isinstance(ev, events.Turn):
            return self._turn(ev)
        if isinstance(ev, events.Sample):
            return self._sample(ev)
        if isinstance(ev, events.Control):
            return self._control(ev)
        if isinstance(ev, events.Evaluation) and ev.run_id == self.run_id:
            tenant, adapter = getattr(ev, "tenant", None), getattr(ev, "adapter", None)
            if adapter is not None and tenant is not None:
                keys = [(tenant, adapter["version"], adapter["name"])]
            elif tenant is not None:
                keys = [(tenant, None, "base")]
            else:
                keys = [(None, ev.policy_version, f"v{ev.policy_version}")]
            for key in keys:
                self._counts(*key).evals[ev.name] = eval_view(ev)
            return True
        return False

    def _keys(self, ev) -> list[tuple]:
        """``(scope, version, name)`` of each row a turn or sample counts for."""
        tenant, adapter = getattr(ev, "tenant", None), getattr(ev, "adapter", None)
        if adapter is not None and tenant is not None:
            return [(tenant, adapter["version"], adapter["name"])]
        keys = [(None, ev.policy_version, f"v{ev.policy_version}")]
        if tenant is not None:
            keys.append((tenant, None, "base"))
        return keys

    def _counts(self, scope, version, name: str) -> VersionCounts:
        rows = self.versions.setdefault(scope, {})
        c = rows.get(version)
        if c is None:
            c = rows[version] = VersionCounts(name)
            if len(rows) > MAX_VERSIONS:
                s = self.serving.scope(scope)
                keep = {version, version_of(s.incumbent), version_of(s.candidate)}
                oldest = next((v for v in rows if v not in keep), None)
                rows.pop(oldest, None)
        return c

    def _turn(self, t: events.Turn) -> bool:
        if t.turn_type != "main" or t.source != "proxy":
            return False
        text = reply_text(t.response)
        refusal, words = is_refusal(text), len(text.split())
        unfinished = t.finish_reason not in events.FINISHED
        self.rollout = self.rollout or t.canary is not None  # a canary served it: rollout is on
        for key in self._keys(t):
            c = self._counts(*key)
            c.turns += 1
            c.canary_turns += t.canary is not None
            c.unfinished += unfinished
            c.refusals += refusal
            c.words += words
        return True

    def _sample(self, s: events.Sample) -> bool:
        feedback_source = "feedback" in (s.reward_source or "").split("+")
        for key in self._keys(s):
            c = self._counts(*key)
            c.samples += 1
            if s.reward is not None:
                c.judged += 1
                c.rewarded += s.reward > 0
                c.reward_feedback += feedback_source
            if s.feedback_score is not None:
                c.feedback += 1
                c.feedback_positive += s.feedback_score > 0
        return True

    def _control(self, ev: events.Control) -> bool:
        if ev.run_id != self.run_id or (ev.tenant is None and not ev.full_weights):
            return False
        scope = None if ev.full_weights else ev.tenant
        this = ev.policy_version if scope is None else ev.adapter
        if this is not None and ev.action in ("weights", "resume", "promote", "rollback"):
            self._counts(scope, version_of(this), label(this))  # a version appears with its order
        for roles in self._roles.values():
            roles.apply(ev, scope)
        if ev.action in events.ROLLOUT_DECISIONS:
            self.rollout = True
        if ev.action in events.ROLLOUT_DECISIONS and this is not None:
            e = ev.evidence or {}
            self._counts(scope, version_of(this), label(this)).decision = {
                "action": ev.action, "reason": e.get("reason"), "rule": e.get("rule"), "bounds": e.get("bounds", {}),
                "arms": e.get("arms", {}), "incumbent": e.get("incumbent"), "created_at": ev.created_at}
        return True

    # ---- reading ---------------------------------------------------------------------------
    def role(self, scope, version) -> str:
        """A version's role now (:meth:`Roles.role`)."""
        return self.roles.role(scope, version)

    def version_view(self, scope, version) -> dict:
        """One version's row (the module docstring's metrics, its role, decision and evals)."""
        c = self.versions[scope][version]
        s = self.serving.scope(scope)
        role = self.role(scope, version)
        return {"scope": scope, "version": version, "label": c.name, "role": role,
                "live": role == "candidate" and s.live, "turns": c.turns, "canary_turns": c.canary_turns,
                "samples": c.samples, "reward": rate(c.rewarded, c.judged),
                "feedback": rate(c.feedback_positive, c.feedback), "reward_feedback": c.reward_feedback,
                "unfinished": rate(c.unfinished, c.turns), "refusals": rate(c.refusals, c.turns),
                "words_per_reply": c.words / c.turns if c.turns else None,
                "evals": [c.evals[k] for k in sorted(c.evals)], "decision": c.decision}

    def snapshot(self) -> list[dict]:
        """Every scope (the full weights first, then tenants by name) as ``{"scope", "incumbent",
        "candidate", "live", "versions": [row, ...]}`` (rows in the order versions were first
        seen; ``incumbent``/``candidate``: version labels or None)."""
        out = []
        for scope in sorted(self.versions, key=lambda k: (k is not None, k or "")):
            rows = self.versions[scope]
            s = self.serving.scope(scope)
            out.append({"scope": scope, "incumbent": label(s.incumbent),
                        "candidate": None if s.candidate is None else label(s.candidate),
                        "live": s.live, "versions": [self.version_view(scope, v) for v in rows]})
        return out
